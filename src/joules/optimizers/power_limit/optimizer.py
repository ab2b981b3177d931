"""The online power-limit optimizer: profiles power limits during training, then keeps the best.

Driven by training progress through callbacks (``on_train_begin``, ``on_epoch_begin``,
``on_step_begin``, ``on_step_end``, ``on_epoch_end``, ``on_train_end``)::

    monitor = EnergyMonitor()
    with PowerLimitOptimizer(monitor, selector="cost:0.5", workload="resnet50-b256") as plo:
        for epoch in range(epochs):
            plo.on_epoch_begin()
            for batch in loader:
                plo.on_step_begin()
                train_step(batch)
                plo.on_step_end()
            plo.on_epoch_end()
            evaluate()

For every limit the search proposes, the optimizer sets it on every GPU it controls, lets
``warmup_steps`` steps pass, then measures ``profile_steps`` steps. An epoch end in the middle
of a profile pauses the measurement (evaluation and data-loader restarts are not training
steps); the next epoch warms up again (``warmup_steps``, but fewer than half the steps of the
epoch before, so that short epochs are measured too) and the measurement resumes where it
stopped. When the search is done, the chosen limit is applied for the rest of training, and
the limits the GPUs had before come back at the end (``on_train_end``, leaving the ``with``
block, an exception, Ctrl-C, SIGTERM, interpreter exit; see
:class:`~joules.devices.restore.RestoreGuard`).

With a ``workload`` name, the measured points are saved, and a later job on the same GPUs
takes them as already measured: it profiles only the limits its own selector and candidates
still need, often none.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from joules.devices.base import GPU, host_name
from joules.devices.restore import RestoreGuard
from joules.errors import DevicePermissionError, JoulesError, WindowError
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.power_limit.profile import LimitPoint, ProfileError
from joules.optimizers.power_limit.search import Adaptive, Search, Sweep
from joules.optimizers.power_limit.selectors import Selector, parse_selector
from joules.optimizers.power_limit.store import ProfileStore

log = logging.getLogger("joules.power_limit")

SearchFactory = Callable[[Sequence[float], Selector], Search]
_WINDOW = "joules.power_limit"
_IDLE_EPOCHS = 3  # epochs in a row that measure no step before profiling is given up
_PROFILE_RETRIES = 3  # profiles of a limit that lost most steps (failed reads, stalls...) before giving up
_MOVED_WARNINGS = 3  # warnings that a limit was changed under the optimizer, at most
_OUTLIER_FACTOR = 3.0  # a step longer than this many times the median of its limit's is left out
_OUTLIER_MIN_STEPS = 5  # steps measured at a limit before outliers are judged
_OUTLIER_HISTORY = 63  # latest steps whose median is the typical step
_OUTLIER_SHARE = 0.1  # long steps more often than this are the workload's, not stalls,
_OUTLIER_JUDGED = 20  # once this many steps were judged
_OUTLIER_BIAS = 0.01  # and only steps that would lengthen the limit's measured time by more than this
_CHUNK_PERIODS = 30  # after a long step, windows end after about this many counter periods
_COUNTER_PERIODS = 10  # a limit whose windows were mostly shorter than one counter period is measured
_MAX_EXTENSION = 64  # again over this many periods' worth of steps, at most this many times profile_steps
_PERMISSION_FIX = (
    "changing GPU power limits needs root or the SYS_ADMIN capability (e.g. run the job with "
    "sudo, or in a container started with --cap-add SYS_ADMIN); pass dry_run=True to only measure"
)


class State(StrEnum):
    """Where the optimizer is."""

    READY = "ready"
    WARMUP = "warmup"
    PROFILING = "profiling"
    DONE = "done"


@dataclass
class _Accumulator:
    """Measured steps at one limit, possibly over several segments split by epoch ends."""

    limit_w: float
    steps: int = 0
    time_s: float = 0.0
    energy_j: float = 0.0
    segments: int = 0
    warm: int = 0  # steps warmed up since the limit was set or the last pause
    warm_target: int = 0  # steps to warm up before measuring
    limit_warm: int = 0  # steps warmed up since the limit was set, pauses or not
    segment_steps: int = 0
    lost: int = 0  # steps counted, but in segments whose window a failed device read lost
    retries: int = 0  # times this limit was profiled again, too few of its steps measured
    why_lost: str = "device reads failed"  # what lost the latest of them
    gpu_energy_j: dict[int, float] = field(default_factory=dict)  # per counted GPU
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=_OUTLIER_HISTORY))  # latest steps, s
    corrected_s: float = 0.0  # time in windows too short for a GPU's energy counter (``corrected``)
    target: int = 0  # steps to measure (0: profile_steps; more where windows are too short)


def _torch_dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


class PowerLimitOptimizer:
    """Finds the best GPU power limit for a training job while it trains, then applies it.

    Args:
        monitor: The energy monitor that measures the GPUs (its GPUs are the ones controlled,
            unless ``gpu_indices`` names a subset).
        selector: What "best" means: a :class:`Selector`, or ``"time"``, ``"energy"``,
            ``"cost:ETA"`` (minimize ``ETA * energy + (1 - ETA) * max_power * time``) or
            ``"slowdown:FACTOR"`` (least energy at most ``FACTOR`` times slower than the
            highest limit).
        search: ``"adaptive"`` (profiles few limits), ``"sweep"`` (every limit), or a
            callable ``(limits, selector) -> Search``.
        warmup_steps: Steps after a limit change (or an epoch start) that are not measured.
            After an epoch end, fewer than half the steps of the epoch before warm up when
            that is less (with a warning), so that short epochs are still measured; after
            another pause, fewer than half the steps since the previous such pause.
        profile_steps: Steps measured at each limit.
        step_w: Distance between candidate limits, from the highest allowed one down.
        limits_w: Candidate limits instead of the ``step_w`` grid; each must be allowed on
            every controlled GPU.
        workload: Name of the workload (e.g. ``"bert-base/b32"``). With a name, the measured
            points are saved, and a later job on the same GPU model(s) and count takes them as
            already measured: it profiles only the limits its selector and candidate limits
            still need (none when the saved points suffice), and adds them to the saved ones.
        store: Where profiles are saved: a :class:`ProfileStore`, a directory, or ``None`` for
            the default one. Ignored without ``workload``.
        gpu_indices: Which of the monitor's GPUs to control (default: all of them).
        distributed: Agree on the limit with the other ``torch.distributed`` ranks: ``"auto"``
            when a process group is initialized, or ``True``/``False``.
        dry_run: Never change a GPU: run the whole schedule (and log the limits it would set)
            at the current limit, e.g. to check the integration on a shared machine. The
            choice then only reflects noise.
        handle_signals: Restore limits on SIGINT, SIGTERM and SIGHUP too (main thread only).
        guard: The :class:`RestoreGuard` that records and restores every change (default: a
            new one over the controlled GPUs, journaled in the default state directory).

    Raises:
        DevicePermissionError: At the first change, when the limits cannot be changed; no GPU
            has been changed then.
        ValueError: A bad argument (named in the message).
    """

    def __init__(
        self,
        monitor: EnergyMonitor,
        selector: Selector | str = "cost:0.5",
        *,
        search: str | SearchFactory = "adaptive",
        warmup_steps: int = 10,
        profile_steps: int = 40,
        step_w: float = 25.0,
        limits_w: Sequence[float] | None = None,
        workload: str | None = None,
        store: ProfileStore | str | Path | None = None,
        gpu_indices: Sequence[int] | None = None,
        distributed: bool | str = "auto",
        dry_run: bool = False,
        handle_signals: bool = True,
        guard: RestoreGuard | None = None,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if profile_steps < 1:
            raise ValueError(f"profile_steps must be >= 1, got {profile_steps}")
        if not step_w > 0:
            raise ValueError(f"step_w must be > 0, got {step_w}")
        if isinstance(search, str) and search not in ("adaptive", "sweep"):
            raise ValueError(f"search must be 'adaptive', 'sweep' or a callable, got {search!r}")
        if distributed not in (True, False, "auto"):
            raise ValueError(f"distributed must be True, False or 'auto', got {distributed!r}")
        if workload is not None and not workload.strip():
            raise ValueError("workload must be a non-empty name (or None)")
        self.monitor = monitor
        if gpu_indices is None:
            self.gpus: list[GPU] = list(monitor.gpus)
        else:
            by_index = {g.index: g for g in monitor.gpus}
            missing = [i for i in gpu_indices if i not in by_index]
            if missing:
                raise ValueError(
                    f"GPU(s) {missing} are not measured by the monitor (it has {sorted(by_index)})")
            self.gpus = [by_index[i] for i in gpu_indices]
        if not self.gpus:
            raise ValueError("the monitor measures no GPU: there is no power limit to optimize")
        if isinstance(selector, str):
            try:
                parse_selector(selector)  # checked now; built for the job's GPU count later
            except JoulesError as e:
                raise ValueError(str(e)) from None
        elif not isinstance(selector, Selector):
            raise ValueError(f"selector must be a Selector or a string, got {type(selector).__name__}")
        self._selector_spec = selector
        self._search_spec = search
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.step_w = float(step_w)
        self._limits_arg = None if limits_w is None else [float(x) for x in limits_w]
        if self._limits_arg is not None:
            if not self._limits_arg:
                raise ValueError("limits_w is empty")
            for g in self.gpus:
                for x in self._limits_arg:
                    g.check_power_limit(x)
        self.workload = workload
        self.store = store if isinstance(store, ProfileStore) else ProfileStore(store)
        self._distributed = distributed
        self.dry_run = dry_run
        if guard is None and not dry_run:
            guard = RestoreGuard(self.gpus, handle_signals=handle_signals)
        self.guard = None if dry_run else guard

        self.state = State.READY
        self.selector: Selector | None = None
        self.search: Search | None = None
        self.limits_w: list[float] = []
        self.points: dict[float, LimitPoint] = {}
        """Time and energy per step at each profiled limit (all GPUs of the job together)."""
        self.chosen_limit_w: float | None = None
        self.reused_profile = False
        """Whether the limit was chosen from the saved profile alone, without profiling."""
        self.reused_limits_w: list[float] = []
        """The limits whose points were taken from the saved profile."""
        self.total_gpus = len(self.gpus)
        self._acc: _Accumulator | None = None
        self._window_open = False
        self._window_lost = False  # the open window's begin failed (a device read): no measurement
        self._moved_warned = 0
        self._last_end: float | None = None  # when the latest step ended (None: a pause since)
        self._outlier_warned = False
        self._busiest_saved_w: float | None = None
        self._outliers = self._judged = 0  # steps found long, of those judged
        self._outliers_off = False
        self._outliers_seen = False  # points were measured without long steps later found the workload's
        self._chunk_s: float | None = None  # after a long step: windows end every so many seconds
        self._window_t0 = 0.0
        self._short_steps_warned = False
        self._ended = False
        self._stepped = False  # a step ran since the last on_train_begin
        self._applied: float | None = None
        self._dist: Any = None
        self._model = self.gpus[0].name
        self._counted = list(self.gpus)  # the GPUs whose energy this rank adds to the job's
        self._measured: list[float] = []  # limits measured by this optimizer (not saved ones)
        self._steps_since_pause = 0
        self._measured_since_pause = 0
        self._profiling_since_pause = False  # a step ran while profiling since the last pause
        self._in_step = False  # on_step_begin called, on_step_end not yet
        self._split_steps = False  # a pause came within a step: windows end at each step's end
        self._epoch_steps = 0  # steps since the last epoch end, whatever the pauses in between
        self._interval_steps = 0  # steps since the last pause that was not an epoch end
        self._epoch_len: int | None = None  # steps of the last epoch
        self._interval_len: int | None = None  # steps between the last two such pauses
        self._idle_epochs = 0
        self._short_epochs_warned = False
        self._changed_workload = False  # workload_changed: nothing is saved

    # -- public state ---------------------------------------------------------------------
    @property
    def current_limit_w(self) -> float | None:
        """The limit the optimizer set last (``None`` before any)."""
        return self._applied

    def report(self) -> dict[str, Any]:
        """JSON-ready summary: state, chosen limit, and every profiled point."""
        return {
            "state": str(self.state),
            "selector": repr(self.selector) if self.selector else str(self._selector_spec),
            "chosen_limit_w": self.chosen_limit_w,
            "reused_profile": self.reused_profile,
            "reused_limits_w": self.reused_limits_w,
            "gpus": self.total_gpus,
            "limits_w": self.limits_w,
            "points": [{"limit_w": p.limit_w, "time_per_step_s": p.time_s, "energy_per_step_j": p.energy_j}
                       for p in self.points.values()],
        }

    # -- callbacks ------------------------------------------------------------------------
    def on_train_begin(self) -> None:
        """Start: agree on candidate limits (and a saved profile) and set the first limit.

        Called again after :meth:`on_train_end` (another ``fit`` with the same optimizer),
        it re-applies the chosen limit, or resumes profiling where it stopped. Called again
        after steps without :meth:`on_train_end` in between (training raised, or was
        interrupted by Ctrl-C, and runs again), it discards what was being measured at the
        current limit and profiles that limit again, and sets the limit again if it was put
        back meanwhile (by the restore guard on SIGINT, say). Called twice with no step in
        between (``with optimizer:`` around a trainer that calls it too), the second call
        changes nothing.
        """
        stepped, self._stepped = self._stepped, False
        self._steps_since_pause = self._measured_since_pause = 0
        self._last_end = None
        self._profiling_since_pause = False
        self._epoch_steps = self._interval_steps = 0
        if self._ended:
            self._ended = False
            if self.state is State.DONE and self.chosen_limit_w is not None:
                self._apply(self.chosen_limit_w)
            elif self._acc is not None:
                self._apply(self._acc.limit_w)
                self._acc.limit_warm = 0  # the limit was put back meanwhile: a full warm-up
                self._warm_up_again()  # before measuring the rest of this limit
            return
        if self.state is not State.READY:
            if stepped:
                self._discard_interrupted()
            self._reapply_if_lost()
            return
        self._dist = _torch_dist() if self._distributed in ("auto", True) else None
        if self._distributed is True and self._dist is None:
            raise JoulesError("distributed=True but torch.distributed is not initialized")
        self._model, self.total_gpus, self._counted = self._job_gpus()
        self.selector = self._make_selector()
        self.limits_w = self._candidate_limits()
        saved = self._load_saved() or []
        self.search = self._make_search()
        if isinstance(self.search, Adaptive) and self._busiest_saved_w is not None:
            self.search.busiest_w = self._busiest_saved_w  # (the reference comes from the saved profile)
        for point in saved:
            self.search.record(point)
            self.points[point.limit_w] = point
        self.reused_limits_w = [p.limit_w for p in saved]
        self._next_limit()
        self.reused_profile = bool(saved) and self.state is State.DONE
        if saved:
            if self.reused_profile:
                log.info("the saved profile for %r answers %s over these limits: no profiling",
                         self.workload, self.selector)
            else:
                log.info("the saved profile for %r has %d of the limits; profiling the ones %s "
                         "still needs", self.workload, len(saved), self.selector)

    def on_epoch_begin(self) -> None:
        """An epoch starts (optional; steps alone drive the optimizer)."""
        if self.state is State.READY or self._ended:
            self.on_train_begin()

    def on_step_begin(self) -> None:
        """A training step starts."""
        if self.state is State.READY or self._ended:
            self.on_train_begin()
        self._stepped = True
        self._in_step = True
        if self.state is State.PROFILING:
            self._profiling_since_pause = True
            if not self._window_open:
                self._open()

    def on_step_end(self) -> None:
        """A training step ended."""
        if self.state is State.READY or self._ended:
            self.on_train_begin()
        self._stepped = True
        self._in_step = False
        self._steps_since_pause += 1
        self._epoch_steps += 1
        self._interval_steps += 1
        acc = self._acc
        if acc is None:
            return
        now = self.monitor.clock.now()
        duration = None if self._last_end is None else now - self._last_end
        self._last_end = now
        if self.state is State.WARMUP:
            if duration is not None and not self._outlier(acc, duration, warn=False):
                acc.durations.append(duration)  # what a step takes at this limit
            acc.warm += 1
            acc.limit_warm += 1
            if acc.warm >= acc.warm_target:
                self.state = State.PROFILING
            return
        if self.state is State.PROFILING:
            self._profiling_since_pause = True
            if not self._window_open:  # on_step_begin is not called: measure from here on
                self._open()
                return
            acc.segment_steps += 1
            self._measured_since_pause += 1
            if duration is not None and self._outlier(acc, duration):
                # The window holds a step far longer than the others (a data-loader stall, a
                # checkpoint within the epoch): it would bias this limit's time and energy.
                # Its steps count, unmeasured; from now on windows end every 30 counter periods
                # or so (3 s on most GPUs; shorter while such steps keep falling into them), so
                # that such a step costs only its own stretch.
                self._lose_window(f"a step took over {_OUTLIER_FACTOR:g} times the others")
                period = self._counter_period_s()
                if self._chunk_s is None:
                    self._chunk_s = _CHUNK_PERIODS * period
                elif self._chunk_s > 2 * period:  # long steps come more often than the windows end
                    self._chunk_s /= 2
                if acc.steps >= self._target(acc):
                    self._complete()
                    return
                self._open()
                return
            if duration is not None:
                acc.durations.append(duration)
            if acc.steps + acc.segment_steps >= self._target(acc):
                self._close()
                self._complete()
            elif self._split_steps or (self._chunk_s is not None and now - self._window_t0 >= self._chunk_s):
                # Pauses may come within steps (or long steps, after one): keep what is measured,
                # and go on from this step's end, so that the host work between steps is
                # measured as before the split.
                self._close()
                self._open()

    def on_epoch_end(self) -> None:
        """An epoch ended: a profile in progress pauses until the next epoch has warmed up."""
        if self._epoch_steps:
            self._epoch_len, self._epoch_steps = self._epoch_steps, 0
        self._pause(self._epoch_len, "epochs of")

    def pause(self) -> None:
        """Work that is not a training step follows (evaluation, a checkpoint): stop measuring.

        A profile in progress keeps the steps measured so far; the next steps warm up again
        before the measurement resumes: ``warmup_steps`` (or what is left of the warm-up
        after the limit change), but fewer than half the steps since the previous pause
        (epoch ends not counted) when that is less, so that work paused more often than the
        warm-up lasts is still measured. After an epoch end, the same holds with the steps
        of the whole epoch, whatever the pauses within it. A pause between
        :meth:`on_step_begin` and :meth:`on_step_end` (within a gradient-accumulation cycle)
        drops what was measured since the previous pause, which ends part-way through a step;
        from then on each step is measured in a window of its own (from the previous step's
        end, so that the host work between steps still counts), so that such a pause drops
        only the step it cuts. When three epochs in a row
        measure no step (epochs of one step without :meth:`on_step_begin`), profiling is
        given up and the limits the GPUs had are put back for the rest of the run. Nothing
        happens outside profiling.
        """
        if self._interval_steps:
            self._interval_len, self._interval_steps = self._interval_steps, 0
        self._pause(self._interval_len, "pauses every")

    def _pause(self, span: int | None, what: str) -> None:
        """Pause; ``span`` is the steps between such pauses (``what`` names them in a warning)."""
        steps, self._steps_since_pause = self._steps_since_pause, 0
        measured, self._measured_since_pause = self._measured_since_pause, 0
        self._last_end = None  # the next step's time is not the pause's
        profiling, self._profiling_since_pause = self._profiling_since_pause, False
        in_step, self._in_step = self._in_step, False
        acc = self._acc
        if acc is None or self.state not in (State.WARMUP, State.PROFILING):
            return
        if steps:
            # A step ran while profiling, yet none was measured (at this limit or one completed
            # meanwhile). A warm-up that ended at the last step before the pause is no sign.
            idle = self.state is State.PROFILING and profiling and not measured
            self._idle_epochs = self._idle_epochs + 1 if idle else 0
        if self._window_open:
            if in_step:  # a pause within a step (between the batches of an accumulation cycle):
                # The window ends in a part-step: its whole steps count, unmeasured (as on every
                # rank, however each split its steps into windows).
                self._lose_window("a pause came within a step")
                self._split_steps = True  # from now on a window spans one step: only it is lost
            else:
                self._close()
        if self._idle_epochs >= _IDLE_EPOCHS:
            why = ("every step was cut by a pause within it: evaluation or a checkpoint inside each "
                   "gradient-accumulation cycle" if self._split_steps else
                   "call on_step_begin too to measure such short epochs")
            assert self._acc is not None
            self._give_up(f"no step could be measured at {self._acc.limit_w:g} W in {self._idle_epochs} "
                          f"epochs in a row (of {steps} step(s); {why})")
            return
        rewarm = self.warmup_steps
        if span is not None and (span - 1) // 2 < rewarm:
            rewarm = (span - 1) // 2
            if not self._short_epochs_warned:
                self._short_epochs_warned = True
                log.warning("%s %d steps are short for warmup_steps=%d and profile_steps=%d: "
                            "after such a pause only %d steps warm up before measuring resumes, and a "
                            "profile spans several of them", what, span, self.warmup_steps,
                            self.profile_steps, rewarm)
        acc.warm = 0
        acc.warm_target = max(self.warmup_steps - acc.limit_warm, rewarm)
        self.state = State.WARMUP if acc.warm_target > 0 else State.PROFILING

    def _warm_up_again(self) -> None:
        """Warm up for the rest of the warm-up of the current limit before measuring again."""
        acc = self._acc
        assert acc is not None
        acc.warm = 0
        acc.warm_target = max(0, self.warmup_steps - acc.limit_warm)
        self.state = State.WARMUP if acc.warm_target > 0 else State.PROFILING

    def _discard_interrupted(self) -> None:
        """A run ended without on_train_end: drop what was being measured at the current limit."""
        if self._window_open:
            self._cancel()  # (the monitor may have lost it meanwhile)
        acc = self._acc
        if acc is not None and self.state in (State.WARMUP, State.PROFILING):
            log.warning("training started again after a run that did not end (no on_train_end): "
                        "the measurement at %g W so far is discarded, and the limit profiled again",
                        acc.limit_w)
            self._acc = _Accumulator(acc.limit_w, retries=acc.retries, target=acc.target)
            self._warm_up_again()

    def _wanted_limit(self) -> float | None:
        """The limit the GPUs should have now: the chosen one, or the one being profiled."""
        if self.state is State.DONE:
            return self.chosen_limit_w
        if self.state in (State.WARMUP, State.PROFILING) and self._acc is not None:
            return self._acc.limit_w
        return None

    def _reapply_if_lost(self) -> None:
        """Set the wanted limit again where the GPUs lost it (the guard restored them, say)."""
        wanted = self._wanted_limit()
        if wanted is None:
            return
        if self.guard is not None:
            held = {c.uuid for c in self.guard.changed if c.original_power_limit_w is not None}
            lost = [g for g in self.gpus if g.uuid not in held or abs(g.power_limit_w() - wanted) > 0.5]
            if lost:
                log.warning("GPU(s) %s no longer have the limit %g W (put back while training was "
                            "interrupted?): setting it again", [g.index for g in lost], wanted)
                self._applied = None
        if self._applied != wanted:
            self._apply(wanted)

    def _give_up(self, why: str) -> None:
        """Stop profiling for good and put back the limits the GPUs had (nothing can be measured)."""
        log.warning("%s: profiling is given up and the GPUs keep the limits they had", why)
        self._acc = None
        self.state = State.DONE
        if self._measured:
            self._save()  # what was measured serves the next job
        self.restore()

    def workload_changed(self, why: str) -> None:
        """The work of a step changed (a smaller batch size after running out of memory, say).

        The points measured so far (and those taken from a saved profile) no longer describe
        the steps: they are dropped and the limits profiled again, from the highest. Nothing
        this optimizer measures is saved from then on: its ``workload`` name describes the
        steps it was made for. Call it on every rank alike.

        Args:
            why: What changed, for the log.
        """
        if self.state is State.READY:
            return  # nothing measured yet
        if self._window_open:
            self._cancel()
        log.warning("%s: the power-limit profile so far no longer applies, and is measured again "
                    "(and not saved%s)", why, f" as {self.workload!r}" if self.workload else "")
        self._changed_workload = True
        self.points.clear()
        self._measured = []
        self.reused_profile, self.reused_limits_w = False, []
        self.chosen_limit_w = None
        self._outliers = self._judged = 0
        self._outliers_seen = self._outliers_off = False
        self._chunk_s = None
        self.search = self._make_search()
        if self._ended:  # nothing trains now: the next on_train_begin sets the first limit
            limit = self.search.next_limit()
            assert limit is not None
            self._acc = _Accumulator(limit, warm_target=self.warmup_steps)
            self.state = State.WARMUP if self.warmup_steps > 0 else State.PROFILING
        else:
            self._next_limit()

    def on_train_end(self) -> None:
        """Training ended: put back the limits the GPUs had before.

        With a ``workload`` name, the limits measured by a search that has not finished are
        saved too: the next job (a recurring job's next trial) takes them as measured and
        profiles only what is left.
        """
        if self._window_open:
            self._lose_window("training ended")  # (its steps count, as on every rank)
        self._stepped = False
        if self.state is not State.READY:
            self._ended = True
        if self.state in (State.WARMUP, State.PROFILING) and self._measured:
            self._save()
        self.restore()

    def restore(self) -> None:
        """Put back the limits the GPUs had before the optimizer changed them (idempotent)."""
        if self.guard is not None:
            self.guard.restore()
        self._applied = None

    def __enter__(self) -> PowerLimitOptimizer:
        self.on_train_begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.on_train_end()

    # -- internals ------------------------------------------------------------------------
    def _window_name(self) -> str:
        return f"{_WINDOW}.{id(self)}"

    def _counter_period_s(self) -> float:
        """The longest energy-counter update period of the GPUs counted (0.1 s where unknown)."""
        periods = [g.energy_counter_period_s() or 0.1 for g in self._counted]
        return max(periods, default=0.1)

    def _target(self, acc: _Accumulator) -> int:
        """The steps to measure at ``acc``'s limit."""
        return acc.target or self.profile_steps

    def _outlier(self, acc: _Accumulator, duration: float, warn: bool = True) -> bool:
        """Whether a step took over ``_OUTLIER_FACTOR`` times the median of this limit's steps.

        Its excess must also be over ``_OUTLIER_BIAS`` of the limit's measured time. The
        median's steps are the limit's latest, those of its warm-up included (steps end to end,
        none across a pause), so that a step at the start of the measurement is judged too.
        """
        if len(acc.durations) < _OUTLIER_MIN_STEPS or self._outliers_off:
            return False
        typical = statistics.median(acc.durations)
        self._judged += 1
        # Far longer than the others, and long enough to bias the limit's time by over
        # _OUTLIER_BIAS (a millisecond's hiccup among steps of a millisecond is neither).
        if not (duration > _OUTLIER_FACTOR * typical > 0
                and duration - typical > _OUTLIER_BIAS * typical * self._target(acc)):
            return False
        self._outliers += 1
        if self._judged >= _OUTLIER_JUDGED and self._outliers > _OUTLIER_SHARE * self._judged:
            # Long steps this often are the workload's own (an optimizer step every few
            # micro-batches): they are measured like the others from now on, and the points
            # measured without them are measured again (decided with every rank, at the end
            # of the current limit).
            self._outliers_off = True
            self._outliers_seen = bool(self._measured) or acc.lost > 0
            log.info("steps over %g times the others are %d of %d: part of the workload, measured from "
                     "now on", _OUTLIER_FACTOR, self._outliers, self._judged)
            return False
        if warn and not self._outlier_warned:
            self._outlier_warned = True
            log.warning("a step took %.3g s, over %g times the others' %.3g s (a data-loader stall, a "
                        "checkpoint within the epoch?): such steps are left out of the power-limit "
                        "profile, and from now on windows end every few seconds",
                        duration, _OUTLIER_FACTOR, typical)
        return True

    def _lose_window(self, why: str) -> None:
        """Drop the open window: its steps count (as on every other rank), unmeasured."""
        acc = self._acc
        self._cancel()
        if acc is None:
            return
        acc.steps += acc.segment_steps
        acc.lost += acc.segment_steps
        acc.why_lost = why

    def _open(self) -> None:
        assert self._acc is not None
        self._acc.segment_steps = 0
        self._window_open = True
        self._window_lost = False
        self._window_t0 = self.monitor.clock.now()
        try:
            self.monitor.begin_window(self._window_name())
        except WindowError:  # (a closed monitor, say: not a device read)
            self._window_open = False
            raise
        except JoulesError as e:  # a device read failed: the steps count, unmeasured
            self._window_lost = True
            self._read_failed(e)

    def _cancel(self) -> None:
        """Drop the open window (what it measured is not kept)."""
        if not self._window_lost:
            with suppress(WindowError):
                self.monitor.cancel_window(self._window_name())
        self._window_open = self._window_lost = False

    def _close(self) -> None:
        acc = self._acc
        assert acc is not None
        m = None
        if not self._window_lost:
            try:
                m = self.monitor.end_window(self._window_name())
            except WindowError:
                raise
            except JoulesError as e:  # (a window whose end failed stays open in the monitor)
                self._read_failed(e)
        if m is not None and self._limit_moved(acc.limit_w):
            m = None
        if m is None:
            # The steps count as on every other rank (they decide together when a limit is
            # done); their time and energy are not known.
            self._lose_window(acc.why_lost)
            return
        self._window_open = False
        if acc.segment_steps == 0:
            return
        per_gpu = {g.index: m.gpu_energy_j.get(g.index, 0.0) for g in self._counted}
        for k, e in per_gpu.items():
            acc.gpu_energy_j[k] = acc.gpu_energy_j.get(k, 0.0) + e
        energy = sum(per_gpu.values())
        if any(m.gpu[g.index].corrected for g in self._counted if g.index in m.gpu):
            acc.corrected_s += m.elapsed_s
        acc.steps += acc.segment_steps
        acc.time_s += m.elapsed_s
        acc.energy_j += energy
        acc.segments += 1

    def _limit_moved(self, limit: float) -> bool:
        """Whether a GPU's limit is no longer ``limit`` (set again, once warned, if so).

        Something else changed it meanwhile (another optimizer on the same GPU, an
        administrator's ``nvidia-smi -pl``): what the window measured is not this limit's.
        """
        if self.dry_run or self._applied != limit:
            return False
        try:
            moved = [(g.index, g.power_limit_w()) for g in self.gpus]
        except JoulesError:
            return False  # (cannot tell: the window stands)
        moved = [(i, w) for i, w in moved if abs(w - limit) > 0.5]
        if not moved:
            return False
        if self._moved_warned < _MOVED_WARNINGS:
            self._moved_warned += 1
            log.warning("while profiling %g W, GPU(s) %s had their power limit changed by something else "
                        "(%s W: another optimizer on the same GPU?): that window is dropped and the limit "
                        "set again", limit, [i for i, _ in moved], ", ".join(f"{w:g}" for _, w in moved))
        self._applied = None
        self._apply(limit)
        assert self._acc is not None
        self._acc.why_lost = "its limit was changed by something else"
        return True

    def _read_failed(self, error: JoulesError) -> None:
        assert self._acc is not None
        self._acc.why_lost = "device reads failed"
        if not self._acc.lost:  # once per limit
            log.warning("a device read failed while profiling %g W (%s): the steps it would have "
                        "measured are left out, and the limit is profiled again if too few are left",
                        self._acc.limit_w, error)

    def _complete(self) -> None:
        acc = self._acc
        assert acc is not None and self.search is not None
        # Points measured while the workload's own long steps were left out (on any rank) are
        # measured again, from the highest limit.
        if self._allreduce([float(self._outliers_seen)], "max")[0]:
            self._outliers_seen = False
            self._outliers_off = True  # on every rank: from now on every rank measures them
            log.warning("the points measured so far left out long steps that are the workload's own: "
                        "profiling again from the highest limit")
            for x in self._measured:
                self.points.pop(x, None)
                self.search.points.pop(x, None)
            self._measured = []
            self._acc = _Accumulator(self.limits_w[0])
            self._apply(self.limits_w[0])
            self._warm_up_again()
            return
        measured = acc.steps - acc.lost
        # Every rank decides alike, on the fewest steps any rank measured.
        fewest = -self._allreduce([-float(measured)], "max")[0]
        if fewest < max(1, acc.steps // 2):
            if acc.retries + 1 >= _PROFILE_RETRIES:
                self._give_up(f"most of the steps at {acc.limit_w:g} W could not be measured, "
                              f"{acc.retries + 1} times ({acc.why_lost})")
                return
            log.warning("too few steps measured at %g W (%d of %d: %s): profiling it again",
                        acc.limit_w, int(fewest), acc.steps, acc.why_lost)
            self._acc = _Accumulator(acc.limit_w, retries=acc.retries + 1, why_lost=acc.why_lost,
                                     target=acc.target)
            self._warm_up_again()
            return
        # Windows shorter than a GPU's counter period (steps of a millisecond or less) are
        # extrapolated from power readings, off by tens of percent: measure again, over
        # enough steps for a window of several counter periods.
        # Once per limit, and only where more steps make a longer window: where one window held
        # them all on every rank (not where pauses or a split into one-step windows cut them).
        short = acc.corrected_s / acc.time_s if acc.time_s > 0 else 0.0
        short, windows = self._allreduce([short, float(acc.segments + self._split_steps)], "max")
        target = self._target(acc)
        most = _MAX_EXTENSION * self.profile_steps
        if short > 0.5 and windows <= 1 and not acc.target and target < most:
            # (every rank alike: the longest step and counter period of any)
            per_step, period = self._allreduce([acc.time_s / measured, self._counter_period_s()], "max")
            wanted = math.ceil(_COUNTER_PERIODS * period / per_step) if per_step > 0 else most
            self._acc = _Accumulator(acc.limit_w, target=min(most, max(2 * target, wanted)),
                                     retries=acc.retries)
            if not self._short_steps_warned:
                self._short_steps_warned = True
                log.warning("the %d steps measured at %g W (%.3g ms each) are too short for the GPUs' energy "
                            "counters: measuring %d steps instead (profile_steps=%d would do at once)",
                            target, acc.limit_w, 1e3 * per_step, self._acc.target, self._acc.target)
            return
        time_s, energy_j = acc.time_s / measured, acc.energy_j / measured
        time_s = self._allreduce([time_s], "max")[0]
        energy_j = self._allreduce([energy_j], "sum")[0]
        if not time_s > 0:
            self._give_up(f"{acc.steps} steps at {acc.limit_w:g} W took no measurable time (a clock "
                          f"that does not advance, or on_step_end called before on_step_begin)")
            return
        if acc.limit_w == self.limits_w[0]:
            # The busiest GPU's power at the highest limit, over every rank: limits below it
            # bind on that GPU, however little the others draw (an idle one lowers the mean).
            powers = [e / acc.time_s for e in acc.gpu_energy_j.values()] if acc.time_s > 0 else []
            busiest = self._allreduce([max(powers, default=0.0)], "max")[0]
            if isinstance(self.search, Adaptive) and busiest > 0:
                self.search.busiest_w = busiest
        point = LimitPoint(acc.limit_w, time_s, energy_j)
        self.points[point.limit_w] = point
        self._measured.append(point.limit_w)
        self.search.record(point)
        log.info("power limit %g W: %.4g s and %.4g J per step (%d steps in %d segment(s))",
                 acc.limit_w, time_s, energy_j, measured, acc.segments)
        self._next_limit()

    def _next_limit(self) -> None:
        assert self.search is not None
        limit = self.search.next_limit()
        if limit is None:
            self._finish()
            return
        self._acc = _Accumulator(limit, warm_target=self.warmup_steps)
        self._apply(limit)
        self.state = State.WARMUP if self.warmup_steps > 0 else State.PROFILING

    def _finish(self) -> None:
        assert self.selector is not None
        chosen = self.selector.choose(list(self.points.values())).limit_w
        self.chosen_limit_w = chosen
        self._acc = None
        self.state = State.DONE
        self._apply(chosen)
        log.info("chose %g W (%s) from %s W", chosen, self.selector,
                 ", ".join(f"{x:g}" for x in self.points))
        if self._measured:
            self._save()

    def _apply(self, limit: float) -> None:
        if self.dry_run:
            log.info("dry run: would set the power limit to %g W", limit)
            self._applied = limit
            return
        assert self.guard is not None
        if self._applied is None:
            self._check_permission()
        for g in self.gpus:
            self.guard.set_power_limit_w(g, limit)
        self._applied = limit

    def _check_permission(self) -> None:
        """Set each GPU's current limit again: harmless, and it fails exactly when a change would."""
        for g in self.gpus:
            try:
                g.set_power_limit_w(g.power_limit_w())
            except DevicePermissionError as e:
                raise DevicePermissionError(
                    f"cannot change the power limit of GPU {g.index} ({g.name}): {e}. {_PERMISSION_FIX}. "
                    "No GPU was changed."
                ) from None

    def _make_selector(self) -> Selector:
        spec = self._selector_spec  # (checked by __init__)
        return spec if isinstance(spec, Selector) else parse_selector(spec, self.total_gpus)

    def _make_search(self) -> Search:
        assert self.selector is not None
        spec = self._search_spec
        if spec == "sweep":
            return Sweep(self.limits_w, self.selector)
        if spec == "adaptive":
            return Adaptive(self.limits_w, self.selector, gpus=self.total_gpus)
        assert callable(spec)
        return spec(self.limits_w, self.selector)

    def _candidate_limits(self) -> list[float]:
        if self._limits_arg is not None:
            return sorted(set(self._limits_arg), reverse=True)
        lo = max(g.power_limit_range_w()[0] for g in self.gpus)
        hi = min(g.power_limit_range_w()[1] for g in self.gpus)
        neg_hi, lo = self._allreduce([-hi, lo], "max")
        hi = -neg_hi
        if lo > hi:
            raise JoulesError(f"the GPUs share no allowed power limit (ranges meet at [{lo:g}, {hi:g}] W)")
        n = int(math.floor((hi - lo) / self.step_w + 1e-9))
        # (max: a step that does not divide the range exactly in floating point can put the
        # last limit a hair below the lowest allowed, which the device refuses)
        return sorted({max(lo, hi - k * self.step_w) for k in range(n + 1)}, reverse=True)

    def _job_gpus(self) -> tuple[str, int, list[GPU]]:
        """The job's GPU model(s) and GPU count, and the GPUs whose energy this rank counts.

        Saved profiles are keyed by the model(s) and count. Ranks on one host may each see
        every GPU (``torchrun`` sets no ``CUDA_VISIBLE_DEVICES`` per rank): a GPU is counted
        once, by the lowest rank that sees it (by host and the UUID of what its readings
        measure: MIG instances of one GPU all read that whole GPU, which counts once).
        """
        host = host_name()
        mine = [(host, g.measured_uuid, g.name) for g in self.gpus]
        if self._dist is None:
            ranks = [mine]
        else:
            ranks = [[] for _ in range(self._dist.get_world_size())]
            self._dist.all_gather_object(ranks, mine)
        owner: dict[tuple[str, str], tuple[int, str]] = {}
        for rank, gpus in enumerate(ranks):
            for h, uuid, name in gpus:
                owner.setdefault((h, uuid), (rank, name))
        me = self._rank()
        counted: list[GPU] = []
        for g in self.gpus:
            if owner[(host, g.measured_uuid)][0] == me and all(
                    c.measured_uuid != g.measured_uuid for c in counted):
                counted.append(g)
        models = sorted({name for _, name in owner.values()})
        return (models[0] if len(models) == 1 else "+".join(models)), len(owner), counted

    def _load_saved(self) -> list[LimitPoint] | None:
        """The saved points at the current candidate limits (rank 0 reads, and broadcasts)."""
        points: list[LimitPoint] | None = None
        busiest: float | None = None
        if self.workload is not None and self._rank() == 0:
            try:
                saved, meta = self.store.read(self._model, self.total_gpus, self.workload)
                saved = saved or []
                busiest = self._saved_busiest(meta)
            except (ProfileError, OSError) as e:  # never fail training over a cache (nor hang
                log.warning("not using the saved power-limit profile: %s", e)  # other ranks)
                saved = []
            allowed = set(self.limits_w)
            points = [p for p in saved if p.limit_w in allowed] or None
            if saved and not points:
                log.warning("saved profile for %r has none of the candidate limits; profiling again",
                            self.workload)
            elif len(saved) > len(points or []):
                log.info("saved profile for %r: %d point(s) at limits that are not candidates now are "
                         "left aside", self.workload, len(saved) - len(points or []))
        if self._dist is not None:
            box = [points, busiest]
            self._dist.broadcast_object_list(box, src=0)
            points, busiest = box
        self._busiest_saved_w = busiest
        return points

    def _saved_busiest(self, meta: dict[str, Any]) -> float | None:
        """The busiest GPU's power at the highest limit, as a saved profile's ``meta`` has it."""
        value, at = meta.get("busiest_gpu_w"), meta.get("busiest_at_w")
        if isinstance(value, int | float) and at == self.limits_w[0] and math.isfinite(value) and value > 0:
            return float(value)
        return None

    def _save(self) -> None:
        """Add the points measured now to the saved profile (rank 0; never fails training)."""
        if (self.workload is None or self._rank() != 0 or self.dry_run or self._outliers_seen
                or self._changed_workload):
            return  # (points that left out the workload's own long steps are not kept)
        try:
            saved, meta = self.store.read(self._model, self.total_gpus, self.workload)
        except (ProfileError, OSError) as e:
            log.warning("not saving the power-limit profile: %s", e)
            return
        merged = {p.limit_w: p for p in saved or []}
        merged.update((x, self.points[x]) for x in self._measured)
        points = [merged[x] for x in sorted(merged, reverse=True)]
        busiest = getattr(self.search, "busiest_w", None)
        # (a job that did not measure it, a sweep's say, keeps the file's)
        extra = {"busiest_gpu_w": busiest, "busiest_at_w": self.limits_w[0]} if busiest is not None else {
            k: v for k, v in meta.items() if k in ("busiest_gpu_w", "busiest_at_w")}
        try:
            path = self.store.save(self._model, self.total_gpus, self.workload, points,
                                   warmup_steps=self.warmup_steps, profile_steps=self.profile_steps,
                                   selector=repr(self.selector), **extra)
            log.info("saved the profile to %s", path)
        except OSError as e:  # never fail training over a cache
            log.warning("could not save the power-limit profile: %s", e)

    def _rank(self) -> int:
        return self._dist.get_rank() if self._dist is not None else 0

    def _allreduce(self, values: list[float], op: str) -> list[float]:
        dist = self._dist
        if dist is None:
            return values
        import torch

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return [float(x) for x in t.tolist()]
