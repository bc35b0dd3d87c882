"""``fedge team``: roles granted to the manager's console accounts; ``fedge jobs`` refuses
a user of another team in one red line and changes nothing."""

import json
from pathlib import Path

from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.console import accounts
from fedge.console.accounts import Role
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.store import Store


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    db_path = ManagerHome(home).db_path
    db_path.parent.mkdir(parents=True, exist_ok=True)
    store = Store(db_path)
    for name in ("st-1", "st-2"):
        edge_store.enroll(store, name, "0" * 64, 0.0)
    for person in ("ana", "bo", "pia"):
        accounts.add_token(store, person, Role.VIEWER)
    store.close()
    return home


def _run(home: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, [*args, "--home", str(home)])
    return result.exit_code, result.output


def test_roles_decide_who_changes_a_teams_jobs(tmp_path: Path) -> None:
    home = _home(tmp_path)
    assert _run(home, "team", "add", "vision", "--as", "root") == (0, "team vision: quota none\n")
    assert _run(home, "team", "add", "paint", "--quota", "8", "--as", "root")[0] == 0
    assert _run(home, "team", "grant", "vision", "ana", "--role", "admin", "--as", "root") == (
        0,
        "ana: admin of team vision\n",
    )
    assert _run(home, "team", "grant", "vision", "bo", "--as", "ana") == (
        0,
        "bo: submitter of team vision\n",
    )
    assert _run(home, "team", "grant", "paint", "pia", "--role", "admin", "--as", "x")[0] == 0
    code, out = _run(home, "team", "grant", "vision", "zed", "--as", "ana")
    assert code == 1 and out.startswith("error: no operator or console account 'zed'"), out
    code, out = _run(home, "team", "grant", "vision", "pia", "--as", "bo")
    assert code == 1 and "only an admin of team vision (ana)" in out, out
    code, out = _run(home, "team", "list", "--json")
    assert json.loads(out) == [
        {"team": "paint", "quota_station_hours": 8.0, "members": {"pia": "admin"}},
        {
            "team": "vision",
            "quota_station_hours": None,
            "members": {"ana": "admin", "bo": "submitter"},
        },
    ]

    submit = ("jobs", "submit", "--kind", "be", "--team", "vision", "--stations", "any 1")
    code, out = _run(home, *submit, "--as", "pia")
    assert code == 1 and out.startswith("error: pia is not a member of team vision"), out
    assert _run(home, "jobs", "list") == (0, "no jobs\n")
    code, out = _run(home, *submit, "--as", "bo", "--json")
    assert code == 0, out
    job_id = json.loads(out)["job_id"]
    for args in (("cancel", job_id), ("priority", job_id, "4")):
        code, out = _run(home, "jobs", *args, "--as", "pia")
        assert code == 1 and "pia is not a member of team vision" in out, out
    code, out = _run(home, "jobs", "show", job_id, "--json")
    shown = json.loads(out)
    assert (shown["state"], shown["priority"]) == ("queued", 0)
    assert _run(home, "jobs", "cancel", job_id, "--as", "ana") == (0, f"{job_id}: cancelled\n")
    code, out = _run(home, "jobs", "show", job_id, "--json")
    assert [(e["state"], e["who"]) for e in json.loads(out)["events"]] == [
        ("queued", "bo"),
        ("cancelled", "ana"),
    ]

    assert _run(home, "team", "revoke", "vision", "bo", "--as", "ana") == (
        0,
        "bo: no role in team vision\n",
    )
    code, out = _run(home, "team", "revoke", "vision", "ana", "--as", "ana")
    assert code == 0, out  # the last member: the team is open again
    code, out = _run(home, "team", "members", "lab")
    assert code == 1 and "unknown team 'lab'" in out, out


def test_an_unknown_team_is_a_clear_error_and_queues_nothing(tmp_path: Path) -> None:
    home = _home(tmp_path)
    code, out = _run(home, "jobs", "submit", "--kind", "te", "--team", "lab", "--as", "ana")
    assert code == 1 and out.startswith("error: unknown team 'lab'"), out
    assert "fedge team add lab" in " ".join(out.split())
    code, out = _run(home, "team", "grant", "lab", "ana", "--role", "admin")
    assert code == 1 and "unknown team 'lab'" in out, out
    assert _run(home, "jobs", "list") == (0, "no jobs\n")
    assert _run(home, "team", "list") == (0, "no teams\n")
