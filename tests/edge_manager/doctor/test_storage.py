"""doctor's store-space and broker-save checks (issue 33): pure, from plain facts."""

from fedge.edge_manager.doctor.storage import (
    StorageFact,
    check_broker_save,
    check_store_space,
    last_save_failure,
)
from fedge.edge_manager.home.space import MIB, DiskSpace, Headroom

ROOMY = DiskSpace("/srv", 50_000 * MIB, 100_000 * MIB)
LOW = DiskSpace("/srv", 100 * MIB, 100_000 * MIB)
BROKER_LOG = """\
1700000000: mosquitto version 2.0.11 starting
1700000005: Error saving in-memory database, unable to open /srv/data/mosquitto.db.new for writing.
1700000005: Error: No space left on device.
1700000100: mosquitto version 2.0.11 starting
1700000200: Client st-01 disconnected.
"""


def _fact(**changes: object) -> StorageFact:
    base: dict[str, object] = {
        "store_path": "/srv/manager.db",
        "space": ROOMY,
        "headroom": Headroom(),
        "broker_save_dir": "/srv/broker/data",
    }
    return StorageFact(**{**base, **changes})  # type: ignore[arg-type]


def test_a_roomy_writable_store_is_ok() -> None:
    [(severity, subject, message)] = check_store_space(_fact())
    assert (severity, subject) == ("ok", "/srv/manager.db")
    assert message.startswith("store writable, 48.8 GiB free of 97.7 GiB (50.0 %) on /srv")


def test_low_space_is_a_warning_and_an_unwritable_store_an_error() -> None:
    [(severity, _, message)] = check_store_space(_fact(space=LOW))
    assert severity == "warning"
    assert "under the headroom of 5 % or 500 MiB" in message
    [(severity, _, message)] = check_store_space(
        _fact(space=LOW, serve_store="unwritable", serve_detail="disk is full", held=321)
    )
    assert severity == "error"
    assert "the store is unwritable (disk is full; 100.0 MiB free" in message
    assert "holds 321 message(s) unacknowledged" in message


def test_a_failed_save_counts_only_since_the_broker_last_started() -> None:
    assert last_save_failure(BROKER_LOG) is None
    failing = BROKER_LOG + "1700000300: Error: No space left on device.\n"
    assert last_save_failure(failing) == (1700000300.0, "Error: No space left on device.")
    [(severity, subject, message)] = check_broker_save(
        _fact(broker_save_failure=last_save_failure(failing))
    )
    assert (severity, subject) == ("error", "/srv/broker/data")
    assert "last at epoch 1700000300: Error: No space left on device." in message
    assert "broker_persistence in manager.toml" in message
    assert check_broker_save(_fact())[0][0] == "ok"
