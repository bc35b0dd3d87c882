"""``fedge model gate``: evaluate a candidate on the stations and bless it, or not."""

import time
from typing import Annotated, Any

import typer
from rich.markup import escape

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    fitted_table,
    friendly_errors,
    open_fleet,
    print_json,
    warn_if_not_serving,
    when,
)
from fedge.edge_manager.errors import ManagerError


@friendly_errors
def gate(
    model: Annotated[str, typer.Argument(help="The candidate, NAME:VERSION, e.g. inspect:4")],
    edges: Annotated[
        str | None,
        typer.Option(help="Comma-separated edges (default: every edge with labels)."),
    ] = None,
    max_drop: Annotated[
        float, typer.Option(help="Largest accuracy drop allowed on any one station.")
    ] = 0.02,
    min_gain: Annotated[
        float, typer.Option(help="Overall accuracy gain needed (0: strictly better).")
    ] = 0.0,
    min_examples: Annotated[
        int, typer.Option(help="Held-out examples a station needs to count.")
    ] = 20,
    target_recall: Annotated[
        float, typer.Option(help="Recall the recommended thresholds are chosen for.")
    ] = 0.95,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the stations.")] = 300.0,
    show: Annotated[
        bool, typer.Option("--show", help="Print the stored evidence; evaluate nothing.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the evidence as JSON.")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Score a candidate and the serving model on each station's held-out labelled
    images (the images stay there) and bless the candidate only if it is not worse by
    more than --max-drop on any station and better overall. Exit code 1 when not blessed.

    Example: fedge model gate inspect:4 --edges st-01,st-02 --max-drop 0.02

    Example: fedge model gate inspect:4 --show
    """
    from fedge.edge_manager.gate import run as gating
    from fedge.edge_manager.gate.verdict import GatePolicy
    from fedge.edge_manager.registry.versions import parse_ref

    name, version = parse_ref(model)
    _, fleet = open_fleet(home)
    if show:
        verdict = gating.stored(fleet.store, name, version)
        if verdict is None:
            fleet.registry.get(name, version)  # an unknown model says so
            raise ManagerError(f"{model} has not been gated yet; run `fedge model gate {model}`")
        _render(verdict.evidence, as_json, verdict.at)
        return
    policy = GatePolicy(max_drop, min_gain, min_examples, target_recall)
    chosen = None if edges is None else [e.strip() for e in edges.split(",") if e.strip()]
    if chosen is not None and not chosen:
        raise ManagerError("--edges names no edge; give e.g. --edges st-01,st-02")
    gating.plan(fleet, model, chosen)  # refused here, before anything is written
    warn_if_not_serving(home, "the evaluation is stored and reaches the stations once it runs")
    started = time.monotonic()
    with console.status(f"evaluating {escape(model)} on the stations…") as status:

        def on_progress(request: gating.GateRequest, state: gating.Progress) -> None:
            waiting = ", ".join(state.pending) or "-"
            status.update(
                f"evaluating {escape(model)}: {len(state.answered)}/{len(request.serving)} "
                f"stations answered, waiting for {escape(waiting)} "
                f"({time.monotonic() - started:.0f}/{timeout:.0f} s)"
            )

        request, result = gating.run(
            fleet, model, policy, edges=chosen, timeout_s=timeout, on_progress=on_progress
        )
    # This run's verdict: another gate of the same model may have stored a newer one.
    stored = gating.stored(fleet.store, name, version, eval_id=request.eval_id)
    assert stored is not None
    _render(stored.evidence, as_json, stored.at)
    if not result.blessed:
        raise typer.Exit(1)


def _fraction(value: Any) -> str:
    return "-" if value is None else f"{float(value):.3f}"


def _render(evidence: dict[str, Any], as_json: bool, at: float) -> None:
    if as_json:
        print_json(evidence)
        return
    table = fitted_table(
        "station", "examples", "serving acc", "candidate acc", "delta", "pass", "reason"
    )
    baseline = False
    for s in evidence["stations"]:
        passed = {True: "[green]pass[/green]", False: "[red]fail[/red]"}.get(s["passed"], "-")
        serving = _fraction(s["serving_accuracy"])
        if s["serving"] is None and s["serving_accuracy"] is not None:
            serving += "*"
            baseline = True
        delta = "-" if s["delta"] is None else f"{s['delta']:+.3f}"
        reason = s["reason"]
        if s.get("dropped_reason"):
            reason += (
                f"; dropped {s.get('foreign_items', 0)} foreign, "
                f"{s.get('rejected_items', 0)} rejected item(s): {s['dropped_reason']}"
            )
        table.add_row(
            escape(s["edge"]), str(s["examples"]), serving, _fraction(s["candidate_accuracy"]),
            delta, passed, escape(reason),
        )  # fmt: skip
    overall = evidence["overall"]
    gain = "-" if overall["gain"] is None else f"{overall['gain']:+.3f}"
    table.add_row(
        "overall", str(overall["examples"]), _fraction(overall["serving_accuracy"]),
        _fraction(overall["candidate_accuracy"]), gain, "", "",
    )  # fmt: skip
    console.print(table)
    if baseline:
        console.print("* no serving model there: the majority-class baseline", highlight=False)
    for key, what in (("not_answered", "did not answer"), ("superseded", "superseded")):
        if evidence.get(key):
            console.print(f"{what}: {escape(', '.join(evidence[key]))}", highlight=False)
    for edge, eval_id in sorted(evidence.get("abandoned", {}).items()):
        console.print(
            f"abandoned on {escape(edge)}: evaluation {escape(eval_id)} (unanswered past "
            "its timeout)",
            highlight=False,
        )
    thresholds = evidence.get("recommended_thresholds")
    if thresholds:
        per_class = ", ".join(f"{k} {v:g}" for k, v in thresholds["class_thresholds"].items())
        recall = evidence["threshold_basis"]["target_recall"]
        console.print(
            f"recommended thresholds (recall >= {recall:g}): default "
            f"{thresholds['default_threshold']:g}; {escape(per_class)}",
            highlight=False,
        )
    verdict = "[green]BLESSED[/green]" if evidence["blessed"] else "[red]NOT BLESSED[/red]"
    console.print(
        f"{escape(evidence['candidate'])}: {verdict} ({when(at)}, evaluation "
        f"{escape(evidence.get('eval_id', '-'))}): {escape(evidence['reason'])}",
        highlight=False,
        soft_wrap=True,
    )
