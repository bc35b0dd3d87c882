"""The demo's last step: run its checks (:mod:`fedge.demo.checks`) on what it wrote.

Adds the figures measured after the report (the federated rounds, the SuperLink front's
counters) to ``summary.json``, reads every demo process's log and the demo's own ERROR
records, prints one line a check, lists them in ``report.md`` and in the summary, and
raises :class:`StoryCheckFailed` when any check failed (the CLI's one red line, exit 1).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from fedge.demo.checks import CheckResult, log_check, story_checks, unexpected_errors
from fedge.demo.errors import StoryCheckFailed

# The format of every fedge process's log (cli/common.py's setup_logging).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SHOWN_ERRORS = 10


class ErrorRecords(logging.Handler):
    """The demo process's own ERROR records, as the lines its log would hold."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        # The first line only: a traceback's lines are not log lines.
        self.lines.append(self.format(record).splitlines()[0])


@contextmanager
def recording_errors() -> Iterator[ErrorRecords]:
    """Collect the demo process's ERROR records while the block runs."""
    root = logging.getLogger()
    records = ErrorRecords()
    # The demo configures no logging: Python's last-resort handler prints its warnings.
    # A handler on the root would silence that, so it joins the root too meanwhile.
    added: list[logging.Handler] = [records]
    if not root.handlers and logging.lastResort is not None:
        added.append(logging.lastResort)
    for handler in added:
        root.addHandler(handler)
    try:
        yield records
    finally:
        for handler in added:
            root.removeHandler(handler)


def _log_errors(out: Path, own: list[str]) -> list[str]:
    """Every unexpected ERROR line, named by the log it is in."""
    found = []
    for log in sorted((out / "logs").glob("*.log")):
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        found += [f"{log.name}: {line}" for line in unexpected_errors(lines)]
    found += [f"the demo: {line}" for line in unexpected_errors(own)]
    return found


def check_story(
    out: Path, measured: dict[str, Any], own_errors: list[str], console: Console
) -> list[CheckResult]:
    """Run the checks on ``out``'s summary with ``measured`` added; print and record them."""
    path = out / "summary.json"
    summary = json.loads(path.read_text(encoding="utf-8"))
    summary.update(measured)
    unexpected = _log_errors(out, own_errors)
    results = [*story_checks(summary), log_check(unexpected)]
    summary["checks"] = [{**dataclasses.asdict(r), "line": r.line} for r in results]
    path.write_text(json.dumps(summary, indent=1), encoding="utf-8")

    console.rule("[bold]the demo checks its own story")
    for result in results:
        colour = "green" if result.ok else "red"
        # One line each, never wrapped: CI's log is read (and grepped) line by line.
        console.print(
            f"[{colour}]{escape(result.line)}[/{colour}]", highlight=False, soft_wrap=True
        )
    for line in unexpected[:SHOWN_ERRORS]:
        console.print(f"  [red]{escape(line)}[/red]", highlight=False, soft_wrap=True)
    if len(unexpected) > SHOWN_ERRORS:
        console.print(f"  … and {len(unexpected) - SHOWN_ERRORS} more", highlight=False)
    with (out / "report.md").open("a", encoding="utf-8") as report:
        report.write(
            "\n".join(
                [
                    "",
                    "## The demo's own checks",
                    "",
                    "What each chapter must show (README), checked on this run's figures; "
                    "any FAILED line makes `fedge demo` exit 1.",
                    "",
                    *(f"- `{r.line}`" for r in results),
                    *(f"  - `{line}`" for line in unexpected[:SHOWN_ERRORS]),
                    "",
                ]
            )
        )
    return results


def raise_if_failed(results: list[CheckResult], out: Path) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        names = "; ".join(f"{r.chapter}: {r.name}" for r in failed)
        raise StoryCheckFailed(
            f"the demo did not show what the README says: {len(failed)} of {len(results)} "
            f"checks FAILED ({names}); see the FAILED lines above and {out / 'report.md'}"
        )
