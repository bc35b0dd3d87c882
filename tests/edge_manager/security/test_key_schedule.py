"""Scheduled rotation of the manager's signing key: `rotate-key --if-older-than DAYS`
rotates when the key in use is that old, and otherwise changes nothing."""

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.security import key_rotation

DAY = 86400.0


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    home = make_fleet_home(tmp_path)
    yield home
    home.close()


def test_due_when_the_key_is_at_least_that_old() -> None:
    assert not key_rotation.rotation_due(since=0.0, now=89.9 * DAY, max_age_days=90)
    assert key_rotation.rotation_due(since=0.0, now=90 * DAY, max_age_days=90)


def test_a_young_key_is_kept_and_an_old_one_rotated_once(fh: FleetHome) -> None:
    home = fh.home
    start = key_rotation.key_since(home)
    assert abs(start - time.time()) < 600  # never rotated: the key file's time
    key_id = home.signing_key().public.key_id
    assert key_rotation.rotate_if_due(home, 90, now=start + 89 * DAY) is None
    assert home.signing_key().public.key_id == key_id  # nothing changed
    done = key_rotation.rotate_if_due(home, 90, now=start + 91 * DAY)
    assert done is not None and done.old_key_id == key_id and done.sequence == 1
    assert key_rotation.key_since(home) == start + 91 * DAY  # the rotation's own time
    assert key_rotation.trust_view(home).since == start + 91 * DAY
    # The schedule runs again a day later: the new key is one day old, kept.
    assert key_rotation.rotate_if_due(home, 90, now=start + 92 * DAY) is None
    assert home.signing_key().public.key_id == done.new_key_id


def test_the_command_says_whether_it_rotated(fh: FleetHome) -> None:
    env = {"FEDGE_HOME": str(fh.home.root)}
    args = ["manager", "rotate-key", "--yes", "--json", "--if-older-than"]
    kept = CliRunner().invoke(app, [*args, "30"], env=env)
    assert kept.exit_code == 0, kept.output
    assert json.loads(kept.output)["rotated"] is False
    before = fh.home.signing_key().public.key_id
    text = CliRunner().invoke(app, ["manager", "rotate-key", "--if-older-than", "30"], env=env)
    assert text.exit_code == 0 and "not rotated" in text.output  # no prompt when not due
    assert fh.home.signing_key().public.key_id == before  # kept, both times
    refused = CliRunner().invoke(app, [*args, "0"], env=env)
    assert refused.exit_code == 2  # at least a day
    rotated = CliRunner().invoke(app, ["manager", "rotate-key", "--yes", "--json"], env=env)
    assert json.loads(rotated.output)["rotated"] is True
    assert fh.home.signing_key().public.key_id != before
