"""The label queue's order (issue 30, item 4): least certain first, then newest."""

from fedge.console.queue import QueueItem, QueueQuery, margin, order
from fedge.console.queue_store import Unlabelled


def item(prediction_id: str, scratch: float, threshold: float = 0.5) -> QueueItem:
    scores = {"clean": 1 - scratch, "scratch": scratch}
    row = Unlabelled(prediction_id, "st-01", 0.0, "inspect:1", "accept", threshold, "{}", "")
    return QueueItem(row, scores, ("clean", "scratch"), margin(scores, threshold, ("scratch",)))


def test_smallest_margin_first_unknown_last_newest_kept_otherwise() -> None:
    newest_first = [item("a", 0.95), item("b", 0.48), item("c", 0.1), item("d", 0.55)]
    unknown = QueueItem(newest_first[0].prediction, {}, (), None)
    by_margin = order([*newest_first, unknown], "margin")
    assert [i.prediction.prediction_id for i in by_margin] == ["b", "d", "c", "a", "a"]
    assert by_margin[-1].margin is None
    assert order(newest_first, "newest") == newest_first
    assert margin({"clean": 0.9}, 0.5, ("scratch",)) is None


def test_the_query_string_falls_back_to_defaults() -> None:
    query = QueueQuery.parse({"order": "random", "decision": "maybe", "page": "x", "edge": "st-01"})
    assert query == QueueQuery(edge="st-01")
    assert QueueQuery.parse({"page": "3", "order": "newest"}).link(page=4) == "?order=newest&page=4"


def novel_item(prediction_id: str, scratch: float) -> QueueItem:
    scores = {"clean": 1 - scratch, "scratch": scratch}
    row = Unlabelled(prediction_id, "st-01", 0.0, "inspect:1", "accept", 0.5, "{}", "", True, 31.5)
    return QueueItem(row, scores, ("clean", "scratch"), margin(scores, 0.5, ("scratch",)))


def test_novel_parts_come_first_in_either_order() -> None:
    # Issue 28: a novel part is confidently called clean (a wide margin); it still leads.
    newest_first = [item("a", 0.48), novel_item("n1", 0.01), item("b", 0.9), novel_item("n2", 0.3)]
    by_margin = order(newest_first, "margin")
    assert [i.prediction.prediction_id for i in by_margin] == ["n2", "n1", "a", "b"]
    by_time = order(newest_first, "newest")
    assert [i.prediction.prediction_id for i in by_time] == ["n1", "n2", "a", "b"]
