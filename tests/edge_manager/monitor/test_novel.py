"""Novel parts (issue 28): the CUSUM rule, and what the manager's store makes of them --
ingest's columns, the label queue's order, the monitor's ``novel_rate`` alert and the
rollout criterion -- on a real SQLite file, written through ingest's own adapter."""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedge.console import queue_store
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor.novel import NOT_NOVEL as NOT
from fedge.edge_manager.monitor.novel import NOVEL, cusum, grade, novel_finding
from fedge.edge_manager.monitor.novel import STRONGLY_NOVEL as STRONG
from fedge.edge_manager.monitor.rules import NovelPolicy
from fedge.edge_manager.monitor.tick import Monitor, policy_from
from fedge.edge_manager.rollout import health
from fedge.edge_manager.rollout.plan import Metric, parse_criteria
from fedge.edge_manager.store import Store
from fedge.protocols.alerts import AlertKind
from fedge.protocols.records import AnomalyScore, PredictionRecord

EDGE, MODEL, ANOMALY = "st-01", "inspect:1", "inspect-anomaly:1"
POLICY = NovelPolicy()


# ---------------------------------------------------------------- the rule, pure


def test_just_over_false_alarms_need_three_close_together() -> None:
    two = [NOT] * 30 + [NOVEL, NOT, NOVEL] + [NOT] * 10
    assert cusum(two, POLICY)[1] < POLICY.limit
    assert novel_finding(two, POLICY).holds is False
    spread = [NOT] * 30 + [NOVEL, NOT, NOT, NOVEL, NOT, NOT, NOVEL]
    assert novel_finding(spread, POLICY).holds is False
    three = [NOT] * 30 + [NOVEL, NOT, NOVEL, NOVEL]
    finding = novel_finding(three, POLICY)
    assert finding.holds is True and finding.kind is AlertKind.NOVEL_RATE
    assert finding.detail["novel"] == 3 and finding.detail["judged"] == 34
    assert finding.detail["strongly_novel"] == 0


def test_parts_well_over_the_threshold_weigh_more() -> None:
    one = [NOT] * 30 + [STRONG] + [NOT] * 20
    assert novel_finding(one, POLICY).holds is False  # one alone is a false alarm's worth
    two = [NOT] * 30 + [STRONG] + [NOT] * 25 + [STRONG]
    finding = novel_finding(two, POLICY)
    assert finding.holds is True and finding.detail["strongly_novel"] == 2
    with_a_novel_one = [NOT] * 30 + [STRONG] + [NOT] * 5 + [NOVEL]
    assert novel_finding(with_a_novel_one, POLICY).holds is True


def test_a_part_is_graded_by_how_far_over_the_threshold_it_scored() -> None:
    assert grade(None, 20.0, 10.0, POLICY) is None  # no verdict
    assert grade(False, 20.0, 10.0, POLICY) == NOT  # not novel, however high
    assert grade(True, 14.9, 10.0, POLICY) == NOVEL
    assert grade(True, 15.0, 10.0, POLICY) == STRONG  # strong_multiple = 1.5
    assert grade(True, 40.0, None, POLICY) == NOVEL  # threshold not known (older agent)
    with pytest.raises(ValueError, match="strong_multiple > 1"):
        NovelPolicy(strong_multiple=1.0)


def test_no_verdicts_are_not_judged_and_say_how_to_get_them() -> None:
    finding = novel_finding([None] * 100 + [NOVEL] * 5, POLICY)
    assert finding.holds is None
    assert "set-threshold" in finding.detail["reason"]


def test_a_crossing_holds_until_it_has_left_the_window() -> None:
    burst = [NOT, NOVEL, NOT, NOVEL, NOVEL]  # crosses at its last part
    later = novel_finding(burst + [NOT] * 90, POLICY)  # the CUSUM fell back meanwhile
    assert cusum(burst + [NOT] * 90, POLICY)[0] == 0.0
    assert later.holds is True
    gone = novel_finding([NOT] * 100, POLICY)  # the window slid past it
    assert gone.holds is False and gone.clears


def test_the_policy_refuses_rates_in_the_wrong_order() -> None:
    with pytest.raises(ValueError, match="in_control_rate < alarm_rate"):
        NovelPolicy(in_control_rate=0.2, alarm_rate=0.1)


def test_novel_rate_is_an_abort_criterion() -> None:
    (criterion,) = parse_criteria("novel_rate>0.05")
    assert criterion.metric is Metric.NOVEL_RATE


# ---------------------------------------------------------------- on the store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "manager.db")
    store.conn.execute(
        "INSERT INTO edges (edge, enrolled_at, token_sha256, serving) VALUES (?, 0, 'x', ?)",
        (EDGE, MODEL),
    )
    yield store
    store.close()


class Line:
    """Parts scored by a station serving an anomaly model beside the classifier."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.n = 0

    def parts(
        self,
        flags: list[bool],
        *,
        threshold: float | None = 10.0,
        at: float = 0.0,
        novel_score: float = 14.0,  # just over the threshold, as good parts' false alarms
    ) -> None:
        records = []
        for novel in flags:
            self.n += 1
            records.append(
                PredictionRecord(
                    prediction_id=f"p-{self.n}",
                    at=1000.0 + self.n,
                    model=MODEL,
                    scores={"clean": 0.95, "scratch": 0.05},
                    decision="accept",
                    threshold=0.5,
                    config_version=1,
                    latency_ms=1.0,
                    anomaly=AnomalyScore(ANOMALY, novel_score if novel else 6.0, threshold),
                )
            )
        with IngestTransaction.open(self.store) as tx:
            tx.add_predictions(EDGE, self.n, records)
            self.store.conn.execute(
                "INSERT INTO batches (edge, stream, seq, session, n_records, received_at) "
                "VALUES (?, 'predictions', ?, 1, ?, ?)",
                (EDGE, self.n, len(records), at),
            )


def test_ingest_keeps_the_score_the_model_and_the_verdict(store: Store) -> None:
    line = Line(store)
    line.parts([True, False])
    line.parts([True], threshold=None)  # no threshold in force: no verdict
    rows = store.conn.execute(
        "SELECT prediction_id, anomaly_model, anomaly_score, novel, anomaly_threshold "
        "FROM predictions ORDER BY at"
    ).fetchall()
    assert rows == [
        ("p-1", ANOMALY, 14.0, 1, 10.0),
        ("p-2", ANOMALY, 6.0, 0, 10.0),
        ("p-3", ANOMALY, 14.0, None, None),
    ]


def test_the_label_queue_reads_novel_parts_first_however_old(store: Store) -> None:
    line = Line(store)
    line.parts([True] + [False] * 30)
    rows = queue_store.unlabelled(store, "", "", "", limit=5)
    assert rows[0].prediction_id == "p-1" and rows[0].novel
    assert rows[0].anomaly_score == 14.0
    assert [r.novel for r in rows[1:]] == [False] * 4


def test_the_monitor_raises_novel_rate_on_a_new_defect_not_on_good_parts(store: Store) -> None:
    rng = np.random.default_rng(3)
    monitor = Monitor(store, "plant-a", policy_from(100, 0.0))
    line = Line(store)
    # In distribution: the threshold's 1 % false alarms, 300 parts.
    for _ in range(30):
        line.parts([bool(x) for x in rng.random(10) < 0.01])
        kinds = {a.condition for a in monitor.tick(now=2000.0 + line.n)}
        assert AlertKind.NOVEL_RATE not in kinds
    # A new defect at 10 %: every tenth part novel, scored twice the threshold.
    fired_after = None
    for batch in range(10):
        line.parts([i == 4 for i in range(10)], novel_score=20.0)
        raised = [
            a for a in monitor.tick(now=3000.0 + line.n) if a.condition is AlertKind.NOVEL_RATE
        ]
        if raised:
            fired_after = 10 * (batch + 1)
            break
    assert fired_after is not None and fired_after <= 30
    (open_alert,) = alert_store.open_alerts(store, EDGE, MODEL).values()
    assert open_alert.kind is AlertKind.NOVEL_RATE


def test_rollout_health_reads_the_new_models_novel_rate_once_there_are_enough(
    store: Store,
) -> None:
    line = Line(store)
    line.parts([True] * 5, at=10.0)  # before the move: not the new model's
    line.parts([False] * 10, at=100.0)
    assert health.novel_rate(store.conn, EDGE, MODEL, since=50.0) is None
    line.parts([True, True] + [False] * 8, at=110.0)
    assert health.novel_rate(store.conn, EDGE, MODEL, since=50.0) == pytest.approx(0.1)
