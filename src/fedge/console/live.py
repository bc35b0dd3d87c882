"""Live updates of the fleet page: server-sent events from one shared snapshot.

Polling the store is what makes a change made anywhere (CLI, another console, an edge's
report ingested by ``manager serve``) show up within a poll, whatever process made it.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from fedge.console.fleet_table import ALL_ROWS, TableQuery, fleet_table
from fedge.console.sessions import Sessions
from fedge.edge_manager.fleet.operations import Fleet

T = TypeVar("T")


class Run(Protocol):
    """Runs work on the fleet in a worker thread (``Console.run``)."""

    def __call__(self, work: Callable[[Fleet], T]) -> Awaitable[T]: ...


class LiveFeed:
    """The fleet's cells and health as JSON (``{"edges": {edge: cells}, "health":
    {"live", "banner"}}``), shared by every open stream. Rebuilt every poll even when the
    store did not change: a state ages into "stale" with nothing written."""

    def __init__(
        self,
        run: Run,
        sessions: Sessions,
        poll_s: float,
        notice: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._run = run
        self._notice = notice  # what is wrong with `manager serve` (health.notice)
        self.sessions = sessions
        self.poll_s = poll_s
        self._snapshot: tuple[float, str] | None = None  # (monotonic time, JSON)
        self._lock = asyncio.Lock()

    async def snapshot(self) -> str:
        """Built at most four times a poll (so a stream sees it at most a quarter poll
        late) however many operators watch."""
        async with self._lock:
            now = time.monotonic()
            if self._snapshot is None or now - self._snapshot[0] >= self.poll_s / 4:

                def build(fleet: Fleet) -> str:
                    # Every edge's cells, whichever page a browser shows (one snapshot
                    # serves every stream; a page puts in place the rows it has).
                    every = TableQuery(per_page=ALL_ROWS)
                    table = fleet_table(fleet, every, serve_notice=self._notice())
                    edges = {row.edge: row.cells for row in table.rows}
                    payload = {"edges": edges, "health": table.health.to_json()}
                    return json.dumps(payload, sort_keys=True)

                self._snapshot = (now, await self._run(build))
            return self._snapshot[1]

    async def stream(
        self, session_id: str, allowed: Callable[[Fleet], object | None]
    ) -> AsyncIterator[str]:
        """Events for one session until it ends: logged out, or ``allowed`` says None
        (its token removed, its operator certificate revoked)."""

        last = None
        while self.sessions.get(session_id) is not None:
            if await self._run(allowed) is None:
                self.sessions.end(session_id)
                return
            payload = await self.snapshot()
            if payload != last:
                yield f"data: {payload}\n\n"
                last = payload
            await asyncio.sleep(self.poll_s)
