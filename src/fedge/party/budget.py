"""A party's privacy ledger: the DP releases it made, per job and for its lifetime (SQLite).

Budgets are enforced where the data is (issue "Privacy"): before a round trains, the party
:meth:`~BudgetLedger.reserve`\\ s the round's planned release -- checked against the job's
epsilon and the station's lifetime epsilon (from its signed edge config) and recorded in
one transaction -- then :meth:`~BudgetLedger.settle`\\ s it to what training took, or
:meth:`~BudgetLedger.cancel`\\ s it when training failed and nothing left the party. Both
bounds compose the whole history with an Opacus accountant
(:mod:`fedge.privacy.accounting`), never by adding epsilons (which would overstate the
cost). Opacus is imported only when a bound is computed: the agent writes budgets here on
its inference path, without torch.

The station's own privacy floor (:mod:`fedge.privacy.floor`, written by its agent from
agent.toml, never from a signed config) sits beside the manager's lifetime budget: the
lifetime bound a round is checked against is the smaller epsilon of the two at the
smaller delta (:meth:`BudgetLedger.bound`), so the manager may tighten the floor, never
loosen or clear it. Evaluations a floor allows are releases too (``dp_evaluations``):
composed into the lifetime spend with the training releases.

One file per station or simulated party, apart from anything a model reinstall replaces.
WAL with ``synchronous=FULL``: the reservation is on disk before training starts, so a
party killed while training keeps the planned release counted. Releases are keyed
``(job, server_round, attempt)``: a round trained again after a crash is a second release
and counted as one (its first update may have reached the server); the same attempt
recorded twice counts once.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from uuid import uuid4

from fedge.party import budget_store
from fedge.privacy.floor import EvaluationBudget, PrivacyFloor, PrivacyFloorError, plan_refusal
from fedge.privacy.settings import BudgetExhaustedError, DpRelease, PrivacyError, PrivacySpec

DEFAULT_LIFETIME_DELTA = budget_store.DEFAULT_LIFETIME_DELTA
RELATIVE_TOLERANCE = 1e-6
"""A plan that lands exactly on its target (up to float rounding) is within it."""


@dataclass(frozen=True)
class LifetimeBound:
    """The bound a round is checked against: the smaller of the station's floor and the
    manager's budget (``epsilon`` None: neither bounds it), at the smaller delta."""

    epsilon: float | None
    delta: float
    floor: PrivacyFloor | None

    @property
    def from_floor(self) -> bool:
        return self.floor is not None and self.epsilon == self.floor.lifetime_epsilon


def lifetime_bound(
    manager: tuple[float | None, float], floor: PrivacyFloor | None
) -> LifetimeBound:
    """min(floor, manager's): the manager's budget tightens the floor, never loosens it."""
    epsilon, delta = manager
    if floor is None:
        return LifetimeBound(epsilon, delta, None)
    bounded = floor.lifetime_epsilon if epsilon is None else min(epsilon, floor.lifetime_epsilon)
    return LifetimeBound(bounded, min(delta, floor.delta), floor)


class BudgetLedger:
    """The releases one party made; ``check`` refuses a round that would overspend."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            self._conn = budget_store.connect(path)
        except (OSError, sqlite3.Error) as exc:
            raise PrivacyError(f"cannot open the privacy ledger {path}: {exc}") from exc
        try:
            columns = budget_store.prepare(self._conn, path)
        except PrivacyError:
            self._conn.close()
            raise
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise PrivacyError(
                f"{path} is not a privacy ledger ({exc}): move it aside and restore the "
                "ledger from a backup; starting a new one forgets the epsilon already spent"
            ) from exc
        if not budget_store.RELEASE_COLUMNS.issubset(columns):
            self._conn.close()
            raise PrivacyError(
                f"{path} has a dp_releases table that is not a privacy ledger's "
                f"(columns {sorted(columns)}): point the party at its own ledger file"
            )

    # -- the lifetime bound (from the station's signed edge config)

    def set_lifetime(self, epsilon: float | None, delta: float) -> None:
        """The party's bound over every job (``None``: no lifetime bound)."""
        if epsilon is not None and not (math.isfinite(epsilon) and epsilon > 0):
            raise PrivacyError(f"a lifetime privacy epsilon must be > 0, got {epsilon}")
        if not (math.isfinite(delta) and 0 < delta < 1):
            raise PrivacyError(f"a lifetime privacy delta must be in (0, 1), got {delta}")
        with self._transaction() as conn:
            budget_store.set_lifetime(conn, epsilon, delta)

    def lifetime(self) -> tuple[float | None, float]:
        """The manager's budget: (epsilon or ``None`` for no bound, delta)."""
        with self._lock, self._sqlite_errors():
            return budget_store.lifetime(self._conn)

    # -- the station's own floor (from its agent.toml, written by its agent)

    def set_floor(self, floor: PrivacyFloor | None) -> None:
        """Record the station's floor (``None``: its operator opted out of one)."""
        text = None if floor is None else json.dumps(floor.to_table(), sort_keys=True)
        with self._transaction() as conn:
            budget_store.set_floor(conn, text)

    def floor_state(self) -> tuple[bool, PrivacyFloor | None]:
        """(whether the agent wrote the floor, the floor or None when opted out/unwritten)."""
        with self._lock, self._sqlite_errors():
            written, text = budget_store.floor(self._conn)
        return written, _parse_floor(self.path, text)

    def floor(self) -> PrivacyFloor | None:
        return self.floor_state()[1]

    def bound(self) -> LifetimeBound:
        """The lifetime bound rounds are checked against (floor and manager's combined)."""
        with self._lock, self._sqlite_errors():
            manager = budget_store.lifetime(self._conn)
            _, text = budget_store.floor(self._conn)
        return lifetime_bound(manager, _parse_floor(self.path, text))

    # -- releases

    def history(self, job: str | None = None) -> list[DpRelease]:
        """The releases of ``job`` (``None``: of every job), in the order they were made."""
        with self._lock, self._sqlite_errors():
            return budget_store.history(self._conn, job)

    def spent(self, job: str | None = None, *, delta: float, accountant: str = "rdp") -> float:
        """Epsilon at ``delta`` spent in ``job``'s training (``None``: over the party's
        lifetime, evaluations included)."""
        if job is not None:
            return _epsilon_spent(self.history(job), delta, accountant)
        with self._lock, self._sqlite_errors():
            every = budget_store.history(self._conn, None) + budget_store.evaluations(
                self._conn, None
            )
        return _epsilon_spent(every, delta, accountant)

    def evaluations(self, job: str | None = None) -> list[DpRelease]:
        """The evaluation releases of ``job`` (``None``: of every job)."""
        with self._lock, self._sqlite_errors():
            return budget_store.evaluations(self._conn, job)

    def record_evaluation(
        self, job: str, budget: EvaluationBudget, accountant: str = "rdp"
    ) -> None:
        """Count one noised evaluation in ``job``: refused (:class:`PrivacyFloorError`)
        past the floor's evaluations per job, or (:class:`BudgetExhaustedError`) past the
        lifetime bound; checked and recorded in one transaction, before anything is
        evaluated (an evaluation that then fails still counts: the safe side)."""
        if not job:
            raise PrivacyError("an evaluation release needs its job's id, got an empty one")
        release = budget.release()
        with self._transaction() as conn:
            refusal = budget.refusal(len(budget_store.evaluations(conn, job)), job)
            if refusal is not None:
                raise PrivacyFloorError(refusal)
            history = budget_store.history(conn, None) + budget_store.evaluations(conn, None)
            bound = lifetime_bound(
                budget_store.lifetime(conn), _parse_floor(self.path, budget_store.floor(conn)[1])
            )
            _judge_lifetime(release, history, bound, accountant, what="evaluation")
            budget_store.insert_evaluation(conn, job, uuid4().hex, release.noise_multiplier)

    def check(
        self,
        job: str,
        release: DpRelease,
        *,
        job_epsilon: float | None,
        delta: float,
        accountant: str = "rdp",
    ) -> None:
        """Raise :class:`BudgetExhaustedError` if ``release`` would overspend a bound.

        The job's bound composes this job's releases at the job's ``delta``; the lifetime
        bound composes every job's releases at the lifetime delta. A party about to train
        uses :meth:`reserve`, which checks and records in one transaction.
        """
        with self._lock, self._sqlite_errors():
            job_history = budget_store.history(self._conn, job)
            history = budget_store.history(self._conn, None)
            history += budget_store.evaluations(self._conn, None)
            lifetime = budget_store.lifetime(self._conn)
            _, floor_text = budget_store.floor(self._conn)
        bound = lifetime_bound(lifetime, _parse_floor(self.path, floor_text))
        _judge(job, release, job_history, history, bound, job_epsilon, delta, accountant)

    def reserve(
        self,
        job: str,
        server_round: int,
        release: DpRelease,
        *,
        attempt: str,
        job_epsilon: float | None,
        delta: float,
        accountant: str = "rdp",
    ) -> None:
        """Check ``release`` against both bounds and record it, in one transaction.

        Two trainings on one ledger (two jobs on a station, two ClientApp processes) can
        never both pass a check only one of them fits: the second waits for the first's
        commit and sees its release. The planned release stays recorded if the party dies
        while training (it may have released an update: counted); :meth:`settle` replaces
        it with what training took, :meth:`cancel` removes it when nothing left the party.
        """
        if not job:
            raise PrivacyError("a DP release needs its job's id, got an empty one")
        with self._transaction() as conn:
            job_history = budget_store.history(conn, job)
            history = budget_store.history(conn, None) + budget_store.evaluations(conn, None)
            bound = lifetime_bound(
                budget_store.lifetime(conn), _parse_floor(self.path, budget_store.floor(conn)[1])
            )
            _judge(job, release, job_history, history, bound, job_epsilon, delta, accountant)
            budget_store.insert(conn, job, server_round, attempt, release)

    def settle(self, job: str, server_round: int, attempt: str, release: DpRelease) -> None:
        """Replace a reserved release with the one training actually made (fewer steps
        when a time cap stopped it)."""
        with self._transaction() as conn:
            budget_store.replace(conn, job, server_round, attempt, release)

    def cancel(self, job: str, server_round: int, attempt: str) -> None:
        """Drop a reservation whose training failed: no update left the party."""
        with self._transaction() as conn:
            budget_store.delete(conn, job, server_round, attempt)

    def record(self, job: str, server_round: int, release: DpRelease, *, attempt: str = "") -> bool:
        """Record a training's release; ``False`` if that attempt was recorded already.

        Every training of a round is its own release: a round retried after a crash may
        follow one whose update reached the server, so each attempt (its own id, given by
        the caller) is counted. Recording the same attempt twice counts it once.
        """
        if not job:
            raise PrivacyError("a DP release needs its job's id, got an empty one")
        with self._transaction() as conn:
            return budget_store.insert(conn, job, server_round, attempt, release)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        # BEGIN IMMEDIATE: the station's ClientApp and its agent may share the file.
        with self._lock, self._sqlite_errors(), budget_store.immediate(self._conn) as conn:
            yield conn

    @contextmanager
    def _sqlite_errors(self) -> Iterator[None]:
        """SQLite's errors (a ledger locked past the timeout, a full disk) as ours."""
        try:
            yield
        except sqlite3.Error as exc:
            raise PrivacyError(f"the privacy ledger {self.path} failed: {exc}") from exc


SHARED_LEDGERS = 64
"""Ledgers :func:`shared` keeps open in one process (a simulator's parties, a station's
ClientApp); the least recently used is closed past this."""
_shared: dict[Path, tuple[tuple[int, int, int], BudgetLedger]] = {}
_shared_lock = threading.Lock()


def shared(path: Path) -> BudgetLedger:
    """The ledger at ``path``, kept open across rounds in this process; never close it.

    Closing a WAL database checkpoints it, a second fsync of the file every round on top
    of the reservation's own: on a busy disk it cost a DP-SGD round as much as its
    training (BENCHMARKS §15a). Nothing else changes: every reservation is still its own
    ``synchronous=FULL`` transaction, and other processes (the agent writing the lifetime
    bound or the floor) are seen at the next transaction. A file replaced or removed since
    it was opened (a restore, a reset) is opened afresh: a kept connection would go on
    writing to the old file."""
    key = path.resolve()
    with _shared_lock:
        kept = _shared.pop(key, None)
        if kept is not None and kept[0] == _identity(key):
            _shared[key] = kept  # most recently used last
            return kept[1]
        if kept is not None:
            kept[1].close()
        ledger = BudgetLedger(path)
        _shared[key] = (_identity(key), ledger)
        while len(_shared) > SHARED_LEDGERS:
            _, oldest = _shared.pop(next(iter(_shared)))
            oldest.close()
        return ledger


@dataclass(frozen=True)
class Reservation:
    """A planned release held in a party's ledger (:func:`reserve_release`) until the
    computation it pays for is settled or cancelled."""

    ledger: BudgetLedger
    spec: PrivacySpec
    job: str
    server_round: int
    attempt: str

    def settle(self, release: DpRelease) -> None:
        self.ledger.settle(self.job, self.server_round, self.attempt, release)

    def cancel(self) -> None:
        self.ledger.cancel(self.job, self.server_round, self.attempt)

    def spent(self) -> tuple[float, float]:
        """The job's epsilon and the party's lifetime epsilon (at the lifetime delta)."""
        _, lifetime_delta = self.ledger.lifetime()
        accountant = self.spec.accountant
        return (
            self.ledger.spent(self.job, delta=self.spec.delta, accountant=accountant),
            self.ledger.spent(None, delta=lifetime_delta, accountant=accountant),
        )


def reserve_release(
    ledger_path: Path,
    release: DpRelease,
    *,
    spec: PrivacySpec,
    floor: PrivacyFloor | None,
    job: str,
    server_round: int,
) -> Reservation:
    """Check a planned release against the station's floor, then reserve it in the ledger.

    Every DP release a party makes (a DP-SGD round, an anomaly job's Gaussian release of
    its statistics) passes here before it computes anything: a noise below the floor's
    minimum is refused (:class:`PrivacyFloorError`), a release past the job's or the
    party's lifetime bound too (:class:`BudgetExhaustedError`), and nothing is recorded.
    Each call is its own attempt (a fresh id): a round computed again is a second release."""
    refusal = plan_refusal(floor, release)
    if refusal is not None:
        raise PrivacyFloorError(refusal)
    reservation = Reservation(shared(ledger_path), spec, job, server_round, uuid4().hex)
    reservation.ledger.reserve(
        job,
        server_round,
        release,
        attempt=reservation.attempt,
        job_epsilon=spec.epsilon,
        delta=spec.delta,
        accountant=spec.accountant,
    )
    return reservation


def _identity(path: Path) -> tuple[int, int, int]:
    """Device, inode and change time: an inode number can be reused by a new file, its
    change time then differs (a checkpoint of our own changes it too: a harmless reopen)."""
    try:
        stat = path.stat()
    except OSError:
        return (-1, -1, -1)
    return (stat.st_dev, stat.st_ino, stat.st_ctime_ns)


def _judge(
    job: str,
    release: DpRelease,
    job_history: list[DpRelease],
    history: list[DpRelease],
    bound: LifetimeBound,
    job_epsilon: float | None,
    delta: float,
    accountant: str,
) -> None:
    """Raise :class:`BudgetExhaustedError` if ``release`` takes either bound past its limit."""
    if job_epsilon is not None:
        before = _epsilon_spent(job_history, delta, accountant)
        after = _epsilon_spent([*job_history, release], delta, accountant)
        if _over(after, job_epsilon):
            raise BudgetExhaustedError(
                f"privacy budget of job {job!r} exhausted: this party spent epsilon = "
                f"{before:.4g} (delta = {delta:g}) in the job and this round would make "
                f"it {after:.4g}, above the job's epsilon = {job_epsilon:g}; it does not "
                "train again in this job (a new job, or one with a larger "
                "privacy.epsilon or fewer rounds_per_party, can use it)"
            )
    _judge_lifetime(release, history, bound, accountant, what="round")


def _judge_lifetime(
    release: DpRelease,
    history: list[DpRelease],
    bound: LifetimeBound,
    accountant: str,
    *,
    what: str,
) -> None:
    """Raise :class:`BudgetExhaustedError` if ``release`` takes the lifetime past ``bound``."""
    if bound.epsilon is None:
        return
    before = _epsilon_spent(history, bound.delta, accountant)
    after = _epsilon_spent([*history, release], bound.delta, accountant)
    if not _over(after, bound.epsilon):
        return
    if bound.from_floor and bound.floor is not None:
        fix = (
            "only the station's own operator may raise its floor (privacy_floor."
            "lifetime_epsilon in its agent.toml, or `fedge agent privacy-floor`); the "
            "manager cannot"
        )
        named = bound.floor.describe()
    else:
        fix = (
            f"an operator may raise it with `fedge edge set-privacy EDGE --epsilon "
            f"{_suggested(after, bound.epsilon)}` (more epsilon is less privacy for this "
            "station's images)"
        )
        named = "the manager's budget"
    raise BudgetExhaustedError(
        f"lifetime privacy budget exhausted: this party spent epsilon = "
        f"{before:.4g} (delta = {bound.delta:g}) over all jobs and this {what} "
        f"would make it {after:.4g}, above its lifetime epsilon = "
        f"{bound.epsilon:g} ({named}); {fix}"
    )


def _over(epsilon: float, bound: float) -> bool:
    return epsilon > bound * (1 + RELATIVE_TOLERANCE)


def _suggested(after: float, bound: float) -> str:
    """A round-up of what this round needs, for the operator's command line."""
    return f"{max(math.ceil(after * 10) / 10, bound):g}"


def _parse_floor(path: Path, text: str | None) -> PrivacyFloor | None:
    if text is None:
        return None
    try:
        table = json.loads(text)
        if not isinstance(table, dict):
            raise ValueError("not a table")
        return PrivacyFloor.from_table(table)
    except (ValueError, PrivacyError) as exc:
        # A floor the ClientApp cannot read must not read as "no floor".
        raise PrivacyError(
            f"the privacy floor in {path} is unreadable ({exc}): restart the station's "
            "agent, which writes it again from agent.toml"
        ) from exc


def _epsilon_spent(history: list[DpRelease], delta: float, accountant: str) -> float:
    """Opacus' accounting, imported when a budget is computed: the agent writes budgets
    into the ledger on its inference path, where torch and Opacus are not installed."""
    from fedge.privacy.accounting import epsilon_spent

    return epsilon_spent(history, delta, accountant)
