"""The station's Flower ``ClientApp`` for an ``anomaly`` job (issue 28): thin adapter.

A *train* message carries the backbone's weights (``"arrays"``, the inspection CNN's
state) and a ``"config"`` record with ``model-spec`` and the ``anomaly-*`` keys of
:mod:`fedge.party.anomaly_round`; the reply is the station's sufficient statistics. An
*evaluate* message carries the backbone and the fleet's fitted model
(``"model"``: :func:`fedge.models.anomaly.statistics.fit_to_arrays`), and the fleet's
pooled moments and count (``"anomaly-fleet"``, when the job sends them); the reply is the
station's threshold on its good parts scored out of sample (held out, and left out of
the fleet's sums: :func:`fedge.party.anomaly_round.threshold_round`). A fleet job's *train* message
(:mod:`fedge.aggregator.anomaly.rounds`) carries the backbone under ``"backbone"`` and
zero moments in ``"arrays"`` (the shapes the reply must have); the reply is then the
moments of the station's good parts, weighted by their count. Under SecAgg+ a train
message is Flower's legacy FitIns, which carries one model only: the moments go through
SecAgg+ and the backbone rides in the config as npz bytes (:data:`BACKBONE_BYTES_KEY`).
Both replies, and a
*query*'s, name the station's edge (``"identity"``, as the station ClientApp answers a
query). A station that cannot answer (no good parts, a family it cannot build) raises
:class:`~fedge.party.errors.PartyError`: Flower turns it into an error reply, which the
server counts as that station's failure.

The node config is the station ClientApp's (:class:`fedge.party.station_app.Station`).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.party.anomaly_round import moments_round, statistics_round, threshold_round
from fedge.party.errors import PartyError
from fedge.party.messages import ARRAYS_KEY, METRICS_KEY, round_config
from fedge.party.secagg import secagg_mod
from fedge.party.station_app import IDENTITY_KEY, Station, model_spec

if TYPE_CHECKING:
    from fedge.models.anomaly.statistics import SufficientStatistics

MODEL_KEY = "model"
BACKBONE_KEY = "backbone"
"""A fleet job's train message: the backbone here, the fleet's moments in ``"arrays"``."""
BACKBONE_BYTES_KEY = "anomaly-backbone"
"""Config key of a SecAgg+ round's train message: the backbone's arrays as npz bytes."""

# SecAgg+ rounds reach the app through Flower's secaggplus_mod (fedge.party.secagg).
app = ClientApp(mods=[secagg_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """This station's good parts' statistics (a fleet job's message: their moments)."""
    station = Station.from_node_config(context.node_config)
    config = round_config(msg)
    if BACKBONE_KEY in msg.content.array_records or BACKBONE_BYTES_KEY in config:
        backbone = (
            _arrays(msg, BACKBONE_KEY)
            if BACKBONE_KEY in msg.content.array_records
            else backbone_from_bytes(config[BACKBONE_BYTES_KEY])
        )
        sent = _arrays(msg, ARRAYS_KEY)
        stats, metrics = moments_round(
            station, model_spec(config), backbone, config, sent=list(sent.keys())
        )
    else:
        stats, metrics = statistics_round(
            station, model_spec(config), _arrays(msg, ARRAYS_KEY), config
        )
    content = RecordDict(
        {
            ARRAYS_KEY: stats,
            METRICS_KEY: MetricRecord(dict(metrics)),
            IDENTITY_KEY: ConfigRecord({"edge": station.edge}),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """This station's threshold for the fleet's model on its good parts scored out of
    sample: held out, and its training parts left out of the fleet's sums."""
    from fedge.models.anomaly import AnomalyError
    from fedge.models.anomaly.statistics import fit_from_arrays

    station = Station.from_node_config(context.node_config)
    config = round_config(msg)
    try:
        model = fit_from_arrays({k: v.numpy() for k, v in _arrays(msg, MODEL_KEY).items()})
    except AnomalyError as exc:
        raise PartyError(
            f"station {station.edge}: bad anomaly model in the message: {exc}"
        ) from exc
    metrics = threshold_round(
        station,
        model_spec(config),
        _arrays(msg, ARRAYS_KEY),
        model,
        config,
        fleet=_fleet(msg, station.edge),
    )
    content = RecordDict(
        {
            METRICS_KEY: MetricRecord(dict(metrics)),
            IDENTITY_KEY: ConfigRecord({"edge": station.edge}),
        }
    )
    return Message(content=content, reply_to=msg)


def _fleet(msg: Message, edge: str) -> SufficientStatistics | None:
    """The fleet's pooled statistics a threshold request carries (None from an older
    fedge: the threshold then rests on held-out parts only)."""
    from fedge.models.anomaly import AnomalyError
    from fedge.models.anomaly.statistics import COUNT_KEY, FLEET_KEY, statistics_from_moments

    if FLEET_KEY not in msg.content.array_records:
        return None
    arrays = {k: v.numpy() for k, v in msg.content.array_records[FLEET_KEY].items()}
    count = arrays.get(COUNT_KEY)
    try:
        if count is None or count.shape != (1,) or not count[0] >= 1:
            raise AnomalyError(f"no count of parts ({COUNT_KEY})")
        return statistics_from_moments(arrays, round(float(count[0])))
    except AnomalyError as exc:
        raise PartyError(f"station {edge}: bad fleet statistics in the message: {exc}") from exc


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The station's edge id: error replies carry no content, so the server asks first."""
    station = Station.from_node_config(context.node_config)
    content = RecordDict({IDENTITY_KEY: ConfigRecord({"edge": station.edge})})
    return Message(content=content, reply_to=msg)


def backbone_from_bytes(value: object) -> ArrayRecord:
    """The backbone's arrays from a SecAgg+ round's config (npz bytes, as the aggregator
    writes them: ``fedge.aggregator.anomaly.rounds``); anything else is an error reply."""
    if not isinstance(value, bytes):
        raise PartyError(f"config[{BACKBONE_BYTES_KEY!r}] must be npz bytes, got {type(value)}")
    try:
        with np.load(io.BytesIO(value), allow_pickle=False) as npz:
            return ArrayRecord(array_dict={k: Array(npz[k]) for k in npz.files})
    except (OSError, ValueError) as exc:
        raise PartyError(f"config[{BACKBONE_BYTES_KEY!r}] is no npz archive: {exc}") from exc


def _arrays(msg: Message, key: str) -> ArrayRecord:
    records = msg.content.array_records
    if key not in records:
        raise PartyError(f"expected an ArrayRecord {key!r} in the message, got {sorted(records)}")
    return records[key]
