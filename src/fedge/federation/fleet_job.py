"""Federated jobs across the fleet: prepare, submit to the SuperLink, wait, publish.

``fedge aggregator run job.toml`` with ``[federation] backend = "fleet"`` comes here:

1. **prepare** (:mod:`.prepare`) -- checked against the manager's store, then the job
   directory is written.
2. **submit** -- ``flwr run`` sends the app to the fleet's SuperLink, which starts
   fedge's ServerApp (:mod:`fedge.aggregator.fleet.server`) in a process of its own.
3. **wait** -- the run store shows the rounds as they end; a ServerApp that died
   (its job lock free while the run says running) is reported, and ``resume`` submits
   the job again to continue from its newest checkpoint.
4. **publish** (:mod:`.publish`) -- the final weights are exported to ONNX (checked
   against torch with ONNX Runtime) and published once with their lineage: the job, its
   rounds, the parties and their example counts, the parent version.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.aggregator.fleet.manifest import is_fleet_manifest, load_fleet_manifest
from fedge.aggregator.jobs.checkpoint import atomic_write_text
from fedge.aggregator.jobs.directory import (
    JOB_MANIFEST,
    RUNS_DB,
    JobError,
    clear_halt,
    is_live,
)
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.superlink.address import connection_toml
from fedge.aggregator.superlink.link import control_address
from fedge.aggregator.superlink.signed_apps import SignedApps
from fedge.edge_manager.home.layout import ManagerHome
from fedge.federation.prepare import APP_DIR, prepare
from fedge.federation.publish import publish
from fedge.protocols.app_signing import AppSignature, sign_fab
from fedge.protocols.signing import SigningKey

SUBMITTED = "submitted.json"
CONNECTION = "fedge-fleet"
# A submitted run's ServerApp must take the job lock within this (Flower starts it through
# SuperExec, which polls; a busy host is slow): past it, a run nobody holds is dead.
DEAD_GRACE_S = 120.0

ProgressFn = Callable[[int, int, float | None], None]


@dataclass(frozen=True)
class FleetJobResult:
    run_id: str
    state: RunState
    rounds: int
    last_round: int
    published: str | None  # the new model's ref, once published
    error: str = ""


# ---------------------------------------------------------------- submit and wait


def superlink_root_certificates(home: ManagerHome) -> Path | None:
    """The CA ``flwr run`` trusts for the home's SuperLink: the fleet CA, or None for a
    home made ``--insecure`` (a plain SuperLink, development only)."""
    return None if home.settings().insecure else home.pki().ca_path


def sign_app(app_dir: Path, key: SigningKey, signed_apps: SignedApps) -> AppSignature:
    """Sign the FAB ``flwr run`` will build from ``app_dir`` and store the signature where
    the SuperLink's front hands it to stations (before submitting: a station may fetch the
    FAB as soon as the ServerApp sends its first message). Flower builds a FAB with fixed
    file dates, so the bytes signed here are the bytes ``flwr run`` sends."""
    from flwr.cli.build import build_fab_from_disk  # the same builder `flwr run` uses

    try:
        fab = build_fab_from_disk(app_dir)
    except Exception as exc:  # Flower raises click/typer errors for a bad app directory
        raise JobError(f"cannot build the Flower app in {app_dir}: {exc}") from exc
    signature = sign_fab(fab, key)
    signed_apps.put(signature)
    return signature


def submit(
    job_dir: Path,
    superlink: str,
    *,
    root_certificates: Path | None = None,
    signing: tuple[SigningKey, SignedApps] | None = None,
) -> dict[str, Any]:
    """Send the job's app to the SuperLink with ``flwr run``; returns Flower's answer.

    Over HTTPS trusting ``root_certificates`` (the fleet CA), or plain when None. With
    ``signing`` (the manager's key and the SuperLink's signature store) the app is signed
    first: stations run only apps the fleet signed. The run is marked queued first: until
    the new ServerApp takes the job, what the run store says (halted, failed) is about the
    previous submission.
    """
    if root_certificates is not None and not root_certificates.is_file():
        raise JobError(f"the SuperLink's CA certificate {root_certificates} does not exist")
    signature = None if signing is None else sign_app(job_dir / APP_DIR, *signing)
    _mark_queued(job_dir)
    cli_home = job_dir / "flwr-cli"
    cli_home.mkdir(exist_ok=True)
    (cli_home / "config.toml").write_text(
        connection_toml(CONNECTION, superlink, root_certificates), encoding="utf-8"
    )
    flwr = Path(sys.executable).parent / "flwr"
    if not flwr.exists():
        found = shutil.which("flwr")
        if found is None:
            raise JobError("the `flwr` command is not installed (pip install 'fedge[train]')")
        flwr = Path(found)
    env = {**os.environ, "FLWR_HOME": str(cli_home), "FLWR_TELEMETRY_ENABLED": "0"}
    try:
        result = subprocess.run(
            [str(flwr), "run", str(job_dir / APP_DIR), CONNECTION, "--format", "json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise JobError(f"`flwr run` did not answer within 180 s (SuperLink {superlink})") from None
    text = result.stdout
    answer: dict[str, Any] = {}
    if "{" in text:
        try:
            answer = json.loads(text[text.index("{") :])
        except json.JSONDecodeError:
            answer = {}
    if result.returncode != 0 or not answer.get("success"):
        detail = (answer.get("error-message") or result.stderr or text).strip()[-800:]
        raise JobError(f"the SuperLink at {superlink} refused the job: {detail}")
    fab_hash = str(answer.get("fab-hash", ""))
    if signature is not None and not (fab_hash and signature.digest.startswith(fab_hash)):
        # Stations would refuse the run: say so now rather than after a round's wait.
        raise JobError(
            f"`flwr run` sent a FAB ({fab_hash}) other than the one signed "
            f"({signature.digest[:12]}): is another Flower version on PATH?"
        )
    answer["submitted_at"] = time.time()
    atomic_write_text(job_dir / SUBMITTED, json.dumps(answer))
    return answer


def _mark_queued(job_dir: Path) -> None:
    """A (re)submitted job is queued again until its new ServerApp takes it."""
    store = RunStore(job_dir / RUNS_DB)
    try:
        run = store.runs()[-1]
        if RunState(run["state"]) is not RunState.COMPLETED:
            store.set_state(str(run["run_id"]), RunState.QUEUED, error="")
    finally:
        store.close()


def wait(
    job_dir: Path,
    *,
    progress: ProgressFn | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
) -> FleetJobResult:
    """Follow the run store until the job ends, halts, fails or its aggregator dies."""
    manifest = load_fleet_manifest(job_dir / JOB_MANIFEST)
    total = manifest.job.rounds
    submitted = submitted_at(job_dir)
    end = None if timeout_s is None else time.monotonic() + timeout_s
    reported = -1
    seen_live = False
    while True:
        store = RunStore(job_dir / RUNS_DB)
        try:
            runs = store.runs()
            run = runs[-1]
            rounds = store.rounds(str(run["run_id"]))
        finally:
            store.close()
        state = RunState(run["state"])
        last = int(run["last_round"])
        settled = float(run["updated_at"]) >= submitted  # not the state of an older submission
        if progress is not None and last != reported:
            accuracy = rounds[-1]["eval_metrics"].get("accuracy") if rounds else None
            progress(last, total, None if accuracy is None else float(accuracy))
            reported = last
        if state is RunState.COMPLETED or (state in (RunState.FAILED, RunState.HALTED) and settled):
            return FleetJobResult(str(run["run_id"]), state, total, last, None, str(run["error"]))
        live = is_live(job_dir)
        seen_live = seen_live or live
        if not live and (seen_live or time.time() - submitted > DEAD_GRACE_S):
            # The lock is free: the ServerApp ended. Read once more what it left: an end
            # written just before it let go is an end, anything else is a death.
            final = _latest_run(job_dir)
            final_state = RunState(final["state"])
            if final_state is RunState.COMPLETED or (
                final_state in (RunState.FAILED, RunState.HALTED)
                and float(final["updated_at"]) >= submitted
            ):
                return FleetJobResult(
                    str(final["run_id"]), final_state, total, int(final["last_round"]), None,
                    str(final["error"]),
                )  # fmt: skip
            return FleetJobResult(
                str(run["run_id"]),
                state,
                total,
                last,
                None,
                "the aggregator (ServerApp) is not running: it was killed or its SuperLink "
                "stopped; `fedge aggregator resume --dir` continues from the last checkpoint",
            )
        if end is not None and time.monotonic() >= end:
            raise JobError(f"job in {job_dir} did not end within {timeout_s:.0f}s")
        time.sleep(poll_s)


def _latest_run(job_dir: Path) -> dict[str, Any]:
    store = RunStore(job_dir / RUNS_DB)
    try:
        return store.runs()[-1]
    finally:
        store.close()


def submitted_at(job_dir: Path) -> float:
    """When the job was last submitted to the SuperLink (0: never)."""
    try:
        return float(json.loads((job_dir / SUBMITTED).read_text())["submitted_at"])
    except (OSError, ValueError, KeyError):
        return 0.0


def needs_submission(job_dir: Path) -> bool:
    """Whether resuming must submit the job again (no aggregator is running it)."""
    store = RunStore(job_dir / RUNS_DB)
    try:
        state = RunState(store.runs()[-1]["state"])
    finally:
        store.close()
    return state is not RunState.COMPLETED and not is_live(job_dir)


# ---------------------------------------------------------------- the whole job


def is_fleet_job(job_dir: Path) -> bool:
    path = job_dir / JOB_MANIFEST
    return path.is_file() and is_fleet_manifest(path.read_text(encoding="utf-8"))


def run_fleet_job(
    manifest_path: Path,
    job_dir: Path,
    home: ManagerHome,
    *,
    progress: ProgressFn | None = None,
    timeout_s: float | None = None,
    root_certificates: Path | None = None,
) -> FleetJobResult:
    """Prepare, submit, follow and publish a fleet job (``fedge aggregator run``);
    ``root_certificates``: see :func:`submit` and :func:`superlink_root_certificates`."""
    prepare(manifest_path, job_dir, home)
    submit_to_fleet(job_dir, home, root_certificates=root_certificates)
    return _finish(job_dir, home, progress, timeout_s)


def submit_to_fleet(
    job_dir: Path, home: ManagerHome, *, root_certificates: Path | None = None
) -> dict[str, Any]:
    """Sign the job's app with the manager's key and submit it to the home's running
    SuperLink on this host (its Control API listens on loopback only)."""
    link_dir = home.root / "superlink"
    return submit(
        job_dir,
        control_address(link_dir),
        root_certificates=root_certificates or superlink_root_certificates(home),
        signing=(home.signing_key(), SignedApps.of(link_dir)),
    )


def resume_fleet_job(
    job_dir: Path,
    home: ManagerHome,
    *,
    progress: ProgressFn | None = None,
    timeout_s: float | None = None,
    root_certificates: Path | None = None,
) -> FleetJobResult:
    """Continue a fleet job: submit it again if no aggregator runs it, follow, publish."""
    if needs_submission(job_dir):
        clear_halt(job_dir)  # resuming is the newer request
        submit_to_fleet(job_dir, home, root_certificates=root_certificates)
    return _finish(job_dir, home, progress, timeout_s)


def _finish(
    job_dir: Path, home: ManagerHome, progress: ProgressFn | None, timeout_s: float | None
) -> FleetJobResult:
    result = wait(job_dir, progress=progress, timeout_s=timeout_s)
    if result.state is RunState.COMPLETED:
        ref = publish(job_dir, home)
        return FleetJobResult(
            result.run_id, result.state, result.rounds, result.last_round, ref, result.error
        )
    return result
