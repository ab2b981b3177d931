"""EnergyMonitor: time and energy of named windows of code, per GPU, CPU package and DRAM."""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, overload

from joules.devices.base import CPU, GPU, DeviceSet, host_name, renew_locks_after_fork
from joules.devices.discovery import discover
from joules.errors import (
    DeviceNotFoundError,
    DevicePermissionError,
    JoulesError,
    NothingMeasuredWarning,
    WindowError,
)
from joules.monitoring.log import WindowLog
from joules.monitoring.measurement import DeviceEnergy, Measurement, Source
from joules.monitoring.sampler import CounterTracker, PowerSampler
from joules.monitoring.sync import SyncSpec, make_sync

P = ParamSpec("P")
R = TypeVar("R")

# Counter resolution of NVML (1 mJ) and RAPL-scale resolution used in uncertainty bounds.
_GPU_COUNTER_RESOLUTION_J = 0.001
_GPU_POWER_RESOLUTION_W = 0.001  # NVML power readings are whole milliwatts
_RAPL_EDGE_S = 0.002  # two edges, each up to one RAPL update period (about 1 ms) late
# Windows at least this long give a CPU zone's rate for bounding later, shorter windows.
_RAPL_RATE_MIN_S = 0.05


@dataclass(slots=True)
class _GPUEdge:
    energy: float  # J, on the device's own (counter or sampled-integral) scale
    uncertainty: float
    samples: int  # sampler's sample count at the edge
    t: float = math.nan  # time of the counter read
    counter: float = math.nan  # raw counter value read
    tick: float = math.nan  # estimated time of the update that produced ``counter``
    resets: int = 0  # counter resets the tracker had seen by the edge
    integral: float = math.nan  # sampler's running integral of sampled power at the edge, J
    half: float = math.nan  # half width of ``tick``'s estimate
    power: float = math.nan  # the power reading extrapolated from ``tick``, W
    unread: bool = False  # a lenient end edge whose counter read failed: measured from samples


@dataclass(slots=True)
class _Edge:
    name: str
    t: float
    gpu: list[_GPUEdge]
    cpu: list[float | None]  # None: unread (a lenient end edge)
    dram: list[float | None]  # None: no DRAM zone, or unread (a lenient end edge)


class WindowHandle:
    """What :meth:`EnergyMonitor.window` yields; holds the measurement once the block ends."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.measurement: Measurement | None = None


def _select(items: Sequence[GPU] | Sequence[CPU], wanted: Sequence[int] | None, kind: str) -> list:
    if wanted is None:
        return list(items)
    by_index = {d.index: d for d in items}
    out = []
    for i in wanted:
        if i not in by_index:
            have = ", ".join(str(k) for k in sorted(by_index)) or "none"
            raise DeviceNotFoundError(f"{kind} index {i} not found (available: {have})")
        out.append(by_index[i])
    return out


def _select_cpus(cpus: Sequence[CPU], wanted: Sequence[int] | None) -> list[CPU]:
    """The CPU packages to measure: all readable ones by default, else exactly those asked for.

    By default a package whose energy this process cannot read (RAPL counters are root-only
    since Linux 5.10) is left out with a warning, so that GPUs are still measured. One asked
    for by index must be readable.

    Raises:
        DeviceNotFoundError: An index does not exist.
        DevicePermissionError: A package asked for cannot be read.
    """
    chosen: list[CPU] = _select(cpus, wanted, "CPU")
    unreadable = [c for c in chosen if not c.readable()]
    if not unreadable:
        return chosen
    problems = [p for c in unreadable for p in c.problems()[:1]]
    why = problems[0].message if problems else "its energy counters cannot be read"
    fixes = " / ".join(dict.fromkeys(p.fix for p in problems if p.fix))
    indices = ", ".join(str(c.index) for c in unreadable)
    message = f"CPU {indices}: {why}" + (f" (and {len(unreadable) - 1} more)" if len(unreadable) > 1 else "")
    message += f". Fix: {fixes}" if fixes else ""
    if wanted is not None:
        raise DevicePermissionError(f"cannot measure {message}")
    warnings.warn(f"CPU package energy left out of the measurement: {message}", RuntimeWarning, stacklevel=3)
    return [c for c in chosen if c.readable()]


def _after_fork_in_child(monitor: EnergyMonitor) -> None:
    """A forked child's copy of a monitor: a free lock, and a sampler to start at the next edge."""
    monitor._lock = threading.Lock()
    monitor._forked = True


def _read_leniently(fn: Callable[[], float]) -> float | None:
    """``fn()``, or ``None`` where the read fails."""
    try:
        return fn()
    except JoulesError:
        return None


def _power_ceiling_w(gpu: GPU) -> float | None:
    """The most a GPU draws on average: its highest settable power limit (else its limit now)."""
    try:
        return float(gpu.power_limit_range_w()[1])
    except Exception:  # noqa: BLE001 - no power-limit support: try the limit in force
        try:
            return float(gpu.power_limit_w())
        except Exception:  # noqa: BLE001
            return None


class EnergyMonitor:
    """Measures time and energy of named windows of code.

    Any number of windows can be open at once, nested or overlapping. GPUs with an energy
    counter are measured by the counter, with each window edge corrected for the time since
    the counter's last update (learned by the background sampler); GPUs without one are
    measured by integrating sampled power. CPU packages and DRAM are measured with their
    RAPL counters, wraparound handled.

    Example:
        >>> mon = EnergyMonitor()
        >>> mon.begin_window("step")
        >>> ...
        >>> m = mon.end_window("step")
        >>> m.total_energy_j, m.elapsed_s

    Args:
        gpu_indices: GPUs to measure (indices among visible GPUs). Default: all.
        cpu_indices: CPU packages to measure. Default: all; ``[]`` for none.
        devices: Devices to use. Default: :func:`joules.devices.discovery.discover`.
        sync: Synchronize device work at window edges: ``"torch"``, ``"jax"``, ``"cupy"``,
            a callable, or ``None``.
        sample_interval_s: Power sampling interval (default: chosen from sensor periods).
        log: Path of a ``.jsonl`` or ``.csv`` file that receives every window.
        sim: Simulated-hardware SPEC, used when ``devices`` is not given.
        skip_reads: At a window edge, do not read an energy counter that the sampler read
            after its latest update (the learned update phase proves a read would return
            the same value). Saves most NVML calls at edges; the result is the same.
        max_edge_read_s: Where reading a GPU's energy counter takes longer than this (the
            median of the sampler's reads; about 3 ms on an H200), an edge that falls after
            a counter update the sampler has not read yet does not wait for a read: it
            extrapolates from the latest value read with the latest power reading, and the
            stated uncertainty covers the longer extrapolation. ``None``: always read.
            Applies once the update phase is learned, with ``skip_reads``.

    Raises:
        DeviceNotFoundError: A requested GPU or CPU index does not exist.
        DevicePermissionError: A CPU package asked for by index cannot be read (by default,
            such packages are left out with a ``RuntimeWarning``).
    """

    def __init__(
        self,
        gpu_indices: Sequence[int] | None = None,
        cpu_indices: Sequence[int] | None = None,
        *,
        devices: DeviceSet | None = None,
        sync: SyncSpec = None,
        sample_interval_s: float | None = None,
        log: str | Path | None = None,
        sim: str | None = None,
        skip_reads: bool = True,
        max_edge_read_s: float | None = 0.0005,
    ) -> None:
        if max_edge_read_s is not None and not max_edge_read_s >= 0:
            raise ValueError(f"max_edge_read_s must be >= 0 or None, got {max_edge_read_s}")
        self.devices = devices if devices is not None else discover(sim=sim)
        self.clock = self.devices.clock
        self.gpus: list[GPU] = _select(self.devices.gpus, gpu_indices, "GPU")
        self.cpus: list[CPU] = _select_cpus(self.devices.cpus, cpu_indices)
        defaults = devices is None and gpu_indices is None and cpu_indices is None
        if defaults and not self.gpus and not self.cpus:
            found = self.devices.problems
            why = f" ({found[0].device}: {found[0].message})" if found else ""
            warnings.warn(f"no GPU or CPU energy readings found{why}, so every window reads 0 J "
                          "(`joules info` lists the problems and their fixes; sim='A100' or JOULES_SIM "
                          "simulates devices)", NothingMeasuredWarning, stacklevel=2)
        self._dram = [c.has_dram() for c in self.cpus]
        self._periods = [g.energy_counter_period_s() or 0.0 for g in self.gpus]
        self._ceilings = [_power_ceiling_w(g) for g in self.gpus]
        self._sync = make_sync(sync, [g.index for g in self.gpus])
        self._log = None
        if log is not None:
            drams = [c.index for c, d in zip(self.cpus, self._dram, strict=True) if d]
            columns = WindowLog.csv_columns([g.index for g in self.gpus], [c.index for c in self.cpus], drams)
            self._log = WindowLog(log, columns)
        self._host = host_name()
        self._windows: dict[str, _Edge] = {}
        self._closed = False
        self._discarded: set[str] = set()  # keys of the windows open when the monitor closed
        self._lock = threading.Lock()
        self._forked = False  # set in a forked child, whose sampler thread stayed in the parent
        renew_locks_after_fork(self, _after_fork_in_child)
        # Per CPU package: [package, DRAM] highest power reported, and latest rate measured
        # over a window long enough to span many RAPL updates.
        self._cpu_max = [[c.max_power_w(), c.max_power_w(dram=True)] for c in self.cpus]
        self._cpu_rate: list[list[float | None]] = [[None, None] for _ in self.cpus]
        self._seq = itertools.count()
        self.sampler = PowerSampler(self.gpus, self.cpus, self.clock, sample_interval_s).start()
        self._trackers = [self.sampler.tracker(g.index) for g in self.gpus]
        self._counter = [t is not None for t in self._trackers]  # measured from the energy counter
        self._skip_reads = skip_reads
        self._max_edge_read_s = max_edge_read_s
        self.reads = {"counter": 0, "counter_skipped": 0, "counter_extrapolated": 0, "power": 0}
        """Device reads made at window edges (the sampler's not included), reads skipped (the
        value is provably the latest one read), and reads avoided because they are slow (the
        edge extrapolates from the latest value read; see ``max_edge_read_s``)."""
        self.last: dict[str, Measurement] = {}

    # -- edges ------------------------------------------------------------------------------
    @staticmethod
    def _reanchored(tracker: CounterTracker, b: _GPUEdge) -> _GPUEdge:
        """A begin edge whose update time is estimated again, with the phase known by the end.

        An edge read before the counter's phase was learned (a window opened as the monitor
        starts, as ``joules measure``'s does) placed the update behind its value anywhere in
        the period before the read, and extrapolated from the middle of it: up to half a
        period of power off. By the window's end the phase is usually known, and the same
        observation places that update within a few milliseconds: the edge's energy is taken
        from there. Its bound stays the edge's own: how the power varied between that update
        and the edge is no better known than before (a single power reading, as the monitor
        starts, shows no spread; a burst there is only in the counter's next value).
        """
        known = tracker.update_of(b.counter)
        if known is None or not known[1] < b.half or not math.isfinite(b.power):
            return b
        tick, half = known
        since = b.t - tick if b.t > tick else 0.0
        return replace(b, energy=b.counter + b.power * since, tick=tick, half=half)

    @staticmethod
    def _interpolated_begin(tracker: CounterTracker, b: _GPUEdge, e: _GPUEdge) -> tuple[float, float]:
        """Energy reading at a window's begin edge, refined once later updates are known.

        At the begin edge only the power before it is known; by the end, the counter's next
        update after the edge usually is too, and interpolating between the two updates
        around the edge is more accurate than extrapolating a power reading that lags a load
        change before the edge. It is less accurate where the load changed at the edge (work
        starting as the window opens): the interval's average power then did not hold on
        either side. Which happened cannot be told apart, so the two estimates' difference
        is returned too, for the bound.

        Returns:
            The refined reading, and how far it is from the edge's own estimate.
        """
        counter, tick, energy = b.counter, b.tick, b.energy
        after = tracker.update_after(counter)
        # An edge that extrapolated past an update it did not read (a slow counter, see
        # ``max_edge_read_s``): start from that update, now known, with the same power.
        while after is not None and after[0] <= b.t and after[1] <= e.counter:
            tick, counter = after
            after = tracker.update_after(counter)
        if counter != b.counter:
            power = (b.energy - b.counter) / (b.t - b.tick) if b.t > b.tick else 0.0
            energy = counter + power * (b.t - tick)
        if after is None:
            return energy, 0.0
        t_next, value = after
        if not (b.t < t_next and value <= e.counter and t_next > tick):
            return energy, 0.0
        rate = (value - counter) / (t_next - tick)
        refined = counter + rate * (b.t - tick)
        return refined, abs(refined - energy)

    def _power_now(self, gpu: GPU, t: float) -> float:
        """The power reading at ``t``: the sampler's when provably current, else a fresh read."""
        power = self.sampler.fresh_power(gpu.index, t) if self._skip_reads else None
        if power is None:
            self.reads["power"] += 1
            return gpu.power_w()
        return power

    def _revised_begin(self, gpu: GPU, b: _GPUEdge) -> float:
        """Sampled-power reading at a begin edge, revised with the first sample after it.

        The first reading after the edge describes the power around it better than the
        reading before, which the edge had to extrapolate. Where the sensor's update phase is
        known, that reading covers only the sensor period before its update (as in the
        sampler's integral): before that, the power read at the edge held.
        """
        after = self.sampler.sample(gpu.index, b.samples)
        if after is None:
            return b.energy
        power = after[1]
        sensor = self.sampler.sensor_update(gpu.index, b.samples)
        if sensor is None:  # each reading covers the interval since the previous sample
            return b.counter + power * (b.t - b.tick)
        update, period = sensor
        split = max(b.tick, update - period)
        if b.t <= split:
            return b.energy
        before = (b.energy - b.counter) / (b.t - b.tick)  # the reading the edge extrapolated
        return b.counter + before * (split - b.tick) + power * (b.t - split)

    def _extrapolate(self, k: int, tracker: CounterTracker, t: float) -> tuple[float, float, float] | None:
        """The latest value read, for an edge where reading the counter would be slow.

        Only with a learned phase and a recent read (within a counter period and two sampler
        intervals of ``t``), so that the extrapolation spans at most that long.
        """
        cost = self.sampler.counter_read_cost_s(self.gpus[k].index)
        if cost is None or cost <= self._max_edge_read_s or not tracker.locked:
            return None
        snap = tracker.snapshot
        if snap is None or not 0.0 <= t - snap[0] <= self._periods[k] + 2 * self.sampler.interval_s:
            return None
        self.reads["counter_extrapolated"] += 1
        return snap[2], snap[3], snap[4]

    def _edge(self, name: str, lenient: bool = False) -> _Edge:
        """Read every device at one moment.

        ``lenient`` (an end edge of :meth:`end_window` with ``partial=True``): a device whose
        read fails is marked unread instead of failing the edge.
        """
        if self._forked:
            self._forked = False
            if not self._closed:
                self.sampler.start()
        if self._sync is not None:
            self._sync()
        now = self.clock.now
        sampler = self.sampler
        skip = self._skip_reads
        gpu_edges = []
        for k, (gpu, tracker) in enumerate(zip(self.gpus, self._trackers, strict=True)):
            if tracker is None:  # no counter: the sampler's running integral
                t = now()
                count, energy, last_t, last_p = sampler.integral_state(gpu.index)
                if t - last_t > 2 * sampler.interval_s + (gpu.power_update_period_s() or 0.0):
                    # The sampler's readings stopped (they fail, or its thread cannot run): a
                    # read here says which, rather than extrapolate an old reading unbounded.
                    # (Leniently, a failing read is let be: the span of failed reads widens
                    # the window's bound, _missed_bound.)
                    self.reads["power"] += 1
                    try:
                        gpu.power_w()
                    except JoulesError:
                        if not lenient:
                            raise
                # ``counter``/``tick`` keep the integral and time of the latest sample, so the
                # edge can be revised once the next sample is known (_revised_begin).
                gpu_edges.append(_GPUEdge(energy + last_p * (t - last_t), 0.0, count, t, energy, last_t))
                continue
            t = now()
            known = tracker.current(t) if skip else None
            if known is None and skip and self._max_edge_read_s is not None:
                known = self._extrapolate(k, tracker, t)
            if known is None:
                self.reads["counter"] += 1
                try:
                    c = gpu.energy_j()
                except JoulesError:
                    if not lenient:
                        raise
                    # The window's energy will come from the sampler's power readings.
                    integral = sampler.integral_now(gpu.index, t)
                    gpu_edges.append(_GPUEdge(math.nan, math.nan, sampler.sample_count(gpu.index), t,
                                              resets=tracker.resets, integral=integral, unread=True))
                    continue
                t_before, t = t, now()
                # A stale read (the sampler read a newer value meanwhile) gets the newer value.
                c, tick, half_width = tracker.observe(t, c, t_before)
            else:  # the counter provably still holds the value the sampler read last
                self.reads["counter_skipped"] += 1
                c, tick, half_width = known
            samples, power, spread = sampler.edge_state(gpu.index)
            # Energy since the update that produced ``c``, from the latest power reading. The
            # power may differ from it by the readings' recent spread, or by as much as the
            # reading differs from the counter's own rate over its latest period: a sensor
            # that averages part of each period, under a load in step with it, reads the same
            # biased value every time (no spread).
            since = t - tick if t > tick else 0.0
            rate = tracker.rate
            if rate is not None:
                spread = max(spread, abs(power - rate))
            gpu_edges.append(_GPUEdge(
                c + power * since,
                spread * since + power * half_width + _GPU_COUNTER_RESOLUTION_J,
                # The sampled-power integral too: the fallback should the counter reset.
                samples, t, c, tick, tracker.resets, sampler.integral_now(gpu.index, t),
                half_width, power,
            ))
        t = now()
        if lenient:
            cpu = [_read_leniently(c.package_energy_j) for c in self.cpus]
            dram = [_read_leniently(c.dram_energy_j) if d else None
                    for c, d in zip(self.cpus, self._dram, strict=True)]
        else:
            cpu = [c.package_energy_j() for c in self.cpus]
            dram = [c.dram_energy_j() if d else None for c, d in zip(self.cpus, self._dram, strict=True)]
        return _Edge(name, t, gpu_edges, cpu, dram)

    # -- windows ----------------------------------------------------------------------------
    def begin_window(self, name: str) -> None:
        """Open a window called ``name``.

        Raises:
            WindowError: A window of that name is already open.
        """
        self._begin(name, name)

    def end_window(self, name: str, *, partial: bool = False) -> Measurement:
        """Close window ``name`` and return its measurement.

        Args:
            name: The window.
            partial: Where a device cannot be read at the end, measure the others rather than
                fail: a GPU whose energy counter cannot be read is measured from the
                sampler's power readings (source ``sampled``; spans of failed readings widen
                its bound); a device that cannot be measured at all is left out of the
                totals and named in :attr:`Measurement.missing`. By default such a read
                raises, and the window stays open to be ended again.

        Raises:
            WindowError: No window of that name is open.
            JoulesError: A device could not be read (the window stays open), unless ``partial``.
        """
        return self._end(name, partial)

    def _begin(self, key: str, name: str) -> None:
        with self._lock:
            if self._closed:
                raise WindowError(f"cannot open window {name!r}: the monitor is closed")
            if key in self._windows:
                raise WindowError(f"window {name!r} is already open; end or cancel it first")
            # Reserve the name while the edge is taken (``t`` NaN marks it as beginning).
            placeholder = _Edge(name, math.nan, [], [], [])
            self._windows[key] = placeholder
        try:
            edge = self._edge(name)
        except BaseException:
            with self._lock:
                if self._windows.get(key) is placeholder:
                    del self._windows[key]
            raise
        with self._lock:
            # Cancelled (or restarted) meanwhile: the window stays discarded.
            if self._windows.get(key) is placeholder:
                self._windows[key] = edge
            elif self._closed and key in self._discarded:
                raise WindowError(f"window {name!r}: the monitor was closed while it was beginning")

    def _end(self, key: str, partial: bool = False) -> Measurement:
        with self._lock:
            begin = self._windows.get(key)
            if begin is None:
                raise WindowError(self._not_open(key))
            if math.isnan(begin.t):
                raise WindowError(f"window {begin.name!r} is still beginning (its begin edge is "
                                  f"being taken in another thread); end it once begin_window returns")
            del self._windows[key]
        try:
            end = self._edge(begin.name, lenient=partial)
            m = self._measure(begin, end, partial)  # (a short window reads the power here)
        except BaseException:
            # A failed read (or sync) at the end edge leaves a named window open: it can be
            # ended again, or cancelled. A block's window is over with its block.
            if key == begin.name:
                with self._lock:
                    if not self._closed:
                        self._windows.setdefault(key, begin)
            raise
        self.last[m.name] = m
        if self._log is not None:
            try:
                self._log.write(m)
            except (OSError, ValueError) as e:  # a full disk, a removed folder, a CSV file another
                # monitor began for other devices: none of them may lose the measurement
                warnings.warn(f"window {m.name!r} not written to the window log: {e}", RuntimeWarning,
                              stacklevel=3)
        return m

    def cancel_window(self, name: str) -> None:
        """Discard open window ``name`` without measuring it.

        Raises:
            WindowError: No window of that name is open.
        """
        with self._lock:
            if self._windows.pop(name, None) is None:
                raise WindowError(self._not_open(name))

    def restart_window(self, name: str) -> None:
        """Discard window ``name`` if open, and open it again from now.

        Raises:
            WindowError: ``name`` is open only as a :meth:`window` block or :meth:`measure`d
                call, which ends with its block.
        """
        with self._lock:
            if self._windows.pop(name, None) is None and name in self._block_names():
                raise WindowError(self._not_open(name))
        self.begin_window(name)

    def _block_names(self) -> set[str]:
        return {e.name for k, e in self._windows.items() if k != e.name}

    def _not_open(self, name: str) -> str:
        if self._closed:
            if name in self._discarded:
                return (f"window {name.split(chr(0))[0]!r} was open when the monitor was closed: "
                        f"close() discards open windows")
            return f"no open window named {name!r}: the monitor is closed"
        if name in self._block_names():
            return (f"window {name!r} is open as a `with monitor.window(...)` block or a measured "
                    f"call: it ends with its block (raise inside the block to discard it)")
        return f"no open window named {name!r}"

    @property
    def open_windows(self) -> list[str]:
        """Names of the windows open now."""
        with self._lock:
            return [edge.name for edge in self._windows.values()]

    @contextmanager
    def window(self, name: str) -> Iterator[WindowHandle]:
        """Measure a ``with`` block; the handle's ``measurement`` is set when it ends.

        If the block raises, the window is cancelled and the exception propagates.
        """
        with self._block(name) as handle:
            yield handle

    @contextmanager
    def _block(self, name: str, ends_on: tuple[type[BaseException], ...] = ()) -> Iterator[WindowHandle]:
        """A block's window: cancelled if the block raises, unless with one of ``ends_on``."""
        handle = WindowHandle(name)
        # Blocks of the same name may overlap (threads, recursion): each gets its own key.
        key = f"{name}\x00{next(self._seq)}"
        self._begin(key, name)
        try:
            yield handle
        except ends_on:
            handle.measurement = self._end(key)
            raise
        except BaseException:
            with self._lock:
                self._windows.pop(key, None)
            raise
        handle.measurement = self._end(key)

    @overload
    def measure(self, name: Callable[P, R]) -> Callable[P, R]: ...

    @overload
    def measure(self, name: str | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]: ...

    def measure(self, name: str | Callable[P, R] | None = None) -> Any:
        """Decorator measuring every call of a function; see :attr:`last` for the result.

        ``@monitor.measure("step")`` names the windows; ``@monitor.measure()`` and
        ``@monitor.measure`` name them after the function.
        Coroutine functions are measured until the coroutine returns, generator functions
        (sync or async) over their whole iteration: the window opens when iteration starts
        and ends when the generator is exhausted or closed. An exception raised inside
        cancels the window, as in :meth:`window`.

        Raises:
            TypeError: ``name`` is neither a string, ``None``, nor the function itself.
        """
        if callable(name):  # used without parentheses: ``name`` is the function
            return self.measure(None)(name)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"measure(name): name must be a string, got {type(name).__name__}")

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            if not callable(fn):
                raise TypeError(f"measure() decorates a function, got {type(fn).__name__}")
            label = name or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) \
                or type(fn).__qualname__
            wrapper: Callable[..., Any]

            if inspect.isasyncgenfunction(fn):
                agen_fn: Callable[..., Any] = fn

                async def wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                    agen = agen_fn(*args, **kwargs)
                    with self._block(label, (GeneratorExit,)):
                        try:
                            value = await agen.__anext__()
                            while True:
                                try:
                                    sent = yield value
                                except GeneratorExit:
                                    await agen.aclose()
                                    raise
                                except BaseException as exc:  # noqa: BLE001 - forwarded
                                    value = await agen.athrow(exc)
                                else:
                                    value = await agen.asend(sent)
                        except StopAsyncIteration:
                            return

            elif inspect.iscoroutinefunction(fn):
                coro_fn: Callable[..., Any] = fn

                async def wrapper(*args: Any, **kwargs: Any) -> Any:
                    with self._block(label):
                        return await coro_fn(*args, **kwargs)

            elif inspect.isgeneratorfunction(fn):
                gen_fn: Callable[..., Any] = fn

                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    with self._block(label, (GeneratorExit,)):
                        return (yield from gen_fn(*args, **kwargs))

            else:

                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    with self._block(label):
                        return fn(*args, **kwargs)

            return functools.wraps(fn)(wrapper)  # type: ignore[return-value]

        return decorate

    # -- measurement ------------------------------------------------------------------------
    def _sampled_energy(
        self, k: int, gpu: GPU, b: _GPUEdge, e: _GPUEdge, elapsed: float
    ) -> tuple[float, float]:
        """Energy from the sampler's power readings over a window, and its bound.

        The sampler's running integral at the two edges where they hold it (however long the
        window); else the average of the readings still retained, times the elapsed time.
        """
        spread = self.sampler.power_spread(gpu.index)
        uncertainty = (spread + _GPU_POWER_RESOLUTION_W) * elapsed
        if math.isfinite(b.integral) and math.isfinite(e.integral):
            energy = max(0.0, e.integral - b.integral)
            # Each edge, and a change of load inside, falls up to a sampling interval (plus
            # the sensor's period, by which a reading lags) from the readings that see it.
            lag = self.sampler.interval_s + (gpu.power_update_period_s() or 0.0)
            uncertainty += self._missed_bound(k, gpu, b.t, b.t + elapsed, energy, elapsed)
            return energy, uncertainty + 2 * lag * self._ceiling(k, energy, elapsed)
        readings = [s[1] for i in range(b.samples, e.samples)
                    if (s := self.sampler.sample(gpu.index, i)) is not None]
        power = sum(readings) / len(readings) if readings else self._power_now(gpu, b.t + elapsed)
        return power * elapsed, uncertainty

    def _missed_bound(self, k: int, gpu: GPU, start: float, end: float, energy: float,
                      elapsed: float) -> float:
        """What the sampled integral may be off by over gaps between samples in a window, J.

        Over a gap (reads that failed, say) the power was taken as the next reading's; it may
        have been anything from 0 W to the GPU's highest power.
        """
        # Each span less what the sampled bound already allows (an interval and a sensor period).
        slack = self.sampler.interval_s + (gpu.power_update_period_s() or 0.0)
        missed = self.sampler.missed_s(gpu.index, start, end, slack)
        if not missed:
            return 0.0
        return missed * self._ceiling(k, energy, elapsed)

    def _ceiling(self, k: int, energy: float, elapsed: float) -> float:
        """The most GPU ``k`` can have drawn on average over a window of ``energy``, W."""
        power = energy / elapsed if elapsed > 0 else 0.0
        return max(self._ceilings[k] or 2.0 * power, power)

    def _window_bound(self, k: int, energy: float, elapsed: float) -> float:
        """Worst-case error of ``energy`` for a window no reading resolves on its own.

        Such a window (shorter than the counter's update period, or holding fewer than two
        power samples) is measured by extrapolating readings taken before it, so a load that
        changed at its start may be invisible: the GPU may have drawn anything from 0 W to
        its highest power limit meanwhile, and the error is at most the distance from
        ``energy`` to the farther end of that range.
        """
        ceiling = self._ceiling(k, energy, elapsed) * elapsed
        return max(energy, ceiling - energy) + _GPU_POWER_RESOLUTION_W * elapsed

    def _rapl_bound(self, k: int, zone: int, energy: float, elapsed: float) -> float:
        """Worst-case error of a RAPL zone's energy over a window (zone 0: package, 1: DRAM).

        RAPL updates about every millisecond, so each edge may miss up to one update period of
        energy, whether or not an update fell inside the window: at most the zone's highest
        power over that period. Where the zone reports no highest power, the rate measured over
        a recent window long enough to be resolved stands in (or this window's own rate).
        """
        rate = energy / elapsed if elapsed > 0 else 0.0
        if elapsed >= _RAPL_RATE_MIN_S:
            self._cpu_rate[k][zone] = rate
        power = max(self._cpu_max[k][zone] or self._cpu_rate[k][zone] or 0.0, rate)
        return _RAPL_EDGE_S * power

    def _measure(self, begin: _Edge, end: _Edge, partial: bool = False) -> Measurement:
        elapsed = max(0.0, end.t - begin.t)
        gpu: dict[int, DeviceEnergy] = {}
        missing: list[str] = []
        for k, g in enumerate(self.gpus):
            try:
                gpu[g.index] = self._gpu_energy(k, g, begin, end, elapsed)
            except JoulesError:
                if not partial:
                    raise
                missing.append(f"gpu{g.index}")
        cpu: dict[int, DeviceEnergy] = {}
        dram: dict[int, DeviceEnergy] = {}
        for k, c in enumerate(self.cpus):
            p0, p1 = begin.cpu[k], end.cpu[k]
            if p0 is None or p1 is None:
                missing.append(f"cpu{c.index}")
            else:
                pkg = p1 - p0
                cpu[c.index] = DeviceEnergy(pkg, Source.COUNTER, self._rapl_bound(k, 0, pkg, elapsed), False,
                                            f"{self._host}/cpu{c.index}")
            d0, d1 = begin.dram[k], end.dram[k]
            if d0 is not None and d1 is not None:
                bound = self._rapl_bound(k, 1, d1 - d0, elapsed)
                dram[c.index] = DeviceEnergy(
                    d1 - d0, Source.COUNTER, bound, False, f"{self._host}/dram{c.index}"
                )
            elif self._dram[k]:
                missing.append(f"dram{c.index}")
        return Measurement(begin.name, begin.t, elapsed, gpu, cpu, dram, self._host, tuple(missing))

    def _gpu_energy(self, k: int, g: GPU, begin: _Edge, end: _Edge, elapsed: float) -> DeviceEnergy:
        """GPU ``k``'s energy over a window (raises where a read it needs fails)."""
        b, e = begin.gpu[k], end.gpu[k]
        if e.unread or (self._counter[k] and e.resets != b.resets):
            # The counter could not be read at a lenient end edge, or was reset inside the
            # window (driver reload, GPU reset: its readings no longer compare). The sampler's
            # power readings over the window.
            energy, uncertainty = self._sampled_energy(k, g, b, e, elapsed)
            source, corrected = Source.SAMPLED, False
        elif self._counter[k] and e.counter == b.counter:
            # The counter did not move: the window fell between two of its updates. The
            # power reading now (the latest sensor period) times the elapsed time.
            energy = self._power_now(g, end.t) * elapsed
            source, corrected = Source.ESTIMATE, True
            uncertainty = self._window_bound(k, energy, elapsed)
        elif self._counter[k]:
            tracker = self._trackers[k]
            assert tracker is not None
            b = self._reanchored(tracker, b)
            begin_energy, disagreement = self._interpolated_begin(tracker, b, e)
            energy = max(0.0, e.energy - begin_energy)
            source = Source.COUNTER
            # (a counter of unknown period: the tracker's bound on it)
            corrected = elapsed < (self._periods[k] or tracker.period)
            uncertainty = b.uncertainty + e.uncertainty + disagreement
            if corrected:  # no counter update brackets the window: worst case, as estimates
                uncertainty = max(uncertainty, self._window_bound(k, energy, elapsed))
        else:
            n = e.samples - b.samples
            if n >= 2:
                energy = max(0.0, e.energy - self._revised_begin(g, b))
                source, corrected = Source.SAMPLED, False
            else:
                # Too short for the samples to resolve: the power reading now (the sensor
                # period closest to the window) times the elapsed time.
                energy = self._power_now(g, end.t) * elapsed
                source, corrected = Source.ESTIMATE, True
            interval = self.sampler.interval_s
            # (the spread around each edge: a change near the begin edge of a long window is
            # no longer in the readings' recent spread when it ends)
            spread = max(self.sampler.power_spread(g.index), self.sampler.spread_around(g.index, b.samples))
            # Edges fall up to one interval from a sample: power may differ by the spread
            # there, however short the window (a sample taken inside a short window
            # revises the power assumed at its begin edge). The end edge's latest reading
            # may also be one sensor period old: the power since is extrapolated.
            lag = 2 * interval + (g.power_update_period_s() or 0.0)
            uncertainty = spread * lag + _GPU_POWER_RESOLUTION_W * elapsed
            uncertainty += self._missed_bound(k, g, begin.t, end.t, energy, elapsed)
            if source is Source.ESTIMATE:
                uncertainty = max(uncertainty, self._window_bound(k, energy, elapsed))
        return DeviceEnergy(energy, source, uncertainty, corrected, g.measured_uuid)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the sampler and close the log (idempotent).

        Windows still open are discarded: without the sampler they could no longer be
        measured reliably. Ending or cancelling one afterwards, or opening a new window,
        raises :class:`~joules.errors.WindowError`.
        """
        with self._lock:
            self._closed = True
            self._discarded.update(self._windows)
            self._windows.clear()
        self.sampler.stop()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> EnergyMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.sampler.stop()
            if self._log is not None:
                self._log.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass
