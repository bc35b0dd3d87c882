"""The simulator's report: a Markdown summary and a PNG of accuracy against virtual time."""

import dataclasses
import json
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedge.sim.errors import SimError
from fedge.sim.runner import Comparison, Curve
from fedge.sim.scenario import Scenario

COLOURS = ("tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def _on_grid(curve: Curve, grid: np.ndarray) -> np.ndarray:
    """Accuracy as a step function of virtual time (the model changes at round ends)."""
    times = np.asarray(curve.times_s)
    index = np.searchsorted(times, grid, side="right") - 1
    values = np.asarray(curve.accuracy, dtype=float)[np.clip(index, 0, len(times) - 1)]
    values[grid > times[-1]] = np.nan  # the run ended: draw nothing rather than a flat line
    return values


def plot(comparison: Comparison, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = sorted({c.strategy for c in comparison.curves}, key=comparison._order)
    horizon = max(c.times_s[-1] for c in comparison.curves)
    grid = np.linspace(0.0, horizon, 600)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for colour, strategy in zip(COLOURS, strategies, strict=False):
        curves = comparison.by(strategy)
        stacked = np.vstack([_on_grid(c, grid) for c in curves])
        # Median and band only where at least half of the seeds are still running.
        alive = np.sum(~np.isnan(stacked), axis=0) * 2 >= len(curves)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            median = np.where(alive, np.nanmedian(stacked, axis=0), np.nan)
            low = np.where(alive, np.nanmin(stacked, axis=0), np.nan)
            high = np.where(alive, np.nanmax(stacked, axis=0), np.nan)
        ax.plot(grid, median, color=colour, label=f"{strategy} (median)")
        if len(curves) > 1:
            ax.fill_between(grid, low, high, color=colour, alpha=0.2, lw=0)
    target = comparison.curves[0].target
    ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label=f"target {target}")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(max(0.0, target - 0.3), 1.0)
    ax.set_title(f"{comparison.scenario}: accuracy vs virtual time (band: min-max over seeds)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_privacy(comparison: Comparison, path: Path) -> Path:
    """Test accuracy against the epsilon spent so far, one line per private run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    strategies = sorted({c.strategy for c in comparison.curves if c.epsilon})
    for colour, strategy in zip(COLOURS, strategies, strict=False):
        for index, curve in enumerate(comparison.by(strategy)):
            label = strategy if index == 0 else None
            ax.plot(curve.epsilon, curve.accuracy, color=colour, alpha=0.8, label=label)
    for curve in comparison.by(comparison.baseline):
        if not curve.epsilon:
            ax.axhline(curve.converged_accuracy, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("epsilon spent (most any party spent; station-level for central DP)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{comparison.scenario}: accuracy vs privacy spent (dotted: without DP)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value: object, digits: int = 3) -> str:
    if value is None:
        return "censored"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


@dataclass(frozen=True)
class ArchitectureRow:
    arch: str
    parameters: int
    seconds_per_example: float
    trained_by: tuple[str, ...]


def architectures(scenario: Scenario, strategies: list[str]) -> list[ArchitectureRow]:
    """Each trained architecture's size and compute, and which strategies train it.

    Compute is the virtual seconds one example costs per local epoch on one CPU: the
    scenario's ``device.seconds_per_example`` is for the reference ``mlp`` and scales with
    the parameter count (an MLP's FLOPs per example), as the party's clock does.
    """
    from fedge.aggregator.strategies.feddf import DEFAULT_TIER_ARCHS
    from fedge.models import digits
    from fedge.sim.party_app import REFERENCE_ARCH

    users: dict[str, list[str]] = {}
    for name in strategies:
        params = scenario.strategy(name)
        if str(params.get("kind", name)) in ("distill", "nested"):
            tier_archs = params.get("tier_archs", list(DEFAULT_TIER_ARCHS))
            assert isinstance(tier_archs, list)  # the strategy was built from it
            for index, arch in enumerate(tier_archs):
                users.setdefault(str(arch), []).append(f"{name} (tier {index})")
        else:
            arch = str(params.get("arch", scenario.training.arch))
            users.setdefault(arch, []).append(name)
    reference = digits.count_parameters(digits.make_model(REFERENCE_ARCH))
    rows = []
    for arch, used_by in users.items():
        size = digits.count_parameters(digits.make_model(arch))
        seconds = scenario.device.seconds_per_example * size / reference
        rows.append(ArchitectureRow(arch, size, seconds, tuple(used_by)))
    return sorted(rows, key=lambda row: -row.parameters)


def markdown(
    comparison: Comparison,
    summary: dict[str, object],
    plot_name: str,
    archs: list[ArchitectureRow] | None = None,
) -> str:
    strategies = sorted({c.strategy for c in comparison.curves}, key=comparison._order)
    seeds = sorted({c.seed for c in comparison.curves})
    lines = [
        f"# Simulation report: {comparison.scenario}",
        "",
        f"Strategies {', '.join(strategies)}; seeds {seeds}; baseline {comparison.baseline}.",
        "Time is virtual: each round lasts as long as its parties' device profiles say.",
        "",
        "| strategy | seed | time to target (s) | rounds to target | final accuracy "
        "| converged accuracy | worst group accuracy | rounds | virtual time (s) | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy in strategies:
        for curve in comparison.by(strategy):
            tta = curve.time_to_target_s
            rounds = None if tta is None else curve.times_s.index(tta)
            lines.append(
                f"| {strategy} | {curve.seed} | {_fmt(tta, 1)} | {_fmt(rounds)} "
                f"| {curve.final_accuracy:.4f} | {curve.converged_accuracy:.4f} "
                f"| {min(curve.group_accuracy):.4f} | {len(curve.times_s) - 1} "
                f"| {curve.times_s[-1]:.1f} | {curve.wall_s:.1f} |"
            )
    lines += [
        "",
        "Converged accuracy: the mean over the last tenth of the run's rounds.",
    ]
    if archs:
        lines += [
            "",
            "## Architectures",
            "",
            "| arch | parameters | compute (virtual s per example and epoch, 1 CPU) | trained by |",
            "|---|---|---|---|",
        ]
        for row in archs:
            lines.append(
                f"| {row.arch} | {row.parameters:,} | {row.seconds_per_example:.4f} "
                f"| {', '.join(row.trained_by)} |"
            )
    lines += ["", "## Summary", "", "```json", json.dumps(summary, indent=1), "```", ""]
    lines += [f"![accuracy vs virtual time]({plot_name})", ""]
    return "\n".join(lines)


def write_report(
    comparison: Comparison, out_dir: Path, scenario: Scenario | None = None
) -> tuple[Path, Path, dict[str, object]]:
    """Markdown + PNG in ``out_dir``; with ``scenario``, also its architectures table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = comparison.summary()
    archs = None
    if scenario is not None:
        strategies = sorted({c.strategy for c in comparison.curves}, key=comparison._order)
        archs = architectures(scenario, strategies)
        summary["architectures"] = [dataclasses.asdict(row) for row in archs]
    png = plot(comparison, out_dir / f"{comparison.scenario}.png")
    md = out_dir / f"{comparison.scenario}.md"
    text = markdown(comparison, summary, png.name, archs)
    if "epsilon_spent" in summary:
        spent = plot_privacy(comparison, out_dir / f"{comparison.scenario}-privacy.png")
        text += f"![accuracy vs privacy spent]({spent.name})\n"
    md.write_text(text)
    return md, png, summary


class ReportExistsError(SimError):
    """A report directory already holds this scenario's report (it is never overwritten)."""


def report_dir(out: Path | None, scenario: str, *, force: bool, now: float) -> Path:
    """Where a run's report goes: a new ``sim-out/SCENARIO-YYYYmmdd-HHMMSS`` by default.

    A run never silently replaces an earlier one's report (issue 15): an explicit ``out``
    that already holds ``SCENARIO.md`` is refused unless ``force``.
    """
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        base = Path("sim-out") / f"{scenario}-{stamp}"
        chosen, n = base, 1
        while chosen.exists():  # two runs in the same second
            n += 1
            chosen = base.with_name(f"{base.name}-{n}")
        return chosen
    existing = out / f"{scenario}.md"
    if existing.exists() and not force:
        raise ReportExistsError(
            f"{existing} exists (an earlier run's report); choose another --out, "
            "omit --out for a new directory, or pass --force to replace it"
        )
    return out


def speedup_text(speedup: Mapping[str, object], baseline: str) -> str:
    """``summary['tta_speedup']`` for people: median and min over the seeds that reached it."""
    per_seed = speedup.get("per_seed")
    values = list(per_seed.values()) if isinstance(per_seed, dict) else []
    reached = sum(value is not None for value in values)
    median, low = speedup.get("median"), speedup.get("min")
    if not isinstance(median, int | float) or not isinstance(low, int | float):
        return f"{speedup.get('strategy')} vs {baseline}: no seed reached the target"
    return (
        f"{speedup.get('strategy')} vs {baseline}: median {median:.2f}x, "
        f"min {low:.2f}x ({reached} of {len(values)} seed(s) reached the target)"
    )
