"""The console's models pages show a closed team's models to its members and the
console's admins only (issue 31 item 4); a team-less or open team's model: everyone."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, console_login, make_fleet_home, publish_model

from fedge.edge_manager.scheduler import owned_models, service
from fedge.edge_manager.scheduler.teams import TeamRole


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=("st-01",))
    for version in (1, 2, 3):
        publish_model(fleet_home, version, seed=version)
    with fleet_home.fleet() as fleet:
        for team, admin in (("vision", "ana"), ("paint", "pia"), ("open", "")):
            service.add_team(fleet.store, team, None, who="root", now=0.0)
            if admin:
                service.grant(fleet.store, team, admin, TeamRole.ADMIN, who="root", now=0.0)
        owned_models.own(fleet.store, "inspect", 2, "vision", who="ana", now=1.0)
        owned_models.own(fleet.store, "inspect", 3, "paint", who="pia", now=1.0)
    yield fleet_home
    fleet_home.close()


def test_a_closed_teams_models_are_its_members_and_the_admins(fh: FleetHome) -> None:
    ana, _ = console_login(fh, "viewer", "ana")
    listing = ana.get("/models").text
    assert 'data-model="inspect:1"' in listing and 'data-model="inspect:2"' in listing
    assert 'data-model="inspect:3"' not in listing
    assert ana.get("/models/inspect/2").status_code == 200
    hidden = ana.get("/models/inspect/3")
    assert hidden.status_code == 404 and "not in the registry" in hidden.text
    boss, _ = console_login(fh, "admin", "boss")
    every = boss.get("/models").text
    assert all(f'data-model="inspect:{v}"' in every for v in (1, 2, 3))
    assert "<td>paint</td>" in every and "<td>vision</td>" in every
    assert boss.get("/models/inspect/3").status_code == 200
    cy, _ = console_login(fh, "operator", "cy")
    seen = cy.get("/models").text
    assert 'data-model="inspect:1"' in seen
    assert 'data-model="inspect:2"' not in seen and 'data-model="inspect:3"' not in seen
