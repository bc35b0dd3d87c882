"""An in-process Flower ``Grid``: the ServerApp's strategy talks to ClientApps directly.

Flower's simulation runtime routes every message through a link state, queues and a Ray
actor; for a laptop-sized fleet of small models that orchestration dominates the run.
This Grid keeps Flower's contract -- the same ``Message`` objects in and out, the same
``Context`` per node (``partition-id``, ``num-partitions``, ``run_config``), an exception
in the ClientApp becomes an error reply -- and calls the ClientApp on a small thread
pool instead. Any Flower ClientApp works with it, fedge's or not.
"""

import threading
import time
import traceback
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from fedge.aggregator.fleet.grids import NODE_ID_BASE, LocalGrid, UserConfig

# Flower's own code for "the ClientApp raised" (flwr.common.constant.ErrorCode).
CLIENT_APP_RAISED_EXCEPTION = 2


class InProcessGrid(LocalGrid):
    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        *,
        run_config: UserConfig | None = None,
        workers: int = 2,
        run_id: int = 1,
    ) -> None:
        super().__init__(run_id, run_config)
        self._client_app = client_app
        # Node ids are NODE_ID_BASE + partition-id (Flower reserves 0 and 1). A node's
        # Context is made when it is first asked: 10,000 parties cost nothing until
        # they train (issue 29); it is kept after, as its state must be.
        self._num_nodes = num_nodes
        self._run_id = run_id
        self._run_config = dict(run_config or {})
        self._contexts: dict[int, Context] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="party")
        self._pending: dict[str, Future[Message]] = {}
        self._lock = threading.Lock()
        # Real seconds each message spent in its ClientApp (for callers without a clock).
        self.elapsed_s: dict[str, float] = {}

    # -- Grid contract (the rest is LocalGrid's)

    def get_node_ids(self) -> Iterable[int]:
        return list(range(NODE_ID_BASE, NODE_ID_BASE + self._num_nodes))

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            node_id = message.metadata.dst_node_id
            if not NODE_ID_BASE <= node_id < NODE_ID_BASE + self._num_nodes:
                raise ValueError(f"no node {node_id} in this grid")
            message_id = str(uuid4())
            message.metadata.__dict__["_message_id"] = message_id
            message.metadata.__dict__["_run_id"] = self._run.run_id
            with self._lock:
                self._pending[message_id] = self._pool.submit(self._call, message)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        with self._lock:
            for message_id in message_ids:
                future = self._pending.get(message_id)
                if future is not None and future.done():
                    del self._pending[message_id]
                    replies.append(future.result())
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        waiting = set(ids)
        while waiting:
            with self._lock:
                futures = [self._pending[i] for i in waiting if i in self._pending]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            for future in futures:
                if not future.done():
                    # Flower's contract: at the timeout, return what came (the rest are
                    # stragglers), never raise.
                    wait([future], timeout=remaining)
                    break
            got = list(self.pull_messages(waiting))
            replies.extend(got)
            waiting -= {r.metadata.reply_to_message_id for r in got}
            if deadline is not None and time.monotonic() >= deadline:
                break
        return replies

    # -- the party side

    def _context(self, node_id: int) -> Context:
        with self._lock:
            context = self._contexts.get(node_id)
            if context is None:
                partition = node_id - NODE_ID_BASE
                context = Context(
                    run_id=self._run_id,
                    node_id=node_id,
                    node_config={"partition-id": partition, "num-partitions": self._num_nodes},
                    state=RecordDict(),
                    run_config=dict(self._run_config),
                )
                self._contexts[node_id] = context
            return context

    def _call(self, message: Message) -> Message:
        context = self._context(message.metadata.dst_node_id)
        started = time.perf_counter()
        try:
            reply = self._client_app(message, context)
        except Exception as exc:  # a failing party is data, not a crash (as in Flower)
            reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
            reply = Message(
                Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message
            )
        reply.metadata.__dict__["_message_id"] = str(uuid4())
        self.elapsed_s[message.metadata.message_id] = time.perf_counter() - started
        return reply

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
