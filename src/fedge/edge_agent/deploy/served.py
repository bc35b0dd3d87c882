"""What the station remembers of the models it served: which it trusts, and their configs.

Two records in the agent's store, both pure JSON handled here (issue "The closed loop",
local rollback on the edge):

- ``proven_models``: the models that passed a probation on this station, and the
  station's first model (nothing before it to judge it against). A proven model the
  manager deploys again -- a rollout's rollback restoring the model it replaced -- is
  not put on probation again: judged against the model the manager is moving away from,
  it could be "rolled back" to it, undoing the manager's order. Only a proven model's
  scores are a baseline for the next model's spread.
- ``model_configs``: per model, the last config applied for it (tied to it, or tied to
  none while it served). A local rollback puts the previous model's config back in
  force: the config a rollout tied to the failed model must not stay, untied, on the
  model the station went back to.
"""

import json
from collections.abc import Iterable, Mapping

from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError

PROVEN = "proven_models"
CONFIGS = "model_configs"
# The newest config version the station is done with (see local_rollback.py).
CONFIG_DONE = "config_done_version"
# The newest models remembered; older ones are long gone from the station's disk.
KEEP_PROVEN = 16
KEEP_CONFIGS = 8


def decode_proven(raw: str | None) -> tuple[str, ...]:
    """The proven models, oldest first; nothing when unreadable (then all are judged)."""
    try:
        data = json.loads(raw or "[]")
    except ValueError:
        return ()
    return tuple(str(ref) for ref in data) if isinstance(data, list) else ()


def add_proven(proven: Iterable[str], ref: str, keep: int = KEEP_PROVEN) -> str:
    """``proven`` with ``ref`` as the newest, at most ``keep``, encoded."""
    refs = [r for r in proven if r != ref]
    refs.append(ref)
    return json.dumps(refs[-keep:], separators=(",", ":"))


def decode_configs(raw: str | None) -> dict[str, str]:
    """Model ref -> its last config (encoded), oldest first; unreadable: none."""
    try:
        data = json.loads(raw or "{}")
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, str)}


def remember_config(
    configs: Mapping[str, str], config: EdgeConfig | None, serving: str, keep: int = KEEP_CONFIGS
) -> str:
    """``configs`` with ``config`` recorded for the model it applies to as set: its tied
    model, or the serving one when it is tied to none. Encoded, at most ``keep``."""
    entries = dict(configs)
    ref = serving if config is None or config.model is None else config.model
    if config is not None and ref:
        entries.pop(ref, None)  # re-inserted as the newest
        entries[ref] = codec.encode(config).decode()
    return json.dumps(dict(list(entries.items())[-keep:]), separators=(",", ":"))


def config_for(
    configs: Mapping[str, str], in_force: EdgeConfig | None, model: str
) -> EdgeConfig | None:
    """The config to put in force with ``model`` (a local rollback to it); None when the
    one in force applies to it as set (tied to it, or to none), or none is remembered."""
    if in_force is None or in_force.model is None or in_force.model == model:
        return None
    raw = configs.get(model)
    if raw is None:
        return None
    try:
        remembered = codec.decode(raw.encode(), EdgeConfig)
    except ProtocolError:
        return None
    # For the same edge, and older than the one in force (it was replaced by it).
    if (remembered.fleet, remembered.edge) != (in_force.fleet, in_force.edge):
        return None
    return remembered if remembered.version < in_force.version else None
