"""The README's five-minute walkthrough, run as written (issue 15).

The commands come from the README itself -- the ``sh`` block after the
``<!-- walkthrough: ... -->`` marker -- so the two cannot drift apart. They run in order
in a fresh temporary directory, as a person would type them in one shell:

- ``source .venv/bin/activate`` is taken as given: the commands run with this venv's
  ``bin`` first on PATH, which is what activating it does;
- ``export NAME=VALUE`` sets the variable (``$PWD`` is the temporary directory);
- a line ending in ``&`` starts a real background process (broker, manager, agents),
  and, as a person waits for its first line before typing on, the next command waits
  for the process to print one;
- every other line runs in ``bash`` and must exit 0.

Two things differ from a person's run, and only these: the ports the README gives
``manager init`` are replaced by free ones (tests run side by side), and each
``p-<id>`` is filled in from the last ``fedge predictions list`` printed -- a line that
labels takes an id no earlier line used (a person labels different parts), any other
line the id taken last.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import Processes, free_port, wait_until

from fedge.edge_manager.home.layout import ManagerHome

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- walkthrough:"
PLACEHOLDER = "p-<id>"
PREDICTION_ID = re.compile(r"\bp-[0-9a-f]{32}\b")
COMMAND_TIMEOUT_S = 120.0
START_TIMEOUT_S = 30.0


def walkthrough_commands(readme: str) -> list[str]:
    """The marked block's commands: continuation lines joined, comments and blanks gone."""
    _, marker, rest = readme.partition(MARKER)
    assert marker, f"README.md has no {MARKER!r} block"
    block = re.search(r"```sh\n(.*?)```", rest, re.DOTALL)
    assert block is not None, "no ```sh block after the walkthrough marker"
    commands: list[str] = []
    pending = ""
    for raw in block.group(1).splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()  # a comment starts at ' #'
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            commands.append(" ".join(line.split()))
    return commands


def test_the_walkthrough_block_parses() -> None:
    commands = walkthrough_commands(README.read_text(encoding="utf-8"))
    assert commands[0] == "source .venv/bin/activate"
    assert any(c.endswith("&") for c in commands)
    assert not any("\\" in c for c in commands)


@dataclass
class Shell:
    """One person's shell: a working directory, exported variables, the last list of ids."""

    cwd: Path
    procs: Processes
    ids: list[str] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    current_id: str | None = None
    last_list: str | None = None

    def run(self, command: str) -> None:
        if command == "source .venv/bin/activate":
            return  # PATH already starts with this venv's bin (see the module docstring)
        if command.startswith("export "):
            name, _, value = command.removeprefix("export ").partition("=")
            self.procs.env[name] = os.path.expandvars(value.replace("$PWD", str(self.cwd)))
            return
        command = self._fresh_ports(command)
        if command.endswith("&"):
            self._start(command.removesuffix("&").strip())
            return
        if PLACEHOLDER in command:
            command = command.replace(PLACEHOLDER, self._id_for(command))
        output = self.foreground(command)
        if " predictions list" in command:
            self.last_list = command
            self.ids = PREDICTION_ID.findall(output)

    def _fresh_ports(self, command: str) -> str:
        if " manager init " not in command:
            return command
        for option in ("--broker-port", "--grpc-port", "--superlink-port"):
            command = re.sub(rf"{option} \d+", f"{option} {free_port()}", command)
        if "--superlink-port" not in command:  # its default, 9092, may be taken here
            command += f" --superlink-port {free_port()}"
        return command

    def _start(self, command: str) -> None:
        words = shlex.split(command)
        assert words[0] == "fedge", f"background commands are fedge commands: {command}"
        proc = self.procs.start("-".join(words[1:3]), *words[1:])
        if words[1:3] == ["manager", "broker"] and "FEDGE_HOME" in self.procs.env:
            # Should the wrapper die first, teardown stops its mosquitto by pid file.
            home = ManagerHome(Path(self.procs.env["FEDGE_HOME"]))
            self.procs.pidfiles.append(home.root / "broker" / "mosquitto.pid")

        def first_line() -> bool:
            assert proc.running(), f"`{command}` exited early\n{proc.output()}"
            return bool(proc.stdout_path.read_text(errors="replace").strip())

        wait_until(first_line, START_TIMEOUT_S, f"`{command}` to print its first line")

    def foreground(self, command: str) -> str:
        result = subprocess.run(
            ["bash", "-c", command],
            cwd=self.cwd,
            env=self.procs.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        assert result.returncode == 0, (
            f"`{command}` exited {result.returncode}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}\n"
            + "\n".join(p.output() for p in self.procs.procs)
        )
        return result.stdout

    def _id_for(self, command: str) -> str:
        if " label" not in command:
            assert self.current_id is not None, f"no id taken before `{command}`"
            return self.current_id
        assert self.last_list is not None, f"no `fedge predictions list` before `{command}`"
        fresh = [i for i in self.ids if i not in self.used]
        if not fresh:  # a person would run the list again: more have arrived since
            listed = self.last_list
            output = wait_until(
                lambda: self.foreground(listed),
                20,
                "more predictions to label",
                expect=lambda out: bool(set(PREDICTION_ID.findall(out)) - self.used),
            )
            fresh = [i for i in PREDICTION_ID.findall(output) if i not in self.used]
        self.current_id = fresh[0]
        self.used.add(fresh[0])
        return fresh[0]


def test_the_readme_walkthrough_works_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands = walkthrough_commands(README.read_text(encoding="utf-8"))
    work = tmp_path / "walkthrough"
    work.mkdir()
    monkeypatch.chdir(work)  # background processes start here too, as in the shell
    venv_bin = str(Path(sys.executable).parent)
    path = f"{venv_bin}{os.pathsep}{os.environ['PATH']}"
    # HOME too: whatever a default puts under it lands in the temporary directory.
    procs = Processes(tmp_path / "logs", env={"PATH": path, "HOME": str(tmp_path)})
    procs.env.pop("FEDGE_HOME", None)  # only the walkthrough's own export counts
    shell = Shell(work, procs)
    try:
        for command in commands:
            shell.run(command)
        # What the walkthrough promised happened, asked as its reader would: the station
        # scored every part image it was given, and every label given (on the device and
        # at the manager) reached the manager.
        parts = len(list((work / "starter" / "parts").glob("*.png")))
        labels_given = sum(" label" in c and PLACEHOLDER in c for c in commands)

        def st_01() -> dict[str, object]:
            stats = json.loads(shell.foreground("fedge labels stats --json"))
            return next(row for row in stats if row["edge"] == "st-01")

        wait_until(
            st_01,
            30,
            "st-01's predictions and labels at the manager",
            expect=lambda row: row["predictions"] == parts and row["labels"] == labels_given,
        )
        if "FEDGE_HOME" in procs.env:
            assert Path(procs.env["FEDGE_HOME"]).is_relative_to(work)
    finally:
        procs.close()
        # Daemons a walkthrough command started itself (`fedge manager up`) are not ours
        # to signal: their own `down` stops them, whether or not the block ends with it.
        for command in commands:
            if re.match(r"fedge \S+ up\b", command):
                down = command.split(" up", 1)[0] + " down"
                subprocess.run(
                    ["bash", "-c", down], cwd=work, env=procs.env, timeout=60, check=False,
                    capture_output=True,
                )  # fmt: skip
