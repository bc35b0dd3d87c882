"""When a station may train: shift windows and "the line has been idle N minutes".

A station with no windows may always train. With windows it may train while any one of
them is open. Shift times are seconds of the station's local day (a shift may cross
midnight: 22:00-06:00); the station's ``utc_offset_s`` turns the scheduler's clock (POSIX
seconds, or the benchmark's virtual seconds) into its local time. The idle window opens
once the agent has reported the line idle for ``idle_s`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedge.edge_manager.scheduler.errors import WindowError

DAY_S = 86_400


@dataclass(frozen=True)
class ShiftWindow:
    """Open from ``start_s`` to ``end_s`` (seconds of the local day, end exclusive)."""

    start_s: int
    end_s: int

    def __post_init__(self) -> None:
        for value in (self.start_s, self.end_s):
            if not 0 <= value <= DAY_S:
                raise WindowError(
                    f"shift time {value} s is outside the day (0..{DAY_S}); give seconds "
                    "since local midnight, e.g. 06:00 is 21600"
                )
        if self.start_s == self.end_s:
            raise WindowError("a shift window opens and closes at the same time; omit it")

    @classmethod
    def parse(cls, text: str) -> ShiftWindow:
        """``"22:00-06:00"`` -> a window crossing midnight."""
        try:
            start, end = text.split("-")
            return cls(_seconds_of_day(start), _seconds_of_day(end))
        except ValueError as exc:
            raise WindowError(f"shift window {text!r} is not HH:MM-HH:MM") from exc

    def is_open(self, local_s: float) -> bool:
        if self.start_s < self.end_s:
            return self.start_s <= local_s < self.end_s
        return local_s >= self.start_s or local_s < self.end_s


@dataclass(frozen=True)
class IdleWindow:
    """Open once the line has been idle ``idle_s`` seconds (the agent reports since when)."""

    idle_s: float

    def __post_init__(self) -> None:
        if self.idle_s < 0:
            raise WindowError(f"idle time {self.idle_s} s is negative; give 0 or more seconds")

    def is_open(self, now: float, idle_since: float | None) -> bool:
        return idle_since is not None and now - idle_since >= self.idle_s


Window = ShiftWindow | IdleWindow


def parse_window(text: str) -> Window:
    """A window as the station's signed config writes it: ``"22:00-06:00"`` or
    ``"idle 30m"`` (protocols.config.TrainingPolicy.windows)."""
    value = text.strip()
    if value.startswith("idle "):
        minutes = value[5:].strip().removesuffix("m")
        try:
            return IdleWindow(int(minutes) * 60.0)
        except ValueError as exc:
            raise WindowError(f"idle window {text!r} is not 'idle Nm' (e.g. idle 30m)") from exc
    return ShiftWindow.parse(value)


def _seconds_of_day(text: str) -> int:
    hours, minutes = text.strip().split(":")
    value = int(hours) * 3600 + int(minutes) * 60
    if not (0 <= int(minutes) < 60 and 0 <= value <= DAY_S):
        raise ValueError(text)
    return value


def may_train(
    windows: tuple[Window, ...], now: float, *, utc_offset_s: int = 0, idle_since: float | None
) -> bool:
    """Whether a station with these windows may be asked to train at ``now``."""
    if not windows:
        return True
    local_s = (now + utc_offset_s) % DAY_S
    for window in windows:
        if isinstance(window, ShiftWindow):
            if window.is_open(local_s):
                return True
        elif window.is_open(now, idle_since):
            return True
    return False
