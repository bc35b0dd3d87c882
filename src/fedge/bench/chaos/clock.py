"""Clock jumps for agent processes, without libfaketime: a ``sitecustomize`` shim.

An agent started with :func:`clock_env` imports the shim below before anything else;
it replaces :func:`time.time` with the real wall clock plus an offset read from a file
the harness writes (re-read at most every 0.2 s of monotonic time). A jump is a new
offset; healing it is offset 0 -- an NTP step one way, then the other. Monotonic clocks
are untouched, as they are by a real step, and so are clocks read in C
(``datetime.now()``, SQLite): the shim moves what the agent stamps its records,
liveness, retention and inbox settling with, which is where a wall-clock step bites.
"""

import os
from pathlib import Path

SHIM = '''"""fedge chaos: wall-clock offset shim (see fedge.bench.chaos.clock)."""
import os as _os
import time as _time

_path = _os.environ.get("FEDGE_CHAOS_CLOCK_FILE")
if _path:
    _real_time = _time.time
    _monotonic = _time.monotonic
    _state = [0.0, -1.0]  # offset, monotonic time of the next read

    def _shifted_time():
        now = _monotonic()
        if now >= _state[1]:
            _state[1] = now + 0.2
            try:
                with open(_path) as _handle:
                    _state[0] = float(_handle.read().strip() or 0.0)
            except (OSError, ValueError):
                _state[0] = 0.0
        return _real_time() + _state[0]

    _time.time = _shifted_time
'''


def install_shim(directory: Path) -> Path:
    """Write the shim as ``DIRECTORY/sitecustomize.py``; return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SHIM)
    return directory


def clock_env(base: dict[str, str], shim_dir: Path, offset_file: Path) -> dict[str, str]:
    """``base`` plus what makes a Python child read its wall clock through the shim."""
    path = os.pathsep.join(p for p in (str(shim_dir), base.get("PYTHONPATH", "")) if p)
    return {**base, "PYTHONPATH": path, "FEDGE_CHAOS_CLOCK_FILE": str(offset_file)}


def set_offset(offset_file: Path, offset_s: float) -> None:
    """Jump the wall clock of the processes reading ``offset_file`` (atomically)."""
    staged = offset_file.with_suffix(".tmp")
    staged.write_text(f"{offset_s:.3f}\n")
    staged.replace(offset_file)
