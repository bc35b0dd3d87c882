"""A station's lifetime privacy budget: set by an operator, signed, kept in its ledger.

``fedge edge set-privacy`` writes a new signed config version; the agent writes the bound
into the privacy ledger in its data directory before it reports the config applied; the
station's ClientApp (tests/party/test_station_privacy.py) refuses rounds past it. Bad
input changes nothing. The real-process test runs the broker, ``manager serve`` and an
``agent run`` process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    FLEET,
    FleetHome,
    Processes,
    make_fleet_home,
    port_open,
    wait_config_applied,
    wait_until,
)
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.config.privacy_budget import apply_budget, lifetime_change, read_floor
from fedge.edge_manager.desired.decide import next_config
from fedge.edge_manager.fleet.views import EdgeView
from fedge.edge_manager.ingest.messages import Ingestor
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.party.budget import BudgetLedger
from fedge.party.privacy_status import LEDGER_FILE, SpentEpsilon, write_spent
from fedge.protocols import topics
from fedge.protocols.config import EdgeConfig, PrivacyBudget

EDGE = "st-01"


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE, "st-02"))
    yield fleet_home
    fleet_home.close()


def lifetime(data_dir: Path) -> tuple[float | None, float]:
    ledger = BudgetLedger(data_dir / LEDGER_FILE)
    try:
        return ledger.lifetime()
    finally:
        ledger.close()


def config_versions(fh: FleetHome) -> int:
    return int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='config'"))


# ---------------------------------------------------------------- pure decisions


def test_the_ledger_changes_only_when_the_bound_does() -> None:
    budget = PrivacyBudget(8.0, 1e-3)
    assert lifetime_change((None, 1e-3), budget) == (8.0, 1e-3)
    assert lifetime_change((8.0, 1e-3), budget) is None
    assert lifetime_change((8.0, 1e-3), PrivacyBudget(8.0, 1e-5)) == (8.0, 1e-5)
    assert lifetime_change((8.0, 1e-5), None) == (None, 1e-5)  # cleared: the delta stays
    assert lifetime_change((None, 1e-5), None) is None


def test_a_new_config_version_keeps_the_budget_until_it_is_cleared() -> None:
    first = next_config(None, fleet=FLEET, edge=EDGE, now=1.0, privacy=PrivacyBudget(8.0))
    assert (first.version, first.privacy) == (1, PrivacyBudget(8.0, 1e-3))
    threshold = next_config(first, fleet=FLEET, edge=EDGE, now=2.0, threshold=0.7)
    assert (threshold.version, threshold.privacy) == (2, PrivacyBudget(8.0, 1e-3))
    cleared = next_config(threshold, fleet=FLEET, edge=EDGE, now=3.0, clear_privacy=True)
    assert (cleared.version, cleared.privacy, cleared.default_threshold) == (3, None, 0.7)


def test_no_ledger_is_created_on_a_station_that_never_had_a_budget(tmp_path: Path) -> None:
    assert apply_budget(tmp_path, None) is None
    assert not (tmp_path / LEDGER_FILE).exists()
    assert apply_budget(tmp_path, PrivacyBudget(2.0, 1e-4)) == (2.0, 1e-4)
    assert apply_budget(tmp_path, PrivacyBudget(2.0, 1e-4)) is None
    assert lifetime(tmp_path) == (2.0, 1e-4)


# ---------------------------------------------------------------- the agent applies it


NO_TRAINING_STACK = """
import sys, tempfile
from pathlib import Path
from fedge.edge_agent.config.privacy_budget import apply_budget
from fedge.protocols.config import PrivacyBudget
apply_budget(Path(tempfile.mkdtemp()), PrivacyBudget(8.0))
print(sorted(m for m in ("torch", "opacus", "flwr") if m in sys.modules))
"""


@pytest.mark.integration
def test_the_agent_writes_its_ledger_without_loading_the_training_stack() -> None:
    """An inference-only station has no torch or Opacus (pyproject's ``agent`` extra)."""
    result = subprocess.run(
        [sys.executable, "-c", NO_TRAINING_STACK],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


def test_the_agent_writes_the_bound_before_it_applies_the_config(
    fh: FleetHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = EdgeAgent(fh.agent_settings(EDGE))
    sent: list[bytes] = []
    monkeypatch.setattr(agent.mqtt, "publish", lambda topic, payload, **kw: sent.append(payload))
    data_dir = fh.data_dir(EDGE)
    manager = fh.home.signing_key()

    def report() -> EdgeView:
        with fh.fleet() as fleet:
            ingestor = Ingestor(fleet.store, FLEET)
            for payload in sent:
                with IngestTransaction.open(fleet.store) as tx:
                    ingestor.handle(tx, topics.up(FLEET, EDGE, topics.Up.CONFIG), payload, 1.0)
            sent.clear()
            return fleet.show(EDGE)

    try:
        agent.handle_config(manager.sign(EdgeConfig(FLEET, EDGE, 1)))
        # No signed budget; the ledger holds only the station's own floor (agent.toml's,
        # written when the agent started: issue 24).
        assert lifetime(data_dir) == (None, 1e-3)
        floor = fh.agent_settings(EDGE).privacy_floor
        assert floor is not None and read_floor(data_dir) == (True, floor)
        budget = PrivacyBudget(8.0, 1e-3)
        agent.handle_config(manager.sign(EdgeConfig(FLEET, EDGE, 2, privacy=budget)))
        assert agent.applied_version == 2
        assert lifetime(data_dir) == (8.0, 1e-3)
        agent.handle_config(manager.sign(EdgeConfig(FLEET, EDGE, 3)))
        assert lifetime(data_dir) == (None, 1e-3)

        # A ledger the agent cannot write: the config is refused, not silently applied.
        (data_dir / LEDGER_FILE).unlink()
        for leftover in data_dir.glob(LEDGER_FILE + "-*"):
            leftover.unlink()
        (data_dir / LEDGER_FILE).mkdir()
        agent.handle_config(manager.sign(EdgeConfig(FLEET, EDGE, 4, privacy=budget)))
        assert agent.applied_version == 3
        view = report()
        assert (view.config_status, view.config_applied) == ("rejected:4", 3)
        assert "privacy budget could not be written" in view.config_reason
        assert json.loads(agent.store.get("applied_config") or "{}")["version"] == 3
    finally:
        agent.store.close()
        agent.station.close()


# ---------------------------------------------------------------- the operator's command


def fedge(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--epsilon", "0"], "privacy.epsilon must be a finite number > 0"),
        (["--epsilon", "-1"], "privacy.epsilon must be a finite number > 0"),
        (["--epsilon", "inf"], "privacy.epsilon must be a finite number > 0"),
        (["--epsilon", "8", "--delta", "1"], "privacy.delta must be in (0, 1)"),
        (["--epsilon", "8", "--delta", "0"], "privacy.delta must be in (0, 1)"),
        (["--epsilon", "8", "--clear"], "give --epsilon (with --delta) or --clear"),
        ([], "give --epsilon (with --delta) or --clear"),
    ],
)
def test_bad_input_is_one_clear_error_and_changes_nothing(
    fh: FleetHome, args: list[str], message: str
) -> None:
    code, output = fedge(fh, "edge", "set-privacy", EDGE, *args)
    assert code != 0, output
    assert message in " ".join(output.split()), output
    assert "Traceback" not in output
    assert config_versions(fh) == 0


def test_an_unknown_edge_is_refused_for_every_edge(fh: FleetHome) -> None:
    code, output = fedge(fh, "edge", "set-privacy", "st-99", "--epsilon", "8")
    assert code == 1, output
    assert "unknown edge(s) st-99" in output
    assert config_versions(fh) == 0
    code, output = fedge(fh, "edge", "set-privacy", "all", "--epsilon", "8", "--delta", "1e-5")
    assert code == 0, output
    assert "st-02: desired config v1 (lifetime epsilon 8 at delta 1e-05)" in output
    with fh.fleet() as fleet:
        config = fleet.desired_config(EDGE)
        assert config is not None
        assert config == EdgeConfig(
            FLEET, EDGE, 1, issued_at=config.issued_at, expires_at=config.expires_at,
            privacy=PrivacyBudget(8.0, 1e-5),
        )  # fmt: skip


# ---------------------------------------------------------------- real processes


def test_set_privacy_reaches_the_stations_ledger_and_show_reports_the_spend(
    tmp_path: Path, processes: Processes
) -> None:
    fh = make_fleet_home(tmp_path, edges=(EDGE,))
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    data_dir = fh.data_dir(EDGE)
    try:
        processes.pidfiles.append(fh.home.root / "broker" / "mosquitto.pid")
        processes.start("broker", "manager", "broker")
        wait_until(lambda: port_open(fh.settings.broker_port), 15, "the managed broker")
        ready = tmp_path / "serve.ready"
        processes.start("serve", "manager", "serve", "--ready-file", str(ready))
        agent = processes.start("agent", "agent", "run", "--config", str(fh.agents[EDGE]))
        wait_until(ready.exists, 30, "manager serve to be ready")
        wait_until(lambda: fh.edge_row(EDGE).get("state"), 30, "the agent online",
                   expect=lambda s: s == "online")  # fmt: skip
        # What the station's ClientApp leaves after a DP-SGD round (its agent reports it).
        write_spent(data_dir, SpentEpsilon(1.25, 1e-3, 1.0))

        out = processes.cli("edge", "set-privacy", EDGE, "--epsilon", "8", "--delta", "1e-3")
        assert f"{EDGE}: desired config v1 (lifetime epsilon 8 at delta 0.001)" in out.stdout
        wait_config_applied(fh, EDGE, 1)
        assert lifetime(data_dir) == (8.0, 1e-3)

        def shown() -> dict[str, Any]:
            result = processes.cli("edge", "show", EDGE, "--json")
            view: dict[str, Any] = json.loads(result.stdout)
            return view

        view = wait_until(shown, 30, "the station's spent epsilon reported",
                          expect=lambda v: v["privacy_epsilon_spent"] is not None)  # fmt: skip
        assert view["desired_config"]["privacy"] == {"epsilon": 8.0, "delta": 0.001}
        assert view["privacy_epsilon_spent"] == 1.25
        text = processes.cli("edge", "show", EDGE).stdout
        assert "lifetime epsilon 8 at delta 0.001; spent epsilon 1.25" in text

        # Restarted, the agent keeps the ledger; a cleared budget reaches it too.
        processes.stop(agent)
        agent = processes.start("agent", "agent", "run", "--config", str(fh.agents[EDGE]))
        processes.cli("edge", "set-privacy", EDGE, "--clear")
        wait_config_applied(fh, EDGE, 2)
        assert lifetime(data_dir) == (None, 1e-3)
        assert "no lifetime bound" in processes.cli("edge", "show", EDGE).stdout
    except BaseException:
        for proc in processes.procs:
            print(proc.output()[-3000:])
        raise
    finally:
        fh.close()
