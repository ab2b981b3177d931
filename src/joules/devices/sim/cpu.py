"""Simulated CPU package with RAPL-like package and DRAM counters that wrap."""

from __future__ import annotations

import math
import threading

from joules.clock import Clock
from joules.devices.base import CPU, WrappingCounter, fork_safe_lock
from joules.devices.sim.catalog import CPUModel
from joules.devices.sim.workload import Constant, Workload
from joules.errors import NotSupportedError


class _Zone:
    """One energy zone: exact energy integral plus a raw counter in energy units that wraps."""

    def __init__(self, clock: Clock, idle_w: float, peak_w: float, unit_j: float, wrap_j: float,
                 period_s: float, offset_j: float) -> None:
        self.clock = clock
        self.idle_w = idle_w
        self.peak_w = peak_w
        self.unit_j = unit_j
        self.wrap_units = int(wrap_j / unit_j)
        self.period_s = period_s
        self.offset_j = offset_j
        self.t_created = clock.now()
        self.t_settled = self.t_created
        self.e_settled = 0.0
        self.workload: Workload = Constant(0.0)
        self.workload_t0 = self.t_created

    def power(self, u: float) -> float:
        return self.idle_w + u * (self.peak_w - self.idle_w)

    def _integral(self, t0: float, t1: float) -> float:
        w0 = self.workload_t0
        return sum((b - a) * self.power(u) for a, b, u in self.workload.pieces(t0 - w0, t1 - w0))

    def energy_at(self, t: float) -> float:
        if t <= self.t_settled:
            return self.e_settled
        if t - self.t_settled > 4.0:  # move the settled point forward: O(lookback) queries
            new_t = t - 2.0
            self.e_settled += self._integral(self.t_settled, new_t)
            self.t_settled = new_t
        return self.e_settled + self._integral(self.t_settled, t)

    def set_workload(self, workload: Workload) -> None:
        now = self.clock.now()
        self.e_settled = self.energy_at(now)
        self.t_settled = now
        self.workload = workload
        self.workload_t0 = now

    def raw_units(self) -> int:
        now = self.clock.now()
        tick = self.t_created + math.floor((now - self.t_created) / self.period_s) * self.period_s
        e = self.energy_at(tick) if tick >= self.t_settled else self.e_settled
        return int((self.offset_j + e) / self.unit_j) % self.wrap_units


class SimCPU(CPU):
    """A simulated CPU package.

    Raw counters count ``energy_unit_j`` units, are updated every ``counter_period_s`` and
    wrap at ``wrap_j`` like RAPL's ``energy_uj`` files; :meth:`package_energy_j` and
    :meth:`dram_energy_j` return wrap-corrected values (read them at least once per
    :meth:`max_read_interval_s`, as the monitor does).

    Args:
        model: CPU model.
        clock: Clock the package runs on.
        index: Package (socket) index.
        workload: Initial workload (default: idle).

    """

    def __init__(self, model: CPUModel, clock: Clock, index: int = 0,
                 workload: Workload | None = None) -> None:
        self.model = model
        self.clock = clock
        self.index = index
        self.name = model.name
        self.vendor = model.vendor
        self._lock = fork_safe_lock(self, factory=threading.RLock)
        offset = 0.8 * model.wrap_j  # start near the wrap point, as long-running machines do
        self._pkg = _Zone(clock, model.idle_w, model.tdp_w, model.energy_unit_j, model.wrap_j,
                          model.counter_period_s, offset)
        self._pkg_counter = WrappingCounter(self._pkg.wrap_units)
        self._dram: _Zone | None = None
        self._dram_counter: WrappingCounter | None = None
        if model.dram_idle_w is not None and model.dram_peak_w is not None:
            unit = model.dram_energy_unit_j or model.energy_unit_j
            wrap = model.dram_wrap_j or model.wrap_j
            self._dram = _Zone(clock, model.dram_idle_w, model.dram_peak_w, unit, wrap,
                               model.counter_period_s, 0.3 * wrap)
            self._dram_counter = WrappingCounter(self._dram.wrap_units)
        if workload is not None:
            self.set_workload(workload)

    def set_workload(self, workload: Workload) -> None:
        """Run ``workload`` on the package (and its memory) from now on."""
        with self._lock:
            self._pkg.set_workload(workload)
            if self._dram is not None:
                self._dram.set_workload(workload)

    def raw_package_units(self) -> int:
        """The raw wrapping counter, in energy units (what ``energy_uj`` would show)."""
        with self._lock:
            return self._pkg.raw_units()

    def true_package_energy_j(self) -> float:
        """Exact package energy since creation, J."""
        with self._lock:
            return self._pkg.energy_at(self.clock.now())

    def true_dram_energy_j(self) -> float:
        """Exact DRAM energy since creation, J."""
        if self._dram is None:
            raise NotSupportedError(f"CPU {self.index} ({self.name}) has no DRAM zone")
        with self._lock:
            return self._dram.energy_at(self.clock.now())

    def package_energy_j(self) -> float:
        with self._lock:
            return self._pkg_counter.update(self._pkg.raw_units()) * self.model.energy_unit_j

    def has_dram(self) -> bool:
        return self._dram is not None

    def dram_energy_j(self) -> float:
        if self._dram is None or self._dram_counter is None:
            raise NotSupportedError(f"CPU {self.index} ({self.name}) has no DRAM zone")
        with self._lock:
            return self._dram_counter.update(self._dram.raw_units()) * self._dram.unit_j

    def max_read_interval_s(self) -> float:
        m = self.model
        return min(m.wrap_j, m.dram_wrap_j or m.wrap_j) / (m.tdp_w + (m.dram_peak_w or 0.0))

    def max_power_w(self, dram: bool = False) -> float | None:
        return self.model.dram_peak_w if dram else self.model.tdp_w
