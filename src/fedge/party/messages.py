"""Reading what a round sends a party: the global model and the round's config.

Flower's strategies put the model in an ArrayRecord ``"arrays"`` and the round's settings
in a ConfigRecord ``"config"``; a strategy that names them otherwise is read when the
message holds exactly one of each. Shared by the station's ClientApp and the simulated
party's.
"""

from flwr.app import ArrayRecord, ConfigRecord, Message

from fedge.party.errors import PartyError

ARRAYS_KEY = "arrays"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"


def global_arrays(message: Message) -> ArrayRecord:
    """The model the round sent; a PartyError when the message holds none or several."""
    records = message.content.array_records
    if ARRAYS_KEY in records:
        return records[ARRAYS_KEY]
    if len(records) == 1:
        return next(iter(records.values()))
    raise PartyError(
        f"expected the global model as one ArrayRecord (key {ARRAYS_KEY!r}), "
        f"got {sorted(records) or 'none'}"
    )


def round_config(message: Message) -> ConfigRecord:
    """The round's ConfigRecord (empty when it sent none)."""
    records = message.content.config_records
    if CONFIG_KEY in records:
        return records[CONFIG_KEY]
    if len(records) == 1:
        return next(iter(records.values()))
    if not records:
        return ConfigRecord()
    raise PartyError(
        f"expected at most one ConfigRecord (key {CONFIG_KEY!r}), got {sorted(records)}"
    )
