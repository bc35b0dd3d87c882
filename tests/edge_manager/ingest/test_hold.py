"""The hold-and-retry decisions of a store that refuses writes (issue 33), and the store's
own account of such a refusal (a real SQLite file made full with max_page_count)."""

from pathlib import Path

import pytest

from fedge.edge_manager.home.space import DiskSpace
from fedge.edge_manager.ingest import hold
from fedge.edge_manager.store import Store, StoreError, unwritable


def test_backoff_doubles_from_the_first_try_and_is_capped() -> None:
    waits = [hold.backoff_s(n) for n in range(1, 9)]
    assert waits == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert max(waits) == hold.RETRY_MAX_S


def test_an_outage_starts_at_the_first_failure_and_counts_the_rest() -> None:
    first = hold.failed(None, 100.0, "OperationalError: database or disk is full")
    assert first == hold.Outage(100.0, "OperationalError: database or disk is full", 1, 100.25)
    later = hold.failed(hold.failed(first, 101.0, "other"), 102.0, "other")
    assert (later.since, later.error, later.failures, later.retry_at) == (
        100.0,
        "OperationalError: database or disk is full",
        3,
        103.0,
    )


def test_held_messages_are_tried_only_when_the_backoff_is_over() -> None:
    outage = hold.failed(None, 10.0, "full")
    assert hold.retry_due(None, 0.0)
    assert not hold.retry_due(outage, 10.2)
    assert hold.retry_due(outage, 10.25)


def test_the_two_lines_say_what_where_how_much_room_and_how_many_waited() -> None:
    space = DiskSpace("/srv/fedge", 0, 4 * 1024 * 1024)
    line = hold.unwritable_line("OperationalError: database or disk is full", "/srv/m.db", space)
    assert line.startswith("store unwritable: OperationalError: database or disk is full (")
    assert "/srv/m.db; 0 B free of 4.0 MiB (0.0 %) on /srv/fedge" in line
    assert "free space on that file system" in line
    assert "free space unknown" in hold.unwritable_line("x", "/srv/m.db", None)
    outage = hold.Outage(100.0, "full", 7, 0.0)
    assert hold.recovered_line(outage, 121.5, 640) == (
        "store writable again after 21.5 s: 640 message(s) waited and are being stored "
        "(7 tries failed)"
    )


def _full_store(tmp_path: Path) -> Store:
    """A real store that has no room for one more page."""
    store = Store(tmp_path / "manager.db")
    pages = store.scalar("PRAGMA page_count")
    store.conn.execute(f"PRAGMA max_page_count={pages}")
    return store


def test_a_full_store_is_unwritable_and_its_transaction_ends_cleanly(tmp_path: Path) -> None:
    store = _full_store(tmp_path)
    row = ("e1", "predictions", 1, 0, 1, 0.0)
    with pytest.raises(StoreError) as raised, store.transaction() as conn:
        for seq in range(2000):  # more than the free pages of the file hold
            conn.execute(
                "INSERT INTO batches (edge, stream, seq, session, n_records, received_at) "
                "VALUES (?,?,?,?,?,?)",
                (*row[:2], seq, *row[3:]),
            )
    assert unwritable(raised.value), raised.value
    assert not store.conn.in_transaction
    # Room again: the same connection takes the next transaction (no "within a transaction").
    store.conn.execute("PRAGMA max_page_count=1073741823")
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO batches (edge, stream, seq, session, n_records, received_at) "
            "VALUES (?,?,?,?,?,?)",
            row,
        )
    assert store.scalar("SELECT count(*) FROM batches") == 1
    store.close()


def test_a_wrong_statement_is_not_an_unwritable_store(tmp_path: Path) -> None:
    store = Store(tmp_path / "manager.db")
    with pytest.raises(StoreError) as raised:
        store.conn.execute("INSERT INTO no_such_table VALUES (1)")
    assert not unwritable(raised.value)
    assert not unwritable(ValueError("disk is full"))
    store.close()
