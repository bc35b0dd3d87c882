"""Rotating the manager's signing key: the manager's side and an agent following it.

The agent here is a real EdgeAgent on a real manager home (SQLite store, registry, keys)
with its MQTT publishes captured; tests/test_key_rotation_processes.py runs the same
over Mosquitto with `manager serve` and agent processes.
"""

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FLEET, FleetHome, deploy, make_fleet_home, publish_model, set_threshold
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.deploy.restore import KeptModel
from fedge.edge_agent.errors import DeployError
from fedge.edge_agent.settings import load_settings
from fedge.edge_manager.desired import refresh as desired_refresh
from fedge.edge_manager.doctor.facts import gather
from fedge.edge_manager.doctor.report import diagnose
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.ingest.messages import Ingestor, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.security import key_rotation, trust_store
from fedge.edge_manager.security.enrollment import revoke
from fedge.protocols import codec, topics
from fedge.protocols.config import ConfigReport, ConfigStatus, EdgeConfig
from fedge.protocols.deployment import DeploymentDesired
from fedge.protocols.freshness import DAY_S, LIFETIME_S, expiry
from fedge.protocols.manifest import ModelManifest, TensorSpec
from fedge.protocols.rotation import parse_link, rotation_link, sign_chain
from fedge.protocols.signing import (
    KeyRing,
    SigningKey,
    open_signed,
    signer_of,
    trusted,
    unverified_payload,
)
from fedge.protocols.trust import TrustChain, TrustReport, TrustStatus

EDGE = "st-01"
Sent = list[tuple[str, bytes]]


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE, "st-02"))
    yield fleet_home
    fleet_home.close()


def offline_agent(fh: FleetHome, sent: Sent, monkeypatch: pytest.MonkeyPatch) -> EdgeAgent:
    agent = EdgeAgent(fh.agent_settings(EDGE))

    def publish(topic: str, payload: bytes, *args: Any, **kwargs: Any) -> None:
        sent.append((topic, payload))

    monkeypatch.setattr(agent.mqtt, "publish", publish)
    return agent


def close(agent: EdgeAgent) -> None:
    agent.store.close()
    agent.station.close()


def latest(fh: FleetHome, kind: str, edge: str = EDGE) -> dict[str, Any]:
    return fh.row(
        "SELECT * FROM desired WHERE edge=? AND kind=? ORDER BY version DESC LIMIT 1",
        (edge, kind),
    )


def signed_at(fh: FleetHome, key: SigningKey, at: float) -> str:
    """st-01's newest config as the manager would have signed it at ``at`` (its expiry
    a lifetime later), in the store too: what the station was sent then."""
    row = latest(fh, "config")
    config = codec.decode(row["document"].encode(), EdgeConfig)
    document = codec.encode(dataclasses.replace(config, expires_at=expiry(at))).decode()
    envelope = key.sign_payload(document.encode()).decode()
    trust_store.replace_signed(fh.db, EDGE, "config", row["version"], document, envelope)
    return envelope


def trust_reports(sent: Sent) -> list[TrustReport]:
    topic = topics.up(FLEET, EDGE, topics.Up.TRUST)
    return [codec.decode(payload, TrustReport) for t, payload in sent if t == topic]


def test_the_manager_signs_the_rotation_with_the_old_key_and_then_uses_only_the_new(
    fh: FleetHome,
) -> None:
    old = fh.home.signing_key()
    set_threshold(fh, EDGE, 0.3)
    publish_model(fh, 1)
    deployment = deploy(fh, 1, ["st-02"])
    done_at = time.time()
    done = key_rotation.rotate(fh.home)
    new = fh.home.signing_key()
    assert (done.sequence, done.old_key_id, done.new_key_id) == (
        1,
        old.public.key_id,
        new.public.key_id,
    )
    assert done.edges == 2 and done.manifests == 1
    assert fh.home.public_key_path.read_text().strip() == new.public.to_text()
    assert oct(fh.home.key_path.stat().st_mode & 0o777) == "0o600"
    assert not (fh.home.key_path.parent / "next").exists()
    # Every edge gets the chain, signed by the new key with an expiry; its one link is
    # signed by the old key and the new, and names both.
    for edge in (EDGE, "st-02"):
        row = latest(fh, "trust", edge)
        chain = open_signed(row["envelope"].encode(), TrustChain, trusted(new.public))
        assert row["version"] == 1 and row["published_at"] is None
        assert chain.expires_at is not None and chain.expires_at > done_at + LIFETIME_S - 60
        link = parse_link(chain.links[0])
        assert set(link.signatures) == {old.public.key_id, new.public.key_id}
        assert link.rotation.old_key == old.public.to_text()
    # What may still go out is re-signed by the new key, its version unchanged.
    config_row = latest(fh, "config")
    assert config_row["version"] == 1 and config_row["published_at"] is None
    config = open_signed(config_row["envelope"].encode(), EdgeConfig, trusted(new.public))
    assert config.default_threshold == pytest.approx(0.3)
    deploy_row = latest(fh, "deploy", "st-02")
    desired = open_signed(deploy_row["envelope"].encode(), DeploymentDesired, trusted(new.public))
    assert desired.deployment_id == deployment
    registry = fh.row("SELECT envelope FROM models WHERE name='inspect' AND version=1")
    assert desired.manifest_envelope == registry["envelope"]
    assert signer_of(registry["envelope"].encode()) == new.public.key_id
    # An edge enrolled after the rotation is told the chain too (it reports its key).
    fh.enroll("st-03")
    assert latest(fh, "trust", "st-03")["version"] == 1
    view = key_rotation.trust_view(fh.home)
    assert view.behind() == [EDGE, "st-02", "st-03"]  # none has reported yet
    behind = [f for f in diagnose(gather(fh.home)) if f.check == "signing-key"]
    assert [(f.severity, f.subject) for f in behind] == [("warning", "st-01, st-02, st-03")]
    # A revoked station can say nothing any more: it is not waited for.
    revoke(fh.home, "st-03")
    assert [e.edge for e in key_rotation.trust_view(fh.home).edges] == [EDGE, "st-02"]
    assert fh.edge_row("st-03")["state"] == "revoked"
    # A second rotation extends the chain, signed by the first rotation's key.
    again = key_rotation.rotate(fh.home)
    assert again.sequence == 2 and again.old_key_id == new.public.key_id
    chain = unverified_payload(latest(fh, "trust")["envelope"].encode(), TrustChain)
    assert [parse_link(link).rotation.old_key for link in chain.links] == [
        old.public.to_text(),
        new.public.to_text(),
    ]
    assert signer_of(latest(fh, "trust")["envelope"].encode()) == again.new_key_id


def test_an_agent_follows_a_rotation_and_then_refuses_the_old_key(
    fh: FleetHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: Sent = []
    old = fh.home.signing_key()
    agent = offline_agent(fh, sent, monkeypatch)
    set_threshold(fh, EDGE, 0.3)
    agent._route(topics.Down.CONFIG, latest(fh, "config")["envelope"].encode())
    assert agent.applied_version == 1
    key_rotation.rotate(fh.home)
    new = fh.home.signing_key()
    set_threshold(fh, EDGE, 0.4)
    # The new config arrives before the rotation (retained topics come in any order):
    # refused for now, kept, and applied once the chain makes its signer trusted.
    agent._route(topics.Down.CONFIG, latest(fh, "config")["envelope"].encode())
    assert agent.applied_version == 1 and agent.counters["config.rejected.bad_signature"] == 1
    agent._route(topics.Down.TRUST, latest(fh, "trust")["envelope"].encode())
    assert agent.applied_version == 2
    assert agent.counters["trust.adopted"] == 1 and agent.counters["trust.replayed"] == 1
    assert set(agent.keys) == {new.public.key_id}
    assert trust_reports(sent)[-1].status is TrustStatus.ADOPTED
    assert trust_reports(sent)[-1].key_id == new.public.key_id
    # The old key signs nothing any more, even a newer version.
    v3 = EdgeConfig(FLEET, EDGE, 3, 0.9)
    agent._route(topics.Down.CONFIG, old.sign(v3))
    assert agent.applied_version == 2 and agent.counters["config.rejected.bad_signature"] == 2
    # The chain again (a reconnect's retained copy): nothing changes, nothing re-reported.
    reports = len(trust_reports(sent))
    agent._route(topics.Down.TRUST, latest(fh, "trust")["envelope"].encode())
    assert len(trust_reports(sent)) == reports and agent.counters["trust.adopted"] == 1
    # A restart keeps the new key.
    close(agent)
    restarted = offline_agent(fh, sent, monkeypatch)
    try:
        assert set(restarted.keys) == {new.public.key_id}
        assert restarted.keys.retired == {old.public.key_id}
        assert restarted.applied_version == 2
        restarted._route(topics.Down.CONFIG, old.sign(v3))
        assert restarted.applied_version == 2
    finally:
        close(restarted)


def test_a_forged_rotation_is_refused_reported_and_changes_nothing(
    fh: FleetHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: Sent = []
    agent = offline_agent(fh, sent, monkeypatch)
    pinned = set(agent.keys)
    forger = SigningKey.generate()
    link = rotation_link(forger, SigningKey.generate(), fleet=FLEET, sequence=1, issued_at=1.0)
    forged = TrustChain(FLEET, (link,))
    try:
        agent._route(topics.Down.TRUST, sign_chain(forger, forged))
        agent._route(topics.Down.TRUST, b'{"not": "a chain"}')
        assert set(agent.keys) == pinned
        assert agent.counters["trust.rejected"] == 2
        reports = trust_reports(sent)
        assert [r.status for r in reports] == [TrustStatus.REJECTED] * 2
        assert "does not lead to" in reports[0].reason
        # A config the forger signed is refused as before.
        agent._route(topics.Down.CONFIG, forger.sign(EdgeConfig(FLEET, EDGE, 1, 0.9)))
        assert agent.applied_version == 0
        # The manager stores the refusal: an operator sees it in `fedge manager keys`.
        ingestor = Ingestor(fh.db, FLEET)
        topic = topics.up(FLEET, EDGE, topics.Up.TRUST)
        with IngestTransaction.open(fh.db) as tx:
            outcome = ingestor.handle(tx, topic, reports_payload(sent), 1.0)
        assert outcome.verdict is Verdict.STORED
        view = key_rotation.trust_view(fh.home)
        row = next(e for e in view.edges if e.edge == EDGE)
        assert row.status == "rejected" and "does not lead to" in row.reason
        # Never rotated: every edge trusts the key it was enrolled with, the current one.
        assert view.on_current_key() == [EDGE, "st-02"] and view.behind() == []
        # `fedge manager doctor` names the station as an error.
        found = [f for f in diagnose(gather(fh.home)) if f.check == "signing-key"]
        assert [(f.severity, f.subject) for f in found] == [("error", EDGE)]
        assert "still trusts the current key" in found[0].message
    finally:
        close(agent)


def reports_payload(sent: Sent) -> bytes:
    topic = topics.up(FLEET, EDGE, topics.Up.TRUST)
    return next(payload for t, payload in sent if t == topic)


def test_a_kept_model_verified_under_a_retired_key_still_restores() -> None:
    old, new, stranger = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    manifest = ModelManifest(
        name="inspect",
        version=1,
        sha256="0" * 64,
        size=1,
        inputs=(TensorSpec("x", "float32", (1, 4)),),
        outputs=(TensorSpec("y", "float32", (1, 2)),),
        classes=("clean", "scratch"),
        positive_classes=("scratch",),
        created_at=1.0,
    )
    ring = KeyRing(old.public)
    ring.replace(new.public)
    kept = KeptModel(Path("model.onnx"), "inspect", 1, old.sign(manifest).decode())
    assert kept.verified_manifest(ring) == manifest
    # Retired means verified before: a plain mapping of the new key refuses it ...
    with pytest.raises(DeployError):
        kept.verified_manifest(trusted(new.public))
    # ... and so does the ring for a key it never trusted.
    foreign = KeptModel(Path("model.onnx"), "inspect", 1, stranger.sign(manifest).decode())
    with pytest.raises(DeployError):
        foreign.verified_manifest(ring)


def test_a_rotation_cut_short_is_finished_or_dropped(
    fh: FleetHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = fh.home.signing_key()

    def crash(*args: Any) -> None:
        raise OSError("killed")

    # Killed after the store has the link, before the key file moved: settle finishes it.
    monkeypatch.setattr(key_rotation, "_install", crash)
    with pytest.raises(OSError):
        key_rotation.rotate(fh.home)
    monkeypatch.undo()
    assert fh.home.signing_key().public == old.public
    assert "finished" in key_rotation.settle(fh.home)
    link = fh.row("SELECT new_key FROM trust_links WHERE sequence=1")
    assert fh.home.signing_key().public.to_text() == link["new_key"]
    # A next key no stored link names (killed before the transaction): dropped.
    stray = SigningKey.generate()
    stray.save(fh.home.key_path.parent / "next" / fh.home.key_path.name)
    cut_short = [f for f in diagnose(gather(fh.home)) if f.check == "signing-key"]
    assert ("warning", "keys/next") in [(f.severity, f.subject) for f in cut_short]
    assert "dropped" in key_rotation.settle(fh.home)
    assert not (fh.home.key_path.parent / "next").exists()
    assert fh.home.signing_key().public.to_text() == link["new_key"]


def test_with_a_root_key_a_stolen_signing_key_cannot_move_a_station(
    fh: FleetHome, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = key_rotation.make_root_key(tmp_path / "usb" / "fleet-root.key")
    key_rotation.pin_root(fh.home, root.public)
    fh.enroll("st-03")  # enrolled after: its agent.toml pins the root key
    settings = load_settings(fh.agents["st-03"])
    assert settings.root_key() == root.public
    sent: Sent = []
    agent = EdgeAgent(settings)
    monkeypatch.setattr(agent.mqtt, "publish", lambda t, p, *a, **k: sent.append((t, p)))
    stolen = fh.home.signing_key()
    try:
        # The thief holds the manager's key, makes its own and co-signs with both.
        thief = SigningKey.generate()
        link = rotation_link(stolen, thief, fleet=FLEET, sequence=1, issued_at=time.time())
        chain = TrustChain(FLEET, (link,), time.time() + DAY_S)
        agent._route(topics.Down.TRUST, sign_chain(thief, chain))
        assert set(agent.keys) == {stolen.public.key_id} and agent.trust.trust.sequence == 0
        assert agent.counters["trust.rejected"] == 1
        topic = topics.up(FLEET, "st-03", topics.Up.TRUST)
        report = codec.decode([p for t, p in sent if t == topic][-1], TrustReport)
        assert report.status is TrustStatus.REJECTED and report.key_id == stolen.public.key_id
        assert f"the root key {root.public.key_id}" in report.reason
        # ... so what it signs next is refused too.
        agent._route(topics.Down.CONFIG, thief.sign(EdgeConfig(FLEET, "st-03", 1, 0.99)))
        assert agent.applied_version == 0
        # The manager refuses a rotation without the root key, or with another one.
        with pytest.raises(ManagerError, match="--root-key"):
            key_rotation.rotate(fh.home)
        with pytest.raises(ManagerError, match="not the fleet's root key"):
            key_rotation.rotate(fh.home, root_key=SigningKey.generate())
        assert fh.home.signing_key().public == stolen.public
        assert fh.row("SELECT count(*) AS n FROM trust_links")["n"] == 0
        # The operator's rotation with the offline root key is followed.
        done = key_rotation.rotate(fh.home, root_key=root)
        agent._route(topics.Down.TRUST, latest(fh, "trust", "st-03")["envelope"].encode())
        assert set(agent.keys) == {done.new_key_id} and agent.trust.trust.sequence == 1
    finally:
        close(agent)


def test_a_refreshed_config_keeps_its_version_and_is_not_applied_again(
    fh: FleetHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: Sent = []
    agent = offline_agent(fh, sent, monkeypatch)
    key = fh.home.signing_key()
    now = time.time()
    try:
        set_threshold(fh, EDGE, 0.3)
        # Signed ten days ago.
        stamped = signed_at(fh, key, now - 10 * DAY_S)
        agent._route(topics.Down.CONFIG, stamped.encode())
        assert agent.applied_version == 1 and agent.counters["config.applied"] == 1
        # Four days left: the hourly sweep re-signs it, same version, later expiry.
        assert desired_refresh.refresh_expiring(fh.db, key, now) == 1
        assert desired_refresh.refresh_expiring(fh.db, key, now) == 0  # not due again
        row = latest(fh, "config")
        assert row["version"] == 1 and row["published_at"] is None
        refreshed = open_signed(row["envelope"].encode(), EdgeConfig, trusted(key.public))
        assert refreshed.expires_at == pytest.approx(now + LIFETIME_S)
        assert refreshed.default_threshold == pytest.approx(0.3)
        agent._route(topics.Down.CONFIG, row["envelope"].encode())
        assert agent.applied_version == 1 and agent.counters["config.applied"] == 1
        assert agent.counters["config.refreshed"] == 2  # first sight, then the refresh
        assert agent.freshness.staleness().expires_at == pytest.approx(now + LIFETIME_S)
        # The old signature replayed extends nothing.
        agent._route(topics.Down.CONFIG, stamped.encode())
        assert agent.counters["config.refreshed"] == 2
    finally:
        close(agent)


def test_a_config_is_signed_with_its_expiry_and_an_older_one_without_gets_one(
    fh: FleetHome,
) -> None:
    key = fh.home.signing_key()
    now = time.time()
    set_threshold(fh, EDGE, 0.3)
    envelope = latest(fh, "config")["envelope"].encode()
    written = open_signed(envelope, EdgeConfig, trusted(key.public))
    # No window in which a station (over gRPC, before the serve loop's next pass) can be
    # sent a document that never expires.
    assert written.expires_at == pytest.approx(now + LIFETIME_S, abs=60)
    assert desired_refresh.stamp(fh.db, key, EDGE, "config", 1, now) is None  # not due
    # One written by a fedge that did not sign an expiry is stamped before it goes out.
    legacy = codec.encode(dataclasses.replace(written, expires_at=None)).decode()
    legacy_envelope = key.sign_payload(legacy.encode()).decode()
    trust_store.replace_signed(fh.db, EDGE, "config", 1, legacy, legacy_envelope)
    stamped = desired_refresh.stamp(fh.db, key, EDGE, "config", 1, now)
    assert stamped is not None
    config = open_signed(stamped.encode(), EdgeConfig, trusted(key.public))
    assert config.expires_at == pytest.approx(now + LIFETIME_S)
    assert dataclasses.replace(config, expires_at=None) == dataclasses.replace(
        written, expires_at=None
    )


def test_an_expired_config_is_refused_reported_and_changes_nothing(
    fh: FleetHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: Sent = []
    agent = offline_agent(fh, sent, monkeypatch)
    key = fh.home.signing_key()
    try:
        set_threshold(fh, EDGE, 0.3)
        expired = signed_at(fh, key, time.time() - 20 * DAY_S)
        agent._route(topics.Down.CONFIG, expired.encode())
        assert agent.applied_version == 0
        assert agent.counters["config.rejected.expired"] == 1
        topic = topics.up(FLEET, EDGE, topics.Up.CONFIG)
        report = codec.decode([p for t, p in sent if t == topic][-1], ConfigReport)
        assert report.status is ConfigStatus.REJECTED and "expired at" in report.reason
        assert "fedge manager serve" in report.reason
    finally:
        close(agent)


def test_a_station_reports_a_desired_state_not_refreshed_for_too_long(
    fh: FleetHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: Sent = []
    agent = offline_agent(fh, sent, monkeypatch)
    key = fh.home.signing_key()
    clock = [time.time()]
    agent.freshness.clock = lambda: clock[0]
    topic = topics.up(FLEET, EDGE, topics.Up.TRUST)
    try:
        set_threshold(fh, EDGE, 0.3)
        stamped = latest(fh, "config")["envelope"]  # signed now, as written
        agent._route(topics.Down.CONFIG, stamped.encode())
        received_at = clock[0]
        agent.trust.check_freshness()
        assert not [p for t, p in sent if t == topic]  # fresh: nothing to say
        # The manager's refreshes are withheld: after 14 days the station says so.
        clock[0] += 13 * DAY_S
        agent.trust.check_freshness()
        assert not [p for t, p in sent if t == topic]
        clock[0] += 1.01 * DAY_S
        agent.trust.check_freshness()
        report = codec.decode([p for t, p in sent if t == topic][-1], TrustReport)
        assert report.stale_since == pytest.approx(received_at)
        assert "desired state stale since" in report.reason
        assert str(agent.status()["desired_freshness"]).startswith("stale since")
        agent.trust.check_freshness()  # said once, not at every tick
        assert len([p for t, p in sent if t == topic]) == 1
        # The manager stores it: `fedge manager keys` and `fedge edge show` show it.
        with IngestTransaction.open(fh.db) as tx:
            Ingestor(fh.db, FLEET).handle(tx, topic, codec.encode(report), clock[0])
        row = next(e for e in key_rotation.trust_view(fh.home).edges if e.edge == EDGE)
        assert "stale since" in row.reason
        env = {"FEDGE_HOME": str(fh.home.root), "COLUMNS": "200"}
        shown = CliRunner().invoke(app, ["edge", "show", EDGE], env=env)
        assert shown.exit_code == 0, shown.output
        line = next(x for x in shown.stdout.splitlines() if x.strip().startswith("trust"))
        assert "desired state stale since" in line
        # A refresh arrives: fresh again, and said.
        fresh = desired_refresh.stamp(fh.db, key, EDGE, "config", 1, clock[0])
        assert fresh is not None
        agent._route(topics.Down.CONFIG, fresh.encode())
        agent.trust.check_freshness()
        last = codec.decode([p for t, p in sent if t == topic][-1], TrustReport)
        assert last.stale_since is None and "stale" not in last.reason
        assert agent.applied_version == 1
    finally:
        close(agent)


def test_the_cli_makes_a_root_key_and_rotates_only_with_it(fh: FleetHome, tmp_path: Path) -> None:
    env = {"FEDGE_HOME": str(fh.home.root), "COLUMNS": "200"}
    out = tmp_path / "usb" / "fleet-root.key"

    def fedge(*args: str) -> Any:
        return CliRunner().invoke(app, ["manager", *args], env=env)

    made = fedge("root-key", "init", "--out", str(out))
    assert made.exit_code == 0, made.output
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    assert key_rotation.fleet_root(fh.home) == SigningKey.load(out).public
    assert not list(fh.home.root.rglob("fleet-root.key"))  # the private half is elsewhere
    again = fedge("root-key", "init", "--out", str(out))
    assert again.exit_code == 1 and "never overwritten" in again.output
    refused = fedge("rotate-key", "--yes")
    assert refused.exit_code == 1 and "--root-key" in refused.output
    rotated = fedge("rotate-key", "--yes", "--json", "--root-key", str(out))
    assert rotated.exit_code == 0, rotated.output
    link = parse_link(str(fh.row("SELECT envelope FROM trust_links")["envelope"]))
    assert key_rotation.fleet_root(fh.home) is not None
    assert SigningKey.load(out).public.key_id in link.signatures and len(link.signatures) == 3
