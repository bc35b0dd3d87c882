"""Which node is which party: stations by edge id, quickstart apps by their own node id."""

import copy
from collections.abc import Iterable

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.app.message import make_message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedge.aggregator.fleet.grids import NODE_ID_BASE, WrappedGrid
from fedge.aggregator.fleet.identity import IdentifiedGrid, identify_station
from fedge.sim.grid import InProcessGrid

EDGES = {"st-01": 1000, "st-02": 1001}


def station_like() -> ClientApp:
    """Partition 0 is st-02, 1 is st-01, 2 claims a foreign edge, 3 has no query handler."""
    app = ClientApp()
    names = {0: "st-02", 1: "st-01", 2: "st-99"}

    @app.query()
    def _who(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if partition not in names:
            raise ValueError("No query function registered")  # as a quickstart app fails
        content = RecordDict({"identity": ConfigRecord({"edge": names[partition]})})
        return Message(content=content, reply_to=msg)

    return app


def test_stations_are_shown_by_edge_and_strangers_are_left_out() -> None:
    inner = InProcessGrid(station_like(), 4)
    try:
        grid = IdentifiedGrid(
            inner, identify=identify_station(EDGES), unidentified="exclude",
            discovery_timeout_s=10,
        )  # fmt: skip
        assert sorted(grid.get_node_ids()) == [1000, 1001]
        assert grid.names == {1000: "st-01", 1001: "st-02"}
        assert grid.real_node_id(1001) == NODE_ID_BASE + 0  # partition 0 said st-02
        reasons = grid.excluded
        assert "not a party of this job" in reasons[NODE_ID_BASE + 2]
        assert "query failed" in reasons[NODE_ID_BASE + 3]
    finally:
        inner.close()


def test_an_app_without_a_query_handler_is_shown_as_itself() -> None:
    inner = InProcessGrid(station_like(), 4)
    try:
        grid = IdentifiedGrid(
            inner, identify=identify_station(EDGES), unidentified="node-id",
            discovery_timeout_s=10,
        )  # fmt: skip
        assert sorted(grid.get_node_ids()) == [1000, 1001, NODE_ID_BASE + 3]
    finally:
        inner.close()


class FirstQueryUnavailable(WrappedGrid):
    """The first query reply of ``node`` is Flower's "node unavailable" error, as the
    SuperLink gives for a node killed and not yet back (issue 27)."""

    def __init__(self, inner: InProcessGrid, node: int) -> None:
        super().__init__(inner)
        self.node = node
        self.failed = False

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        for reply in self.inner.pull_messages(message_ids):
            if reply.metadata.src_node_id == self.node and not self.failed:
                self.failed = True
                reply = make_message(
                    copy.copy(reply.metadata),
                    error=Error(ErrorCode.NODE_UNAVAILABLE, "Error: Node Unavailable"),
                )
            replies.append(reply)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        raise NotImplementedError


def test_a_node_unavailable_when_asked_is_asked_again_not_written_off() -> None:
    inner = InProcessGrid(station_like(), 4)
    try:
        flaky = FirstQueryUnavailable(inner, NODE_ID_BASE + 1)  # partition 1 is st-01
        grid = IdentifiedGrid(
            flaky, identify=identify_station(EDGES), unidentified="exclude",
            discovery_timeout_s=10,
        )  # fmt: skip
        assert sorted(grid.get_node_ids()) == [1001]  # st-01 was not there to answer
        assert NODE_ID_BASE + 1 not in grid.excluded
        assert sorted(grid.get_node_ids()) == [1000, 1001]  # back: asked again, placed
    finally:
        inner.close()
