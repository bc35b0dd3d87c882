"""The closed loop's timeline, read back from the manager's store (what happened, when).

Every mark on the plot is a stored row -- an alert, a gate verdict, a rollout event, a
loop step, a station's deploy status -- so the picture is the record, not the demo's
own notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class Mark:
    at: float
    lane: str  # an edge, or "gate", "rollout", "loop"
    what: str
    kind: str  # colour group: alert, gate_ok, gate_no, rollout, abort, loop, deploy, back


def marks(store: Store, since: float) -> list[Mark]:
    found: list[Mark] = []
    for row in store.query(
        "SELECT edge, model, kind, raised_at, cleared_at FROM alerts WHERE raised_at >= ?",
        (since,),
    ):
        found.append(
            Mark(row["raised_at"], row["edge"], f"{row['kind']} ({row['model']})", "alert")
        )
    for row in store.query(
        "SELECT name, version, blessed, at FROM gate_results WHERE at >= ? ORDER BY at", (since,)
    ):
        verdict = "blessed" if row["blessed"] else "not blessed"
        kind = "gate_ok" if row["blessed"] else "gate_no"
        found.append(Mark(row["at"], "gate", f"{row['name']}:{row['version']} {verdict}", kind))
    for row in store.query(
        "SELECT e.at, e.kind, e.edge, r.model_name, r.model_version FROM rollout_events e "
        "JOIN rollouts r USING (rollout_id) WHERE e.at >= ? AND e.kind IN "
        "('started', 'wave', 'completed', 'aborted', 'rolled_back') ORDER BY e.at",
        (since,),
    ):
        if row["edge"]:
            continue  # per-edge moves show in the edges' own lanes (deploy statuses)
        kind = "abort" if row["kind"] in ("aborted", "rolled_back") else "rollout"
        ref = f"{row['model_name']}:{row['model_version']}"
        found.append(Mark(row["at"], "rollout", f"{ref} {row['kind']}", kind))
    for row in store.query(
        "SELECT at, step, detail FROM loop_events WHERE at >= ? ORDER BY at", (since,)
    ):
        found.append(Mark(row["at"], "loop", str(row["step"]).replace("_", " "), "loop"))
    for row in store.query(
        "SELECT edge, stage, serving, at FROM deploy_events WHERE at >= ? "
        "AND stage IN ('active', 'rolled_back') ORDER BY at",
        (since,),
    ):
        kind = "back" if row["stage"] == "rolled_back" else "deploy"
        found.append(Mark(row["at"], row["edge"], f"serves {row['serving']}", kind))
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
