"""The plant-like fleet the console benchmark and the README's picture are made of: a
dozen stations already show every kind of row; a thousand keep plant-like proportions."""

from collections import Counter

from fedge.bench.console_fleet import BATCH, VERSIONS, plan
from fedge.protocols.liveness import EdgeState


def test_a_dozen_stations_show_every_kind_of_row() -> None:
    plans = [plan(i) for i in range(1, 12)]
    assert len({p.edge for p in plans}) == 11
    assert {p.serving for p in plans} == {f"inspect:{v}" for v in VERSIONS}
    assert any(not p.seen for p in plans)
    assert any(p.state is EdgeState.LOST for p in plans)
    assert any(p.pending for p in plans) and any(p.gap for p in plans)
    assert any(p.missed for p in plans) and len({p.threshold for p in plans}) > 1
    for p in plans:
        assert 0 <= p.missed <= p.labelled <= p.predictions
        assert p.seen or (p.predictions == 0 and not p.gap and p.state is EdgeState.ONLINE)
        # A lost batch is a full one between others, so the manager sees a gap.
        assert not p.gap or p.predictions > 2 * BATCH
        assert p.delivered == p.predictions - (BATCH if p.gap else 0)


def test_a_thousand_stations_are_mostly_online_and_in_sync() -> None:
    plans = [plan(i) for i in range(1, 1000)]
    states = Counter("never-seen" if not p.seen else p.state.value for p in plans)
    assert states["online"] > 0.85 * len(plans)
    assert 0 < states["lost"] < 0.15 * len(plans) and 0 < states["never-seen"] < 0.1 * len(plans)
    assert 0 < sum(p.pending for p in plans) < 0.25 * len(plans)
    assert sum(p.delivered for p in plans) > 15 * len(plans)
