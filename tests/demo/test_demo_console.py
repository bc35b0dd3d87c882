"""The demo's last step, ``fedge demo --console PORT``: the console over the demo's
manager home in a real process, its admin token printed once on the terminal and
nowhere else, Ctrl-C ending it; and the hint a plain ``make demo`` ends with."""

import io
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import free_port, make_fleet_home, wait_until
from rich.console import Console

from fedge.demo import fleet as demo_fleet

pytestmark = pytest.mark.integration

SERVE = "from pathlib import Path; from fedge.demo.fleet import serve_console; " \
    "from fedge.edge_manager.home.layout import ManagerHome; " \
    "serve_console(ManagerHome(Path({home!r})), {port})"  # fmt: skip


def test_the_demo_console_serves_the_fleet_prints_its_token_once_and_stops_on_ctrl_c(
    tmp_path: Path,
) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01", "st-02"))
    port = free_port()
    terminal = tmp_path / "terminal.txt"  # what the person running the demo sees
    with terminal.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE.format(home=str(fh.home.root), port=port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_until(lambda: url in terminal.read_text(), 20, "the console's URL")
        text = terminal.read_text()
        token = text.split("not written to any file):", 1)[1].split()[0]
        with httpx.Client(base_url=url, timeout=10) as client:
            wait_until(lambda: client.get("/login").status_code == 200, 20, "the console")
            login = client.get("/login").text
            csrf = re.findall(r'name="csrf" value="([^"]+)"', login)[0]
            assert client.post("/login", data={"csrf": csrf, "token": "wrong"}).status_code != 303
            answer = client.post("/login", data={"csrf": csrf, "token": token})
            assert answer.status_code == 303
            page = client.get("/").text
            assert 'data-edge="st-01"' in page and 'data-edge="st-02"' in page
            assert "demo-admin (admin)" in page
        assert text.count(token) == 1
        # The store keeps its hash only; no file of the home (logs, store) holds it.
        for path in fh.home.root.rglob("*"):
            if path.is_file():
                assert token.encode() not in path.read_bytes(), path
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_plain_demo_ends_with_how_to_open_the_console(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown = io.StringIO()
    monkeypatch.setattr(demo_fleet, "console", Console(file=shown, width=200))
    demo_fleet.console_hint(tmp_path / "demo-out")
    text = shown.getvalue()
    assert "make console" in text and "fedge demo --console 8470" in text
    assert f"fedge console --home {tmp_path / 'demo-out' / 'manager'}" in text
