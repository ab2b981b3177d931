"""What the server does, over the database: register jobs, hand out trials, take epoch reports, end trials.

Every change runs in ONE transaction. One that changes the policy's state (registering a
job, starting a trial, ending one) locks the job's row
(:func:`~joules.servers.batch_size.db.lock_job`; on SQLite the transaction itself holds the
database's write lock from ``BEGIN IMMEDIATE``), then loads the policy's state, applies the
policy and writes the state back. Two such requests for the same job, in one process or in
several, therefore run one after the other, each seeing what the previous one committed. An
epoch report locks only its trial's row, and the job's too only when the report ends the
trial: reports of different trials do not wait for each other on PostgreSQL, nor do requests
for different jobs. Locks are always taken trial first, then job; expiry skips trials whose
row another transaction holds (they are active). Nothing is kept in the process between
requests except the jobs' specs and policy objects, which are pure (configuration only).

How a trial ends (the answer to each epoch report, checked in this order):

1. ``reached``: the reported metric meets the target (``>=`` when higher is better, else ``<=``);
2. ``max_epochs``: this was epoch ``max_epochs``;
3. ``early_stopped``: another epoch like this one would take the trial's cost past the stop
   cost (see :func:`stop_bound`): the trial stops *before* the epoch that would cross it, so
   a trial that cannot beat ``beta`` times the best is not trained an epoch too long.

``POST .../end`` with ``completed`` on a trial still running (no report told it to stop) ends
it as ``early_stopped`` if its cost now exceeds the stop cost (other trials may have lowered
it since its last report), else as ``max_epochs``: training ended without reaching the
target, as if ``max_epochs`` had been its last epoch. A trial with no epoch reported, or whose
cost is not finite (stored before the schema had limits), ends as ``aborted`` either way:
there is nothing to learn from it. ``aborted`` ends a running trial
as ``aborted``; ``failed`` (the batch size cannot train: out of memory, diverged) as
``failed``, which prunes the batch size whatever its epochs; the policy sees every ending
(:class:`TrialResult`). Ending a trial that has
already ended changes nothing and returns it.

Expiry: a client that dies without ending its trial would leave it ``running`` forever, and
the policy would keep its batch size in flight. A running trial whose last activity (its
creation, or its latest epoch report) is more than the job's ``stale_after_s`` ago is ended
as ``aborted``, exactly as an explicit abort ends it (the policy observes ``aborted``). This
happens in the job-locked transaction of the next request that starts a trial or reads the
job's state, before anything else (the policy's view of what is in flight matters only
then); a later report to the expired trial gets 409 (the trial has ended). A report to a
stale trial not yet expired is taken, and makes it active again.
"""

from __future__ import annotations

import json
import math
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import ColumnElement, Row, bindparam, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer

from joules.optimizers.batch_size.types import Policy, PolicyConfig, TrialOutcome, TrialResult, trial_cost
from joules.servers.batch_size.db import Database, EpochReportRow, Job, Trial, as_utc, lock_job, utcnow
from joules.servers.batch_size.schemas import (
    EpochAnswer,
    EpochReport,
    JobCreate,
    JobOut,
    JobState,
    PosteriorOut,
    TrialCreate,
    TrialEnd,
    TrialOut,
)

PolicyFactory = Callable[[PolicyConfig], Policy]


class ServiceError(Exception):
    """A request the service refuses; the message names the object or field at fault."""

    status_code = 400


class NotFoundError(ServiceError):
    """An unknown job or trial (HTTP 404)."""

    status_code = 404


class ConflictError(ServiceError):
    """A request that contradicts what the database holds (HTTP 409)."""

    status_code = 409


class InvalidError(ServiceError):
    """A request the schema accepts but the policy does not (HTTP 422).

    Attributes:
        loc: Where the problem is, as in pydantic's errors (e.g. ``("body", "batch_sizes")``).
    """

    status_code = 422

    def __init__(self, message: str, loc: tuple[str, ...] = ("body",)) -> None:
        super().__init__(message)
        self.loc = loc


def default_policy_factory(config: PolicyConfig) -> Policy:
    """``joules.optimizers.batch_size.policy.make_policy`` (imported on first use)."""
    from joules.optimizers.batch_size.policy import make_policy

    return make_policy(config)


def policy_config(spec: JobCreate) -> PolicyConfig:
    """The policy configuration of a job."""
    return PolicyConfig(
        batch_sizes=tuple(spec.batch_sizes),
        default_batch_size=spec.default_batch_size,
        eta=spec.eta,
        beta=spec.beta,
        window_size=spec.window_size,
        prior_mean=spec.prior_mean,
        prior_precision=spec.prior_precision,
        seed=spec.seed,
        max_epochs=spec.max_epochs,
        variant=spec.policy,
    )


def stop_bound(policy_stop_cost: float | None, trial_stop_cost: float | None) -> float | None:
    """The cost above which a running trial stops (``None``: none).

    The lower of the policy's current stop cost and the one the trial was given when it
    started (the policy's only goes down as trials reach the target).
    """
    bounds = [b for b in (policy_stop_cost, trial_stop_cost) if b is not None and not math.isnan(b)]
    return min(bounds) if bounds else None


def reached(spec: JobCreate, metric: float) -> bool:
    """Whether ``metric`` meets the job's target."""
    return metric >= spec.target_metric if spec.higher_is_better else metric <= spec.target_metric


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _dumps(state: dict[str, Any]) -> str:
    return json.dumps(state, separators=(",", ":"))


def _canonical(spec: JobCreate) -> str:
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


@dataclass
class ReportResult:
    """The answer to an epoch report and what it changed.

    Attributes:
        answer: What the client is told.
        repeated: The epoch had been reported before with the same values (nothing changed).
        ended: The trial, when this report ended it.
    """

    answer: EpochAnswer
    repeated: bool
    ended: TrialOut | None = None


# The statements of an epoch report, built once (see BatchSizeService.report).
_LOCK_TRIAL = (
    select(Trial.status, Trial.outcome, Trial.epochs, Trial.time_s, Trial.energy_j, Trial.stop_cost,
           Job.stop_cost.label("job_stop_cost"))
    .join(Job, Trial.job_id == Job.id)
    .where(Job.id == bindparam("job_id"), Trial.id == bindparam("trial_id"))
    .with_for_update(of=Trial.__table__)
)
_JOB_SPEC = select(Job.spec).where(Job.id == bindparam("job_id"))
_EPOCH_ROW = (
    select(EpochReportRow.time_s, EpochReportRow.energy_j, EpochReportRow.metric, EpochReportRow.stop,
           EpochReportRow.reason, EpochReportRow.cost, EpochReportRow.stop_cost)
    .where(EpochReportRow.trial_id == bindparam("trial_id"), EpochReportRow.epoch == bindparam("epoch"))
)
_UPDATE_TRIAL = (
    update(Trial.__table__).where(Trial.__table__.c.id == bindparam("trial_id"))
    .values(last_activity_at=bindparam("last_activity_at"), epochs=bindparam("epochs"),
            time_s=bindparam("time_s"), energy_j=bindparam("energy_j"), cost=bindparam("cost"))
)
_INSERT_EPOCH = insert(EpochReportRow.__table__)


class BatchSizeService:
    """The server's logic (no HTTP): every method is one database transaction.

    Args:
        db: The database (already migrated).
        policy_factory: Makes a job's policy from its configuration (default: the joules
            policy, :func:`default_policy_factory`).
        clock: Now, as an aware UTC datetime (default :func:`~joules.servers.batch_size.db.utcnow`;
            tests may inject another).

    Attributes:
        on_expired: Called (outside any transaction) with the number of trials just ended by
            expiry, when there were any (the app counts them in its metrics).
    """

    def __init__(self, db: Database, policy_factory: PolicyFactory | None = None,
                 clock: Callable[[], datetime] | None = None) -> None:
        self.db = db
        self.policy_factory = policy_factory or default_policy_factory
        self.clock = clock or utcnow
        self.on_expired: Callable[[int], None] | None = None
        # Per job id, its spec and policy: a job's spec never changes once registered, so it is
        # validated, and its policy made, once per process, not on every request.
        self._jobs: dict[str, tuple[JobCreate, Policy]] = {}
        self._jobs_lock = threading.Lock()  # guards the cache only, never held across a transaction

    # -- helpers -------------------------------------------------------------------------------

    def _policy(self, spec: JobCreate) -> Policy:
        """A policy object (pure) for a job spec."""
        try:
            return self.policy_factory(policy_config(spec))
        except (ValueError, TypeError) as e:
            raise InvalidError(f"policy {spec.policy!r} rejects this job: {e}") from e

    def _job(self, job: Job) -> tuple[JobCreate, Policy]:
        """The job's spec and policy, validated and made once per process."""
        return self._job_by_id(job.id, lambda: job.spec)

    def _job_by_id(self, job_id: str, load_spec: Callable[[], dict[str, Any]]) -> tuple[JobCreate, Policy]:
        """The spec and policy of job ``job_id``; ``load_spec`` gives its stored spec on a cache miss."""
        cached = self._jobs.get(job_id)
        if cached is None:
            try:
                spec = JobCreate.model_validate(load_spec())
            except ValidationError as e:  # registered before a limit of the schema existed
                raise ConflictError(f"job {job_id!r} was registered with a spec this server no longer "
                                    f"accepts ({_fields(e)}); register it again under a new name") from e
            cached = (spec, self._policy(spec))
            with self._jobs_lock:
                if len(self._jobs) > 4096:
                    self._jobs.clear()
                self._jobs[job_id] = cached
        return cached

    def _spec(self, job: Job) -> JobCreate:
        return self._job(job)[0]

    @staticmethod
    def _job_out(job: Job) -> JobOut:
        return JobOut.model_validate({**job.spec, "job_id": job.id, "created_at": as_utc(job.created_at)})

    @staticmethod
    def trial_out(trial: Trial) -> TrialOut:
        """The API view of a trial row."""
        return TrialOut(
            trial_id=trial.id, job_id=trial.job_id, batch_size=trial.batch_size, phase=trial.phase,  # type: ignore[arg-type]
            stop_cost=_finite(trial.stop_cost), status=trial.status,  # type: ignore[arg-type]
            outcome=trial.outcome, epochs=trial.epochs, time_s=trial.time_s,  # type: ignore[arg-type]
            energy_j=trial.energy_j, cost=trial.cost, created_at=as_utc(trial.created_at),  # type: ignore[arg-type]
            ended_at=as_utc(trial.ended_at),
        )

    @staticmethod
    def _get_job(session: Session, job_id: str) -> Job:
        job = session.get(Job, job_id)
        if job is None:
            raise NotFoundError(f"job {job_id!r} not found")
        return job

    def _state_rows(self, session: Session, job: Job) -> tuple[JobOut, dict[str, Any], Sequence[Row[Any]]]:
        """The job's API view, its policy state, and its trial counts by status and outcome."""
        rows = session.execute(select(Trial.status, Trial.outcome, func.count())
                               .where(Trial.job_id == job.id).group_by(Trial.status, Trial.outcome)).all()
        return self._job_out(job), json.loads(job.policy_state), rows

    @staticmethod
    def _locked_job(session: Session, job_id: str) -> Job:
        job = lock_job(session, job_id)
        if job is None:
            raise NotFoundError(f"job {job_id!r} not found")
        return job

    @staticmethod
    def _job_and_locked_trial(session: Session, job_id: str, trial_id: str) -> tuple[Job, Trial]:
        """The job (read; its policy state loaded on first use) and its trial, whose row is locked."""
        row = session.execute(
            select(Job, Trial).join(Trial, Trial.job_id == Job.id)
            .where(Job.id == job_id, Trial.id == trial_id)
            .options(defer(Job.policy_state)).with_for_update(of=Trial)
        ).first()
        if row is None:
            raise BatchSizeService._missing_trial(session, job_id, trial_id)
        return row[0], row[1]

    @staticmethod
    def _missing_trial(session: Session, job_id: str, trial_id: str) -> NotFoundError:
        """The error for a trial not found in job ``job_id`` (raises the job's own if the job is missing)."""
        BatchSizeService._get_job(session, job_id)
        return NotFoundError(f"trial {trial_id!r} of job {job_id!r} not found")

    @staticmethod
    def _trial(session: Session, job_id: str, trial_id: str) -> Trial:
        trial = session.get(Trial, trial_id)
        if trial is None or trial.job_id != job_id:
            raise NotFoundError(f"trial {trial_id!r} of job {job_id!r} not found")
        return trial

    def _end(self, job: Job, spec: JobCreate, trial: Trial, outcome: TrialOutcome) -> None:
        """End a running trial and let the policy learn from it (the job row is locked)."""
        trial.status = "ended"
        trial.outcome = outcome.value
        trial.ended_at = self.clock()
        policy = self._job(job)[1]
        state = policy.observe(json.loads(job.policy_state), TrialResult(
            batch_size=trial.batch_size, outcome=outcome, cost=trial.cost, time_s=trial.time_s,
            energy_j=trial.energy_j, epochs=trial.epochs))
        self._save_state(job, policy, state)
        job.updated_at = trial.ended_at

    def _stale(self, job: Job, spec: JobCreate) -> tuple[ColumnElement[bool], ...]:
        """The WHERE clause of the job's running trials idle for over ``stale_after_s``."""
        cutoff = self.clock() - timedelta(seconds=spec.stale_after_s)
        return Trial.job_id == job.id, Trial.status == "running", Trial.last_activity_at < cutoff

    def _expire_stale(self, session: Session, job: Job, spec: JobCreate) -> int:
        """End as ``aborted`` the job's running trials idle for over ``stale_after_s`` (job row locked).

        Returns:
            How many trials were ended.
        """
        # A trial whose row another transaction holds is being reported or ended: not stale.
        query = (select(Trial).where(*self._stale(job, spec)).order_by(Trial.seq)
                 .with_for_update(skip_locked=True))
        stale = session.execute(query).scalars().all()
        for trial in stale:
            self._end(job, spec, trial, TrialOutcome.ABORTED)
        if stale:
            session.flush()
        return len(stale)

    def _expired(self, n: int) -> None:
        if n and self.on_expired is not None:
            self.on_expired(n)

    def _has_stale(self, session: Session, job: Job, spec: JobCreate) -> bool:
        """Whether the job has a running trial to expire (a read: no lock needed)."""
        return session.execute(select(Trial.id).where(*self._stale(job, spec)).limit(1)).first() is not None

    @staticmethod
    def _save_state(job: Job, policy: Policy, state: dict[str, Any]) -> None:
        """Write the policy's state, and its stop cost (kept so that reports need not load the state)."""
        job.policy_state = _dumps(state)
        job.stop_cost = _finite(policy.stop_cost(state))

    # -- operations ----------------------------------------------------------------------------

    def register(self, spec: JobCreate) -> tuple[JobOut, bool]:
        """Register a job, or find the one registered under its name.

        Returns:
            The job, and whether it was created now.

        Raises:
            ConflictError: The name is taken by a job with another spec.
            InvalidError: The policy does not accept the spec.
        """
        policy = self._policy(spec)
        canonical = _canonical(spec)
        for attempt in range(3):
            try:
                with self.db.transaction() as s:
                    job = s.execute(select(Job).where(Job.name == spec.name)).scalar_one_or_none()
                    if job is not None:
                        existing = self._spec(job)
                        if _canonical(existing) != canonical:
                            raise ConflictError(_spec_difference(spec.name, existing, spec))
                        return self._job_out(job), False
                    now = self.clock()
                    job = Job(id=uuid.uuid4().hex, name=spec.name, spec=spec.model_dump(mode="json"),
                              policy=spec.policy, trials_started=0, created_at=now, updated_at=now)
                    self._save_state(job, policy, policy.initial_state())
                    s.add(job)
                    s.flush()
                    return self._job_out(job), True
            except IntegrityError:  # PostgreSQL: registered concurrently under the same name
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def job_state(self, job_id: str) -> JobState:
        """A job, its policy's summary and its trial counts.

        Stale running trials are expired first (see the module's docstring).

        Raises:
            NotFoundError: Unknown job.
        """
        with self.db.transaction(write=False) as s:
            job = self._get_job(s, job_id)
            spec, policy = self._job(job)
            stale = self._has_stale(s, job, spec)
            if not stale:  # the usual case: one read
                job_out, state, rows = self._state_rows(s, job)
        if stale:  # only then take the job's lock, to expire them, and read again
            with self.db.transaction() as s:
                n = self._expire_stale(s, self._locked_job(s, job_id), spec)
            self._expired(n)
            with self.db.transaction(write=False) as s:
                job_out, state, rows = self._state_rows(s, self._get_job(s, job_id))
        counts = {"running": 0, "ended": 0}
        for status, outcome, n in rows:
            counts[status] = counts.get(status, 0) + n
            if outcome is not None:
                counts[outcome] = counts.get(outcome, 0) + n
        summary = policy.summary(state)
        posterior = {}
        for bs, p in summary.posterior.items():
            mean, std = _finite(p.get("mean")), _finite(p.get("std"))
            if mean is None or std is None:
                continue  # no finite estimate yet: left out
            posterior[int(bs)] = PosteriorOut(mean=mean, std=std, n=int(p.get("n", 0)))
        return JobState(
            job=job_out, phase=summary.phase, explored={int(k): v for k, v in summary.explored.items()},
            surviving=list(summary.surviving), posterior=posterior, best_batch_size=summary.best_batch_size,
            best_cost=_finite(summary.best_cost), trials=counts,
        )

    def trials(self, job_id: str, offset: int = 0, limit: int | None = None) -> list[TrialOut]:
        """The job's trials, oldest first.

        Args:
            job_id: The job.
            offset: How many of the oldest trials to skip.
            limit: At most this many trials (``None``: all the rest).

        Raises:
            NotFoundError: Unknown job.
        """
        with self.db.transaction(write=False) as s:
            self._get_job(s, job_id)
            query = select(Trial).where(Trial.job_id == job_id).order_by(Trial.seq).offset(offset)
            if limit is not None:
                query = query.limit(limit)
            rows = s.execute(query).scalars().all()
            return [self.trial_out(t) for t in rows]

    def trial(self, job_id: str, trial_id: str) -> TrialOut:
        """One trial.

        Raises:
            NotFoundError: Unknown job or trial.
        """
        with self.db.transaction(write=False) as s:
            return self.trial_out(self._trial(s, job_id, trial_id))

    def start_trial(self, job_id: str, request: TrialCreate) -> tuple[TrialOut, bool]:
        """Ask the policy for the batch size of a new trial.

        Returns:
            The trial, and whether it was created now (``False``: the trial that an earlier
            request with the same ``request_id`` created).

        Raises:
            NotFoundError: Unknown job.
        """
        with self.db.transaction() as s:
            job = self._locked_job(s, job_id)
            if request.request_id is not None:
                earlier = s.execute(select(Trial).where(
                    Trial.job_id == job_id, Trial.request_id == request.request_id)).scalar_one_or_none()
                if earlier is not None:
                    return self.trial_out(earlier), False
            spec, policy = self._job(job)
            expired = self._expire_stale(s, job, spec)
            state, decision = policy.next_trial(json.loads(job.policy_state))
            now = self.clock()
            job.trials_started += 1
            trial = Trial(id=uuid.uuid4().hex, job_id=job.id, seq=job.trials_started,
                          batch_size=int(decision.batch_size), phase=decision.phase,
                          stop_cost=_finite(decision.stop_cost), status="running", outcome=None, epochs=0,
                          time_s=0.0, energy_j=0.0, cost=0.0, client=request.client,
                          request_id=request.request_id, created_at=now, last_activity_at=now)
            s.add(trial)
            self._save_state(job, policy, state)
            job.updated_at = now
            s.flush()
            out = self.trial_out(trial)
        self._expired(expired)
        return out, True

    def report(self, job_id: str, trial_id: str, report: EpochReport) -> ReportResult:
        """Take one epoch's report and say whether the trial should stop.

        The most frequent request, so it runs as plain SQL statements rather than through the
        ORM's unit of work: lock the trial's row and read what the answer needs, update the
        trial's totals, insert the epoch. Only a report that ends the trial loads the trial
        and the job (locked) as objects, for the policy to learn.

        Raises:
            NotFoundError: Unknown job or trial.
            ConflictError: The epoch was reported before with other values; the trial has
                ended; or the epoch is not the next one.
            InvalidError: The trial's cost would not be finite (possible only for a trial
                whose totals were stored before the schema's limits existed).
        """
        with self.db.transaction() as s:
            conn = s.connection()
            ids = {"job_id": job_id, "trial_id": trial_id}
            trial = conn.execute(_LOCK_TRIAL, ids).first()
            if trial is None:
                raise self._missing_trial(s, job_id, trial_id)
            if report.epoch <= trial.epochs:  # epochs 1..trial.epochs have their rows: a repeat
                row = conn.execute(_EPOCH_ROW, {"trial_id": trial_id, "epoch": report.epoch}).one()
                if (row.time_s, row.energy_j, row.metric) != (report.time_s, report.energy_j, report.metric):
                    raise ConflictError(
                        f"epoch {report.epoch} of trial {trial_id!r} was already reported with other values "
                        f"(time_s={row.time_s!r}, energy_j={row.energy_j!r}, metric={row.metric!r})")
                return ReportResult(EpochAnswer(stop=row.stop, reason=row.reason, cost=row.cost,
                                                stop_cost=_finite(row.stop_cost)), repeated=True)
            spec = self._job_by_id(job_id, lambda: conn.execute(_JOB_SPEC, ids).scalar_one())[0]
            if trial.status != "running":
                raise ConflictError(f"trial {trial_id!r} has ended ({trial.outcome}): "
                                    f"epoch {report.epoch} cannot be reported")
            if report.epoch != trial.epochs + 1:
                raise ConflictError(f"epoch {report.epoch} of trial {trial_id!r} is out of order: "
                                    f"the next epoch is {trial.epochs + 1}")
            now = self.clock()
            time_s = trial.time_s + report.time_s
            energy_j = trial.energy_j + report.energy_j
            cost = trial_cost(spec.eta, spec.max_power_w, energy_j, time_s)
            if not math.isfinite(cost):  # finite within the schema's limits, but a trial stored before them
                field = "energy_j" if math.isfinite(spec.max_power_w * time_s) else "time_s"
                raise InvalidError(f"{field}: the trial's cost would not be finite "
                                   f"(in all: time_s={time_s!r}, energy_j={energy_j!r})", loc=("body", field))
            bound = stop_bound(trial.job_stop_cost, trial.stop_cost)
            outcome: TrialOutcome | None = None
            if reached(spec, report.metric):
                outcome = TrialOutcome.REACHED
            elif report.epoch >= spec.max_epochs:
                outcome = TrialOutcome.MAX_EPOCHS
            elif bound is not None and cost + trial_cost(
                    spec.eta, spec.max_power_w, report.energy_j, report.time_s) > bound:
                outcome = TrialOutcome.EARLY_STOPPED
            answer = EpochAnswer(stop=outcome is not None, reason=outcome.value if outcome else None,  # type: ignore[arg-type]
                                 cost=cost, stop_cost=_finite(bound))
            conn.execute(_UPDATE_TRIAL, {"trial_id": trial_id, "last_activity_at": now,
                                         "epochs": report.epoch, "time_s": time_s, "energy_j": energy_j,
                                         "cost": cost})
            conn.execute(_INSERT_EPOCH, {
                "trial_id": trial_id, "epoch": report.epoch, "time_s": report.time_s,
                "energy_j": report.energy_j, "metric": report.metric, "stop": answer.stop,
                "reason": answer.reason, "cost": answer.cost, "stop_cost": answer.stop_cost,
                "created_at": now})
            ended = None
            if outcome is not None:  # the policy learns: now the job's row is locked too
                trial_row = s.get_one(Trial, trial_id)  # read after the update above
                self._end(self._locked_job(s, job_id), spec, trial_row, outcome)
                s.flush()
                ended = self.trial_out(trial_row)
        return ReportResult(answer, repeated=False, ended=ended)

    def end_trial(self, job_id: str, trial_id: str, request: TrialEnd) -> tuple[TrialOut, bool]:
        """End a trial (see the module's docstring for the outcome).

        Returns:
            The trial, and whether this call ended it.

        Raises:
            NotFoundError: Unknown job or trial.
        """
        with self.db.transaction() as s:
            job, trial = self._job_and_locked_trial(s, job_id, trial_id)
            if trial.status != "running":
                return self.trial_out(trial), False
            job = self._locked_job(s, job_id)
            spec = self._spec(job)
            if request.status == "failed":
                outcome = TrialOutcome.FAILED
            elif request.status == "aborted" or trial.epochs == 0 or not math.isfinite(trial.cost):
                # A cost that is not finite (stored before the schema's limits) teaches nothing.
                outcome = TrialOutcome.ABORTED
            else:
                bound = stop_bound(job.stop_cost, trial.stop_cost)
                over = bound is not None and trial.cost > bound
                outcome = TrialOutcome.EARLY_STOPPED if over else TrialOutcome.MAX_EPOCHS
            self._end(job, spec, trial, outcome)
            s.flush()
            return self.trial_out(trial), True


def _fields(error: ValidationError) -> str:
    """The fields a validation error names, e.g. ``"stale_after_s, batch_sizes.1"``."""
    return ", ".join(".".join(str(x) for x in e["loc"]) for e in error.errors())


def _spec_difference(name: str, old: JobCreate, new: JobCreate) -> str:
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    # (as _canonical compares specs: key order aside, 1 and 1.0 or true and 1 differ)
    fields = [k for k in a if json.dumps(a[k], sort_keys=True) != json.dumps(b.get(k), sort_keys=True)]
    return (f"job {name!r} is already registered with another spec (differs in: {', '.join(fields)}); "
            "register under a new name")
