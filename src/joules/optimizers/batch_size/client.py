"""The batch-size optimizer client: a recurring job asks the server for its batch size.

Each run of a recurring training job is a *trial*. The client registers the job, gets the
trial's batch size from the server, measures every epoch's time and GPU energy with an
:class:`~joules.monitoring.monitor.EnergyMonitor`, reports each epoch with its validation
metric, and learns from the server's answer whether to stop::

    monitor = EnergyMonitor()
    job = {"name": "resnet50-imagenet", "batch_sizes": [64, 128, 256, 512],
           "default_batch_size": 256, "target_metric": 0.75, "max_epochs": 90}
    with BatchSizeOptimizer(monitor, "http://bso.internal:7787", job) as bso:
        loader = make_loader(batch_size=bso.get_batch_size())
        bso.on_train_begin()
        for epoch in range(90):
            bso.on_epoch_begin()
            for batch in loader:
                bso.on_step_begin()
                train_step(batch)
                bso.on_step_end()
            bso.on_epoch_end()
            if bso.on_evaluate(evaluate()):
                break
        bso.on_train_end()

Inside each trial, a :class:`~joules.optimizers.power_limit.PowerLimitOptimizer` (on by
default) finds the GPU power limit for that batch size during the first epochs; its profile
is saved per job and batch size, so a later trial with the same batch size skips profiling.
The profiling is part of the trial, so its time and energy are part of the trial's cost.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import random
import signal
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ValidationError

from joules.devices.restore import RestoreGuard, restore_busy
from joules.errors import JoulesError, NotSupportedError
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer
from joules.servers.batch_size.schemas import (
    EpochAnswer,
    EpochReport,
    JobCreate,
    JobOut,
    TrialCreate,
    TrialEnd,
    TrialOut,
    token_problem,
)
from joules.servers.batch_size.settings import TOKEN_ENV

log = logging.getLogger("joules.batch_size")
_MAX_TIMEOUT_S = 86400.0  # a day
_END_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
# The clients whose trial trains (each in the process that started it), and the handlers
# _on_end_signal took over.
_TRAINING: weakref.WeakSet[BatchSizeOptimizer] = weakref.WeakSet()
_PREVIOUS: dict[int, Any] = {}
_PASSED: dict[int, Any] = {}  # the frame each signal was passed on with, while a program's handler runs
_DEPTH: dict[int, int] = {}  # how deep in the program's handlers each signal is
_MAX_DEPTH = 3  # (a handler that passes the signal back with a frame of its own ends the chain here)
_END_AT_EXIT_S = 2.0  # what ending the trials may add to the process's end, s
_QUIET_LOGGERS = ("httpx", "httpcore")  # (their records could wait on a lock the interrupted thread holds)


def _install_end_signal_handlers() -> None:
    """Install :func:`_on_end_signal` for SIGTERM and SIGHUP (main thread only), as each trial starts.

    Where the handler is the default: first, and again where a program set the default back
    (Lightning does at the end of ``fit``). Once installed it stays, passing the signal on while
    no trial trains: taking it out would break the chain of handlers installed on top of it
    since (a restore guard's), which would call it anyway. Where a program installed a handler
    of its own over it, it is left alone: that handler may pass the signal on to it.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in _END_SIGNALS:
        try:
            previous = signal.getsignal(signum)
            if previous is _on_end_signal or previous == signal.SIG_IGN:
                continue  # (installed already; under nohup a hang-up ends nothing)
            if signum in _PREVIOUS and previous not in (signal.SIG_DFL, None):
                continue  # (a handler over it, which may pass the signal on to it)
            signal.signal(signum, _on_end_signal)
        except (ValueError, OSError):
            continue
        _PREVIOUS[signum] = previous


def _guards_on_the_way(handler: Any, signum: int) -> tuple[list[RestoreGuard], bool]:
    """The restore guards ``handler`` passes the signal through, and whether it then ends the process.

    The default ends it; a restore guard's handler puts the GPUs back and passes the signal on,
    so it ends it where what it passes it on to does. A program's own handler decides for
    itself: not known.
    """
    guards: list[RestoreGuard] = []
    for _ in range(16):
        if handler in (signal.SIG_DFL, None):
            return guards, True
        owner = getattr(handler, "__self__", None)
        if not (isinstance(owner, RestoreGuard) and handler.__name__ == "_handle_signal"):
            return guards, False
        guards.append(owner)
        handler = owner._prev_handlers.get(signum, signal.SIG_DFL)
    return guards, False


def _on_end_signal(signum: int, frame: Any) -> None:
    """End this process's training trials as aborted where the signal ends the process, and pass it on.

    Where the handler it took over ends the process (the default, or a restore guard's that
    passes it on to the default), the GPUs are put back first (the trials' power-limit
    searches and those guards: a stop with a short grace period kills the process soon), then
    the trials are ended (:func:`_end_trials`). A program's own handler is called instead, and
    decides (an exception out of the ``with`` block aborts the trial as usual). Should that
    handler pass the signal back here (it wraps this handler: it is installed over it, or is
    called with the frame it was given, or none), the chain ends here, as the default. While a
    restore guard's operation is under way in this thread (it holds the journal directory's
    lock), the signal is handled once it is over. A forked child's copies of its parent's
    clients are not its own.
    """
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if previous == signal.SIG_IGN:
        return
    depth = _DEPTH.get(signum, 0)
    passed_back = (
        (callable(previous) and signal.getsignal(signum) is previous)  # called by it, on top of this one
        or (depth > 0 and (frame is None or _PASSED.get(signum) is frame))
        or depth >= _MAX_DEPTH
    )
    if passed_back:  # the end of the chain
        previous = signal.SIG_DFL
    guards, ends = _guards_on_the_way(previous, signum)
    if callable(previous) and not ends:  # (a second signal meanwhile comes here with another frame)
        outer = _PASSED.get(signum)
        _PASSED[signum], _DEPTH[signum] = frame, depth + 1
        try:
            previous(signum, frame)
        finally:
            _PASSED[signum], _DEPTH[signum] = outer, depth
        return
    mine = [c for c in list(_TRAINING) if c._trial_pid == os.getpid()]
    if mine and restore_busy():  # (putting the GPUs back now would wait on this thread's own lock)
        threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()  # again, once it is over
        return
    if mine:
        for restorer in [*(c.power_limit_optimizer for c in mine if c.power_limit_optimizer), *guards]:
            with contextlib.suppress(Exception):
                restorer.restore()
        _end_trials(signum, mine)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _end_trials(signum: int, clients: list[BatchSizeOptimizer]) -> None:
    """End ``clients``' trials as aborted before the process ends of ``signum``.

    One request each, all at once on threads of their own, given 2 s in all (a server that
    does not answer delays the end no longer); meanwhile SIGINT, SIGTERM and SIGHUP are taken
    by a handler that does nothing (a second SIGTERM or a Ctrl-C cut the requests short; the
    process is ending anyway), and the HTTP libraries' loggers are quiet.
    """
    previous_handlers = {}
    for other in (signal.SIGINT, *_END_SIGNALS):
        with contextlib.suppress(ValueError, OSError, TypeError):
            previous_handlers[other] = signal.signal(other, _ignore)
    names = [n for n in list(logging.root.manager.loggerDict) if n.split(".")[0] in _QUIET_LOGGERS]
    quiet = [(logger, logger.disabled) for logger in map(logging.getLogger, {*_QUIET_LOGGERS, *names})]
    for logger, _ in quiet:
        logger.disabled = True
    errors: list[str] = []
    try:
        workers = [threading.Thread(target=c._end_at_exit, args=(errors,), daemon=True, name="joules-bso-end")
                   for c in clients]
        for w in workers:
            w.start()
        deadline = time.monotonic() + _END_AT_EXIT_S
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
        late = sum(w.is_alive() for w in workers)
    finally:
        for logger, disabled in quiet:
            logger.disabled = disabled
        for other, handler in previous_handlers.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(other, handler if handler is not None else signal.SIG_DFL)
    if late:
        errors.append(f"{late} trial(s) not ended within {_END_AT_EXIT_S:g} s (they expire after the "
                      "job's stale_after_s)")
    for e in errors:
        log.warning("could not end the trial as signal %d ends the process: %s", signum, e)


def _ignore(_signum: int, _frame: Any) -> None:
    """A signal that comes while the trials are ended: the process is ending anyway."""


_WINDOW = "joules.batch_size"
# Retried: a request timeout (a proxy's), too early, too many requests, and server errors but
# 501 (not implemented).
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504}) | frozenset(range(505, 600))
_MAX_RETRY_AFTER_S = 60.0
_MAX_BACKOFF_S = 30.0  # the longest wait between retries (before jitter)
M = TypeVar("M", bound=BaseModel)


def _known_fields(model: type[BaseModel], answer: object) -> object:
    """``answer`` less the fields ``model`` does not know.

    The server's models refuse unknown fields in requests (a misspelt field is a 422). An
    answer is read leniently, so that a server upgraded before its clients, which answers
    with fields added since, is still understood.
    """
    if not isinstance(answer, dict):
        return answer
    return {k: v for k, v in answer.items() if k in model.model_fields}

_STOP_REASONS = {
    "reached": "the target metric was reached",
    "max_epochs": "max_epochs passed without reaching the target metric",
    "early_stopped": "the trial's cost exceeded the early-stop bound (beta times the best cost)",
}


class ServerError(JoulesError):
    """The batch-size server could not be reached, or answered with an error.

    Attributes:
        status_code: The HTTP status of the last answer (``None``: no answer, e.g. a
            connection error or a timeout).
        detail: The server's ``detail``, when it gave one.
    """

    def __init__(self, message: str, status_code: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail


@dataclass(frozen=True)
class EpochRecord:
    """One reported epoch and the server's answer.

    Attributes:
        report: What was reported (epoch number, time, energy, metric).
        answer: Whether to stop, why, and the trial's cost so far.
    """

    report: EpochReport
    answer: EpochAnswer


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise JoulesError(
            f"server_url must be an http(s) URL like http://host:7787, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise JoulesError(f"server_url {url!r} has an invalid port") from None
    if parts.query or parts.fragment:
        raise JoulesError(f"server_url {url!r} must not have a query or fragment")
    return url.rstrip("/")


def _detail(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or None
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        if isinstance(detail, list) and all(isinstance(d, dict) and "msg" in d for d in detail):
            # A validation error (422): "body.batch_sizes: Value error, ..." for each problem.
            return "; ".join(f"{'.'.join(str(x) for x in d.get('loc', []))}: {d['msg']}" for d in detail)
        return detail
    return body


def _default_max_power_w(monitor: EnergyMonitor) -> float:
    if not monitor.gpus:
        raise JoulesError("the job has no max_power_w and the monitor measures no GPU: give max_power_w")
    try:
        return float(sum(g.power_limit_range_w()[1] for g in monitor.gpus))
    except NotSupportedError as e:
        raise JoulesError(f"the job has no max_power_w and the GPUs do not tell their maximum power ({e}): "
                          "give max_power_w") from None


class BatchSizeOptimizer:
    """Gets a recurring job's batch size from the batch-size server and reports each epoch.

    Args:
        monitor: Measures each epoch's time and GPU energy (all of its GPUs are the job's).
        server_url: The server, e.g. ``"http://bso.internal:7787"``.
        job: The job's spec: a :class:`~joules.servers.batch_size.schemas.JobCreate` or a dict
            of its fields. A dict without ``max_power_w`` gets the sum of the monitor's GPUs'
            highest power limits.
        token: Bearer token for the server (default: ``$JOULES_SERVER_TOKEN``, if set).
        timeout_s: Timeout of each request (connect, read, write), s (at most a day).
        retries: Retries of a request that failed with a connection error, a timeout, a 5xx
            other than 501 (not implemented), or a 408, 425 or 429 answer (no other 4xx is
            retried).
        backoff_s: Wait before the first retry; it doubles with every retry up to 30 s (plus
            up to 10% jitter). A retried answer's ``Retry-After`` is honored up to 60 s.
        power_limit: Optimize the GPU power limit within each trial: ``True`` (default), a
            dict of :class:`~joules.optimizers.power_limit.PowerLimitOptimizer` arguments
            (``selector``, ``warmup_steps``, ``handle_signals``...), or ``False``. By default
            the selector is ``cost:ETA`` with the job's ``eta``, the saved profile is keyed
            ``"{job name}/bs{batch size}"``, and ``distributed=False`` (one client per job: it
            controls the GPUs its monitor measures). With ``True``, a process that may not change power
            limits (or a monitor without GPUs) gets a warning and trains at the current
            limits; with a dict, it gets the error.
        client_name: Free text the server records with each trial (default: ``host:pid``).
        transport: An ``httpx`` transport (tests use ``httpx.MockTransport``).

    Raises:
        JoulesError: A malformed ``server_url``.
        pydantic.ValidationError: A ``job`` that does not fit the schema (the message names
            the field).
    """

    def __init__(
        self,
        monitor: EnergyMonitor,
        server_url: str,
        job: JobCreate | Mapping[str, Any],
        *,
        token: str | None = None,
        timeout_s: float = 10.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        power_limit: bool | Mapping[str, Any] = True,
        client_name: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not 0 < timeout_s <= _MAX_TIMEOUT_S:  # (an infinite one overflows the socket's)
            raise ValueError(f"timeout_s must be > 0 and at most {_MAX_TIMEOUT_S:g} s, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if not backoff_s >= 0:  # NaN too
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        if not isinstance(power_limit, bool | Mapping):
            raise ValueError(f"power_limit must be True, False or a dict, got {power_limit!r}")
        if isinstance(power_limit, Mapping):
            allowed = set(inspect.signature(PowerLimitOptimizer).parameters) - {"monitor"}
            unknown = sorted(set(power_limit) - allowed)
            if unknown:
                raise ValueError(f"power_limit has unknown PowerLimitOptimizer argument(s) {unknown} "
                                 f"(known: {', '.join(sorted(allowed))})")
        self.monitor = monitor
        self.server_url = _check_url(server_url)
        if isinstance(job, Mapping):
            spec = dict(job)
            if "max_power_w" not in spec:
                spec["max_power_w"] = _default_max_power_w(monitor)
            job = JobCreate.model_validate(spec)
        elif not isinstance(job, JobCreate):
            raise ValueError(f"job must be a JobCreate or a dict, got {type(job).__name__}")
        self.spec: JobCreate = job
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.timeout_s = float(timeout_s)
        self.client_name = client_name if client_name is not None else f"{socket.gethostname()}:{os.getpid()}"
        self._power_limit = power_limit
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        headers = {"Accept": "application/json", "User-Agent": "joules-batch-size-client"}
        if token:
            if (problem := token_problem(token)) is not None:
                raise ValueError(f"token (or ${TOKEN_ENV}) {problem}")
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.server_url, headers=headers, timeout=self.timeout_s,
                                  transport=transport)
        self._transport = transport
        self._trial_pid = 0  # the process whose trial this client trains (a forked child is not it)
        self._sleep: Callable[[float], None] = time.sleep

        self.job: JobOut | None = None
        """The registered job (after :meth:`get_batch_size`)."""
        self.trial: TrialOut | None = None
        """The current trial (after :meth:`get_batch_size`); updated when it ends."""
        self.epochs: list[EpochRecord] = []
        """The current trial's reported epochs and the server's answers."""
        self.stop_reason: str | None = None
        """Why the server said to stop (``"reached"``, ``"max_epochs"``, ``"early_stopped"``)."""
        self.power_limit_optimizer: PowerLimitOptimizer | None = None
        """The current trial's power-limit optimizer (``None`` when disabled)."""
        self._began = False
        self._ended = False  # training of the current trial is over (its end may not be sent yet)
        self._window_open = False
        # Epochs measured but not yet taken by the server (a report that failed), oldest first:
        # each is sent again, with the same body, before anything else about the trial.
        self._unsent: list[EpochReport] = []
        # The status of an end request that failed: the next end (or new trial) sends it again.
        self._end_pending: Literal["completed", "aborted", "failed"] | None = None
        # The request id of a trial creation that failed (the server may have made the trial):
        # the next get_batch_size() sends it again, and gets that trial back if it was made.
        self._create_pending: str | None = None

    # -- public state ---------------------------------------------------------------------
    @property
    def batch_size(self) -> int | None:
        """The current trial's batch size (``None`` before :meth:`get_batch_size`)."""
        return self.trial.batch_size if self.trial is not None else None

    @property
    def epoch(self) -> int:
        """Epochs reported in the current trial."""
        return len(self.epochs)

    # -- the trial ------------------------------------------------------------------------
    def get_batch_size(self) -> int:
        """The batch size to train with: registers the job and starts a trial (once per trial).

        Calling it again returns the same batch size until the trial ends; after
        :meth:`on_train_end` or :meth:`abort`, it starts a new trial (ending the previous one
        first if telling the server failed then).

        If creating the trial fails after every retry for a reason that may pass (no answer,
        5xx, 429), the next call asks again with the same request id: the server hands back
        the trial it made for the lost request, if it made one, rather than a second trial.
        A trial handed back that has ended since (it expired) is replaced by a new one.

        Raises:
            ServerError: The server could not be reached, refused the token, or has a job of
                this name with a different spec (the message lists the fields that differ).
        """
        if self.trial is not None and not self._ended:
            return self.trial.batch_size
        if self._end_pending is not None:
            self._send_end()
        if self.job is None:
            self.job = self._register()
        trial = self._create_trial()
        if trial.status != "running":
            log.warning("trial %s, made for a request whose answer was lost, has ended since (%s): "
                        "starting another", trial.trial_id, trial.outcome)
            trial = self._create_trial()
        self._use(trial)
        self._ended = False
        self._watch_signals()  # (a signal before training begins ends the trial too)
        log.info("job %r trial %s: batch size %d (%s%s)", self.spec.name, trial.trial_id, trial.batch_size,
                 trial.phase, "" if trial.stop_cost is None else f", stop cost {trial.stop_cost:.4g}")
        return trial.batch_size

    def on_train_begin(self) -> None:
        """Training starts: the first epoch is measured from here, and the power-limit search starts.

        The first step or epoch callback calls it if it was not called.

        Raises:
            JoulesError: No trial: :meth:`get_batch_size` was not called (or the trial ended).
            DevicePermissionError: With a ``power_limit`` dict, the power limits cannot be
                changed (the trial is ended as aborted).
        """
        if self._began:
            return
        if self.trial is None or self._ended:
            raise JoulesError("call get_batch_size() first: it starts the trial and tells its batch size")
        self._began = True
        self.monitor.begin_window(self._window_name())
        self._window_open = True
        try:
            self.power_limit_optimizer = self._make_power_limit_optimizer(self.trial.batch_size)
            if self.power_limit_optimizer is not None:
                self.power_limit_optimizer.on_train_begin()
        except (JoulesError, ValueError) as e:
            if not self._tolerate_power_limit_failure(e):
                try:
                    self.abort()
                except JoulesError as abort_error:
                    log.warning("could not mark the trial aborted: %s", abort_error)
                raise

    def on_epoch_begin(self) -> None:
        """An epoch starts (optional)."""
        self._ensure_began()
        if self.power_limit_optimizer is not None:
            self.power_limit_optimizer.on_epoch_begin()

    def on_step_begin(self) -> None:
        """A training step starts (optional; drives the power-limit search)."""
        self._ensure_began()
        if self.power_limit_optimizer is not None:
            self.power_limit_optimizer.on_step_begin()

    def on_step_end(self) -> None:
        """A training step ended (drives the power-limit search)."""
        self._ensure_began()
        if self.power_limit_optimizer is not None:
            self.power_limit_optimizer.on_step_end()

    def on_epoch_end(self) -> None:
        """The epoch's training steps ended: call it before evaluating.

        It pauses a power-limit profile in progress, so that evaluation is not measured as
        training steps (:meth:`on_evaluate` does it too, but only after the evaluation).
        The evaluation still counts in the epoch's time and energy.
        """
        if self.power_limit_optimizer is not None:
            self.power_limit_optimizer.on_epoch_end()

    def on_evaluate(self, metric: float) -> bool:
        """Report the epoch that just ended with its validation ``metric``; True: stop training.

        The epoch's time and GPU energy are measured from :meth:`on_train_begin` (first epoch)
        or the previous :meth:`on_evaluate` to now, evaluation included: the trial's cost is
        its whole time and energy to accuracy.

        A report that fails after every retry raises, but the epoch is kept: the next call (or
        :meth:`on_train_end`) sends it again, unchanged, before its own epoch, so no epoch's
        time and energy are lost (the server takes a repeated report once). If that earlier
        report's answer is to stop, this epoch is not reported and the answer is True.

        A metric that is NaN or infinite means training diverged at this batch size: the trial
        ends as failed (:meth:`fail`), the batch size is not tried again, and the answer is
        True.

        Raises:
            JoulesError: No trial (no :meth:`get_batch_size`), the trial has ended, or training
                did not begin (no :meth:`on_train_begin` or step callbacks).
            TypeError: ``metric`` is not a number (a string, ``None``...).
            ServerError: The report failed after every retry.
        """
        if self.trial is None:
            raise JoulesError("on_evaluate() before get_batch_size(): there is no trial to report to")
        if self._ended:
            raise JoulesError("on_evaluate() after the trial ended (on_train_end(), abort() or fail())")
        if not self._began or not self._window_open:
            raise JoulesError("on_evaluate() before on_train_begin(): there is no epoch to report")
        if not _check_metric(metric):
            log.warning("the metric is %s: training diverged at batch size %d, whose trial ends as "
                        "failed (it is not tried again); stop training", metric, self.trial.batch_size)
            try:
                self.fail()
            except ServerError as e:  # (sent again by the next end, or get_batch_size)
                log.warning("could not tell the server the trial failed: %s", e)
            return True
        if self.stop_reason is not None:  # the server ended the trial with that answer
            log.warning("on_evaluate() after the server said to stop (%s): not reported; stop training",
                        self.stop_reason)
            return True
        if self.power_limit_optimizer is not None:
            self.power_limit_optimizer.pause()
        name = self._window_name()
        m = self.monitor.end_window(name)
        self.monitor.begin_window(name)  # the next epoch starts now: the report's own time counts
        energy = sum(m.gpu_energy_j.get(g.index, 0.0) for g in self.monitor.gpus)
        epoch = len(self.epochs) + len(self._unsent) + 1
        self._unsent.append(EpochReport(epoch=epoch, time_s=m.elapsed_s, energy_j=energy, metric=metric))
        return self._send_reports()

    def on_train_end(self) -> None:
        """Training ended: end the trial (``completed``) and restore the GPUs' power limits.

        Epoch reports that failed are sent first. If the server cannot be told, the GPUs'
        limits are restored anyway, and the next :meth:`on_train_end`, :meth:`abort` or
        :meth:`get_batch_size` tries again (with the same request).

        Raises:
            ServerError: The server could not be told.
        """
        if self.trial is None or (self._ended and self._end_pending is None):
            return
        self._finish("completed")

    def fail(self) -> None:
        """End the trial as ``failed``: its batch size cannot train, and is not tried again.

        For a batch size that runs out of memory, or whose training diverges (a NaN loss);
        leaving a ``with`` block on an out-of-memory error, and a metric that is NaN or
        infinite, end it so. (:meth:`abort`, by contrast, says nothing about the batch size:
        it is handed out again.) The GPUs' limits are restored.

        Raises:
            ServerError: The server could not be told (the next :meth:`on_train_end`,
                :meth:`abort`, :meth:`fail` or :meth:`get_batch_size` tries again).
        """
        if self.trial is None or (self._ended and self._end_pending is None):
            return
        self._finish("failed")

    def abort(self) -> None:
        """End the trial as ``aborted`` (it crashed or was cancelled; the server learns nothing).

        If the server cannot be told, the next :meth:`on_train_end`, :meth:`abort` or
        :meth:`get_batch_size` tries again (with the same request).

        After a :meth:`get_batch_size` whose trial creation failed, the creation is sent once
        more (one attempt, no retries), to learn the trial the server may have made and end it
        as aborted; if the server makes the trial only now, it is ended at once. If that
        attempt fails too, nothing is raised: the next :meth:`get_batch_size` asks again with
        the same request id, and an unused trial expires after the job's ``stale_after_s``.

        Raises:
            ServerError: The server could not be told (the GPUs' limits are restored anyway).
        """
        if self._create_pending is not None:
            self._learn_pending_trial()
        if self.trial is None or (self._ended and self._end_pending is None):
            return
        self._finish("aborted")

    def close(self) -> None:
        """Close the HTTP connection pool (the trial is not ended; see :meth:`on_train_end`)."""
        self._http.close()

    def __enter__(self) -> BatchSizeOptimizer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.on_train_end()
            return
        failed = _out_of_memory(exc)
        try:
            if failed:
                log.warning("batch size %s ran out of memory: its trial ends as failed (it is not "
                            "tried again)", self.trial.batch_size if self.trial else "?")
                self.fail()
            else:
                self.abort()
        except JoulesError as e:  # never hide the exception that ended training
            log.warning("could not mark the trial %s: %s", "failed" if failed else "aborted", e)

    # -- internals ------------------------------------------------------------------------
    def _watch_signals(self) -> None:
        """While a trial trains, SIGTERM and SIGHUP end it as aborted before the process ends.

        A scheduler's stop (SLURM's ``scancel``, a Kubernetes eviction) or a closed terminal
        ends the process without leaving the ``with`` block: the trial stayed running until it
        expired (a day by default), its batch size in flight for the policy. See
        :func:`_on_end_signal`.
        """
        self._trial_pid = os.getpid()
        _TRAINING.add(self)
        _install_end_signal_handlers()

    def _unwatch_signals(self) -> None:
        _TRAINING.discard(self)

    def _end_at_exit(self, errors: list[str]) -> None:
        """End the trial as aborted as the process ends of a signal (on a thread of its own).

        Aborted whatever end was being sent: a ``completed`` one would need its unsent epoch
        reports first (without them, its outcome would be wrong), and ``failed`` is not known
        to older servers. One request, on a connection pool of its own (the signal may have
        interrupted a request holding the client's).
        """
        trial = self.trial
        if trial is None or (self._ended and self._end_pending is None):
            return
        # (pending until it is sent: should the process live on, abort() sends it again)
        self._ended, self._end_pending = True, "aborted"
        try:
            with httpx.Client(base_url=self.server_url, headers=self._http.headers, timeout=_END_AT_EXIT_S,
                              transport=self._transport) as http:
                r = http.post(f"/jobs/{trial.job_id}/trials/{trial.trial_id}/end", json={"status": "aborted"})
            if r.status_code >= 400:
                errors.append(f"trial {trial.trial_id}: HTTP {r.status_code}")
            if r.status_code < 500:
                self._end_pending = None
        except Exception as e:  # noqa: BLE001 - the process is ending: never stop that
            errors.append(f"trial {trial.trial_id}: {e}")

    def _window_name(self) -> str:
        return f"{_WINDOW}.{id(self)}"

    def _ensure_began(self) -> None:
        if not self._began:
            self.on_train_begin()

    def _create_trial(self, retries: int | None = None) -> TrialOut:
        """Ask the server for a new trial (``retries``: default, the client's).

        The request carries an idempotency key: a retry whose first attempt reached the server
        gets that trial back, not a second one. A request that fails for a reason that may pass
        keeps its key for the next one; an answer, or a refusal (another 4xx), clears it.
        """
        assert self.job is not None
        if self._create_pending is None:
            self._create_pending = uuid.uuid4().hex
        request = TrialCreate(client=self.client_name, request_id=self._create_pending)
        try:
            trial = self._call("POST", f"/jobs/{self.job.job_id}/trials", TrialOut, request,
                               what="create a trial", retries=retries)
        except ServerError as e:
            if not _retryable(e):
                self._create_pending = None
            raise
        self._create_pending = None
        return trial

    def _use(self, trial: TrialOut) -> None:
        """Make ``trial`` the current one, with no epoch and no training begun."""
        self.trial = trial
        self.epochs = []
        self._unsent = []
        self.stop_reason = None
        self.power_limit_optimizer = None
        self._began = False

    def _learn_pending_trial(self) -> None:
        """On abort: one attempt to get the trial of a failed creation, which is then to be aborted.

        The trial becomes the current one, ended, with its end (``aborted``) pending when it is
        still running; nothing changes, and nothing is raised, if the attempt fails.
        """
        try:
            trial = self._create_trial(retries=0)
        except ServerError as e:
            log.warning("could not learn the trial of the failed creation (the next get_batch_size() "
                        "asks again; an unused trial expires after the job's stale_after_s): %s", e)
            return
        self._use(trial)
        self._ended = True
        self._end_pending = "aborted" if trial.status == "running" else None

    def _finish(self, status: Literal["completed", "aborted", "failed"]) -> None:
        assert self.trial is not None
        if self._ended:  # an end that failed: send the same request again
            self._send_end()
            return
        self._ended = True
        self._end_pending = status
        if self._window_open:
            try:
                self.monitor.cancel_window(self._window_name())
            except JoulesError:
                pass
            self._window_open = False
        try:
            if self.power_limit_optimizer is not None:
                self.power_limit_optimizer.on_train_end()
        finally:
            self._began = False
            self._send_end()

    def _send_end(self) -> None:
        """Send the pending end of the trial (after its unsent epoch reports, if it completed)."""
        assert self.trial is not None and self._end_pending is not None
        status = self._end_pending
        trial = self.trial
        if status == "completed" and self._unsent:
            try:
                self._send_reports()
            except ServerError as e:
                if _retryable(e):
                    raise
                log.warning("ending the trial without the epoch(s) the server refused: %s", e)
        try:
            out = self._call("POST", f"/jobs/{trial.job_id}/trials/{trial.trial_id}/end", TrialOut,
                             TrialEnd(status=status), what=f"end the trial ({status})")
        except ServerError as e:
            if status == "failed" and e.status_code == 422:  # a server older than "failed"
                log.warning("the server does not know trials that fail (an older joules serve): the "
                            "trial of batch size %d ends as aborted, and may be handed out again",
                            trial.batch_size)
                self._end_pending = "aborted"
                self._send_end()
                return
            if not _retryable(e):  # e.g. 404: asking again cannot help
                self._end_pending = None
                self._unsent = []
            raise
        self._end_pending = None
        self._unsent = []
        self.trial = out
        self._unwatch_signals()  # (until the end is sent, a signal sends it)
        if out.outcome is not None:
            log.info("job %r trial %s ended: %s after %d epoch(s), %.4g s, %.4g J, cost %.4g",
                     self.spec.name, out.trial_id, out.outcome, out.epochs, out.time_s, out.energy_j,
                     out.cost)

    def _send_reports(self) -> bool:
        """Send the unsent epoch reports, oldest first; True: the server said to stop.

        A report that fails stays unsent, to be sent again unchanged before the next one:
        also one refused with a 4xx (a proxy's 403 passes; the server may even have taken it
        and only its answer was lost), as a report dropped would lose its epoch's time and
        energy and give the next epoch its number. A refusal that does not pass (the trial
        ended on the server) raises again at every epoch; the trial's end drops what is left.
        The reports after one whose answer is to stop are dropped.
        """
        stop = False
        while self._unsent and not stop:
            report = self._unsent[0]
            answer = self._report(report)
            self._unsent.pop(0)
            self.epochs.append(EpochRecord(report, answer))
            log.info("epoch %d: %.4g s, %.4g J, metric %.6g; cost so far %.4g", report.epoch, report.time_s,
                     report.energy_j, report.metric, answer.cost)
            stop = answer.stop
            if stop:
                self.stop_reason = answer.reason
                why = _STOP_REASONS.get(answer.reason or "", answer.reason or "the server said so")
                log.info("job %r trial %s (batch size %d): stop after epoch %d: %s (cost %.4g)",
                         self.spec.name, self.trial.trial_id if self.trial else "?", self.batch_size or 0,
                         report.epoch, why, answer.cost)
        if stop and self._unsent:
            log.warning("the server said to stop after epoch %d: the %d epoch(s) trained since are not "
                        "reported; stop training", self.epochs[-1].report.epoch, len(self._unsent))
            self._unsent = []
        return stop

    def _make_power_limit_optimizer(self, batch_size: int) -> PowerLimitOptimizer | None:
        if self._power_limit is False:
            return None
        # One client per job (rank 0 under torch.distributed): the other ranks do not run a
        # power-limit optimizer, so this one must not wait for them in collectives.
        kwargs: dict[str, Any] = {"selector": f"cost:{self.spec.eta:g}",
                                  "workload": f"{self.spec.name}/bs{batch_size}", "distributed": False}
        if isinstance(self._power_limit, Mapping):
            kwargs.update(self._power_limit)
        return PowerLimitOptimizer(self.monitor, **kwargs)

    def _tolerate_power_limit_failure(self, e: Exception) -> bool:
        """With ``power_limit=True``, a power-limit optimizer that cannot work is only a warning."""
        if self._power_limit is not True:
            return False
        log.warning("training at the current power limits; the power-limit optimizer is off: %s", e)
        plo, self.power_limit_optimizer = self.power_limit_optimizer, None
        if plo is not None:
            plo.on_train_end()
        return True

    def _register(self) -> JobOut:
        try:
            return self._call("POST", "/jobs", JobOut, self.spec, what="register the job")
        except ServerError as e:
            if e.status_code != 409:
                raise
            # The server's detail names the fields that differ.
            raise ServerError(
                f"could not register the job {self.spec.name!r} at {self.server_url}: {e.detail} (a job of "
                "that name is registered with a different spec: use its spec, or another name)",
                409, e.detail) from None

    def _report(self, report: EpochReport) -> EpochAnswer:
        assert self.trial is not None
        trial = self.trial
        return self._call("POST", f"/jobs/{trial.job_id}/trials/{trial.trial_id}/epochs", EpochAnswer,
                          report, what=f"report epoch {report.epoch}")

    def _call(self, method: str, path: str, model: type[M], body: BaseModel | None = None, *,
              what: str, retries: int | None = None) -> M:
        """One request, retried on connection errors, timeouts, 5xx and 429; the answer parsed.

        Every request is safe to repeat: registration and epoch reports are idempotent on the
        server, and a trial is created with an idempotency key. ``retries`` overrides the
        client's.
        """
        url = f"{self.server_url}{path}"
        # Fields never set are not sent: a server older than this client, which
        # does not know the fields added since, still accepts what it is sent.
        payload = body.model_dump(mode="json", exclude_unset=True) if body is not None else None
        attempts = (self.retries if retries is None else retries) + 1
        failure = ""
        retry_after: float | None = None
        for attempt in range(attempts):
            if attempt:
                self._sleep(self._delay(attempt, retry_after))
            retry_after = None
            try:
                response = self._http.request(method, path, json=payload)
            except httpx.TimeoutException as e:
                failure = f"timed out after {self.timeout_s:g} s ({type(e).__name__})"
                log.warning("%s %s: %s (attempt %d of %d)", method, url, failure, attempt + 1, attempts)
                continue
            except httpx.HTTPError as e:  # connection, protocol, an answer that cannot be decoded
                failure = f"{type(e).__name__}: {e}"
                log.warning("%s %s: %s (attempt %d of %d)", method, url, failure, attempt + 1, attempts)
                continue
            status = response.status_code
            if status < 400:
                try:
                    return model.model_validate(_known_fields(model, response.json()))
                except (ValueError, ValidationError) as e:
                    raise ServerError(f"could not {what}: {method} {url} answered {status} with a body "
                                      f"that is not a {model.__name__}: {e}", status) from None
            detail = _detail(response)
            if status in _RETRY_STATUS:
                failure = f"HTTP {status}: {detail}"
                retry_after = _retry_after(response)
                log.warning("%s %s: %s (attempt %d of %d)", method, url, failure, attempt + 1, attempts)
                continue
            hint = ""
            if status in (401, 403):
                hint = f" (check the token: token=... or ${TOKEN_ENV})"
            raise ServerError(f"could not {what}: {method} {url} answered HTTP {status}{hint}: {detail}",
                              status, detail)
        last_status = None
        if failure.startswith("HTTP "):
            last_status = int(failure[5:8])
        raise ServerError(f"could not {what}: {method} {url} failed {attempts} time(s); last: {failure}",
                          last_status)

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        delay = min(self.backoff_s * 2.0 ** min(attempt - 1, 60), _MAX_BACKOFF_S)
        delay += random.uniform(0.0, 0.1 * delay)
        if retry_after is not None:
            delay = max(delay, min(retry_after, _MAX_RETRY_AFTER_S))
        return delay


def _retryable(error: ServerError) -> bool:
    """Whether a request that failed after every retry may succeed later (no answer, 5xx, 429)."""
    return error.status_code is None or error.status_code in _RETRY_STATUS


def _check_metric(metric: object) -> bool:
    """Whether ``metric`` is finite; raise naming it unless it is a number (not a string)."""
    if isinstance(metric, (str, bytes, bool)):
        raise TypeError(f"metric must be a number, got {type(metric).__name__} {metric!r}")
    try:
        return math.isfinite(metric)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"metric must be a number, got {type(metric).__name__} {metric!r}") from None


def _out_of_memory(error: BaseException | None) -> bool:
    """Whether ``error`` is running out of memory (a GPU's, as PyTorch and JAX say it, or the host's)."""
    if error is None:
        return False
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True  # (torch.OutOfMemoryError, torch.cuda.OutOfMemoryError)
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "resource_exhausted" in text)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
