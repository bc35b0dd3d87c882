"""Whether ``manager serve`` is ready for traffic (``/readyz``, issue 27): a pure rule."""

from fedge.transport.metrics import Readiness


def manager_readiness(
    *,
    broker_connected: bool,
    broker_detail: str,
    store_state: str,
    store_detail: str,
    worker_alive: bool,
) -> Readiness:
    """Ready when serve reaches its broker, its store takes writes and its writer runs.
    A store low on space is still ready (it warns and prunes; it has not refused)."""
    return Readiness(
        {
            "broker": None if broker_connected else f"not connected ({broker_detail or 'no link'})",
            "store": None if store_state != "unwritable" else f"unwritable ({store_detail})",
            "worker": None if worker_alive else "the ingest worker stopped; restart serve",
        }
    )
