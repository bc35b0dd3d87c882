"""The silence rule (issue 27, item 6): pure cut-off, and the sweep on a real SQLite store."""

import time
from collections import Counter
from pathlib import Path

from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.fleet.liveness import SilenceSweep, sweep_cutoff
from fedge.edge_manager.store import Store


def test_the_cutoff_waits_for_serve_itself_and_can_be_off() -> None:
    # ``now`` is the moment serve has stored everything received before.
    assert sweep_cutoff(now=100.0, started=95.0, lost_after_s=7.0) is None
    assert sweep_cutoff(now=100.0, started=93.0, lost_after_s=7.0) == 93.0
    assert sweep_cutoff(now=100.0, started=0.0, lost_after_s=0.0) is None


def _edge(store: Store, edge: str, state: str, last_seen: float | None) -> None:
    edge_store.enroll(store, edge, "x" * 64, 0.0)
    store.conn.execute(
        "UPDATE edges SET state=?, last_seen=? WHERE edge=?", (state, last_seen, edge)
    )


def test_only_silent_online_edges_are_marked_lost(tmp_path: Path) -> None:
    store = Store(tmp_path / "manager.db")
    now = time.time()
    _edge(store, "st-quiet", "online", now - 8.0)
    _edge(store, "st-beating", "online", now - 1.0)
    _edge(store, "st-off", "offline", now - 100.0)
    _edge(store, "st-new", "never-seen", None)
    counters: Counter[str] = Counter()
    through: list[float | None] = [None]
    sweep = SilenceSweep(7.0, counters, started=now - 60.0, stored_through=lambda: through[0])
    assert sweep.tick(store, now) == []  # messages held by a store outage: nothing judged
    # Everything stored only up to 2 s ago (a heartbeat of st-quiet may wait in the
    # queue): silence is judged as of then, and 6 s of it is not enough.
    through[0], sweep._due = now - 2.0, 0.0
    assert sweep.tick(store, now) == []
    through[0], sweep._due = now, 0.0
    assert sweep.tick(store, now) == ["st-quiet"]
    assert counters["liveness.silent_lost"] == 1
    states = {s.edge: s.state for s in edge_store.summaries(store)}
    assert states == {
        "st-quiet": "lost",
        "st-beating": "online",
        "st-off": "offline",
        "st-new": "never-seen",
    }
    assert sweep.tick(store, now + 0.5) == []  # not due again within a second
    store.close()


def test_records_from_a_quiet_edge_bring_it_back_online(tmp_path: Path) -> None:
    """An agent from before heartbeats sends no birth between its reports: silence marks
    it lost, and its next records mark it online again (ingest's sign of life)."""
    from fedge.edge_manager.ingest.store import IngestTransaction

    store = Store(tmp_path / "manager.db")
    now = time.time()
    _edge(store, "st-old", "online", now - 8.0)
    sweep = SilenceSweep(7.0, Counter(), started=now - 60.0, stored_through=lambda: now)
    assert sweep.tick(store, now) == ["st-old"]
    with IngestTransaction.open(store) as tx:
        tx.seen("st-old", now + 1.0)
    (state,) = [s.state for s in edge_store.summaries(store) if s.edge == "st-old"]
    assert state == "online"
    store.close()
