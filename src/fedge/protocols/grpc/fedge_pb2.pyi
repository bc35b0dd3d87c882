# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DownloadRequest(_message.Message):
    __slots__ = ("edge", "model_name", "model_version", "offset", "chunk_size")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    edge: str
    model_name: str
    model_version: int
    offset: int
    chunk_size: int
    def __init__(self, edge: _Optional[str] = ..., model_name: _Optional[str] = ..., model_version: _Optional[int] = ..., offset: _Optional[int] = ..., chunk_size: _Optional[int] = ...) -> None: ...

class DownloadHeader(_message.Message):
    __slots__ = ("manifest_envelope", "total_size", "offset", "sha256")
    MANIFEST_ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    manifest_envelope: bytes
    total_size: int
    offset: int
    sha256: str
    def __init__(self, manifest_envelope: _Optional[bytes] = ..., total_size: _Optional[int] = ..., offset: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class DownloadChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: DownloadHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[DownloadHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("edge", "payload", "request_id")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    edge: str
    payload: bytes
    request_id: int
    def __init__(self, edge: _Optional[str] = ..., payload: _Optional[bytes] = ..., request_id: _Optional[int] = ...) -> None: ...

class UploadAck(_message.Message):
    __slots__ = ("request_id", "accepted", "duplicate", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    accepted: bool
    duplicate: bool
    error: str
    def __init__(self, request_id: _Optional[int] = ..., accepted: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class DesiredRequest(_message.Message):
    __slots__ = ("edge", "known")
    class KnownEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EDGE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    edge: str
    known: _containers.ScalarMap[str, int]
    def __init__(self, edge: _Optional[str] = ..., known: _Optional[_Mapping[str, int]] = ...) -> None: ...

class DesiredEnvelope(_message.Message):
    __slots__ = ("kind", "version", "envelope")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    version: int
    envelope: bytes
    def __init__(self, kind: _Optional[str] = ..., version: _Optional[int] = ..., envelope: _Optional[bytes] = ...) -> None: ...

class DesiredReply(_message.Message):
    __slots__ = ("envelopes",)
    ENVELOPES_FIELD_NUMBER: _ClassVar[int]
    envelopes: _containers.RepeatedCompositeFieldContainer[DesiredEnvelope]
    def __init__(self, envelopes: _Optional[_Iterable[_Union[DesiredEnvelope, _Mapping]]] = ...) -> None: ...

class StatusReport(_message.Message):
    __slots__ = ("edge", "kind", "payload")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    edge: str
    kind: str
    payload: bytes
    def __init__(self, edge: _Optional[str] = ..., kind: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class StatusAck(_message.Message):
    __slots__ = ("accepted", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
