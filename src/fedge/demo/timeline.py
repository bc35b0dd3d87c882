"""The closed loop's timeline, read back from the manager's store (what happened, when).

Every mark on the plot is a stored row -- an alert, a gate verdict, a rollout event, a
loop step, a station's deploy status -- so the picture is the record, not the demo's
own notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedge.edge_manager.reports import timeline_store
from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class Mark:
    at: float
    lane: str  # an edge, or "gate", "rollout", "loop"
    what: str
    kind: str  # colour group: alert, gate_ok, gate_no, rollout, abort, loop, deploy, back


# The rollout events that mark the timeline: a rollout's start, waves and end.
_ROLLOUT_KINDS = ("started", "wave", "completed", "aborted", "rolled_back")


def marks(store: Store, since: float) -> list[Mark]:
    found: list[Mark] = []
    for alert in timeline_store.alerts_raised(store, since):
        found.append(Mark(alert.raised_at, alert.edge, f"{alert.kind} ({alert.model})", "alert"))
    for gate in timeline_store.gate_verdicts(store, since):
        verdict = "blessed" if gate.blessed else "not blessed"
        kind = "gate_ok" if gate.blessed else "gate_no"
        found.append(Mark(gate.at, "gate", f"{gate.name}:{gate.version} {verdict}", kind))
    for event in timeline_store.rollout_events(store, since, _ROLLOUT_KINDS):
        if event.edge:
            continue  # per-edge moves show in the edges' own lanes (deploy statuses)
        kind = "abort" if event.kind in ("aborted", "rolled_back") else "rollout"
        ref = f"{event.model_name}:{event.model_version}"
        found.append(Mark(event.at, "rollout", f"{ref} {event.kind}", kind))
    for step in timeline_store.loop_steps(store, since):
        found.append(Mark(step.at, "loop", str(step.step).replace("_", " "), "loop"))
    for deploy in timeline_store.deploy_events(store, since, ("active", "rolled_back")):
        kind = "back" if deploy.stage == "rolled_back" else "deploy"
        found.append(Mark(deploy.at, deploy.edge, f"serves {deploy.serving}", kind))
    return sorted(found, key=lambda m: m.at)


_COLOURS = {
    "alert": "tab:red",
    "gate_ok": "tab:green",
    "gate_no": "tab:purple",
    "rollout": "tab:blue",
    "abort": "tab:orange",
    "loop": "tab:gray",
    "deploy": "tab:cyan",
    "back": "tab:brown",
}


def plot(found: list[Mark], since: float, edges: tuple[str, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = ["loop", "gate", "rollout", *edges]
    fig, ax = plt.subplots(figsize=(13, 1.0 + 1.0 * len(lanes)))
    placed: dict[str, int] = {}
    for mark in found:
        if mark.lane not in lanes:
            continue
        y = lanes.index(mark.lane)
        x = (mark.at - since) / 60.0
        ax.scatter([x], [y], color=_COLOURS[mark.kind], s=40, zorder=3)
        # Marks close in time overlap: their labels step up and down in turn.
        turn = placed.get(mark.lane, 0)
        placed[mark.lane] = turn + 1
        ax.annotate(
            mark.what,
            (x, y),
            xytext=(3, (8, -12, 18, -22)[turn % 4]),
            textcoords="offset points",
            fontsize=6,
        )
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.2)
    ax.set_xlabel("minutes since the chapter started")
    ax.grid(axis="x", alpha=0.3)
    for kind, colour in _COLOURS.items():
        ax.scatter([], [], color=colour, label=kind.replace("_", " "))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title("the closed loop: alerts, gate verdicts, rollouts and what each station served")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
