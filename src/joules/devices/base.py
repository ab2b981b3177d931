"""The device interfaces: what every GPU and CPU backend provides.

Backends (NVML, amdsmi, Linux powercap RAPL, simulated hardware) implement these and
contain hardware access only; measurement logic lives in :mod:`joules.monitoring`.
Units are SI throughout: seconds, joules, watts, MHz, degrees Celsius.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from joules.clock import Clock, RealClock
from joules.errors import InvalidSpecError, NotSupportedError

_T = TypeVar("_T")

# -- fork safety --------------------------------------------------------------------------------
# A forked child runs only the thread that called fork(); a lock that another thread (the
# power sampler, say, in the middle of a reading) held at that moment stays locked in the
# child forever. Device objects are kept across a fork (discover() caches them), so whatever
# owns such a lock registers here, and the child gives each of them fresh locks.
_RENEW_AFTER_FORK: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()


def renew_locks_after_fork(owner: _T, renew: Callable[[_T], None]) -> _T:
    """Have a forked child call ``renew(owner)`` to replace the locks ``owner`` holds.

    ``owner`` is held weakly (it must support weak references); ``renew`` must not refer to
    it, or it is never freed. Returns ``owner``.
    """
    _RENEW_AFTER_FORK[owner] = renew
    return owner


HOST_ENV = "JOULES_HOST"


def host_name() -> str:
    """The name of the machine whose devices these are: ``$JOULES_HOST``, else the host name.

    Devices are told apart by host and id (a GPU's UUID, ``<host>/cpu0``), so that processes on
    one machine count each device once. Containers on one machine (Kubernetes pods, each with
    a host name of its own) share its GPUs and CPU packages: give them the machine's name
    (``JOULES_HOST``, e.g. the node name from the downward API) so that a GPU they share (MIG
    instances of one GPU) and the CPU packages count once.
    """
    name = os.environ.get(HOST_ENV, "").strip()
    if "," in name:  # (host names joined with commas name a total combined across hosts)
        raise InvalidSpecError(f"{HOST_ENV}={name!r}: a host name cannot have a comma")
    return name or socket.gethostname()


def fork_safe_lock(owner: object, attr: str = "_lock",
                   factory: Callable[[], Any] = threading.Lock) -> Any:
    """A new lock for ``owner.<attr>``; a forked child's copy of ``owner`` gets a fresh one."""
    renew_locks_after_fork(owner, lambda o: setattr(o, attr, factory()))
    return factory()


def _renew_locks_in_child() -> None:
    for owner, renew in list(_RENEW_AFTER_FORK.items()):
        try:
            renew(owner)
        except Exception:  # noqa: BLE001 - the child must start, whatever one owner does
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_locks_in_child)


@dataclass(frozen=True)
class Problem:
    """Something that limits what joules can do on a device, and how to fix it."""

    device: str
    message: str
    fix: str = ""


class GPU(ABC):
    """One GPU (or MIG instance) as seen by this process.

    ``index`` is the position among the GPUs visible to this process (the index CUDA and
    frameworks use); ``physical_index`` is the index the driver uses.
    """

    index: int
    physical_index: int
    name: str
    uuid: str
    vendor: str = "unknown"

    @property
    def measured_uuid(self) -> str:
        """UUID of the device whose energy and power this one reports.

        Its own UUID, except for a MIG instance: NVML reports the whole physical GPU there,
        so two instances of one GPU read the same energy, which must be counted once.
        """
        return self.uuid

    @property
    def control_uuid(self) -> str:
        """UUID of the device whose power limit and clocks this one sets.

        Its own UUID, except for a MIG instance: the limit and the clocks are the whole
        physical GPU's, so what changes them through two instances changes one device (a
        :class:`~joules.devices.restore.RestoreGuard` keys its changes and journals by it).
        """
        return self.uuid

    # -- energy and power -------------------------------------------------------------------
    @abstractmethod
    def has_energy_counter(self) -> bool:
        """Whether :meth:`energy_j` is available."""

    @abstractmethod
    def energy_j(self) -> float:
        """Cumulative energy counter in joules (arbitrary origin). NotSupportedError if none."""

    def energy_counter_period_s(self) -> float | None:
        """How often the energy counter is updated by the hardware, when known."""
        return None

    @abstractmethod
    def power_w(self) -> float:
        """The most instantaneous power reading the device offers, W."""

    @abstractmethod
    def average_power_w(self) -> float:
        """Averaged power reading, W (a 1 s average on NVIDIA Ampere and newer, except GA100).

        Where the device offers no averaged reading (NVIDIA GA100 and older GPUs) this is the
        instant one.
        """

    def power_update_period_s(self) -> float | None:
        """How often the power reading changes, when known."""
        return None

    # -- power limit ------------------------------------------------------------------------
    @abstractmethod
    def power_limit_w(self) -> float:
        """Current power limit, W."""

    @abstractmethod
    def default_power_limit_w(self) -> float:
        """Default (factory) power limit, W."""

    @abstractmethod
    def power_limit_range_w(self) -> tuple[float, float]:
        """(min, max) settable power limit, W."""

    @abstractmethod
    def set_power_limit_w(self, watts: float) -> None:
        """Set the power limit. ValueError outside the allowed range."""

    def check_power_limit(self, watts: float) -> float:
        """Return ``watts`` if it is a settable power limit; ValueError naming the range if not."""
        lo, hi = self.power_limit_range_w()
        if not lo <= watts <= hi:
            raise ValueError(
                f"GPU {self.index} ({self.name}): power limit {watts:g} W is outside the allowed "
                f"range [{lo:g}, {hi:g}] W"
            )
        return watts

    def reset_power_limit(self) -> None:
        """Restore the default power limit."""
        self.set_power_limit_w(self.default_power_limit_w())

    # -- clocks -----------------------------------------------------------------------------
    @abstractmethod
    def sm_clock_mhz(self) -> float:
        """Current SM (graphics) clock, MHz."""

    @abstractmethod
    def memory_clock_mhz(self) -> float:
        """Current memory clock, MHz."""

    @abstractmethod
    def supported_sm_clocks_mhz(self) -> list[float]:
        """SM clocks the device accepts for locking, highest first."""

    @abstractmethod
    def lock_sm_clock(self, min_mhz: float, max_mhz: float) -> None:
        """Lock the SM clock to the range [min_mhz, max_mhz]."""

    @abstractmethod
    def reset_sm_clock(self) -> None:
        """Undo :meth:`lock_sm_clock`."""

    def lock_memory_clock(self, min_mhz: float, max_mhz: float) -> None:
        """Lock the memory clock to a range."""
        raise NotSupportedError(f"GPU {self.index} ({self.name}): memory clock locking")

    def reset_memory_clock(self) -> None:
        """Undo :meth:`lock_memory_clock`."""
        raise NotSupportedError(f"GPU {self.index} ({self.name}): memory clock locking")

    # -- misc -------------------------------------------------------------------------------
    @abstractmethod
    def temperature_c(self) -> float:
        """GPU temperature, degrees Celsius."""

    def problems(self) -> list[Problem]:
        """What limits measurement or control on this GPU, each with its fix."""
        return []

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary of the GPU and what it supports."""
        info: dict[str, object] = {
            "index": self.index,
            "physical_index": self.physical_index,
            "name": self.name,
            "uuid": self.uuid,
            "vendor": self.vendor,
            "energy_counter": self.has_energy_counter(),
            "energy_counter_period_s": self.energy_counter_period_s(),
            "power_update_period_s": self.power_update_period_s(),
        }
        for key, fn in (
            ("power_w", self.power_w),
            ("power_limit_w", self.power_limit_w),
            ("default_power_limit_w", self.default_power_limit_w),
            ("power_limit_range_w", self.power_limit_range_w),
            ("sm_clock_mhz", self.sm_clock_mhz),
            ("temperature_c", self.temperature_c),
        ):
            try:
                info[key] = fn()
            except Exception:  # noqa: BLE001 - a summary reports what it can read
                info[key] = None
        return info


class WrappingCounter:
    """Extends a hardware counter that wraps around at ``wrap`` into a monotonic one.

    RAPL energy counters wrap every few minutes at high power. As long as :meth:`update` is
    called at least once per wrap period (the power sampler does this for CPU zones), the
    extended value is exact at any window length. Thread-safe.

    Args:
        wrap: The value at which the raw counter wraps to zero (``max_energy_range_uj``).

    """

    def __init__(self, wrap: int) -> None:
        if wrap <= 0:
            raise ValueError(f"counter wrap value must be positive, got {wrap}")
        self.wrap = wrap
        self._last: int | None = None
        self._base = 0
        self._lock = fork_safe_lock(self)

    def update(self, raw: int, max_gain: float | None = None) -> int:
        """Feed a raw reading; return the extended value (monotonic but for resets).

        Args:
            raw: The reading.
            max_gain: The most the counter can have gained since the previous reading (its
                highest rate times the time since), if known. A reading that went back by
                more than a wrap could explain is a reset of the counter (a GPU reset, a
                driver reload), not a wrap: the extended value restarts from it, so it goes
                back too and its reader sees the reset.
        """
        with self._lock:
            if self._last is not None and raw < self._last:
                if max_gain is not None and self.wrap - self._last + raw > max_gain:
                    self._base = 0
                else:
                    self._base += self.wrap
            self._last = raw
            return self._base + raw


class CPU(ABC):
    """One CPU package (socket) with its package and, where present, DRAM energy zones."""

    index: int
    name: str
    vendor: str = "unknown"

    @abstractmethod
    def package_energy_j(self) -> float:
        """Cumulative package energy, J, wrap-corrected (monotonic)."""

    @abstractmethod
    def has_dram(self) -> bool:
        """Whether :meth:`dram_energy_j` is available."""

    def readable(self) -> bool:
        """Whether this process can read the package energy (RAPL counters are often root-only)."""
        return True

    @abstractmethod
    def dram_energy_j(self) -> float:
        """Cumulative DRAM energy, J, wrap-corrected. NotSupportedError if none."""

    def max_read_interval_s(self) -> float:
        """How often the counters must be read for wraps to be caught (shortest wrap time)."""
        return 60.0

    def max_power_w(self, dram: bool = False) -> float | None:
        """The most the package (or its DRAM) can draw, W, where the device says; else ``None``."""
        return None

    def problems(self) -> list[Problem]:
        """What limits measurement on this package, each with its fix."""
        return []

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary of the package."""
        return {
            "index": self.index,
            "name": self.name,
            "vendor": self.vendor,
            "dram": self.has_dram(),
            "max_read_interval_s": self.max_read_interval_s(),
        }


@dataclass
class DeviceSet:
    """The devices a process can use, the clock they run on, and what went wrong finding them."""

    gpus: list[GPU] = field(default_factory=list)
    cpus: list[CPU] = field(default_factory=list)
    clock: Clock = field(default_factory=RealClock)
    problems: list[Problem] = field(default_factory=list)
    backend: str = "none"
    simulator: object | None = None
