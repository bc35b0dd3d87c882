"""The telemetry pace the manager asks for (issue 33), at the station: signed, once,
kept across a restart, and only the metric records slow down."""

import json
from pathlib import Path

from conftest import make_fleet_home

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_manager.desired import pace
from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.fleet.operations import Fleet
from fedge.protocols import codec
from fedge.protocols.pace import TelemetryPace
from fedge.protocols.signing import SigningKey


def _pace_envelope(fleet: Fleet, edge: str) -> bytes:
    rows = [row for row in desired_store.latest_desired(fleet.store, edge) if row.kind == pace.PACE]
    assert len(rows) == 1
    return rows[0].envelope.encode()


def test_the_station_applies_a_signed_pace_once_and_keeps_it(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01", "st-02"))
    with fh.fleet() as fleet:
        assert pace.push_pace(fleet, pace.SLOW_FACTOR, "short of space", 1.0) == 2
        slow = _pace_envelope(fleet, "st-01")
        # Asking again for the same pace writes nothing.
        assert pace.push_pace(fleet, pace.SLOW_FACTOR, "short of space", 2.0) == 0
        assert pace.push_pace(fleet, 1.0, "", 3.0) == 2
        normal = _pace_envelope(fleet, "st-01")
        kept = fleet.store.scalar("SELECT count(*) FROM desired WHERE kind='pace'")
    assert kept == 2  # one per edge: older pace documents are not kept

    agent = EdgeAgent(fh.agent_settings("st-01"))
    try:
        assert agent.pace.factor == 1.0
        assert "pace" not in agent._known_versions()  # an older manager refuses the kind
        agent.handle_pace(slow)
        assert (agent.pace.factor, agent.pace.reason) == (6.0, "short of space")
        assert agent.status()["telemetry_pace"] == {"factor": 6.0, "reason": "short of space"}
        assert agent._known_versions()["pace"] == 1
        agent.handle_pace(slow)  # the retained copy again: stale, nothing changes
        assert agent.counters["pace.stale"] == 1

        # Forged (another key), for another edge, replayed or malformed: counted, no change.
        document = codec.decode(json.loads(slow)["payload"].encode(), TelemetryPace)
        forged = TelemetryPace(document.fleet, "st-01", 9, 60.0)
        agent.handle_pace(SigningKey.generate().sign(forged))
        foreign = TelemetryPace(document.fleet, "st-02", 9, 60.0)
        agent.handle_pace(fh.home.signing_key().sign(foreign))
        agent.handle_pace(b"{not json")
        rejected = sum(v for k, v in agent.counters.items() if k.startswith("pace.rejected"))
        assert rejected == 3
        assert agent.pace.factor == 6.0
    finally:
        agent.store.close()
        agent.station.close()

    # A restart keeps the pace: the station does not flood a manager short of space.
    again = EdgeAgent(fh.agent_settings("st-01"))
    try:
        assert again.pace.factor == 6.0
        again.handle_pace(normal)
        assert again.pace.factor == 1.0
        assert again.counters["pace.applied"] == 1
    finally:
        again.store.close()
        again.station.close()
