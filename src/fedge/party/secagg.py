"""SecAgg+ on the party: Flower's ``secaggplus_mod`` in front of our Message-API ClientApps.

Secure aggregation is Flower's SecAgg+ (Bell et al., "Secure Single-Server Aggregation
with (Poly)Logarithmic Overhead", CCS 2020): ``secaggplus_mod`` on the party,
``SecAggPlusWorkflow`` on the server (:mod:`fedge.aggregator.privacy.secagg`). We write no
cryptography; this module only lets our ClientApps take part.

Two things stand between Flower's mod and our apps, and :func:`secagg_mod` bridges both:

* ``secaggplus_mod`` reads a ``secaggplus_configs`` record from every TRAIN message and
  fails on one without it, so it cannot simply sit in front of an app that also serves
  plain rounds. :func:`secagg_mod` hands it only the messages of a SecAgg+ round and lets
  every other message through untouched: one ClientApp serves plain and SecAgg+ rounds.
* At its masked-vector stage the mod calls the app with a legacy ``FitIns`` (records
  ``fitins.parameters`` -- arrays without names -- and ``fitins.config``) and reads a
  legacy ``FitRes`` back. Our apps speak the Message API (``"arrays"``, ``"config"``,
  ``"metrics"``, :mod:`fedge.party.messages`). :func:`to_message_api` names the arrays
  again (the server sends their names in the config under :data:`ARRAY_NAMES_KEY`) and
  :func:`to_legacy_fitres` turns the app's reply into a ``FitRes`` whose weight is the
  reply's ``num-examples``. The mod then masks the update and clears the reply's arrays:
  what leaves the party is the masked vector and the metrics, never the update itself.

A party that raises at any stage (a refusal, a crash) becomes an error reply: SecAgg+
treats it as a dropout and, while enough of the round's parties remain (its
reconstruction threshold), still recovers the aggregate of the others.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.message import make_message
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from fedge.party.errors import PartyError
from fedge.party.messages import ARRAYS_KEY, CONFIG_KEY, METRICS_KEY
from fedge.privacy.settings import SECAGG_MIN_PARTIES, PrivacyError

ARRAY_NAMES_KEY = "secagg-array-names"
"""FitIns config key: the model's array names, JSON, in the order of ``fitins.parameters``."""
NUM_EXAMPLES_KEY = "num-examples"
SECAGG_CONFIGS_KEY = RECORD_KEY_CONFIGS

FITINS_PARAMETERS = "fitins.parameters"
FITINS_CONFIG = "fitins.config"
FITRES_PARAMETERS = "fitres.parameters"
FITRES_NUM_EXAMPLES = "fitres.num_examples"
FITRES_METRICS = "fitres.metrics"
FITRES_STATUS = "fitres.status"
NUMPY_STYPE = "numpy.ndarray"


class SecAggPartyError(PartyError):
    """A SecAgg+ round's message or the app's reply to it cannot be translated."""


def is_secagg_message(message: Message) -> bool:
    """Whether ``message`` belongs to a SecAgg+ round (any of its four stages)."""
    return (
        message.metadata.message_type == MessageType.TRAIN
        and SECAGG_CONFIGS_KEY in message.content.config_records
    )


def secagg_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A ClientApp mod: SecAgg+ rounds through Flower's ``secaggplus_mod``, others as they are.

    ``ClientApp(mods=[secagg_mod])``; the app below sees Message-API train messages in
    both kinds of round.
    """
    if not is_secagg_message(message):
        return call_next(message, context)
    check_threshold(message)

    def legacy_app(legacy: Message, ctxt: Context) -> Message:
        names = array_names(legacy)
        reply = call_next(to_message_api(legacy, names), ctxt)
        return to_legacy_fitres(reply, names, legacy)

    return secaggplus_mod(_own_configs(message), context, legacy_app)


def check_threshold(message: Message) -> None:
    """A station takes no part in a SecAgg+ round whose reconstruction threshold is below
    3 (issue 24): our server never asks one, another server might, and shares that 2 can
    combine let a pair unmask each other. Raises PrivacyError (an error reply) at setup."""
    configs = message.content.config_records[SECAGG_CONFIGS_KEY]
    if configs.get(Key.STAGE) != Stage.SETUP:
        return
    threshold = configs.get(Key.THRESHOLD)
    if not isinstance(threshold, int) or threshold < SECAGG_MIN_PARTIES:
        raise PrivacyError(
            f"SecAgg+ round refused: its reconstruction threshold is {threshold!r}, below "
            f"the {SECAGG_MIN_PARTIES} parties this station requires"
        )


def _own_configs(message: Message) -> Message:
    """The message with a copy of its SecAgg+ configs, which ``secaggplus_mod`` edits.

    Over the wire every party gets its own copy; an in-process grid hands every party the
    same objects, and the first party's edits would reach the others.
    """
    content = RecordDict(dict(message.content.items()))
    configs = message.content.config_records[SECAGG_CONFIGS_KEY]
    content[SECAGG_CONFIGS_KEY] = ConfigRecord(dict(configs))
    return make_message(copy.copy(message.metadata), content=content)


# ---------------------------------------------------------------- translation (pure)


def array_names(legacy: Message) -> list[str]:
    """The model's array names the server sent (``"0"``, ``"1"``, ... when it sent none)."""
    records = legacy.content.config_records
    config = records.get(FITINS_CONFIG, ConfigRecord())
    raw = config.get(ARRAY_NAMES_KEY)
    parameters = legacy.content.array_records.get(FITINS_PARAMETERS)
    if parameters is None:
        raise SecAggPartyError(
            f"a SecAgg+ train message must carry {FITINS_PARAMETERS!r} (a legacy FitIns); "
            f"got records {sorted(legacy.content.keys())}"
        )
    count = len(parameters)
    if raw is None:
        return [str(i) for i in range(count)]
    try:
        names = json.loads(str(raw))
    except ValueError as exc:
        raise SecAggPartyError(f"config[{ARRAY_NAMES_KEY!r}] is not JSON: {exc}") from exc
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise SecAggPartyError(f"config[{ARRAY_NAMES_KEY!r}] must be a JSON list of names")
    if len(names) != count or len(set(names)) != count:
        raise SecAggPartyError(
            f"config[{ARRAY_NAMES_KEY!r}] names {len(names)} arrays (distinct: "
            f"{len(set(names))}) but the message carries {count}"
        )
    return names


def to_message_api(legacy: Message, names: Sequence[str]) -> Message:
    """A legacy FitIns message as our apps read one: named ``"arrays"`` and ``"config"``.

    The SecAgg+ configs record stays out: the app never sees the protocol's keys.
    """
    parameters = legacy.content.array_records[FITINS_PARAMETERS]
    config = ConfigRecord(dict(legacy.content.config_records.get(FITINS_CONFIG, {})))
    config.pop(ARRAY_NAMES_KEY, None)
    arrays = ArrayRecord()
    for name, array in zip(names, parameters.values(), strict=True):
        # Legacy arrays carry no dtype or shape of their own: the bytes (np.save) do.
        arrays[name] = Array(array.numpy())
    content = RecordDict({ARRAYS_KEY: arrays, CONFIG_KEY: config})
    return make_message(copy.copy(legacy.metadata), content=content)


def to_legacy_fitres(reply: Message, names: Sequence[str], request: Message) -> Message:
    """Our app's train reply as the legacy FitRes ``secaggplus_mod`` reads.

    The arrays go in the order of ``names`` (the order the server sent and will read the
    aggregate in); the weight is the reply's ``num-examples``, a whole number >= 0.
    """
    if reply.has_error():
        raise SecAggPartyError(f"the app answered with an error: {reply.error.reason}")
    arrays = reply.content.array_records.get(ARRAYS_KEY)
    if arrays is None:
        raise SecAggPartyError(f"the app's reply has no {ARRAYS_KEY!r} ArrayRecord")
    missing = [n for n in names if n not in arrays]
    if missing or len(arrays) != len(names):
        raise SecAggPartyError(
            f"the app's reply arrays {sorted(arrays)} are not the model sent {list(names)}"
        )
    metrics = _reply_metrics(reply)
    examples = metrics.get(NUM_EXAMPLES_KEY)
    if isinstance(examples, bool) or not isinstance(examples, int | float) or examples < 0:
        raise SecAggPartyError(
            f"the app's reply needs a {NUM_EXAMPLES_KEY!r} metric >= 0, got {examples!r}"
        )
    if examples != int(examples):
        raise SecAggPartyError(f"{NUM_EXAMPLES_KEY!r} must be whole, got {examples}")
    parameters = ArrayRecord()
    for index, name in enumerate(names):
        array = arrays[name]
        parameters[str(index)] = Array(data=array.data, dtype="", stype=NUMPY_STYPE, shape=())
    content = RecordDict(
        {
            FITRES_PARAMETERS: parameters,
            FITRES_NUM_EXAMPLES: MetricRecord({"num_examples": int(examples)}),
            FITRES_METRICS: ConfigRecord(dict(metrics)),
            FITRES_STATUS: ConfigRecord({"code": 0, "message": "Success"}),
        }
    )
    return Message(content=content, reply_to=request)


def _reply_metrics(reply: Message) -> MetricRecord:
    records = reply.content.metric_records
    if METRICS_KEY in records:
        return records[METRICS_KEY]
    if len(records) == 1:
        return next(iter(records.values()))
    raise SecAggPartyError(
        f"the app's reply needs one MetricRecord ({METRICS_KEY!r}), got {sorted(records)}"
    )
