"""Simulated GPU: a physical model with realistic sensors and exact ground truth."""

from __future__ import annotations

import math
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from joules.clock import Clock, RealClock
from joules.devices.base import GPU, Problem, fork_safe_lock
from joules.devices.sim.catalog import GPUModel
from joules.devices.sim.workload import Constant, Workload
from joules.errors import DevicePermissionError, NotSupportedError


def _dynamic_scale(speed: float, floor: float) -> float:
    """Dynamic power at clock fraction ``speed``: frequency times voltage squared.

    Voltage scales with the clock down to ``floor`` and stays there below it.
    """
    return speed * max(speed, floor) ** 2


def _speed_for(scale: float, floor: float) -> float:
    """The inverse of :func:`_dynamic_scale`."""
    if scale >= floor**3:
        return scale ** (1.0 / 3.0)
    return scale / floor**2


@dataclass
class _Epoch:
    """A span of time with one configuration; energy inside it is an exact integral."""

    t_start: float
    e_start: float
    limit_w: float
    sm_cap_mhz: float
    workload: Workload
    workload_t0: float
    # A later point of known energy, so queries cost O(lookback), not O(epoch length).
    ck_t: float = -math.inf
    ck_e: float = 0.0


class SimGPU(GPU):
    """A simulated GPU that draws power from a workload model.

    Power at utilization ``u`` is ``idle + u * (peak - idle) * s * max(s, floor) ** 2`` with
    ``s = f / f_max`` (frequency times voltage squared; the voltage stops falling at a floor),
    capped by the power limit; the clock ``f`` is the locked maximum, or the highest clock that fits
    under the power limit. Sensors have the artifacts of the real ones: the energy counter
    is updated every ``counter_period_s`` (at a per-GPU phase) in 1 mJ steps; the instant
    power reading is updated every ``power_period_s`` and averages only the last
    ``sample_fraction`` of each period; the averaged reading covers ``averaged_power_s``.

    Ground truth (:meth:`true_energy_j`, :meth:`true_power_w`) is exact.

    Args:
        model: The GPU model.
        clock: The clock the GPU runs on (a :class:`~joules.clock.VirtualClock` in tests).
        index: Index among visible GPUs.
        workload: Initial workload (default: idle).
        counter_offset_j: Value of the energy counter at creation (real counters do not
            start at zero).
        allow_control: When false, changing power limit or clocks raises a permission error,
            as for a non-root user.

    Attributes:
        on_change: Called with the GPU after each change of its power limit or SM clock lock
            (the simulator's state file uses it to make settings outlive the process).
        on_read: Called with the GPU before its power limit or SM clock lock is read or
            changed (the state file uses it to take up other processes' changes).

    """

    vendor = "nvidia"

    def __init__(
        self,
        model: GPUModel,
        clock: Clock,
        index: int = 0,
        workload: Workload | None = None,
        counter_offset_j: float | None = None,
        allow_control: bool = True,
    ) -> None:
        self.model = model
        self.clock = clock
        self.index = index
        self.physical_index = index
        self.name = model.name
        self.uuid = f"GPU-5e1a7ed0-{index:04d}-4000-8000-{zlib.crc32(model.name.encode()):012d}"
        self.allow_control = allow_control
        self.on_change: Callable[[SimGPU], None] | None = None
        self.changed_setting: str | None = None  # the setting of the latest change
        self.on_read: Callable[[SimGPU], None] | None = None
        self._lock = fork_safe_lock(self, factory=threading.RLock)
        self._t_created = clock.now()
        self._phase = ((index * 0.37) % 1.0) * model.counter_period_s
        self._offset_j = 1000.0 * (index + 1) if counter_offset_j is None else counter_offset_j
        self._sm_lock: tuple[float, float] | None = None
        self._mem_lock: tuple[float, float] | None = None
        # Sensor values latched at their update ticks, as hardware holds them: recomputing one
        # later (the integral's checkpoint having moved) could differ in the last mJ / mW.
        self._latched: dict[str, tuple[float, float]] = {}
        self._epochs = [
            _Epoch(
                self._t_created, 0.0, model.default_limit_w, model.max_sm_mhz,
                workload or Constant(0.0), self._t_created,
            )
        ]

    # -- physics ----------------------------------------------------------------------------
    def _power_of(self, epoch: _Epoch, u: float) -> float:
        m = self.model
        scale = _dynamic_scale(epoch.sm_cap_mhz / m.max_sm_mhz, m.voltage_floor)
        return min(m.idle_w + u * (m.peak_w - m.idle_w) * scale, max(epoch.limit_w, m.idle_w))

    def _integral(self, epoch: _Epoch, t0: float, t1: float) -> float:
        if t1 <= t0:
            return 0.0
        w0 = epoch.workload_t0
        return sum(
            (b - a) * self._power_of(epoch, u) for a, b, u in epoch.workload.pieces(t0 - w0, t1 - w0)
        )

    def _epoch_at(self, t: float) -> _Epoch:
        for epoch in reversed(self._epochs):
            if epoch.t_start <= t:
                return epoch
        return self._epochs[0]

    def _energy_at(self, t: float) -> float:
        """True energy since creation at time ``t`` (exact)."""
        epoch = self._epoch_at(t)
        if t < epoch.t_start:
            return epoch.e_start - self._integral(epoch, t, epoch.t_start)
        if t < epoch.ck_t:
            return epoch.e_start + self._integral(epoch, epoch.t_start, t)
        if epoch.ck_t == -math.inf:
            epoch.ck_t, epoch.ck_e = epoch.t_start, epoch.e_start
        if t - epoch.ck_t > 4.0:  # sensors look back at most ~1 s: keep the checkpoint 2 s behind
            new_t = t - 2.0
            epoch.ck_e += self._integral(epoch, epoch.ck_t, new_t)
            epoch.ck_t = new_t
        return epoch.ck_e + self._integral(epoch, epoch.ck_t, t)

    def _new_epoch(self, **changes: object) -> None:
        now = self.clock.now()
        cur = self._epochs[-1]
        e_now = self._energy_at(now)
        fields = {
            "limit_w": cur.limit_w,
            "sm_cap_mhz": cur.sm_cap_mhz,
            "workload": cur.workload,
            "workload_t0": cur.workload_t0,
        }
        fields.update(changes)
        self._epochs.append(_Epoch(t_start=now, e_start=e_now, **fields))  # type: ignore[arg-type]
        # Sensors look back at most ~1 s; keep a little more history than that.
        horizon = now - 5.0
        while len(self._epochs) > 2 and self._epochs[1].t_start < horizon:
            self._epochs.pop(0)

    def _last_tick(self, period: float, phase: float = 0.0) -> float:
        now = self.clock.now()
        base = self._t_created + phase
        return base + math.floor((now - base) / period) * period

    # -- simulation control -----------------------------------------------------------------
    def set_workload(self, workload: Workload) -> None:
        """Run ``workload`` from now on (its time 0 is now)."""
        with self._lock:
            self._new_epoch(workload=workload, workload_t0=self.clock.now())

    def load_control_state(
        self, power_limit_w: float | None, sm_clock_lock_mhz: tuple[float, float] | None
    ) -> None:
        """Start from settings a previous process left (values outside the model's ranges are ignored)."""
        with self._lock:
            self.sync_control_state(power_limit_w, sm_clock_lock_mhz or self._sm_lock)

    def sync_control_state(
        self, power_limit_w: float | None, sm_clock_lock_mhz: tuple[float, float] | None
    ) -> None:
        """Take up settings another process changed: the limit (``None``: unchanged) and lock."""
        m = self.model
        with self._lock:
            changes: dict[str, object] = {}
            if (power_limit_w is not None and m.min_limit_w <= power_limit_w <= m.max_limit_w
                    and power_limit_w != self._epochs[-1].limit_w):
                changes["limit_w"] = float(power_limit_w)
            lock = sm_clock_lock_mhz
            if lock is not None and not m.min_sm_mhz <= lock[0] <= lock[1] <= m.max_sm_mhz:
                lock = self._sm_lock  # malformed: ignored
            if lock != self._sm_lock:
                self._sm_lock = None if lock is None else (float(lock[0]), float(lock[1]))
                changes["sm_cap_mhz"] = m.max_sm_mhz if lock is None else float(lock[1])
            if changes:
                self._new_epoch(**changes)

    def _read(self) -> None:
        if self.on_read is not None:
            self.on_read(self)

    def _changed(self, setting: str) -> None:
        self.changed_setting = setting  # (what the state file must record: set, even to its value)
        if self.on_change is not None:
            self.on_change(self)

    def true_energy_j(self) -> float:
        """Exact energy drawn since creation, J."""
        with self._lock:
            return self._energy_at(self.clock.now())

    def true_power_w(self) -> float:
        """Exact power now, W."""
        with self._lock:
            epoch = self._epochs[-1]
            now = self.clock.now()
            u = epoch.workload.utilization(now - epoch.workload_t0)
            return self._power_of(epoch, u)

    def utilization(self) -> float:
        """The workload's utilization now."""
        with self._lock:
            epoch = self._epochs[-1]
            return epoch.workload.utilization(self.clock.now() - epoch.workload_t0)

    def relative_speed(self, utilization: float = 1.0) -> float:
        """Throughput relative to an unconstrained GPU at this utilization (clock ratio)."""
        with self._lock:
            m = self.model
            epoch = self._epochs[-1]
            f = epoch.sm_cap_mhz
            if utilization > 0:
                room = max(epoch.limit_w - m.idle_w, 1e-9) / (utilization * (m.peak_w - m.idle_w))
                f = min(f, m.max_sm_mhz * _speed_for(room, m.voltage_floor))
            return f / m.max_sm_mhz

    def step_time_s(self, work_s: float, compute_fraction: float = 1.0,
                    utilization: float | None = None) -> float:
        """How long ``work_s`` seconds of full-speed work take on this GPU at its limit and clock.

        A ``compute_fraction`` of the work scales with the SM clock, the rest (memory- or
        input-bound) does not. The clock is the one the current workload gets (or the one at
        ``utilization``).
        """
        if work_s < 0 or not 0.0 <= compute_fraction <= 1.0:
            raise ValueError("work_s must be >= 0 and compute_fraction within [0, 1]")
        speed = self.relative_speed(self.utilization() if utilization is None else utilization)
        return work_s * ((1.0 - compute_fraction) + compute_fraction / max(speed, 1e-9))

    # -- GPU interface: energy and power ----------------------------------------------------
    def has_energy_counter(self) -> bool:
        return self.model.energy_counter

    def energy_j(self) -> float:
        if not self.model.energy_counter:
            raise NotSupportedError(f"GPU {self.index} ({self.name}) has no energy counter")
        if self.model.counter_read_s and isinstance(self.clock, RealClock):
            time.sleep(self.model.counter_read_s)  # blocked in the driver, as on an H200
        with self._lock:
            t = self._last_tick(self.model.counter_period_s, self._phase)
            latched = self._latched.get("energy")
            if latched is None or latched[0] != t:
                e = self._energy_at(t) if t >= self._t_created else 0.0
                latched = self._latched["energy"] = (t, math.floor(e * 1000.0) / 1000.0)
            return self._offset_j + latched[1]

    def energy_counter_period_s(self) -> float | None:
        return self.model.counter_period_s if self.model.energy_counter else None

    def power_update_period_s(self) -> float | None:
        return self.model.power_period_s

    def power_w(self) -> float:
        with self._lock:
            m = self.model
            t = self._last_tick(m.power_period_s)
            return self._latch("power", t, m.sample_fraction * m.power_period_s)

    def average_power_w(self) -> float:
        m = self.model
        if m.averaged_power_s is None:
            return self.power_w()
        with self._lock:
            return self._latch("average", self._last_tick(m.power_period_s), m.averaged_power_s)

    def _latch(self, key: str, t: float, span: float) -> float:
        """Average power over ``span`` before the update tick ``t``, W (mW resolution), latched."""
        latched = self._latched.get(key)
        if latched is None or latched[0] != t:
            p = (self._energy_at(t) - self._energy_at(t - span)) / span
            latched = self._latched[key] = (t, math.floor(p * 1000.0) / 1000.0)
        return latched[1]

    # -- power limit ------------------------------------------------------------------------
    def power_limit_w(self) -> float:
        self._read()
        return self._epochs[-1].limit_w

    def default_power_limit_w(self) -> float:
        return self.model.default_limit_w

    def power_limit_range_w(self) -> tuple[float, float]:
        return (self.model.min_limit_w, self.model.max_limit_w)

    def _check_control(self, what: str) -> None:
        if not self.allow_control:
            raise DevicePermissionError(
                f"GPU {self.index}: no permission to change {what}; run as root or grant "
                "the SYS_ADMIN capability"
            )

    def set_power_limit_w(self, watts: float) -> None:
        self.check_power_limit(watts)
        self._check_control("the power limit")
        with self._lock:
            self._read()
            self._new_epoch(limit_w=float(watts))
            self._changed("power_limit_w")

    # -- clocks -----------------------------------------------------------------------------
    def sm_clock_mhz(self) -> float:
        with self._lock:
            epoch = self._epochs[-1]
            u = epoch.workload.utilization(self.clock.now() - epoch.workload_t0)
            if u == 0:
                return self.model.min_sm_mhz if self._sm_lock is None else self._sm_lock[0]
            return round(self.model.max_sm_mhz * self.relative_speed(u))

    def memory_clock_mhz(self) -> float:
        return self.model.mem_mhz if self._mem_lock is None else self._mem_lock[1]

    def supported_sm_clocks_mhz(self) -> list[float]:
        m = self.model
        n = int((m.max_sm_mhz - m.min_sm_mhz) // m.sm_step_mhz)
        return [m.max_sm_mhz - i * m.sm_step_mhz for i in range(n + 1)]

    def _check_sm_lock(self) -> None:
        if self.model.arch in ("kepler", "maxwell", "pascal"):  # NVML: "For Volta or newer"
            raise NotSupportedError(
                f"GPU {self.index} ({self.name}) cannot lock SM clocks (needs Volta or newer)"
            )

    def lock_sm_clock(self, min_mhz: float, max_mhz: float) -> None:
        m = self.model
        self._check_sm_lock()
        if not (m.min_sm_mhz <= min_mhz <= max_mhz <= m.max_sm_mhz):
            raise ValueError(
                f"GPU {self.index} ({self.name}): SM clock range [{min_mhz:g}, {max_mhz:g}] "
                f"MHz is outside [{m.min_sm_mhz:g}, {m.max_sm_mhz:g}] MHz"
            )
        self._check_control("SM clocks")
        with self._lock:
            self._read()
            self._sm_lock = (float(min_mhz), float(max_mhz))
            self._new_epoch(sm_cap_mhz=float(max_mhz))
            self._changed("sm_clock_lock_mhz")

    def reset_sm_clock(self) -> None:
        self._check_sm_lock()
        self._check_control("SM clocks")
        with self._lock:
            self._read()
            self._sm_lock = None
            self._new_epoch(sm_cap_mhz=self.model.max_sm_mhz)
            self._changed("sm_clock_lock_mhz")

    def _check_memory_lock(self) -> None:
        if self.model.arch in ("kepler", "maxwell", "pascal", "volta", "turing"):  # NVML: "Ampere or newer"
            raise NotSupportedError(
                f"GPU {self.index} ({self.name}) cannot lock memory clocks (needs Ampere or newer)"
            )

    def lock_memory_clock(self, min_mhz: float, max_mhz: float) -> None:
        self._check_memory_lock()
        top = self.model.mem_mhz
        if not (0 < min_mhz <= max_mhz <= top):  # (NaN fails every comparison)
            raise ValueError(f"GPU {self.index} ({self.name}): memory clock range [{min_mhz:g}, {max_mhz:g}] "
                             f"MHz is outside (0, {top:g}] MHz")
        self._check_control("memory clocks")
        self._mem_lock = (float(min_mhz), float(max_mhz))

    def reset_memory_clock(self) -> None:
        self._check_memory_lock()
        self._check_control("memory clocks")
        self._mem_lock = None

    def sm_clock_locked(self) -> tuple[float, float] | None:
        """The locked SM clock range, or ``None`` (for checking restore behaviour)."""
        self._read()
        return self._sm_lock

    def temperature_c(self) -> float:
        return round(28.0 + 0.09 * self.true_power_w(), 1)

    def problems(self) -> list[Problem]:
        if not self.model.energy_counter:
            return [
                Problem(
                    f"GPU {self.index}",
                    f"{self.name} has no energy counter; energy comes from power sampling",
                    "use a Volta or newer GPU for counter-based energy",
                )
            ]
        return []
