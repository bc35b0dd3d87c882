"""Group commit: concurrent writers share one transaction, each still durable on return.

The agent's contract is that a prediction is in the SQLite file before the call that made
it returns. One COMMIT per prediction costs more than a small model's forward pass, so
writers that arrive while a commit is under way (the local API serves requests on
threads) wait for it and are then written together by one of them, the leader -- the
classic database technique (Gawlick & Kinkade, "Varieties of concurrency control in
IMS/VS Fast Path", 1985; Helland et al., "Group commit timers and high volume transaction
systems", 1987). A lone writer commits at once: there is no timer, so no latency is added.

The write function is called without the condition's lock held, so it may take its own
locks (the store's) freely.
"""

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class GroupCommit(Generic[T]):
    """``submit(items)`` returns once ``write`` committed them (alone or with others)."""

    def __init__(self, write: Callable[[Sequence[T]], None]) -> None:
        self._write = write
        self._cond = threading.Condition()
        self._pending: list[T] = []
        # Generation g collects the items submitted while it is open; a leader closes it
        # (takes its items and opens g + 1), writes, then publishes the outcome of g.
        self._open_generation = 0
        self._done_generation = -1
        self._leading = False
        # Writers of a generation not yet told its outcome, and the failure to tell them.
        self._members: Counter[int] = Counter()
        self._failures: dict[int, BaseException] = {}
        self.groups = 0  # transactions written, for tests and the agent's counters

    def submit(self, items: Sequence[T]) -> None:
        if not items:
            return
        with self._cond:
            self._pending.extend(items)
            mine = self._open_generation
            self._members[mine] += 1
            while self._done_generation < mine and self._leading:
                self._cond.wait()
            if self._done_generation >= mine:
                self._leave(mine)  # written by another writer's transaction
                return
            # Lead: write every item pending now (this writer's and the waiters').
            self._leading = True
            batch, self._pending = self._pending, []
            self._open_generation += 1
        failure: BaseException | None = None
        try:
            self._write(batch)
        except BaseException as exc:  # handed to every writer of the group
            failure = exc
        with self._cond:
            self._leading = False
            self._done_generation = mine
            self.groups += 1
            if failure is not None:
                self._failures[mine] = failure
            self._cond.notify_all()
            self._leave(mine)

    def _leave(self, generation: int) -> None:
        """One writer of ``generation`` learns its outcome: return, or raise its failure."""
        self._members[generation] -= 1
        failure = self._failures.get(generation)
        if self._members[generation] <= 0:
            del self._members[generation]
            self._failures.pop(generation, None)
        if failure is not None:
            raise failure
