"""Waiting for a grid's nodes: Flower's runtimes register them while the ServerApp runs."""

import time
from collections.abc import Iterable

from fedge.aggregator.fleet.grids import wait_for_nodes


class GrowingNodes:
    """A grid whose nodes join one per ``every_s`` (only what wait_for_nodes reads)."""

    def __init__(self, total: int, every_s: float) -> None:
        self.total = total
        self.every_s = every_s
        self.started = time.monotonic()
        self.asked = 0

    def get_node_ids(self) -> Iterable[int]:
        self.asked += 1
        joined = min(self.total, int((time.monotonic() - self.started) / self.every_s))
        return range(joined)


def test_it_returns_once_enough_nodes_joined() -> None:
    grid = GrowingNodes(total=5, every_s=0.05)
    seen = wait_for_nodes(grid, 3, wait_s=30.0, poll_s=0.01)  # type: ignore[arg-type]
    assert 3 <= seen <= 5
    assert time.monotonic() - grid.started < 10.0  # did not wait out the 30 s


def test_it_gives_up_after_wait_s_with_how_many_it_saw() -> None:
    grid = GrowingNodes(total=2, every_s=0.01)
    started = time.monotonic()
    assert wait_for_nodes(grid, 3, wait_s=0.3, poll_s=0.02) == 2  # type: ignore[arg-type]
    assert 0.3 <= time.monotonic() - started < 5.0
    assert grid.asked > 2  # polled, not one look


def test_enough_nodes_at_once_means_no_wait() -> None:
    grid = GrowingNodes(total=4, every_s=0.0001)
    time.sleep(0.01)
    started = time.monotonic()
    assert wait_for_nodes(grid, 4, wait_s=30.0, poll_s=5.0) == 4  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0
    assert grid.asked == 1
