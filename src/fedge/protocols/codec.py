"""Strict JSON wire codec for the message dataclasses.

Wire form: one flat JSON object, ``{"schema": 1, "kind": "<kind>", <fields>...}``.
Decoding is strict on purpose -- a device fleet runs for years and a lenient parser turns
every producer bug into silent data: unknown fields, missing fields, wrong JSON types
(``true`` for an int, ``"1"`` for a float), NaN/Infinity, an unsupported schema and an
oversized payload are all a :class:`DecodeError`; a broken value rule is a
:class:`ValidationError`. Nothing else escapes :func:`decode`.

Decoders are compiled once per dataclass from its type hints, so a 500-record batch
decodes without per-field reflection.
"""

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

from fedge.protocols.alerts import Alert
from fedge.protocols.config import ConfigReport, EdgeConfig
from fedge.protocols.deployment import DeploymentDesired, DeployStatus
from fedge.protocols.enrollment import EnrollRequest, EnrollResponse, RenewRequest
from fedge.protocols.errors import DecodeError, OversizedError, ProtocolError, ValidationError
from fedge.protocols.evaluation import EvaluationReport, EvaluationRequest
from fedge.protocols.labels import StationLabels
from fedge.protocols.liveness import Liveness
from fedge.protocols.manifest import ModelManifest
from fedge.protocols.pace import TelemetryPace
from fedge.protocols.records import RECORD_TYPE, RecordBatch
from fedge.protocols.trust import KeyRotation, TrustChain, TrustReport
from fedge.protocols.validate import OMIT_KEY

SCHEMA_VERSION = 1
DEFAULT_MAX_BYTES = 256 * 1024

T = TypeVar("T")
_Conv = Callable[[Any, str], Any]

KINDS: dict[type[Any], str] = {
    EdgeConfig: "edge_config",
    ConfigReport: "config_report",
    ModelManifest: "model_manifest",
    DeploymentDesired: "deployment",
    DeployStatus: "deploy_status",
    Liveness: "liveness",
    RecordBatch: "record_batch",
    StationLabels: "station_labels",
    EvaluationRequest: "evaluation_request",
    EvaluationReport: "evaluation_report",
    Alert: "alert",
    EnrollRequest: "enroll_request",
    EnrollResponse: "enroll_response",
    RenewRequest: "renew_request",
    KeyRotation: "key_rotation",
    TrustChain: "trust_chain",
    TrustReport: "trust_report",
    TelemetryPace: "telemetry_pace",
}


# ---------------------------------------------------------------- encoding


# Exact types that are their own JSON form (an enum that is also a str is not one of them).
_PLAIN_TYPES = frozenset({str, int, float, bool, type(None)})
# Per dataclass: its fields' names and whether each is left out when None. Read once per
# class, not per message: a prediction is encoded on the line camera's path (issue 25).
_FIELD_PLANS: dict[type, tuple[tuple[str, bool], ...]] = {}


def _field_plan(cls: type) -> tuple[tuple[str, bool], ...]:
    plan = _FIELD_PLANS.get(cls)
    if plan is None:
        plan = tuple((f.name, bool(f.metadata.get(OMIT_KEY))) for f in dataclasses.fields(cls))
        _FIELD_PLANS[cls] = plan
    return plan


def _to_obj(value: Any) -> Any:
    if type(value) in _PLAIN_TYPES:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        plain = {}
        for name, omit_when_none in _field_plan(type(value)):
            item = getattr(value, name)
            if not (omit_when_none and item is None):
                plain[name] = _to_obj(item)
        return plain
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_to_obj(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_obj(v) for k, v in value.items()}
    return value


def to_plain(value: Any) -> Any:
    """A dataclass (or anything inside one) as plain JSON-ready values."""
    return _to_obj(value)


def decoder_for(cls: type[T]) -> Callable[[Any, str], T]:
    """The compiled strict decoder of a dataclass, for plain values already parsed."""
    return typing.cast(Callable[[Any, str], T], _decoder(cls))


def to_wire_obj(message: Any) -> dict[str, Any]:
    kind = KINDS.get(type(message))
    if kind is None:
        raise TypeError(f"{type(message).__name__} is not a wire message")
    return {"schema": SCHEMA_VERSION, "kind": kind, **_to_obj(message)}


def encode(message: Any) -> bytes:
    """Compact, key-sorted JSON (sorted so that equal messages give equal bytes)."""
    return json.dumps(
        to_wire_obj(message), separators=(",", ":"), sort_keys=True, allow_nan=False
    ).encode()


# ---------------------------------------------------------------- decoding


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "null" if value is None else "number"
    )


def _fail(path: str, expected: str, value: Any) -> typing.NoReturn:
    raise DecodeError(f"{path}: expected {expected}, got {_type_name(value)}")


def _conv_int(v: Any, path: str) -> int:
    if type(v) is not int:
        _fail(path, "integer", v)
    return v


def _conv_float(v: Any, path: str) -> float:
    if type(v) is float:
        result = v
    elif type(v) is int:
        try:
            result = float(v)
        except OverflowError:
            raise DecodeError(f"{path}: number out of range") from None
    else:
        _fail(path, "number", v)
    # 1e400 parses as inf; no field of ours means "infinite".
    if not math.isfinite(result):
        raise DecodeError(f"{path}: number out of range")
    return result


def _conv_str(v: Any, path: str) -> str:
    if type(v) is not str:
        _fail(path, "string", v)
    return v


def _conv_bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        _fail(path, "boolean", v)
    return v


_SCALARS: dict[Any, _Conv] = {int: _conv_int, float: _conv_float, str: _conv_str, bool: _conv_bool}


def _converter(hint: Any) -> _Conv:
    if hint in _SCALARS:
        return _SCALARS[hint]
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, Enum):
        allowed = {m.value: m for m in hint}

        def conv_enum(v: Any, path: str) -> Any:
            if type(v) is not str or v not in allowed:
                raise DecodeError(f"{path}: expected one of {sorted(allowed)}, got {v!r:.40}")
            return allowed[v]

        return conv_enum
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _decoder(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        nullable = len(options) < len(args)
        convs = [_converter(a) for a in options]
        names = " or ".join(getattr(a, "__name__", str(a)) for a in options)

        def conv_union(v: Any, path: str) -> Any:
            if v is None and nullable:
                return None
            for conv in convs:
                try:
                    return conv(v, path)
                except DecodeError:
                    continue
            _fail(path, names + (" or null" if nullable else ""), v)

        return conv_union
    if origin is tuple:
        item = _converter(args[0])

        def conv_tuple(v: Any, path: str) -> tuple[Any, ...]:
            if type(v) is not list:
                _fail(path, "array", v)
            return tuple(item(x, f"{path}[{i}]") for i, x in enumerate(v))

        return conv_tuple
    if origin is dict:
        value_conv = _converter(args[1])

        def conv_dict(v: Any, path: str) -> dict[str, Any]:
            if type(v) is not dict:
                _fail(path, "object", v)
            if len(v) > 1024:
                raise DecodeError(f"{path}: {len(v)} entries, limit 1024")
            return {k: value_conv(x, f"{path}.{k}") for k, x in v.items()}

        return conv_dict
    raise TypeError(f"no wire converter for {hint!r}")


_DECODERS: dict[type[Any], _Conv] = {}


def _decoder(cls: type[Any]) -> _Conv:
    cached = _DECODERS.get(cls)
    if cached is None:
        cached = _DECODERS[cls] = _compile_decoder(cls)
    return cached


def _compile_decoder(cls: type[Any]) -> _Conv:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    required = frozenset(
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    known = frozenset(f.name for f in fields)
    convs = {f.name: _converter(hints[f.name]) for f in fields if f.name != "records"}
    if cls is RecordBatch:
        record_decoders = {s: _decoder(t) for s, t in RECORD_TYPE.items()}

    def decode_obj(v: Any, path: str) -> Any:
        if type(v) is not dict:
            _fail(path or cls.__name__, "object", v)
        unknown = v.keys() - known
        if unknown:
            raise DecodeError(f"{path or cls.__name__}: unknown field(s) {sorted(unknown)}")
        missing = required - v.keys()
        if missing:
            raise DecodeError(f"{path or cls.__name__}: missing field(s) {sorted(missing)}")
        prefix = f"{path}." if path else ""
        kwargs = {k: convs[k](x, prefix + k) for k, x in v.items() if k != "records"}
        if cls is RecordBatch and "records" in v:
            raw = v["records"]
            if type(raw) is not list:
                _fail(prefix + "records", "array", raw)
            record_decode = record_decoders[kwargs["stream"]]
            kwargs["records"] = tuple(
                record_decode(r, f"{prefix}records[{i}]") for i, r in enumerate(raw)
            )
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise ValidationError(f"{path or cls.__name__}: {exc}") from None

    return decode_obj


def _reject_constant(name: str) -> Any:
    raise DecodeError(f"non-standard JSON number {name}")


def loads(payload: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Parse JSON with a size limit, refusing NaN/Infinity; always raises DecodeError."""
    if len(payload) > max_bytes:
        raise OversizedError(f"payload is {len(payload)} bytes, limit {max_bytes}")
    try:
        return json.loads(payload, parse_constant=_reject_constant)
    except DecodeError:
        raise
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise DecodeError(f"not valid JSON: {exc}") from None


def from_wire_obj(obj: Any, cls: type[T]) -> T:
    kind = KINDS[cls]
    if type(obj) is not dict:
        _fail("message", "object", obj)
    schema = obj.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise DecodeError(f"unsupported schema {schema!r} (this side speaks {SCHEMA_VERSION})")
    if obj.get("kind") != kind:
        raise DecodeError(f"expected kind {kind!r}, got {obj.get('kind')!r:.40}")
    body = {k: v for k, v in obj.items() if k not in ("schema", "kind")}
    try:
        return typing.cast(T, _decoder(cls)(body, ""))
    except ProtocolError:
        raise
    except (TypeError, ValueError) as exc:  # a rule we did not foresee must still be typed
        raise DecodeError(f"{cls.__name__}: {exc}") from None


def decode(payload: bytes, cls: type[T], *, max_bytes: int = DEFAULT_MAX_BYTES) -> T:
    """Decode one message of type ``cls``; raises only :class:`ProtocolError` subclasses."""
    return from_wire_obj(loads(payload, max_bytes=max_bytes), cls)
