"""Background power sampler: one thread for all devices, bounded memory, O(1) window queries.

The sampler polls each GPU's power reading every ``interval_s`` seconds, its energy counter
(where there is one) at the same ticks until the counter's update phase is learned and then
only at the ticks just before and just after each update, and each CPU package's counters
often enough that no RAPL wraparound is missed. For every GPU it keeps

* a running energy integral of the power readings, so the energy between any two instants
  is the difference of two O(1) lookups however long the sampler has run;
* a :class:`CounterTracker` that learns when the energy counter updates, so that window
  edges falling between counter updates can be corrected;
* a ring buffer of recent samples (fixed capacity) for timeline export.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
import statistics
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from joules.clock import Clock, Timer
from joules.devices.base import CPU, GPU, fork_safe_lock

# Poll at a fraction of the counter period that is not a simple ratio, so that poll times
# sweep across the counter's update phase and the phase can be pinned down quickly.
_PHASE_SWEEP_RATIO = 0.29
# Floor of the default interval, also not a simple fraction of common counter periods.
_MIN_INTERVAL_S = 0.0107
# Assumed at most between a counter's updates where its period is not known (the slowest
# known period): it only bounds when the update behind the first value seen came.
_UNKNOWN_PERIOD_BOUND_S = 0.1


_GAP_INTERVALS = 10  # samples further apart than this many intervals, and than _GAP_MIN_S, leave a gap
_GAP_MIN_S = 0.25  # (missed_s) even where no read failed: a thread held up that long
_SPREAD_WINDOW_S = 1.0  # power_spread: the range of the readings of the last this many seconds ...
_SPREAD_INTERVALS = 20  # ... and at least this many intervals


class CounterTracker:
    """Learns the update phase of a periodically updated energy counter.

    Each observed change of the counter between two reads at ``a < b`` means an update
    happened in ``(a, b]``. With a known period ``T``, every such interval constrains the
    phase (update time modulo ``T``) to an arc; intersecting the arcs narrows it down to a
    few milliseconds within a second or two of polling. When observations contradict the
    current estimate (an irregular counter), the estimate restarts from the latest one.

    It also learns the update phase of a periodically refreshed power reading
    (``monotonic=False``): there any new value is an update, and reads are taken by one
    thread only.

    A counter whose period is not known (``learn_phase=False``) is tracked without a phase:
    each update is placed in the interval between the polls around it, no read is ever
    skipped, and ``period_s`` only bounds when the update behind the first value seen came.

    Args:
        period_s: Nominal update period of the counter.
        monotonic: Whether values only grow (energy counters), so that a smaller value is a
            stale read or a reset.
        learn_phase: Whether ``period_s`` is the counter's real period, whose phase can be
            learned.
    """

    __slots__ = ("period", "_arc_start", "_arc_len", "_last_value", "_last_t", "_lo", "_hi", "_lock",
                 "_changes", "_values", "_last_end", "snapshot", "monotonic", "learn_phase", "resets",
                 "rate", "__weakref__")  # weakly held by the fork hook that renews _lock

    history = 1024
    """Counter updates remembered, for interpolating window edges after the fact."""

    margin_s = 0.002
    """Safety margin around the learned update phase when deciding a read can be skipped."""

    stable_periods = 5
    """Periods without change after which a non-monotonic value is taken as steady."""

    def __init__(self, period_s: float, monotonic: bool = True, learn_phase: bool = True) -> None:
        self.period = period_s
        self.monotonic = monotonic
        self.learn_phase = learn_phase
        self.resets = 0
        """Times the counter was seen to go back (a driver reload or GPU reset)."""
        self._arc_start = 0.0
        self._arc_len = period_s  # phase unknown: the whole circle
        self._last_value: float | None = None
        self._last_t = -math.inf  # latest time at which the last value is known to have held
        self._last_end = -math.inf  # when the latest read ended
        # The update that produced the current value happened in (_lo, _hi].
        self._lo = -math.inf
        self._hi = -math.inf
        self._lock = fork_safe_lock(self)  # a forked child gets a free one
        # Recent updates: (new value, lo, hi), the update having happened in (lo, hi]; and
        # their values alone, for bisection.
        self._changes: deque[tuple[float, float, float]] = deque(maxlen=self.history)
        self._values: deque[float] = deque(maxlen=self.history)
        # (valid from, valid until, value, update time, half width): read lock-free by
        # :meth:`current`; replaced whole (atomically) after every observation.
        self.snapshot: tuple[float, float, float, float, float] | None = None
        self.rate: float | None = None
        """Mean rate of change between the two latest updates seen (W, for an energy counter):
        what the counter itself says of the power over its latest period."""

    @property
    def locked(self) -> bool:
        """Whether the phase is known to within a quarter period."""
        return self._arc_len <= self.period / 4.0

    def observe(self, t: float, value: float, t_before: float | None = None) -> tuple[float, float, float]:
        """Record a counter read that returned ``value``.

        Args:
            t: Time right after the read.
            value: The value read (the counter never decreases).
            t_before: Time right before the read (default ``t``). A read is not
                instantaneous, and another thread may be scheduled in the middle of it: the
                value held at some instant in ``[t_before, t]``.

        Returns:
            ``(latest value, estimate, half_width)``: the latest value known and when the
            update that produced it happened, as :meth:`update_time`. The latest value is
            ``value`` unless the read was stale: a read that began before another thread's
            read of a newer value ended (two threads reading at once) returns the older
            value, which is replaced by the newer one, so the value and its update time
            always belong together.
        """
        tb = t if t_before is None else t_before
        with self._lock:
            last = self._last_value
            if not self.monotonic and last is not None and value != last:
                last = -math.inf  # any new value is an update
            if last is not None and value < last and tb >= self._last_end:
                # Not a stale read (it began after the latest one ended): the counter was
                # reset. Start learning afresh.
                last = None
                self.resets += 1
                self._arc_start, self._arc_len = 0.0, self.period
                self._changes.clear()
                self._values.clear()
            self._last_end = max(self._last_end, t)
            if last is None:
                # The update that produced the first value seen came within a period before.
                self._record(value, t - self.period, t)
            elif value < last:  # a stale read adds nothing
                return (last, *self._estimate(self._lo, self._hi))
            elif value == last:
                self._last_t = max(self._last_t, tb)  # the old value still held at tb
                return (value, *self._refresh())
            else:
                # The old value held at or after _last_t; the new one by t.
                lo = min(self._last_t, t)
                self._record(value, lo, t)
                if self.learn_phase and 0 < t - lo < self.period:
                    self._narrow(lo % self.period, t - lo)
            self._last_value = value
            self._last_t = tb
            return (value, *self._refresh())

    def _record(self, value: float, lo: float, hi: float) -> None:
        if self._changes and self.monotonic:
            previous, p_lo, p_hi = self._changes[-1]
            span = self._estimate(lo, hi)[0] - self._estimate(p_lo, p_hi)[0]
            if span > 0 and lo > -math.inf and p_lo > -math.inf:
                self.rate = (value - previous) / span
        self._lo, self._hi = lo, hi
        self._changes.append((value, lo, hi))
        self._values.append(value)

    def _refresh(self) -> tuple[float, float]:
        """Recompute the latest update's estimate and the lock-free snapshot."""
        tick, half = self._estimate(self._lo, self._hi)
        until = -math.inf
        if self.locked:
            period, start, length, margin = self.period, self._arc_start, self._arc_len, self.margin_s
            # The first possible update (arc occurrence) that may end after the latest read.
            k = math.ceil((self._last_t - margin - (start + length)) / period)
            until = start + k * period - margin
        elif not self.monotonic and self._last_t - self._hi >= self.stable_periods * self.period:
            # A reading that has not changed for many periods (a steady load, whose phase
            # cannot be learned) is taken to hold for one more period.
            until = self._last_t + self.period - self.margin_s
        assert self._last_value is not None
        self.snapshot = (self._last_t, until, self._last_value, tick, half)
        return tick, half

    def _narrow(self, start: float, length: float) -> None:
        period = self.period
        if self._arc_len >= period:
            self._arc_start, self._arc_len = start, length
            return
        pieces = []
        for shift in (-period, 0.0, period):
            s2 = start + shift
            lo = max(self._arc_start, s2)
            hi = min(self._arc_start + self._arc_len, s2 + length)
            if hi >= lo:
                pieces.append((lo, hi))
        if not pieces:  # contradiction: the counter is not as periodic as assumed
            self._arc_start, self._arc_len = start, length
        else:
            # Where the interval meets the arc in two pieces, the phase may be in either: keep
            # the part of the arc that spans both (never one piece, which could drop it).
            lo, hi = min(p[0] for p in pieces), max(p[1] for p in pieces)
            self._arc_start, self._arc_len = lo % period, max(hi - lo, 1e-6)

    def _estimate(self, lo: float, hi: float) -> tuple[float, float]:
        """Narrow an update known to lie in ``(lo, hi]`` with the learned phase."""
        if self._arc_len < self.period:
            period = self.period
            start = self._arc_start + math.floor((hi - self._arc_start) / period) * period
            for s in (start, start - period):
                a, b = max(lo, s), min(hi, s + self._arc_len)
                if b > a:
                    lo, hi = a, b
                    break
        return (lo + hi) / 2.0, (hi - lo) / 2.0

    def update_time(self) -> tuple[float, float] | None:
        """When the update that produced the latest observed value happened.

        Returns ``(estimate, half_width)``, or ``None`` before the first observation.
        The change interval seen by polling is intersected with the learned phase.
        """
        with self._lock:
            if self._lo == -math.inf:
                return None
            return self._estimate(self._lo, self._hi)

    def current(self, t: float) -> tuple[float, float, float] | None:
        """The counter's value at ``t`` without reading it, when the phase proves it unchanged.

        When the phase is locked and no possible update (the learned phase arc, widened by
        :attr:`margin_s`) falls between the latest read and ``t``, a read at ``t`` would
        return the latest value. Lock-free: one attribute read and two comparisons.

        Returns:
            ``(value, update time estimate, half_width)``, or ``None`` when a read is needed.
        """
        snap = self.snapshot
        if snap is None or not snap[0] <= t < snap[1]:
            return None
        return snap[2], snap[3], snap[4]

    def update_after(self, value: float) -> tuple[float, float] | None:
        """The first remembered update that moved the counter past ``value``.

        Returns ``(update time estimate, new value)``, or ``None`` when there was none yet
        or it is no longer remembered.
        """
        with self._lock:
            i = bisect.bisect_right(self._values, value)
            if i == len(self._values) or i == 0:
                return None
            new, lo, hi = self._changes[i]
            return self._estimate(lo, hi)[0], new

    def update_of(self, value: float) -> tuple[float, float] | None:
        """When the remembered update that produced ``value`` happened, with the phase as now known.

        An edge that read ``value`` before the phase was learned placed its update anywhere in
        the period before the read; once the phase is known, the same observation narrows it.

        Returns:
            ``(estimate, half_width)``, or ``None`` when ``value`` is no longer remembered.
        """
        with self._lock:
            i = bisect.bisect_left(self._values, value)
            if i == len(self._values) or self._values[i] != value:
                return None
            _, lo, hi = self._changes[i]
            if lo == -math.inf:
                return None
            return self._estimate(lo, hi)

    def updates(self, start: float, end: float) -> list[tuple[float, float, float]]:
        """Remembered updates estimated within ``[start, end]``, oldest first.

        Returns:
            ``(update time estimate, half width, new value)`` of each.
        """
        with self._lock:
            out = []
            for value, lo, hi in self._changes:
                t, half = self._estimate(lo, hi)
                if start <= t <= end:
                    out.append((t, half, value))
            return out


@dataclass
class _GPUTrack:
    gpu: GPU
    tracker: CounterTracker | None
    times: np.ndarray
    powers: np.ndarray
    updates: np.ndarray  # when the sensor produced each reading (NaN: not known)
    count: int = 0
    energy: float = 0.0  # running integral of sampled power, J
    last_t: float = math.nan
    last_p: float = math.nan
    recent_max: float = 0.0
    recent_min: float = math.inf
    # Forgetting averages of the extremes: the swings of longer cycles than the window's.
    decayed_max: float = 0.0
    decayed_min: float = math.inf
    # The readings of the last _SPREAD_WINDOW_S whose later readings are all lower (higher):
    # the window's highest (lowest) reading is the first one.
    highs: deque[tuple[float, float]] = field(default_factory=deque)
    lows: deque[tuple[float, float]] = field(default_factory=deque)
    sensor: CounterTracker | None = None  # update phase of the power reading
    # Wall-clock seconds of the latest energy-counter reads (what a read costs the caller),
    # and their median.
    read_costs: deque[float] = field(default_factory=lambda: deque(maxlen=15))
    read_cost: float | None = None
    # Spans between two samples where reads failed (or the thread could not run for long):
    # the integral assumed the later reading's power over them.
    gaps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=256))
    failing_since: float = math.nan  # reads have failed since this time (NaN: the latest worked)


def _spread(track: _GPUTrack) -> float:
    """The range of the last spread window's readings, or the swing of longer cycles, if wider."""
    if not track.count:
        return 0.0
    return max(0.0, track.recent_max - track.recent_min, track.decayed_max - track.decayed_min)


class PowerSampler:
    """Samples device power on one background thread (or virtual-clock timer).

    Args:
        gpus: GPUs to sample.
        cpus: CPU packages whose wrapping counters must be kept current.
        clock: Clock to use (periodic work runs through ``clock.every``).
        interval_s: Sampling interval. Default: a fraction of the fastest sensor's update
            period chosen to learn counter phases quickly (29 ms for 100 ms sensors), at
            least 10 ms.
        capacity: Samples kept per GPU for timeline export (ring buffer).
    """

    def __init__(
        self,
        gpus: Sequence[GPU],
        cpus: Sequence[CPU] = (),
        clock: Clock | None = None,
        interval_s: float | None = None,
        capacity: int = 65536,
    ) -> None:
        from joules.clock import RealClock

        self.clock = clock or RealClock()
        self.cpus = list(cpus)
        if interval_s is None:
            periods = [
                p for g in gpus for p in (g.energy_counter_period_s(), g.power_update_period_s()) if p
            ]
            interval_s = max(_MIN_INTERVAL_S, _PHASE_SWEEP_RATIO * min(periods)) if periods else 0.1
        if interval_s <= 0:
            raise ValueError(f"sampling interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        self._gap_s = max(_GAP_INTERVALS * interval_s, _GAP_MIN_S)  # a longer span between samples is a gap
        self._spread_window_s = max(_SPREAD_WINDOW_S, _SPREAD_INTERVALS * interval_s)
        self.capacity = capacity
        self._tracks: dict[int, _GPUTrack] = {}
        for g in gpus:
            tracker = None
            if g.has_energy_counter():
                period = g.energy_counter_period_s()
                # A counter of unknown period (GPUs not yet characterized) is still the best
                # source; it is tracked without a phase.
                tracker = (CounterTracker(period) if period
                           else CounterTracker(_UNKNOWN_PERIOD_BOUND_S, learn_phase=False))
            power_period = g.power_update_period_s()
            self._tracks[g.index] = _GPUTrack(
                gpu=g,
                tracker=tracker,
                times=np.zeros(capacity),
                updates=np.full(capacity, math.nan),
                powers=np.zeros(capacity),
                sensor=CounterTracker(power_period, monotonic=False) if power_period else None,
            )
        # CPU zones are read four times per shortest wrap time, by the clock: ticks held up
        # (a GPU read that blocks) must not space the reads out past a wrap.
        self._cpu_period_s = min((c.max_read_interval_s() for c in self.cpus), default=60.0) / 4.0
        self._cpu_next = -math.inf
        self._ticks = 0
        self._lock = fork_safe_lock(self)  # a forked child gets a free one
        self._life_lock = fork_safe_lock(self, "_life_lock")
        self._timer: Timer | None = None
        self.errors = 0

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> PowerSampler:
        """Start sampling (idempotent); in a forked child, start the thread the parent's sampler had."""
        with self._life_lock:  # two threads starting at once start one thread
            if not self.running:
                self._timer = self.clock.every(self.interval_s, self._tick, name="joules-sampler")
        return self

    def stop(self) -> None:
        """Stop sampling (idempotent)."""
        with self._life_lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    @property
    def running(self) -> bool:
        """Whether the sampler is started (and, on a thread, that thread exists in this process)."""
        return self._timer is not None and getattr(self._timer, "alive", True)

    def _tick(self, now: float) -> None:
        next_tick = now + self.interval_s
        for track in self._tracks.values():
            # A counter whose learned phase proves it cannot change before the next tick is
            # not read: reads come at the last tick before each update and the first after it,
            # which is what the phase and the edges need (about two reads per counter period
            # instead of one per tick). A counter read that fails leaves the power reading to
            # be taken: a window whose end cannot read the counter is measured from them.
            if track.tracker is not None and track.tracker.current(next_tick) is None:
                try:
                    t_before = self.clock.now()
                    w0 = time.perf_counter()
                    value = track.gpu.energy_j()
                    track.read_costs.append(time.perf_counter() - w0)
                    track.read_cost = statistics.median(track.read_costs)
                    track.tracker.observe(self.clock.now(), value, t_before)
                except Exception:  # noqa: BLE001 - a flaky read must not kill the sampler
                    self.errors += 1
            try:
                t_before = self.clock.now()
                p = track.gpu.power_w()
                t = self.clock.now()
            except Exception:  # noqa: BLE001 - a flaky read must not kill the sampler
                self.errors += 1
                if math.isnan(track.failing_since):
                    track.failing_since = self.clock.now()
                continue
            update = track.sensor.observe(t, p, t_before)[1] if track.sensor is not None else None
            # Energy comes from the counter where there is one: keep the plain integral there.
            self._add(track, t, p, update if track.tracker is None else None)
        self._ticks += 1
        if self.cpus and self.clock.now() >= self._cpu_next:
            self._cpu_next = self.clock.now() + self._cpu_period_s
            for cpu in self.cpus:
                for read in (cpu.package_energy_j, *([cpu.dram_energy_j] if cpu.has_dram() else [])):
                    try:  # (each zone on its own: a failing package read does not stop DRAM's)
                        read()
                    except Exception:  # noqa: BLE001
                        self.errors += 1

    def counter_read_cost_s(self, index: int) -> float | None:
        """Median wall-clock time of the sampler's latest reads of GPU ``index``'s energy counter.

        ``None`` before the first read, or without a counter. Reading the counter costs
        microseconds on most GPUs, but milliseconds on some (about 3 ms on an H200 with driver
        580): the monitor then avoids reading it at window edges.
        """
        return self._tracks[index].read_cost

    def _add(self, track: _GPUTrack, t: float, p: float, update: float | None = None) -> None:
        """Add a reading ``p`` taken at ``t``; ``update``: when the sensor produced it, if known.

        A reading describes the power before it was taken. Without a known update time it
        covers the interval since the previous sample; with one (the sensor's update phase
        learned as for counters), a new value covers the sensor period before its update.
        Either way the integral is exact at constant power, whatever the number of repeated
        readings.
        """
        with self._lock:
            if track.count:
                previous = float(track.times[(track.count - 1) % self.capacity])
                if not math.isnan(track.failing_since) or t - previous > self._gap_s:
                    track.gaps.append((previous, t))
            track.failing_since = math.nan
            if update is None:
                if track.count and t > track.last_t:
                    track.energy += p * (t - track.last_t)
                track.last_t = t
            elif not track.count:
                track.last_t = update
            elif p != track.last_p and update > track.last_t:
                # The new value covers the sensor period ending at its update; before that,
                # the sensor kept updating to the previous value.
                assert track.sensor is not None
                split = max(track.last_t, update - track.sensor.period)
                track.energy += track.last_p * (split - track.last_t) + p * (update - split)
                track.last_t = update
            i = track.count % self.capacity
            track.times[i] = t
            track.updates[i] = math.nan if update is None else update
            track.powers[i] = p
            track.count += 1
            track.last_p = p
            # The spread of the readings of the last few seconds, for uncertainty bounds (a
            # forgetting average of the extremes leaked: under a periodic load, each low phase
            # was forgotten by the next, and an edge's bound fell short of the swing).
            highs, lows, start = track.highs, track.lows, t - self._spread_window_s
            while highs and highs[-1][1] <= p:
                highs.pop()
            while lows and lows[-1][1] >= p:
                lows.pop()
            highs.append((t, p))
            lows.append((t, p))
            while highs[0][0] < start:
                highs.popleft()
            while lows[0][0] < start:
                lows.popleft()
            track.recent_max, track.recent_min = highs[0][1], lows[0][1]
            # ... and, beside it, how the power swung over longer cycles (a forgetting average of
            # the extremes, decaying 2 % a reading): a load that alternates every few seconds
            # may swing again at the next edge, though the last second was steady.
            track.decayed_max = max(p, track.decayed_max * 0.98 + p * 0.02)
            track.decayed_min = min(p, track.decayed_min * 0.98 + p * 0.02)

    # -- queries (O(1)) ---------------------------------------------------------------------
    def missed_s(self, index: int, start: float, end: float, slack: float = 0.0) -> float:
        """Seconds of ``[start, end]`` in gaps between GPU ``index``'s samples, less ``slack`` each.

        A gap is a span between two samples where reads failed, or longer than
        ``_GAP_INTERVALS`` intervals and ``_GAP_MIN_S`` (a thread that could not run for
        long); its energy was taken at the later reading's power. Reads failing still count
        up to ``end``. ``slack``: what each span could be off anyway (already bounded).
        """
        with self._lock:
            track = self._tracks[index]
            gaps = list(track.gaps)
            if not math.isnan(track.failing_since) and track.count:
                gaps.append((float(track.times[(track.count - 1) % self.capacity]), end))
        return sum(max(0.0, min(b, end) - max(a, start) - slack) for a, b in gaps)

    def sample_now(self, index: int) -> None:
        """Take one sample of GPU ``index`` immediately (used when none exists yet)."""
        track = self._tracks[index]
        self._add(track, self.clock.now(), track.gpu.power_w())

    def energy_integral(self, index: int, t: float) -> float:
        """Integral of sampled power of GPU ``index`` from the first sample to time ``t``, J.

        Past the latest sample the latest reading is extrapolated.
        """
        track = self._tracks[index]
        if not track.count:
            self.sample_now(index)
        with self._lock:
            return track.energy + track.last_p * (t - track.last_t)

    def integral_state(self, index: int) -> tuple[int, float, float, float]:
        """``(sample count, integral at the latest sample J, its time, its power W)`` at once."""
        track = self._tracks[index]
        if not track.count:
            self.sample_now(index)
        with self._lock:
            return track.count, track.energy, track.last_t, track.last_p

    def integral_now(self, index: int, t: float) -> float:
        """The sampled-power integral of GPU ``index`` up to ``t`` (after its latest sample), J.

        Lock-free, for window edges: a sample added at the same moment may be half seen,
        which moves the result by at most one sample's energy.
        """
        track = self._tracks[index]
        return track.energy + track.last_p * (t - track.last_t)

    def sample(self, index: int, i: int) -> tuple[float, float] | None:
        """The ``i``-th sample of GPU ``index`` as ``(time, power)``, if still retained."""
        track = self._tracks[index]
        with self._lock:
            if not track.count - self.capacity <= i < track.count:
                return None
            j = i % self.capacity
            return float(track.times[j]), float(track.powers[j])

    def sensor_update(self, index: int, i: int) -> tuple[float, float] | None:
        """When the sensor produced the ``i``-th reading of GPU ``index``, and its period.

        ``None`` where that is not known (no sensor phase is learned for this GPU, or the
        sample is no longer retained).
        """
        track = self._tracks[index]
        with self._lock:
            if track.sensor is None or not track.count - self.capacity <= i < track.count:
                return None
            u = float(track.updates[i % self.capacity])
        return None if math.isnan(u) else (u, track.sensor.period)

    def latest_power(self, index: int) -> float:
        """Most recent power reading of GPU ``index``, W."""
        track = self._tracks[index]
        if not track.count:
            self.sample_now(index)
        return track.last_p

    def power_spread(self, index: int) -> float:
        """Recent spread (max - min) of GPU ``index``'s power readings, W."""
        return _spread(self._tracks[index])

    def spread_around(self, index: int, sample: int) -> float:
        """Spread of GPU ``index``'s readings around its ``sample``-th: a spread window's worth each side, W.

        What :meth:`power_spread` said near that sample, looked at afterwards (a window's begin
        edge, once the window ends), and with the readings that followed it. Retained readings
        only; 0 where none is.
        """
        track = self._tracks[index]
        span = max(1, math.ceil(self._spread_window_s / self.interval_s))
        with self._lock:
            first = max(sample - span, track.count - self.capacity, 0)
            last = min(sample + span, track.count)
            if last <= first:
                return 0.0
            idx = np.arange(first, last) % self.capacity
            values = track.powers[idx]
            return float(values.max() - values.min())

    def edge_state(self, index: int) -> tuple[int, float, float]:
        """``(sample count, latest power W, recent power spread W)`` of GPU ``index`` at once."""
        track = self._tracks[index]
        if not track.count:
            self.sample_now(index)
        return track.count, track.last_p, _spread(track)

    def sample_count(self, index: int) -> int:
        """Number of samples of GPU ``index`` taken so far."""
        return self._tracks[index].count

    def fresh_power(self, index: int, t: float) -> float | None:
        """GPU ``index``'s power reading at ``t`` if the sampler's is provably still current.

        ``None`` when the sensor may have refreshed since the sampler's latest read.
        """
        sensor = self._tracks[index].sensor
        known = sensor.current(t) if sensor is not None else None
        return None if known is None else known[0]

    def tracker(self, index: int) -> CounterTracker | None:
        """The counter tracker of GPU ``index`` (``None`` without an energy counter)."""
        return self._tracks[index].tracker

    # -- export -----------------------------------------------------------------------------
    def timeline(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Retained samples of GPU ``index`` in time order: (times s, power W)."""
        track = self._tracks[index]
        with self._lock:
            n = min(track.count, self.capacity)
            start = track.count % self.capacity if track.count > self.capacity else 0
            order = (np.arange(n) + start) % self.capacity
            return track.times[order].copy(), track.powers[order].copy()

    def export(self, path: str | Path) -> Path:
        """Write every retained sample to ``path`` (``.csv`` or ``.jsonl``).

        Each GPU keeps its latest ``capacity`` samples (a ring): where more were taken, the
        earliest are not in the file, and a :class:`RuntimeWarning` says how many and until when.
        """
        path = Path(path)
        rows = []
        for index in sorted(self._tracks):
            times, powers = self.timeline(index)
            taken = self._tracks[index].count
            if taken > self.capacity and times.size:
                warnings.warn(f"timeline {path}: GPU {index}: the first {taken - self.capacity} of {taken} "
                              f"samples, before t = {times[0]:.1f} s, are not kept (the latest "
                              f"{self.capacity} are)", RuntimeWarning, stacklevel=2)
            rows.extend((float(t), f"gpu{index}", float(p)) for t, p in zip(times, powers, strict=True))
        rows.sort()
        if path.suffix == ".jsonl":
            with path.open("w") as f:
                for t, dev, p in rows:
                    f.write(json.dumps({"time_s": t, "device": dev, "power_w": p}) + "\n")
        elif path.suffix == ".csv":
            with path.open("w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["time_s", "device", "power_w"])
                w.writerows(rows)
        else:
            raise ValueError(f"timeline export needs a .csv or .jsonl path, got {path}")
        return path
