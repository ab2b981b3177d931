"""Profile a pipeline stage's computations at each SM clock, during training.

The planner needs, for every stage, the time and energy of one forward and one backward at
each GPU clock (:class:`~joules.optimizers.pipeline.profile.PipelineProfile`). On real
hardware they are measured where they run: in the first iterations of the training job
itself. :class:`StageProfiler` takes the same callbacks as the
:class:`~joules.optimizers.pipeline.controller.FrequencyController` that later applies the
plan (``on_instruction_begin`` / ``on_instruction_end``) and, on each rank:

1. locks the stage's GPU to one clock (through a
   :class:`~joules.devices.restore.RestoreGuard`, so the clock is reset at the end, on an
   exception, on SIGINT/SIGTERM/SIGHUP and at exit, and after a SIGKILL by the next job or
   ``joules restore``), from the highest down;
2. measures every forward and backward at that clock as a window of the
   :class:`~joules.monitoring.monitor.EnergyMonitor` (so a monitor made with
   ``sync="torch"`` waits for the GPU at each edge), and the gaps between them, leaving out
   the first ``warmup`` of each kind after a clock change, until it has ``samples`` of each
   kind and has stayed ``min_span_s``;
3. splits the energy the GPU's counter saw between consecutive updates at that clock among
   forwards, backwards and gaps (one power each, least squares), which is free of the edge
   errors of windows shorter than the counter's period;
4. moves on to the next clock; after the last one it resets the clock and goes quiet (the
   callbacks then cost next to nothing), and :meth:`StageProfiler.profile` is the stage's
   profile.

The gaps between computations are, on a pipeline rank, mostly waits for a neighbour, so their
power estimates the *blocking power* (:attr:`StageProfiler.blocking_power_w`). They also hold
whatever else runs there (optimizer step, data loading), so it errs high where those are long.

Each rank writes its own rows (:meth:`StageProfiler.to_csv`); ``joules pipeline plan
--profile rank0.csv --profile rank1.csv ...`` (or :meth:`PipelineProfile.merge
<joules.optimizers.pipeline.profile.PipelineProfile.merge>`) joins them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from joules.devices.base import GPU
from joules.devices.restore import RestoreGuard
from joules.errors import JoulesError, WindowError
from joules.optimizers.pipeline.controller import clock_guard, lock_clock, normalize_kind, snap_frequency
from joules.optimizers.pipeline.profile import PipelineProfile
from joules.optimizers.pipeline.schedule import KINDS, Kind

if TYPE_CHECKING:
    from joules.monitoring.monitor import EnergyMonitor

log = logging.getLogger(__name__)


class ProfilingError(JoulesError, RuntimeError):
    """The profiler was driven wrongly (e.g. a computation ended that had not begun), or has no data."""


def _supported_clocks(gpu: GPU) -> list[float]:
    """``gpu``'s supported SM clocks, MHz; ``ValueError`` when it reports none."""
    clocks = list(gpu.supported_sm_clocks_mhz())
    if not clocks:
        raise ValueError(f"GPU {gpu.index} ({gpu.name}) reports no supported SM clocks")
    return clocks


def default_frequencies(gpu: GPU, lowest_mhz: float | None = None, step: int = 1) -> list[float]:
    """Supported SM clocks of ``gpu`` from ``lowest_mhz`` (default: 60% of the highest) up, ascending.

    Args:
        gpu: The GPU.
        lowest_mhz: Lowest clock to include.
        step: Take every ``step``-th clock counted from the highest.

    Raises:
        ValueError: The GPU reports no supported clocks, or none is at least ``lowest_mhz``.
    """
    clocks = sorted(_supported_clocks(gpu), reverse=True)
    lo = 0.6 * clocks[0] if lowest_mhz is None else lowest_mhz
    chosen = sorted(f for f in clocks[:: max(1, step)] if f >= lo)
    if not chosen:
        raise ValueError(f"GPU {gpu.index} has no supported SM clock at or above {lo:g} MHz "
                         f"(highest: {clocks[0]:g} MHz)")
    return chosen


@dataclass(frozen=True)
class Sample:
    """One measured computation.

    Attributes:
        computation: ``"forward"`` or ``"backward"``.
        microbatch: Its microbatch.
        frequency: The SM clock it ran at, MHz.
        time_s: Its time, s.
        energy_j: The GPU's energy during it as its own window measured it, J (the profile's
            energies are attributed where they can be, see :meth:`StageProfiler.rows`).
    """

    computation: Kind
    microbatch: int
    frequency: int
    time_s: float
    energy_j: float


FIT_PATIENCE = 3.0  # a clock whose energy cannot be attributed yet stays up to this many min_span_s


class StageProfiler:
    """Measures one pipeline stage's forward and backward at each SM clock as training runs.

    Example:
        >>> mon = EnergyMonitor(gpu_indices=[rank], sync="torch")
        >>> prof = StageProfiler(mon, stage=rank)
        >>> while not prof.done:                    # the first iterations of training
        ...     for kind, mb in my_schedule(rank):
        ...         prof.on_instruction_begin(kind, mb)
        ...         run(kind, mb)
        ...         prof.on_instruction_end(kind, mb)
        >>> prof.to_csv(f"profile-rank{rank}.csv")

    Args:
        monitor: Measures the computations; it must measure the stage's GPU.
        stage: The pipeline stage this rank runs (the profile's ``stage`` column).
        gpu: Index of the stage's GPU (as the monitor names it). Default: the monitor's only GPU.
        frequencies: Clocks to profile, MHz (each snapped to a supported one). Default:
            :func:`default_frequencies` with ``lowest_mhz`` and ``step``.
        lowest_mhz: Lowest default clock.
        step: Spacing of the default clocks (every ``step``-th supported clock).
        warmup: Computations of each kind left out after each clock change.
        samples: Computations of each kind measured (and averaged) at each clock, at least.
        min_span_s: Stay at each clock at least this long, s (default: 20 periods of the GPU's
            energy counter, 0 without one), so that enough counter updates fall within it
            for the energies to be attributed (see the module docs).
        guard: The :class:`RestoreGuard` the locks go through (default: a new one over the GPU).
        dry_run: Never touch the GPU: measure the computations at whatever clock the GPU runs,
            and record in :attr:`would_lock` the locks that would have been made. Checks the
            measurement path (see :meth:`measured`); :meth:`profile` refuses, as every sample
            ran at the same clock.
        journal_dir: Journal directory of the default guard.
        handle_signals: Whether the default guard restores on SIGINT, SIGTERM and SIGHUP too.
        recover_stale: Whether the default guard first resets what killed jobs left locked.

    Raises:
        ValueError: Bad ``stage``, ``warmup``, ``samples`` or frequencies, or no such GPU.
    """

    def __init__(
        self,
        monitor: EnergyMonitor,
        stage: int,
        *,
        gpu: int | None = None,
        frequencies: Sequence[float] | None = None,
        lowest_mhz: float | None = None,
        step: int = 1,
        warmup: int = 1,
        samples: int = 3,
        min_span_s: float | None = None,
        guard: RestoreGuard | None = None,
        dry_run: bool = False,
        journal_dir: str | Path | None = None,
        handle_signals: bool = True,
        recover_stale: bool = True,
    ) -> None:
        if stage < 0:
            raise ValueError(f"stage must be >= 0, got {stage}")
        if warmup < 0 or samples < 1:
            raise ValueError(f"warmup must be >= 0 and samples >= 1 (got {warmup} and {samples})")
        self.monitor = monitor
        self.stage = int(stage)
        self.gpu = self._pick_gpu(monitor, gpu)
        if frequencies is None:
            clocks = default_frequencies(self.gpu, lowest_mhz, step)
        else:
            if not frequencies:
                raise ValueError("frequencies is empty")
            supported = _supported_clocks(self.gpu)
            clocks = sorted({snap_frequency(float(f), supported) for f in frequencies})
        self.frequencies: tuple[float, ...] = tuple(sorted(clocks, reverse=True))  # highest first
        self.warmup, self.samples = int(warmup), int(samples)
        period = self.gpu.energy_counter_period_s() if self.gpu.has_energy_counter() else None
        self.min_span_s = float(min_span_s) if min_span_s is not None else 20.0 * (period or 0.0)
        self.dry_run = dry_run
        self.guard = clock_guard(self.gpu, guard, dry_run, journal_dir, handle_signals, recover_stale)
        self.would_lock: list[float] = []
        """Dry run: the clocks that would have been locked, in order."""
        self._samples: list[Sample] = []
        self._segments: list[tuple[float, float, int]] = []  # (start, end, kind) at the current clock
        self._powers: dict[int, np.ndarray] = {}  # clock -> attributed (forward, backward, gap) power, W
        self._index = 0
        self._complete: list[int] = []  # clocks measured in full, MHz
        self._closed = False
        self._seen = dict.fromkeys(KINDS, 0)  # computations of each kind at the current clock
        self._locked: float | None = None
        self._running: tuple[Kind, int] | None = None
        self._gap_open = False
        self._window = f"joules-pipeline-profile-stage{self.stage}"
        self._gap = f"joules-pipeline-gap-stage{self.stage}"

    @staticmethod
    def _pick_gpu(monitor: EnergyMonitor, index: int | None) -> GPU:
        gpus = {g.index: g for g in monitor.gpus}
        if index is None:
            if len(gpus) != 1:
                raise ValueError(f"the monitor measures GPUs {sorted(gpus)}; pass gpu= to say which "
                                 "one runs this stage")
            return next(iter(gpus.values()))
        if index not in gpus:
            raise ValueError(f"the monitor does not measure GPU {index} (it measures {sorted(gpus)})")
        return gpus[index]

    # -- state --------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Whether every clock has been profiled, or profiling was closed (the clock is then reset)."""
        return self._closed or self._index >= len(self.frequencies)

    @property
    def current_mhz(self) -> float | None:
        """The clock being profiled (``None`` when done)."""
        return None if self.done else self.frequencies[self._index]

    @property
    def progress(self) -> tuple[int, int]:
        """``(clocks measured in full, clocks to profile)``."""
        return len(self._complete), len(self.frequencies)

    @property
    def blocking_power_w(self) -> float | None:
        """GPU power between computations, W: the median over the clocks attributed so far.

        ``None`` before any clock was attributed (or without an energy counter).
        """
        if not self._powers:
            return None
        return float(np.median([p[2] for p in self._powers.values()]))

    @property
    def attributed(self) -> list[int]:
        """Clocks (MHz) whose energies come from the counter's updates (the rest: from the windows)."""
        return sorted(self._powers)

    def measured(self) -> list[Sample]:
        """Every computation kept so far (warm-up ones left out), in order."""
        return list(self._samples)

    # -- callbacks ----------------------------------------------------------------------------
    def on_instruction_begin(self, computation: str, microbatch: int) -> float | None:
        """A computation begins: lock the clock being profiled (if not already) and start measuring.

        Returns:
            The clock it runs at, MHz (``None`` once profiling is done).

        Raises:
            ProfilingError: Another computation is still running.
            DevicePermissionError: The clock cannot be locked; the GPU is unchanged.
        """
        if self.done:
            return None
        kind = normalize_kind(computation)
        if self._running is not None:
            raise ProfilingError(f"stage {self.stage}: {kind} {microbatch} began while "
                                 f"{self._running[0]} {self._running[1]} was still running")
        mhz = self.frequencies[self._index]
        if self._gap_open:
            self._gap_open = False
            m = self.monitor.end_window(self._gap)
            self._segments.append((m.start_time, m.start_time + m.elapsed_s, 2))
        if self._locked != mhz or (self.guard is not None and not self.dry_run
                                   and not self.guard.holds_sm_clock(self.gpu, (mhz, mhz))):
            self._lock(mhz)  # (again, when something reset the clock through a shared guard)
        self.monitor.begin_window(self._window)
        self._running = (kind, int(microbatch))
        return mhz

    def on_instruction_end(self, computation: str, microbatch: int) -> None:
        """The computation ends: record it; after enough of both kinds, move to the next clock.

        Raises:
            ProfilingError: It is not the computation that began last.
        """
        if self.done:
            return
        key = (normalize_kind(computation), int(microbatch))
        if self._running != key:
            running = "nothing" if self._running is None else f"{self._running[0]} {self._running[1]}"
            raise ProfilingError(f"stage {self.stage}: {key[0]} {key[1]} ended, but {running} was running")
        m = self.monitor.end_window(self._window)
        self._running = None
        kind, mb = key
        self._seen[kind] += 1
        if self._seen[kind] > self.warmup:
            # (a warm-up computation is in no fit interval either: one that overlaps it is not
            # accounted for in full, and is left out)
            self._segments.append((m.start_time, m.start_time + m.elapsed_s, KINDS.index(kind)))
            mhz = self.frequencies[self._index]
            self._samples.append(Sample(kind, mb, int(round(mhz)), m.elapsed_s,
                                        m.gpu_energy_j.get(self.gpu.index, 0.0)))
        span = self._segments[-1][1] - self._segments[0][0] if self._segments else 0.0
        if all(n >= self.warmup + self.samples for n in self._seen.values()) and span >= self.min_span_s:
            mhz = int(round(self.frequencies[self._index]))
            # A clock whose intervals do not tell the kinds apart yet (work in step with the
            # counter's period) stays a while longer: a little drift is enough to separate them.
            if not self._attribute(mhz, final=span >= FIT_PATIENCE * self.min_span_s):
                self.monitor.begin_window(self._gap)
                self._gap_open = True
                return
            self._segments = []
            self._complete.append(mhz)
            self._index += 1
            self._seen = dict.fromkeys(KINDS, 0)
            if self.done:
                self.restore()
                log.info("stage %d: profiled %d clocks", self.stage, len(self.frequencies))
                return
        self.monitor.begin_window(self._gap)
        self._gap_open = True

    def _attribute(self, mhz: int, final: bool) -> bool:
        """Split the energy the counter saw at this clock between forwards, backwards and gaps.

        Each pair of consecutive counter updates gives the exact energy between them; the time
        each kind of work (and the gaps) took within that interval is known from the windows.
        A least-squares fit of one power per kind to these intervals is free of the edge
        errors of windows shorter than the counter's period.

        Returns:
            Whether the clock is done: attributed, impossible to attribute (no energy
            counter), or ``final`` (the windows' energies are kept, with a warning).
        """
        segments = self._segments
        tracker = self.monitor.sampler.tracker(self.gpu.index)
        if tracker is None:
            return True
        if len(segments) < 3:
            return final
        seg = np.asarray(segments, dtype=np.float64)
        updates = tracker.updates(seg[0, 0], seg[-1, 1])
        rows, energies = [], []
        for (ta, ha, va), (tb, hb, vb) in zip(updates, updates[1:], strict=False):
            if tb - ta <= 4 * (ha + hb):
                continue  # update times too uncertain for this interval
            overlap = np.clip(np.minimum(seg[:, 1], tb) - np.maximum(seg[:, 0], ta), 0.0, None)
            x = np.bincount(seg[:, 2].astype(np.int64), weights=overlap, minlength=3)
            if x.sum() >= 0.99 * (tb - ta):  # the whole interval is accounted for
                rows.append(x)
                energies.append(vb - va)
        why = None
        if len(rows) < 6:
            why = f"{len(rows)} usable counter intervals"
        else:
            power, _, rank, _ = np.linalg.lstsq(np.asarray(rows), np.asarray(energies), rcond=None)
            if rank < 3 or not all(math.isfinite(p) and p > 0 for p in power):
                # (every interval holding the same mix of work: in step with the counter's period)
                why = f"the counter intervals do not tell forwards, backwards and gaps apart (rank {rank})"
        if why is None:
            self._powers[mhz] = power
            return True
        if final:
            log.warning("stage %d: %s at %d MHz; its energies come from windows shorter than the "
                        "counter's period, which can be off by 10 %% or more", self.stage, why, mhz)
        return final

    def _lock(self, mhz: float) -> None:
        if self.dry_run:
            self.would_lock.append(mhz)
        else:
            assert self.guard is not None
            lock_clock(self.guard, self.gpu, mhz, "only check the measurements")
        self._locked = mhz

    # -- results ------------------------------------------------------------------------------
    def rows(self) -> list[tuple[int, str, int, float, float]]:
        """``(stage, instruction, frequency, time_s, energy_j)``, averaged per clock and kind.

        Only clocks measured in full are included. The energy is the attributed power times the
        mean time where the clock was attributed (:attr:`attributed`), else the windows' mean.
        """
        complete = set(self._complete)
        sums: dict[tuple[str, int], list[float]] = {}
        for s in self._samples:
            if s.frequency in complete:
                acc = sums.setdefault((s.computation, s.frequency), [0.0, 0.0, 0.0])
                acc[0] += s.time_s
                acc[1] += s.energy_j
                acc[2] += 1
        out = []
        for (kind, f), (t, e, n) in sorted(sums.items()):
            power = self._powers.get(f)
            energy = power[KINDS.index(kind)] * t / n if power is not None else e / n
            out.append((self.stage, kind, f, t / n, float(energy)))
        return out

    def profile(self, name: str | None = None) -> PipelineProfile:
        """This stage's profile, of the clocks measured in full so far.

        Raises:
            ProfilingError: A dry run (every computation ran at the GPU's own clock), or no
                clock has been measured in full yet.
        """
        if self.dry_run:
            raise ProfilingError(f"stage {self.stage}: a dry run locks no clock, so it has no profile "
                                 "(its measurements are in measured())")
        rows = self.rows()
        if not rows:
            raise ProfilingError(f"stage {self.stage}: no clock measured in full yet "
                                 f"({self.warmup + self.samples} forwards and backwards each)")
        return PipelineProfile.from_rows(rows, name=name or f"stage{self.stage}-gpu{self.gpu.index}")

    def to_csv(self, path: str | Path) -> None:
        """Write :meth:`profile` as a ``stage,instruction,frequency,time,energy`` CSV file."""
        self.profile().to_csv(path)

    # -- restore ------------------------------------------------------------------------------
    def restore(self) -> list[str]:
        """Stop measuring and reset the clock (through the guard); idempotent.

        Returns:
            The guard's error lines (empty when everything was restored, and in a dry run).
        """
        try:
            for name, is_open in ((self._window, self._running is not None), (self._gap, self._gap_open)):
                if is_open:
                    with contextlib.suppress(WindowError):  # e.g. the monitor was closed first
                        self.monitor.cancel_window(name)
        finally:
            self._running = None
            self._gap_open = False
            self._locked = None
            self._segments = []
            # Only this stage's GPU: a guard shared with other stages' profilers keeps theirs locked.
            errors = [] if self.guard is None else self.guard.restore(self.gpu)
        return errors

    def close(self) -> list[str]:
        """Stop profiling for good (the callbacks then do nothing) and reset the clock.

        The clocks measured in full so far stay in :meth:`profile`.
        """
        self._closed = True
        return self.restore()

    def __enter__(self) -> StageProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ProfilingError", "Sample", "StageProfiler", "default_frequencies"]
