"""``fedge manager doctor``'s look at where the manager writes (issue 33).

Facts come from the store's file system, ``manager serve``'s own account (run/serve.json)
and the broker's log (doctor/facts.py); the checks are pure and give (severity, subject,
message) for doctor/report.py to turn into findings:

- ``store-space``: the store unwritable now (serve holds messages for it): an error;
  space under the headroom (home/space.py): a warning; otherwise the room left.
- ``broker-save``: the broker failed to write its save file (mosquitto.db: sessions,
  queued messages, retained documents) since it last started: an error, since a broker
  restart then loses what it holds; Mosquitto logs failed saves only, so a save that
  worked afterwards is not seen (the finding says when the last failure was).
"""

import re
from dataclasses import dataclass

from fedge.edge_manager.doctor.keys import Judgement
from fedge.edge_manager.home.space import DiskSpace, Headroom, describe_space

STORE_SPACE = "store-space"
BROKER_SAVE = "broker-save"
# Mosquitto's own words (src/persist_write.c, src/mosquitto.c), after "<epoch>: ".
_SAVE_FAILED = re.compile(r"^(\d+): (Error saving in-memory database.*|Error: .*)$")
_STARTED = re.compile(r"^(\d+): mosquitto version \S+ starting")


@dataclass(frozen=True)
class StorageFact:
    store_path: str
    space: DiskSpace | None  # the store's file system; None: could not be measured
    headroom: Headroom
    serve_store: str | None = None  # serve.json's "store" (None: serve is not running)
    serve_detail: str = ""
    held: int = 0
    broker_save_dir: str = ""
    broker_save_failure: tuple[float, str] | None = None  # (when, Mosquitto's line)


def last_save_failure(log_text: str) -> tuple[float, str] | None:
    """The broker's last failed save since its last start, from its log's lines."""
    found: tuple[float, str] | None = None
    for line in log_text.splitlines():
        if _STARTED.match(line):
            found = None
            continue
        failed = _SAVE_FAILED.match(line)
        if failed:
            found = (float(failed.group(1)), failed.group(2))
    return found


def check_store_space(fact: StorageFact) -> list[Judgement]:
    found: list[Judgement] = []
    subject = fact.store_path
    room = "free space unknown" if fact.space is None else describe_space(fact.space)
    if fact.serve_store == "unwritable":
        found.append(
            (
                "error",
                subject,
                f"the store is unwritable ({fact.serve_detail}; {room}): `manager serve` "
                f"holds {fact.held} message(s) unacknowledged until it is; free space there",
            )
        )
    elif fact.space is not None and fact.headroom.low(fact.space):
        found.append(
            (
                "warning",
                subject,
                f"{room}, under the headroom of {fact.headroom.describe()}: free space there "
                "or lower keep_*_days in manager.toml before ingest stops",
            )
        )
    else:
        found.append(("ok", subject, f"store writable, {room}"))
    return found


def check_broker_save(fact: StorageFact) -> list[Judgement]:
    if fact.broker_save_failure is not None:
        at, line = fact.broker_save_failure
        return [
            (
                "error",
                fact.broker_save_dir,
                f"the broker could not write its save file (last at epoch {at:.0f}: {line}); "
                "a broker restart now loses the sessions and messages it holds: free space "
                "there, or move it (broker_persistence in manager.toml) and restart the broker",
            )
        ]
    return [("ok", fact.broker_save_dir, "no failed save of the broker's state logged")]
