"""The agent's label index when an operator withdraws a label (issue 30), on real SQLite:
the withdrawn label leaves, a label given after the withdrawal stands, and applying the
same withdrawal again removes nothing more."""

from pathlib import Path

from fedge.edge_agent.store import LocalStore


def _index(store: LocalStore) -> set[tuple[str, str]]:
    return {(str(r["prediction_id"]), str(r["label"])) for r in store.labels()}


def test_a_withdrawal_leaves_the_index_once_and_a_later_label_stands(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "agent.db")
    try:
        store.add_remote_label("l-1", "p-1", "scratch", "lena", at=100.0)
        store.add_remote_label("l-2", "p-2", "clean", "lena", at=100.0)
        store.add_label("l-3", "p-3", "dent", "local", at=100.0)
        assert store.withdraw_label("p-1", at=100.0) == 1
        assert _index(store) == {("p-2", "clean"), ("p-3", "dent")}
        assert store.withdraw_label("p-1", at=100.0) == 0  # applied again: nothing more
        # Labelled again after an undo: the withdrawal (still listed) leaves it standing.
        store.add_remote_label("l-4", "p-2", "scratch", "lena", at=200.0)
        assert store.withdraw_label("p-2", at=150.0) == 0
        assert ("p-2", "scratch") in _index(store) and ("p-2", "clean") in _index(store)
        # A withdrawal made before the label was given removes nothing either.
        assert store.withdraw_label("p-3", at=50.0) == 0
        assert store.withdraw_label("p-unknown", at=500.0) == 0
        assert _index(store) == {("p-2", "clean"), ("p-2", "scratch"), ("p-3", "dent")}
    finally:
        store.close()
