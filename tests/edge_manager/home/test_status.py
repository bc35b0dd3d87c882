"""`fedge manager status` names the logs that exist (issue 26): the output log only for a
process `manager up` started, the terminal for one started by hand, engines' own logs
whoever started them. Pure logic, and the real lock files of this process."""

import os
from pathlib import Path

from fedge.edge_manager.home import launcher
from fedge.edge_manager.home.launcher import Output, describe, role_status
from fedge.edge_manager.home.run_dir import Role, hold, read_up_marker, write_up_marker

ROOT = Path("/srv/fedge-home")
SERVE_LOG = ROOT / "logs" / "serve.log"
BROKER_LOG = ROOT / "logs" / "broker.log"
MOSQUITTO_LOG = ROOT / "broker" / "mosquitto.log"


def test_a_process_up_started_is_named_with_its_log() -> None:
    status = role_status(ROOT, Role.SERVE, 41, 41, {SERVE_LOG})
    assert status.output is Output.LOG and status.logs == (SERVE_LOG,)
    assert describe(status) == f"running (pid 41); log {SERVE_LOG}"


def test_a_process_started_by_hand_logs_to_its_terminal_not_to_an_old_up_log() -> None:
    # `up` ran serve once (pid 7) and left its log; now a serve started by hand runs.
    status = role_status(ROOT, Role.SERVE, 41, 7, {SERVE_LOG})
    assert status.output is Output.TERMINAL and status.logs == ()
    assert describe(status) == (
        "running (pid 41), started outside `manager up`: its output goes to its terminal"
    )
    never_up = role_status(ROOT, Role.SERVE, 41, None, set())
    assert describe(never_up) == describe(status)


def test_the_brokers_own_log_is_named_however_it_was_started() -> None:
    by_hand = role_status(ROOT, Role.BROKER, 9, None, {MOSQUITTO_LOG, BROKER_LOG})
    assert by_hand.logs == (MOSQUITTO_LOG,)
    assert describe(by_hand).endswith(f"its output goes to its terminal; also {MOSQUITTO_LOG}")
    by_up = role_status(ROOT, Role.BROKER, 9, 9, {MOSQUITTO_LOG, BROKER_LOG})
    assert describe(by_up) == f"running (pid 9); logs {BROKER_LOG}, {MOSQUITTO_LOG}"


def test_a_stopped_role_names_its_last_runs_logs_or_none() -> None:
    superlink_log = ROOT / "superlink" / "superlink.log"
    stopped = role_status(ROOT, Role.SUPERLINK, None, 5, {superlink_log})
    assert stopped.output is Output.NONE
    assert describe(stopped) == f"stopped; logs of its last run: {superlink_log}"
    assert describe(role_status(ROOT, Role.SERVE, None, None, set())) == "stopped; no log"
    removed = role_status(ROOT, Role.SERVE, 41, 41, set())
    assert describe(removed) == "running (pid 41); no log (its log file was removed)"


def test_status_reads_the_home_locks_markers_and_files(tmp_path: Path) -> None:
    fd = hold(tmp_path, Role.SERVE)  # this process holds serve's lock, as a serve would
    try:
        serve = next(s for s in launcher.status(tmp_path) if s.role is Role.SERVE)
        assert serve.pid == os.getpid() and serve.output is Output.TERMINAL
        assert serve.logs == ()

        write_up_marker(tmp_path, Role.SERVE, os.getpid())
        assert read_up_marker(tmp_path, Role.SERVE) == os.getpid()
        log = tmp_path / "logs" / "serve.log"
        log.parent.mkdir()
        log.write_text("--- started\n")
        serve = next(s for s in launcher.status(tmp_path) if s.role is Role.SERVE)
        assert serve.output is Output.LOG and serve.logs == (log,)
    finally:
        os.close(fd)
    after = {s.role: s for s in launcher.status(tmp_path)}
    assert after[Role.SERVE].pid is None and after[Role.SERVE].logs == (log,)
    assert after[Role.BROKER].pid is None and after[Role.BROKER].logs == ()
    assert not (tmp_path / "run" / "serve.up.tmp").exists()


def test_the_engine_logs_are_where_the_engines_write_them(tmp_path: Path) -> None:
    from fedge.aggregator.superlink.link import SuperLink
    from fedge.edge_manager.home.run_dir import engine_log_paths
    from fedge.transport.broker import FleetAccess, MosquittoBroker

    access = FleetAccess("plant-a", "fedge-manager", "", {})
    mosquitto = MosquittoBroker(tmp_path / "broker", access, 1883)
    assert engine_log_paths(tmp_path, Role.BROKER)[0] == mosquitto.log_path
    superlink = SuperLink(tmp_path / "superlink", "127.0.0.1", 9092)
    assert engine_log_paths(tmp_path, Role.SUPERLINK) == (superlink.log_path,)
    assert engine_log_paths(tmp_path, Role.SERVE) == ()
