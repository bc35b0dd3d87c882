"""Rotating the manager's signing key on a running fleet: separate ``fedge`` processes.

Managed Mosquitto (mutual TLS), ``manager serve`` and two agents. st-01 is online when the
key rotates; st-02 is offline and follows the retained chain when it starts. After the
rotation every station applies what the new key signs, keeps serving the model it verified
under the old key (also after a restart), and refuses a forged rotation -- which the
manager hears about.
"""

import json
import time
from typing import Any

import pytest
from conftest import (
    FLEET,
    FleetHome,
    Processes,
    make_fleet_home,
    port_open,
    publish_model,
    wait_config_applied,
    wait_until,
)

from fedge.protocols import codec
from fedge.protocols.rotation import rotation_link, sign_chain
from fedge.protocols.signing import SigningKey
from fedge.protocols.trust import TrustChain

pytestmark = pytest.mark.integration


def _keys(processes: Processes) -> dict[str, Any]:
    view: dict[str, Any] = json.loads(processes.cli("manager", "keys", "--json").stdout)
    return view


def _trusts(view: dict[str, Any], edge: str) -> dict[str, Any]:
    return next(e for e in view["edges"] if e["edge"] == edge)


def test_a_running_fleet_follows_a_key_rotation_and_refuses_a_forged_one(
    tmp_path: Any, processes: Processes
) -> None:
    fh: FleetHome = make_fleet_home(tmp_path, edges=("st-01", "st-02"))
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    publish_model(fh, 1)
    old_key = fh.home.signing_key().public.key_id
    processes.pidfiles.append(fh.home.root / "broker" / "mosquitto.pid")
    processes.start("broker", "manager", "broker")
    wait_until(lambda: port_open(fh.settings.broker_port), 15, "the managed broker to listen")
    ready = tmp_path / "serve.ready"
    processes.start("serve", "manager", "serve", "--ready-file", str(ready))
    wait_until(ready.exists, 20, "manager serve to be ready")

    def start_agent(edge: str) -> Any:
        return processes.start(edge, "agent", "run", "--config", str(fh.agents[edge]))

    st01 = start_agent("st-01")
    deployed = processes.cli("deploy", "inspect:1", "--edges", "st-01", "--wait", "30")
    assert "active" in deployed.stdout, deployed.stdout
    processes.cli("edge", "set-threshold", "st-01", "0.6")
    wait_config_applied(fh, "st-01", 1)
    # st-02 has never run: its threshold waits for it, signed by the old key.
    processes.cli("edge", "set-threshold", "st-02", "0.65")

    # -- rotate while serve and st-01 run
    rotated = json.loads(processes.cli("manager", "rotate-key", "--yes", "--json").stdout)
    assert rotated["old_key_id"] == old_key and rotated["sequence"] == 1
    new_key = rotated["new_key_id"]
    view = wait_until(
        lambda: _keys(processes),
        20,
        "st-01 to report it follows the rotation",
        expect=lambda v: _trusts(v, "st-01")["key_id"] == new_key,
    )
    assert _trusts(view, "st-01")["status"] == "adopted"
    assert view["key_id"] == new_key and view["behind"] == ["st-02"]

    # What the new key signs is applied; serve picked the key up without a restart.
    processes.cli("edge", "set-threshold", "st-01", "0.7")
    wait_config_applied(fh, "st-01", 2)

    # -- st-02 starts after the rotation: the retained chain, then its re-signed config
    start_agent("st-02")
    wait_config_applied(fh, "st-02", 1, timeout_s=30)
    view = wait_until(
        lambda: _keys(processes),
        20,
        "st-02 to report the new key",
        expect=lambda v: _trusts(v, "st-02")["key_id"] == new_key,
    )
    assert view["behind"] == [] and sorted(view["on_current_key"]) == ["st-01", "st-02"]
    # The registry's manifests were re-signed: a deployment after the rotation verifies.
    deployed = processes.cli("deploy", "inspect:1", "--edges", "st-02", "--wait", "30")
    assert "active" in deployed.stdout, deployed.stdout

    # -- a forged rotation, slipped into the store by someone without the key
    forger, forged_key = SigningKey.generate(), SigningKey.generate()
    links = (
        str(fh.row("SELECT envelope FROM trust_links WHERE sequence=1")["envelope"]),
        rotation_link(forger, forged_key, fleet=FLEET, sequence=2, issued_at=time.time()),
    )
    chain = TrustChain(FLEET, links, time.time() + 86400.0)
    document = codec.encode(chain).decode()
    envelope = sign_chain(forged_key, chain).decode()
    with fh.db.transaction() as conn:
        conn.execute(
            "INSERT INTO desired (edge, kind, version, document, envelope, created_at) "
            "VALUES ('st-01', 'trust', 2, ?, ?, ?)",
            (document, envelope, time.time()),
        )
    view = wait_until(
        lambda: _keys(processes),
        20,
        "st-01 to report the forged rotation refused",
        expect=lambda v: _trusts(v, "st-01")["status"] == "rejected",
    )
    assert _trusts(view, "st-01")["key_id"] == new_key
    assert "does not lead to" in _trusts(view, "st-01")["reason"]
    processes.cli("edge", "set-threshold", "st-01", "0.75")
    wait_config_applied(fh, "st-01", 3)

    # -- a restart keeps the new key, and the model verified under the old one
    processes.kill(st01)
    start_agent("st-01")
    processes.cli("edge", "set-threshold", "st-01", "0.8")
    wait_config_applied(fh, "st-01", 4, timeout_s=30)
    assert fh.edge_row("st-01")["serving"] == "inspect:1"
    assert fh.edge_row("st-01")["deploy_stage"] == "active"
