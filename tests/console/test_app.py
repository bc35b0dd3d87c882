"""The console over a real manager store, through Starlette's TestClient: access, CSRF,
roles, bad input (nothing changes, the page says why), and that actions are the CLI's."""

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import FleetHome, deploy, make_fleet_home, publish_model
from starlette.testclient import TestClient
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.console import accounts, audit
from fedge.console.accounts import Role
from fedge.console.app import create_app
from fedge.console.audit import Outcome
from fedge.console.sessions import COOKIE
from fedge.protocols.thumbnails import ThumbnailPolicy

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@dataclass
class Plant:
    fh: FleetHome
    tokens: dict[Role, str]

    def client(self) -> TestClient:
        return TestClient(create_app(self.fh.home), follow_redirects=False)

    def desired_versions(self, edge: str) -> list[int]:
        rows = self.fh.db.query(
            "SELECT version FROM desired WHERE edge=? AND kind='config' ORDER BY version", (edge,)
        )
        return [int(r["version"]) for r in rows]

    def audit(self) -> list[audit.AuditEntry]:
        return audit.recent(self.fh.db)


@pytest.fixture
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    fh = make_fleet_home(tmp_path_factory.mktemp("console"))
    publish_model(fh, 1)
    deploy(fh, 1, ["st-01"])
    with fh.fleet() as fleet:
        for index in range(3):
            fleet.store.conn.execute(
                "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, "
                "decision, threshold, config_version, latency_ms, source) "
                "VALUES (?, 'st-01', ?, ?, 'inspect:1', "
                "'{\"clean\": 0.7, \"scratch\": 0.3}', 'accept', 0.5, 0, 1.0, ?)",
                (f"p-{index}", index, time.time() - index, f"file:part-{index}.png"),
            )
        tokens = {role: accounts.add_token(fleet.store, role.value, role) for role in Role}
    yield Plant(fh, tokens)
    fh.close()


def login(client: TestClient, token: str) -> str:
    """Log in; returns the session's CSRF token (from the fleet page's forms)."""
    page = client.get("/login")
    response = client.post("/login", data={"csrf": CSRF.findall(page.text)[0], "token": token})
    assert response.status_code == 303, response.text
    fleet = client.get("/")
    assert fleet.status_code == 200
    return str(CSRF.findall(fleet.text)[0])


def test_pages_need_a_session_and_a_valid_token(plant: Plant) -> None:
    client = plant.client()
    assert client.get("/").headers["location"] == "/login"
    assert client.get("/edges/st-01").headers["location"] == "/login"
    assert client.get("/events").status_code == 403
    page = client.get("/login")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    csrf = CSRF.findall(page.text)[0]
    refused = client.post("/login", data={"csrf": csrf, "token": "fct_not-a-token"})
    assert refused.status_code == 403
    assert "unknown token" in refused.text
    forged = client.post("/login", data={"csrf": "forged", "token": plant.tokens[Role.ADMIN]})
    assert forged.status_code == 403
    assert COOKIE not in client.cookies
    ok = client.post("/login", data={"csrf": csrf, "token": plant.tokens[Role.OPERATOR]})
    cookie = ok.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert "secure" not in cookie and "strict-transport-security" not in ok.headers  # plain
    entries = [(e.who, e.action, e.outcome) for e in plant.audit()]
    assert entries[:2] == [("operator", "login", Outcome.DONE), ("-", "login", Outcome.REFUSED)]
    assert all(plant.tokens[Role.OPERATOR] not in e.detail for e in plant.audit())


def test_the_fleet_page_shows_every_edge(plant: Plant) -> None:
    client = plant.client()
    login(client, plant.tokens[Role.VIEWER])
    page = client.get("/").text
    assert 'data-edge="st-01"' in page and 'data-edge="st-02"' in page
    assert "never-seen" in page
    assert ">0.5 (default)<" in page  # the agent's default, marked as no report of it
    assert "viewers cannot act" in page  # the form is there, disabled
    edge = client.get("/edges/st-01")
    assert edge.status_code == 200
    assert "p-0" in edge.text and "file:part-0.png" in edge.text
    missing = client.get("/edges/st-99")
    assert missing.status_code == 404 and "unknown edge" in missing.text


def test_an_operator_sets_a_threshold_as_the_cli_does(plant: Plant) -> None:
    client = plant.client()
    csrf = login(client, plant.tokens[Role.OPERATOR])
    done = client.post("/edges/st-01/threshold", data={"csrf": csrf, "threshold": "0.72"})
    assert done.status_code == 303 and done.headers["location"] == "/"
    assert "desired config v1 (threshold 0.72)" in client.get("/").text  # the flash message
    with plant.fh.fleet() as fleet:
        desired = fleet.desired_config("st-01")
    assert desired is not None and desired.default_threshold == 0.72
    form = {"csrf": csrf, "threshold": "0.4", "class_name": "scratch", "back": "edge"}
    per_class = client.post("/edges/st-01/threshold", data=form)
    assert per_class.headers["location"] == "/edges/st-01"
    assert plant.desired_versions("st-01") == [1, 2]
    latest = plant.audit()[0]
    assert (latest.who, latest.action, latest.target, latest.outcome) == (
        "operator",
        "set-threshold",
        "st-01",
        Outcome.DONE,
    )


@pytest.mark.parametrize(
    ("edge", "form", "status", "message"),
    [
        ("st-01", {"threshold": "1.5"}, 400, "must be in [0, 1]"),
        ("st-01", {"threshold": "nan"}, 400, "must be a number in [0, 1]"),
        ("st-01", {"threshold": "abc"}, 400, "must be a number in [0, 1], not &#39;abc&#39;"),
        ("st-01", {"threshold": "0.6", "class_name": "dent"}, 400, "dent"),
        ("st-01", {"threshold": "0.6", "edge": "st-02"}, 400, "fields it does not have (edge)"),
        ("st-01", {"threshold": "0.6", "back": "http://evil"}, 400, "return page"),
        ("st-99", {"threshold": "0.6"}, 400, "unknown edge(s) st-99"),
        ("st-99", {"threshold": "0.6", "back": "edge"}, 404, "unknown edge"),
    ],
)
def test_bad_threshold_input_says_why_and_changes_nothing(
    plant: Plant, edge: str, form: dict[str, str], status: int, message: str
) -> None:
    client = plant.client()
    csrf = login(client, plant.tokens[Role.OPERATOR])
    response = client.post(f"/edges/{edge}/threshold", data={"csrf": csrf, **form})
    assert response.status_code == status
    assert 'id="error"' in response.text and message in response.text, response.text
    assert plant.desired_versions("st-01") == plant.desired_versions("st-99") == []
    assert plant.audit()[0].outcome is Outcome.INVALID


def test_actions_need_the_csrf_token_and_a_role_that_acts(plant: Plant) -> None:
    anonymous = plant.client()
    assert anonymous.post("/edges/st-01/threshold", data={"threshold": "0.6"}).status_code == 403
    client = plant.client()
    csrf = login(client, plant.tokens[Role.OPERATOR])
    for form in ({"threshold": "0.6"}, {"threshold": "0.6", "csrf": csrf[:-1] + "x"}):
        refused = client.post("/edges/st-01/threshold", data=form)
        assert refused.status_code == 403 and "CSRF" in refused.text
    assert (
        client.post("/labels", data={"prediction_id": "p-0", "label": "clean"}).status_code == 403
    )
    viewer = plant.client()
    viewer_csrf = login(viewer, plant.tokens[Role.VIEWER])
    acted = viewer.post("/edges/st-01/threshold", data={"csrf": viewer_csrf, "threshold": "0.6"})
    assert acted.status_code == 403 and "viewers cannot act" in acted.text
    label = {"csrf": viewer_csrf, "prediction_id": "p-0", "label": "scratch"}
    assert viewer.post("/labels", data=label).status_code == 403
    assert plant.desired_versions("st-01") == []
    assert plant.fh.db.scalar("SELECT count(*) FROM labels") == 0
    refusals = [(e.who, e.outcome) for e in plant.audit()[:2]]
    assert refusals == [("viewer", Outcome.REFUSED)] * 2
    # Only an admin reads the audit log.
    assert viewer.get("/audit").status_code == 403
    admin = plant.client()
    login(admin, plant.tokens[Role.ADMIN])
    log = admin.get("/audit")
    assert log.status_code == 200 and "set-threshold" in log.text and "refused" in log.text


def test_labelling_from_the_queue_stores_it_and_sends_it_to_the_station(plant: Plant) -> None:
    client = plant.client()
    csrf = login(client, plant.tokens[Role.OPERATOR])
    queue = client.get("/labels").text
    assert all(f'data-prediction="p-{i}"' in queue for i in range(3))
    assert '<option value="scratch">' in queue
    done = client.post("/labels", data={"csrf": csrf, "prediction_id": "p-1", "label": "scratch"})
    assert done.status_code == 303 and done.headers["location"] == "/labels"
    labels = plant.fh.db.query("SELECT prediction_id, label, who, origin FROM labels")
    assert labels == [
        {"prediction_id": "p-1", "label": "scratch", "who": "operator", "origin": "operator"}
    ]
    documents = plant.fh.db.query("SELECT edge FROM desired WHERE kind='labels'")
    assert documents == [{"edge": "st-01"}]  # what serve publishes to the station
    assert 'data-prediction="p-1"' not in client.get("/labels").text
    for form, message in (
        ({"prediction_id": "p-2", "label": "dent"}, "dent"),
        ({"prediction_id": "p-404", "label": "clean"}, "no prediction"),
        ({"prediction_id": "p-2", "label": "clean", "who": "mallory"}, "fields it does not have"),
    ):
        bad = client.post("/labels", data={"csrf": csrf, **form})
        assert bad.status_code == 400 and message in bad.text, bad.text
    assert plant.fh.db.scalar("SELECT count(*) FROM labels") == 1
    # A correction goes through the same call: the old label moves to the history.
    again = {"csrf": csrf, "prediction_id": "p-1", "label": "clean"}
    assert client.post("/labels", data=again).status_code == 303
    assert "relabelled scratch -&gt; clean" in client.get("/labels").text


def test_a_removed_token_ends_its_sessions(plant: Plant) -> None:
    client = plant.client()
    login(client, plant.tokens[Role.OPERATOR])
    with plant.fh.fleet() as fleet:
        accounts.remove_token(fleet.store, "operator")
    assert client.get("/").headers["location"] == "/login"


def test_token_commands_print_a_token_once_and_list_names_only(plant: Plant) -> None:
    home = str(plant.fh.home.root)
    runner = CliRunner()
    added = runner.invoke(
        app, ["console", "token", "add", "bob", "--role", "admin", "--home", home]
    )
    assert added.exit_code == 0, added.output
    token = added.stdout.strip()
    assert token.startswith(accounts.TOKEN_PREFIX)
    assert accounts.authenticate(plant.fh.db, token) == accounts.account(plant.fh.db, "bob")
    listed = runner.invoke(app, ["console", "token", "list", "--home", home])
    assert "bob" in listed.stdout and "admin" in listed.stdout and token not in listed.stdout
    bad = runner.invoke(app, ["console", "token", "add", "eve", "--role", "root", "--home", home])
    assert bad.exit_code == 1 and "role must be one of viewer, operator, admin" in bad.stderr
    assert runner.invoke(app, ["console", "token", "remove", "bob", "--home", home]).exit_code == 0
    gone = runner.invoke(app, ["console", "token", "remove", "bob", "--home", home])
    assert gone.exit_code == 1 and "no console account 'bob'" in gone.stderr


def test_an_admin_lets_a_station_share_thumbnails_and_stops_it(plant: Plant) -> None:
    client = plant.client()
    csrf = login(client, plant.tokens[Role.ADMIN])
    page = client.get("/edges/st-01").text
    assert 'value="stay" selected' in page  # off by default: the images stay on the station
    form = {"csrf": csrf, "images": "rejects", "size": "48", "per_minute": "12"}
    done = client.post("/edges/st-01/thumbnails", data=form)
    assert done.status_code == 303 and done.headers["location"] == "/edges/st-01"
    with plant.fh.fleet() as fleet:
        desired = fleet.desired_config("st-01")
    assert desired is not None and desired.thumbnails == ThumbnailPolicy(48, True, 12)
    page = client.get("/edges/st-01").text
    assert "shares thumbnails of rejected images, 48 px, 12/min" in page  # the flash message
    assert 'value="rejects" selected' in page and 'value="48"' in page
    stop = client.post("/edges/st-01/thumbnails", data={"csrf": csrf, "images": "stay"})
    assert stop.status_code == 303
    with plant.fh.fleet() as fleet:
        stopped = fleet.desired_config("st-01")
    assert stopped is not None and stopped.thumbnails is None
    assert plant.desired_versions("st-01") == [1, 2]
    entries = [(e.who, e.action, e.target, e.outcome) for e in plant.audit()[:2]]
    assert entries == [("admin", "set-thumbnails", "st-01", Outcome.DONE)] * 2


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"images": "everything"}, "images must be one of stay, rejects, all"),
        ({"images": "all", "size": "200", "per_minute": "5"}, "thumbnails.size must be in"),
        ({"images": "all", "size": "64", "per_minute": "0"}, "per_minute must be in"),
        ({"images": "all", "size": "-3", "per_minute": "5"}, "size must be a whole number"),
        ({"images": "all", "size": "64", "per_minute": "1e9"}, "per minute must be a whole"),
        ({"images": "all", "size": "6\u00b2", "per_minute": "5"}, "size must be a whole number"),
        ({"images": "stay", "edge": "st-02"}, "fields it does not have (edge)"),
    ],
)
def test_bad_thumbnail_input_says_why_and_changes_nothing(
    plant: Plant, form: dict[str, str], message: str
) -> None:
    client = plant.client()
    csrf = login(client, plant.tokens[Role.ADMIN])
    response = client.post("/edges/st-01/thumbnails", data={"csrf": csrf, **form})
    assert response.status_code == 400
    assert 'id="error"' in response.text and message in response.text, response.text
    assert plant.desired_versions("st-01") == []
    assert plant.audit()[0].outcome is Outcome.INVALID


def test_only_an_admin_decides_what_images_leave_a_station(plant: Plant) -> None:
    form = {"images": "all", "size": "64", "per_minute": "30"}
    for role, text in (
        (Role.OPERATOR, "only an admin can set thumbnails"),
        (Role.VIEWER, "viewers"),
    ):
        client = plant.client()
        csrf = login(client, plant.tokens[role])
        assert (
            "only an admin decides what images leave a station" in client.get("/edges/st-01").text
        )
        refused = client.post("/edges/st-01/thumbnails", data={"csrf": csrf, **form})
        assert refused.status_code == 403 and text in refused.text
    unknown = plant.client()
    csrf = login(unknown, plant.tokens[Role.ADMIN])
    missing = unknown.post("/edges/st-99/thumbnails", data={"csrf": csrf, **form})
    assert missing.status_code == 404 and "unknown edge" in missing.text
    assert plant.desired_versions("st-01") == plant.desired_versions("st-99") == []
    outcomes = [(e.who, e.outcome) for e in plant.audit() if e.action == "set-thumbnails"]
    assert outcomes == [
        ("admin", Outcome.INVALID),
        ("viewer", Outcome.REFUSED),
        ("operator", Outcome.REFUSED),
    ]
