"""Thumbnails on the wire: the policy's bounds, and every way a thumbnail record is refused."""

import base64
import io
import json
import struct
import zlib

import pytest
from conftest import PNG_2X2
from PIL import Image

from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError, ValidationError
from fedge.protocols.records import RecordBatch, Stream
from fedge.protocols.thumbnails import (
    MAX_PNG_BYTES,
    MAX_SIDE,
    PER_BATCH,
    ThumbnailPolicy,
    ThumbnailRecord,
    check_png,
    png_size,
)


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("L", (width, height), 7).save(out, "PNG")
    return out.getvalue()


def _ihdr_only(width: int, height: int) -> bytes:
    """A PNG header claiming ``width`` x ``height`` (what a forger would send)."""
    body = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunk = struct.pack(">I", 13) + body + struct.pack(">I", zlib.crc32(body))
    return b"\x89PNG\r\n\x1a\n" + chunk + b"\x00" * 16


def test_a_real_png_within_bounds_is_accepted() -> None:
    record = ThumbnailRecord.of("p-1", 1.0, _png(MAX_SIDE, 40))
    assert png_size(record.image()) == (MAX_SIDE, 40)
    assert check_png(base64.b64decode(PNG_2X2)) == (2, 2)


@pytest.mark.parametrize(
    ("png", "message"),
    [
        ("not base64 at all!", "not valid base64"),
        (base64.b64encode(b"GIF89a" + b"\x00" * 40).decode(), "not a PNG"),
        (base64.b64encode(_ihdr_only(MAX_SIDE + 1, 8)).decode(), "limit 96x96"),
        (base64.b64encode(_ihdr_only(0, 8)).decode(), "0x8"),
        (base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 30).decode(), "no IHDR"),
        ("A" * (4 * (MAX_PNG_BYTES // 3 + 1) + 4), "over"),
    ],
    ids=["base64", "gif", "too-wide", "zero-wide", "no-ihdr", "oversized"],
)
def test_a_bad_thumbnail_is_refused(png: str, message: str) -> None:
    with pytest.raises(ValidationError, match="thumbnail") as refused:
        ThumbnailRecord("p-1", 1.0, png)
    assert message in str(refused.value)


def test_a_png_over_the_byte_bound_is_refused() -> None:
    noise = Image.frombytes("L", (MAX_SIDE, MAX_SIDE), bytes(range(256)) * 36)
    out = io.BytesIO()
    noise.save(out, "PNG", compress_level=0)
    data = out.getvalue() + b"\x00" * MAX_PNG_BYTES
    with pytest.raises(ValidationError, match=f"limit {MAX_PNG_BYTES}"):
        check_png(data)


def test_a_forged_record_in_a_batch_fails_decoding_and_names_it() -> None:
    good = RecordBatch("st-01", Stream.THUMBNAILS, 1, 0, (ThumbnailRecord("p-1", 1.0, PNG_2X2),))
    wire = json.loads(codec.encode(good))
    wire["records"][0]["png"] = base64.b64encode(b"<svg onload=alert(1)>" * 3).decode()
    with pytest.raises(ProtocolError, match=r"records\[0\].*not a PNG"):
        codec.decode(json.dumps(wire).encode(), RecordBatch)


def test_a_thumbnail_batch_is_bounded_so_it_stays_under_the_codec_limit() -> None:
    big = base64.b64encode(_png(MAX_SIDE, MAX_SIDE)).decode()
    records = tuple(ThumbnailRecord(f"p-{i}", 1.0, big) for i in range(PER_BATCH + 1))
    with pytest.raises(ValidationError, match=f"limit {PER_BATCH}"):
        RecordBatch("st-01", Stream.THUMBNAILS, 1, 0, records)
    # The largest thumbnails a batch may carry, as base64, still fit one message.
    worst = "A" * (4 * (MAX_PNG_BYTES // 3 + 1))
    payload = json.dumps({"records": [{"png": worst}] * PER_BATCH})
    assert len(payload) < codec.DEFAULT_MAX_BYTES


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("size", 8, "thumbnails.size"),
        ("size", MAX_SIDE + 1, "thumbnails.size"),
        ("per_minute", 0, "thumbnails.per_minute"),
        ("per_minute", 10_000, "thumbnails.per_minute"),
    ],
)
def test_a_policy_out_of_bounds_is_refused_even_in_a_config(
    field: str, value: int, message: str
) -> None:
    wire = json.loads(codec.encode(EdgeConfig("plant-a", "st-01", 2, thumbnails=ThumbnailPolicy())))
    wire["thumbnails"][field] = value
    with pytest.raises(ValidationError, match=message):
        codec.decode(json.dumps(wire).encode(), EdgeConfig)


def test_a_config_without_thumbnails_says_nothing_of_them_on_the_wire() -> None:
    # An agent from before thumbnails keeps decoding every config that does not share.
    assert b"thumbnails" not in codec.encode(EdgeConfig("plant-a", "st-01", 2))
