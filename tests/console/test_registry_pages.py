"""The models and rollouts pages over a real store: the registry with its lineage and the
gate's verdict; rollouts with their waves; pause, resume and abort through the same
library calls as ``fedge rollout`` -- CSRF, roles, audit and bad input as everywhere."""

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import FleetHome, deploy, make_fleet_home, publish_model
from starlette.testclient import TestClient

from fedge.console import accounts, audit
from fedge.console.accounts import Role
from fedge.console.app import create_app
from fedge.console.audit import Outcome
from fedge.edge_manager.rollout.plan import make_plan
from fedge.edge_manager.rollout.service import Rollouts

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@dataclass
class Plant:
    fh: FleetHome
    tokens: dict[Role, str]
    rollout: str

    def client(self, role: Role) -> tuple[TestClient, str]:
        client = TestClient(create_app(self.fh.home), follow_redirects=False)
        page = client.get("/login")
        client.post("/login", data={"csrf": CSRF.findall(page.text)[0], "token": self.tokens[role]})
        return client, CSRF.findall(client.get("/").text)[0]

    def state(self) -> str:
        return str(
            self.fh.row("SELECT state FROM rollouts WHERE rollout_id=?", (self.rollout,))["state"]
        )


@pytest.fixture
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    fh = make_fleet_home(tmp_path_factory.mktemp("registry"))
    publish_model(fh, 1)
    publish_model(fh, 2, seed=1)  # trained from inspect:1 (its lineage parent)
    deploy(fh, 1, ["st-01", "st-02"])
    with fh.fleet() as fleet:
        fleet.store.conn.execute("UPDATE edges SET serving='inspect:1'")
        rollout = Rollouts(fleet).start(
            "inspect:2",
            make_plan(["st-01", "st-02"], canary=["st-01"]),
            now=time.time(),
            force_unblessed=True,
            paused=True,
        )
        tokens = {role: accounts.add_token(fleet.store, role.value, role) for role in Role}
    yield Plant(fh, tokens, rollout)
    fh.close()


def test_the_models_page_shows_the_registry_and_its_lineage(plant: Plant) -> None:
    client, _ = plant.client(Role.VIEWER)
    page = client.get("/models")
    assert page.status_code == 200
    assert re.findall(r'<tr data-model="([^"]+)"', page.text) == ["inspect:2", "inspect:1"]
    # inspect:2 sits under inspect:1 in the lineage tree.
    tree = page.text.split('data-model="inspect"', 1)[1].split("</div>", 1)[0]
    assert tree.index("inspect:1") < tree.index("inspect:2")
    assert tree.count("<ul") == 2
    assert "serving on 2" in tree


def test_the_rollouts_pages_show_waves_and_state(plant: Plant) -> None:
    client, _ = plant.client(Role.VIEWER)
    listing = client.get("/rollouts")
    assert f'data-rollout="{plant.rollout}"' in listing.text
    assert "paused" in listing.text and "forced unblessed" in listing.text
    detail = client.get(f"/rollouts/{plant.rollout}")
    assert detail.status_code == 200
    assert "canary: 0 of 1 moved" in detail.text
    assert re.findall(r'<tr data-edge="([^"]+)"', detail.text) == ["st-01", "st-02"]
    missing = client.get("/rollouts/r-nothing")
    assert missing.status_code == 404 and "no rollout" in missing.text


def test_an_operator_resumes_pauses_and_aborts_a_rollout(plant: Plant) -> None:
    client, csrf = plant.client(Role.OPERATOR)
    url = f"/rollouts/{plant.rollout}"
    resumed = client.post(f"{url}/resume", data={"csrf": csrf})
    assert resumed.status_code == 303 and plant.state() == "pending"
    assert "resumed, now pending" in client.get(url).text
    client.post(f"{url}/pause", data={"csrf": csrf})
    assert plant.state() == "paused"
    aborted = client.post(f"{url}/abort", data={"csrf": csrf, "reason": "bad lighting"})
    assert aborted.status_code == 303 and plant.state() == "aborted"
    reason = plant.fh.row("SELECT reason FROM rollouts WHERE rollout_id=?", (plant.rollout,))
    assert reason["reason"] == "bad lighting"
    # Not allowed in its state: the page says why, nothing changes.
    again = client.post(f"{url}/resume", data={"csrf": csrf})
    assert again.status_code == 400 and plant.state() == "aborted"
    assert 'role="alert"' in again.text
    done = [(e.action, e.outcome) for e in audit.recent(plant.fh.db)][:4]
    assert done == [
        ("rollout-resume", Outcome.INVALID),
        ("rollout-abort", Outcome.DONE),
        ("rollout-pause", Outcome.DONE),
        ("rollout-resume", Outcome.DONE),
    ]


@pytest.mark.parametrize(
    ("path", "form", "says"),
    [
        ("/pause", {"reason": "x"}, "only an abort takes a reason"),
        ("/delete", {}, "not something a rollout can do"),
        ("/abort", {"reason": "x" * 201}, "over 200 characters"),
        ("/abort", {"reason": "x", "edges": "st-02"}, "fields it does not have"),
    ],
)
def test_bad_rollout_forms_change_nothing(
    plant: Plant, path: str, form: dict[str, str], says: str
) -> None:
    client, csrf = plant.client(Role.OPERATOR)
    response = client.post(f"/rollouts/{plant.rollout}{path}", data={"csrf": csrf, **form})
    assert response.status_code == 400 and says in response.text
    assert plant.state() == "paused"


def test_a_viewer_and_a_forged_request_cannot_act(plant: Plant) -> None:
    viewer, csrf = plant.client(Role.VIEWER)
    refused = viewer.post(f"/rollouts/{plant.rollout}/resume", data={"csrf": csrf})
    assert refused.status_code == 403 and "viewers cannot act" in refused.text
    operator, _ = plant.client(Role.OPERATOR)
    forged = operator.post(f"/rollouts/{plant.rollout}/abort", data={"csrf": "forged"})
    assert forged.status_code == 403
    anonymous = TestClient(create_app(plant.fh.home), follow_redirects=False)
    assert anonymous.post(f"/rollouts/{plant.rollout}/abort", data={}).status_code == 403
    assert plant.state() == "paused"
