"""The SuperLink's front as an ASGI app over a stand-in SuperLink (issue 24).

The processes are in tests/federation/test_stranger.py; here, what the front passes on,
refuses and adds, with the upstream answered by an in-memory transport."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from flwr.proto.fab_pb2 import GetFabResponse

from fedge.aggregator.superlink.front import FleetOnly
from fedge.aggregator.superlink.signed_apps import SignedApps
from fedge.protocols.app_signing import VALID_LICENSE, fab_digest, sign_fab
from fedge.protocols.signing import SigningKey

FAB = b"the FAB's bytes"


def fab_reply(content: bytes) -> bytes:
    reply = GetFabResponse()
    reply.fab.hash_str = fab_digest(content)
    reply.fab.content = content
    return reply.SerializeToString()


SIGNED = {"flwr-public-key": "a2V5", "flwr-signature": "c2ln", "flwr-timestamp": "now"}


def call(
    front: FleetOnly,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/fleet/get-fab":
            return httpx.Response(200, content=fab_reply(FAB))
        echoed = request.headers.get("x-forwarded-for", "")
        return httpx.Response(200, content=b"ok:" + request.content, headers={"x-seen": echoed})

    async def go() -> httpx.Response:
        front._client = httpx.AsyncClient(
            transport=httpx.MockTransport(upstream), base_url="https://superlink"
        )
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="https://front") as client:
            return await client.request(method, path, content=body, headers=headers or SIGNED)

    response = asyncio.run(go())
    response.extensions["upstream_calls"] = seen
    return response


def test_only_fleet_api_calls_pass(tmp_path: Path) -> None:
    front = FleetOnly("https://superlink", False, SignedApps(tmp_path))
    passed = call(front, "POST", "/v1/fleet/pull-messages", b"\x08\x01")
    assert passed.status_code == 200 and passed.content == b"ok:\x08\x01"
    for method, path in (
        ("POST", "/v1/control/start-run"),
        ("POST", "/v1/control/register-supernode"),
        ("POST", "/v1/runtime/push-messages"),
        ("GET", "/v1/fleet/pull-messages"),
        ("POST", "/v1/fleet/../control/start-run"),
        ("POST", "/v1/fleet/%2e%2e/control/start-run"),
        ("POST", "/v1/fleet/anything-else"),
        ("GET", "/"),
    ):
        refused = call(front, method, path)
        assert refused.status_code == 404, (method, path)
        assert refused.extensions["upstream_calls"] == []  # nothing reached Flower
    assert front.counters["refused.not_fleet_api"] == 8
    assert front.counters["forwarded"] == 1


def test_an_oversized_body_is_refused_before_it_is_forwarded(tmp_path: Path) -> None:
    front = FleetOnly("https://superlink", False, SignedApps(tmp_path), max_body=1024)
    refused = call(front, "POST", "/v1/fleet/push-object", b"x" * 4096)
    assert refused.status_code == 413 and refused.extensions["upstream_calls"] == []
    # Only pushed objects and messages may be large; a pull is a small request.
    assert call(front, "POST", "/v1/fleet/push-object", b"x" * 1000).status_code == 200
    small = call(front, "POST", "/v1/fleet/pull-messages", b"x" * 100_000)
    assert small.status_code == 413 and small.extensions["upstream_calls"] == []
    assert front.counters["refused.too_large"] == 2


def test_unsigned_calls_are_refused_and_claimed_addresses_replaced(tmp_path: Path) -> None:
    front = FleetOnly("https://superlink", False, SignedApps(tmp_path))
    unsigned = call(front, "POST", "/v1/fleet/pull-messages", headers={"x": "y"})
    assert unsigned.status_code == 401 and unsigned.extensions["upstream_calls"] == []
    assert front.counters["refused.unsigned"] == 1
    spoofed = {**SIGNED, "x-forwarded-for": "10.9.9.9", "forwarded": "for=10.9.9.9"}
    passed = call(front, "POST", "/v1/fleet/pull-messages", headers=spoofed)
    (seen,) = passed.extensions["upstream_calls"]
    assert "forwarded" not in seen.headers
    assert seen.headers["x-forwarded-for"] != "10.9.9.9"  # the real peer's address


def test_the_fleets_signature_is_added_to_a_fab_it_signed(tmp_path: Path) -> None:
    apps = SignedApps(tmp_path)
    front = FleetOnly("https://superlink", False, apps)
    unsigned = GetFabResponse.FromString(call(front, "POST", "/v1/fleet/get-fab").content)
    assert dict(unsigned.fab.verifications) == {} and front.counters["fab.unsigned"] == 1
    signature = sign_fab(FAB, SigningKey.generate())
    apps.put(signature)
    signed = GetFabResponse.FromString(call(front, "POST", "/v1/fleet/get-fab").content)
    key_id, record = signature.verification()
    assert dict(signed.fab.verifications) == {VALID_LICENSE: "Valid", key_id: record}
    assert signed.fab.content == FAB
    # A signature file for other bytes, or a damaged one, signs nothing.
    (tmp_path / f"{fab_digest(FAB)}.json").write_text("{not json")
    damaged = GetFabResponse.FromString(call(front, "POST", "/v1/fleet/get-fab").content)
    assert dict(damaged.fab.verifications) == {}
