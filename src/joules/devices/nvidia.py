"""NVIDIA GPUs through NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``).

``pynvml`` is imported lazily with :func:`importlib.import_module`, so tests can put a fake in
``sys.modules`` (see :mod:`joules.testing.fake_pynvml`).

Readings:

* Energy: ``nvmlDeviceGetTotalEnergyConsumption`` (mJ; Volta and newer), checked once when
  the GPU object is made.
* Power: the ``NVML_FI_DEV_POWER_INSTANT`` field where the driver supports it, because on
  Ampere (except GA100: A100, A30) and newer ``nvmlDeviceGetPowerUsage`` is a 1 s average;
  otherwise ``nvmlDeviceGetPowerUsage``, which is the instant reading on GA100 and older
  GPUs. The power scope is ``"gpu"`` (the GPU board) or ``"module"`` (the whole module on
  Grace-Hopper-like boards).
* MIG: a MIG device is measured through its parent GPU: NVML reports power and energy for
  the physical GPU only, so readings include every MIG device on it.

The hot paths (:meth:`NVMLGPU.energy_j`, :meth:`NVMLGPU.power_w`) make one NVML call each,
with handles, functions, constants and the field-value request built once.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import operator
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from joules.devices.base import GPU, Problem, renew_locks_after_fork
from joules.devices.visible import MigDevice, resolve_visible_devices
from joules.errors import DeviceNotFoundError, DevicePermissionError, JoulesError, NotSupportedError

__all__ = ["MIN_DRIVER_VERSION", "NVMLGPU", "POWER_SCOPES", "discover_nvml"]

POWER_SCOPES = ("gpu", "module")
"""Accepted ``power_scope`` values."""

MIN_DRIVER_VERSION = (525, 60)
"""Oldest driver joules measures well with.

R525 (525.60, the first CUDA 12.0 driver) is the first whose NVML has the
``NVML_FI_DEV_POWER_INSTANT``/``NVML_FI_DEV_POWER_AVERAGE`` fields and power scopes. With an
older driver, ``power_w`` on Ampere (except GA100) and newer can only return the 1 s average of
``nvmlDeviceGetPowerUsage``, which smears short phases.
"""

# Architecture -> (energy counter update period, power reading update period), seconds.
# Best-known values from public measurements of V100, A100 and H100 boards (and the P100's
# power sensor); other architectures are not measured and report None.
_ARCH_TIMING: dict[str, tuple[float | None, float | None]] = {
    "pascal": (None, 0.02),
    "volta": (0.02, 0.02),
    "ampere": (0.1, 0.1),
    "hopper": (0.1, 0.1),
}
_ARCH_NAMES = {
    2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere", 8: "ada",
    9: "hopper", 10: "blackwell", 13: "rubin",
}
_PRE_VOLTA = ("kepler", "maxwell", "pascal")
# Where nvmlDeviceGetPowerUsage is a 1 s average: Ampere and newer, except GA100 (compute
# capability 8.0: A100, A30, A800), whose reading is instantaneous as on older GPUs.
_AVERAGING_ARCHS = ("ampere", "ada", "hopper", "blackwell", "rubin")
_GA100_NAME = re.compile(r"\bA(100|30|800)\b")
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

_ROOT_FIX = (
    "run as root (sudo) or with the CAP_SYS_ADMIN capability, and keep persistence mode on "
    "(`sudo nvidia-smi -pm 1`) so settings are not lost when the driver unloads"
)

# NVML modules this process has initialized (NVML counts nvmlInit calls; once is enough).
_INITIALIZED: weakref.WeakSet[ModuleType] = weakref.WeakSet()
_INIT_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child initializes NVML itself on next use, and starts with its lock free."""
    global _INIT_LOCK
    _INIT_LOCK = threading.Lock()
    _INITIALIZED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _import_nvml() -> ModuleType:
    return importlib.import_module("pynvml")


def _ensure_init(nvml: ModuleType) -> None:
    with _INIT_LOCK:
        if nvml not in _INITIALIZED:
            nvml.nvmlInit()
            _INITIALIZED.add(nvml)


def _const(nvml: ModuleType, name: str, default: int) -> int:
    return int(getattr(nvml, name, default))


_PROBE_TRIES = 3  # tries of a capability before an error other than "not supported" rules it out
_PERMANENT_ERRORS = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NO_PERMISSION",
                     "NVML_ERROR_INVALID_ARGUMENT")


def _permanent(nvml: ModuleType, code: object) -> bool:
    """Whether an NVML return code says a query cannot work on this GPU (not: failed this once)."""
    return code in {_const(nvml, name, -1) for name in _PERMANENT_ERRORS}


def _probe(nvml: ModuleType, fn: Callable[[], Any]) -> Any:
    """``fn()``, tried again after a transient NVML error (a timeout, say) as a GPU is opened.

    A capability probed once at start-up and found failing is off for the whole process: one
    timeout then cost a GPU its energy counter or its instant power field for good.
    """
    for attempt in range(_PROBE_TRIES):
        try:
            return fn()
        except nvml.NVMLError as e:
            if _permanent(nvml, getattr(e, "value", None)) or attempt == _PROBE_TRIES - 1:
                raise
            time.sleep(0.01)
    raise AssertionError("unreachable")


def _parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _fast_field_reader(
    nvml: ModuleType, handle: object, field_id: int, scope: int, member: str
) -> Callable[[], int] | None:
    """A reader that reuses one request array and calls NVML's C function directly.

    nvidia-ml-py's ``nvmlDeviceGetFieldValues`` builds a new ctypes array and fills it through
    Python-level attribute hooks on every call; this does that work once. ``None`` when the
    module does not expose what it needs (then the public function is used).
    """
    get_pointer = getattr(nvml, "_nvmlGetFunctionPointer", None)
    struct = getattr(nvml, "c_nvmlFieldValue_t", None)
    if get_pointer is None or struct is None:
        return None
    try:
        fn = get_pointer("nvmlDeviceGetFieldValues")
        array = (struct * 1)()
        elem = array[0]  # a view into the array's memory
        # ctypes field descriptors: set and read without nvidia-ml-py's Python attribute hooks.
        set_field, set_scope = struct.fieldId.__set__, struct.scopeId.__set__
        get_ret = struct.nvmlReturn.__get__
        value = elem.value  # a view as well
        get_value = operator.attrgetter(member)
        count = ctypes.c_int32(1)
        ref = ctypes.byref(array)
    except Exception:  # noqa: BLE001 - any mismatch: use the public function instead
        return None
    err, ok = nvml.NVMLError, _const(nvml, "NVML_SUCCESS", 0)
    lock = threading.Lock()  # the request array is shared: one reading at a time

    def read() -> int:
        with lock:
            set_field(elem, field_id)
            set_scope(elem, scope)
            ret = fn(handle, count, ref)
            if ret != ok:
                raise err(ret)
            ret = get_ret(elem, struct)
            if ret != ok:
                raise err(ret)
            return get_value(value)

    def renew_lock(_: object) -> None:
        nonlocal lock
        lock = threading.Lock()  # a forked child: the parent's may have been held

    try:
        read()
    except Exception:  # noqa: BLE001 - the public path will report errors properly
        return None
    return renew_locks_after_fork(read, renew_lock)


def _field_reader(nvml: ModuleType, handle: object, field_id: int, scope: int) -> Callable[[], int] | None:
    """A zero-argument reader of one field value, or ``None`` if the GPU does not support it."""
    err, ok = nvml.NVMLError, _const(nvml, "NVML_SUCCESS", 0)
    request = [(field_id, scope)]

    def probe() -> Any:
        fv = nvml.nvmlDeviceGetFieldValues(handle, request)[0]
        if fv.nvmlReturn != ok:
            raise err(fv.nvmlReturn)  # (tried again unless it says "not supported")
        return fv

    try:
        fv = _probe(nvml, probe)
        member = _VALUE_MEMBERS.get(int(fv.valueType), "uiVal")
    except err:
        return None
    fast = _fast_field_reader(nvml, handle, field_id, scope, member)
    if fast is not None:
        return fast
    get = nvml.nvmlDeviceGetFieldValues
    get_value = operator.attrgetter(member)

    def read() -> int:
        v = get(handle, request)[0]
        if v.nvmlReturn != ok:
            raise err(v.nvmlReturn)
        return get_value(v.value)

    return read


class NVMLGPU(GPU):
    """An NVIDIA GPU, or a MIG device on one, read and controlled through NVML.

    NVML must be importable as ``pynvml``; it is initialized on first use. Use
    :func:`discover_nvml` to get the GPUs a process can see.

    Args:
        physical_index: NVML index of the physical GPU.
        index: Index among the GPUs visible to the process (default: ``physical_index``).
        mig_uuid: UUID of a MIG device on that GPU, when the process runs on one. Power and
            energy are then those of the whole physical GPU.
        power_scope: ``"gpu"`` for the GPU board, or ``"module"`` for the whole module on
            Grace-Hopper-like boards (``NVML_POWER_SCOPE_MODULE``).
        nvml: The ``pynvml`` module to use (default: imported lazily).

    Raises:
        ValueError: For an unknown power scope.
        NotSupportedError: When ``power_scope="module"`` and the GPU reports no module power.
        DeviceNotFoundError: When ``mig_uuid`` is not a MIG device of that GPU.

    Attributes:
        is_ga100: Whether the GPU is a GA100 (compute capability 8.0: A100, A30, A800).
        power_usage_averaged: Whether ``nvmlDeviceGetPowerUsage`` is a 1 s average (Ampere
            and newer except GA100) rather than an instant reading.

    """

    vendor = "nvidia"

    def __init__(
        self,
        physical_index: int,
        *,
        index: int | None = None,
        mig_uuid: str | None = None,
        power_scope: str = "gpu",
        nvml: ModuleType | None = None,
    ) -> None:
        if power_scope not in POWER_SCOPES:
            raise ValueError(f"power_scope must be one of {POWER_SCOPES}, got {power_scope!r}")
        nvml = _import_nvml() if nvml is None else nvml
        _ensure_init(nvml)
        self._nvml = nvml
        self._err: type[Exception] = nvml.NVMLError
        self._code_no_permission = _const(nvml, "NVML_ERROR_NO_PERMISSION", 4)
        self._code_not_supported = _const(nvml, "NVML_ERROR_NOT_SUPPORTED", 3)
        self._code_invalid = _const(nvml, "NVML_ERROR_INVALID_ARGUMENT", 2)
        self._code_function_not_found = _const(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)
        self.physical_index = physical_index
        self.index = physical_index if index is None else index
        self.power_scope = power_scope
        self._label = f"GPU {self.index}"

        h = self._handle = self._call(nvml.nvmlDeviceGetHandleByIndex, "open the GPU", physical_index)
        self.gpu_uuid: str = self._call(nvml.nvmlDeviceGetUUID, "read the UUID", h)
        self.gpu_name: str = self._call(nvml.nvmlDeviceGetName, "read the name", h)
        self.mig_uuid = mig_uuid
        if mig_uuid is not None:
            mig_handle = self._find_mig(mig_uuid)
            self.name = self._call(nvml.nvmlDeviceGetName, "read the MIG device name", mig_handle)
            self.uuid = mig_uuid
        else:
            self.name, self.uuid = self.gpu_name, self.gpu_uuid
        self._label = f"GPU {self.index} ({self.name})"

        self.architecture = self._optional(lambda: _ARCH_NAMES.get(int(nvml.nvmlDeviceGetArchitecture(h))))
        self.architecture = self.architecture or "unknown"
        capability = self._optional(lambda: tuple(nvml.nvmlDeviceGetCudaComputeCapability(h)))
        if self.architecture != "ampere":
            self.is_ga100 = False
        elif capability is not None:
            self.is_ga100 = capability == (8, 0)
        else:
            self.is_ga100 = _GA100_NAME.search(self.gpu_name) is not None
        self.power_usage_averaged = self.architecture in _AVERAGING_ARCHS and not self.is_ga100
        self.driver_version: str | None = self._optional(nvml.nvmlSystemGetDriverVersion)
        mode = self._optional(lambda: nvml.nvmlDeviceGetPersistenceMode(h))
        self.persistence_mode: bool | None = (
            None if mode is None else mode == _const(nvml, "NVML_FEATURE_ENABLED", 1)
        )
        mig_mode = self._optional(lambda: nvml.nvmlDeviceGetMigMode(h)[0])
        self.mig_mode = bool(mig_mode) and mig_mode == _const(nvml, "NVML_DEVICE_MIG_ENABLE", 1)

        # Energy counter: checked once.
        self._energy_error: str | None = None
        self._read_energy: Callable[[Any], int] | None = nvml.nvmlDeviceGetTotalEnergyConsumption
        try:
            _probe(nvml, lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h))
        except self._err as e:
            self._read_energy = None
            if self.architecture in _PRE_VOLTA or getattr(e, "value", None) == self._code_not_supported:
                self._energy_error = (
                    f"{self._label} has no energy counter (NVML's counter needs a Volta or newer GPU)"
                )
            else:
                self._energy_error = f"{self._label}: cannot read the energy counter ({e})"

        # Power readings.
        scope_id = _const(
            nvml, "NVML_POWER_SCOPE_MODULE" if power_scope == "module" else "NVML_POWER_SCOPE_GPU",
            1 if power_scope == "module" else 0,
        )
        fi_instant = _const(nvml, "NVML_FI_DEV_POWER_INSTANT", 186)
        fi_average = _const(nvml, "NVML_FI_DEV_POWER_AVERAGE", 185)
        instant = _field_reader(nvml, h, fi_instant, scope_id)
        self._instant_field = instant is not None
        if power_scope == "gpu":
            usage = functools.partial(nvml.nvmlDeviceGetPowerUsage, h)
            self._read_power: Callable[[], int] = instant or usage
            self._read_average: Callable[[], int] = usage
            self.power_source = "NVML_FI_DEV_POWER_INSTANT" if instant else "nvmlDeviceGetPowerUsage"
            self.average_power_source = "nvmlDeviceGetPowerUsage"
        else:
            average = _field_reader(nvml, h, fi_average, scope_id)
            if instant is None and average is None:
                raise NotSupportedError(
                    f"{self._label} reports no module-scope power (NVML_POWER_SCOPE_MODULE is for "
                    "Grace-Hopper-like modules); use power_scope='gpu'"
                )
            self._read_power = instant or average  # type: ignore[assignment]
            self._read_average = average or instant  # type: ignore[assignment]
            self.power_source = "NVML_FI_DEV_POWER_INSTANT" if instant else "NVML_FI_DEV_POWER_AVERAGE"
            self.average_power_source = (
                "NVML_FI_DEV_POWER_AVERAGE" if average else "NVML_FI_DEV_POWER_INSTANT"
            )
            self.power_source += " (module scope)"
            self.average_power_source += " (module scope)"

        self._limit_range: tuple[float, float] | None = None
        self._default_limit: float | None = None
        self._sm_clocks: list[float] | None = None
        self._read_temperature: Callable[[], int] | None = None

    # -- helpers ----------------------------------------------------------------------------
    def _translate(self, e: Exception, action: str, fix: str = "") -> Exception:
        code = getattr(e, "value", None)
        if code == self._code_no_permission:
            return DevicePermissionError(f"{self._label}: no permission to {action}. Fix: {fix or _ROOT_FIX}")
        if code in (self._code_not_supported, self._code_function_not_found):
            return NotSupportedError(f"{self._label}: NVML cannot {action} on this GPU ({e})")
        if code == self._code_invalid:
            return ValueError(f"{self._label}: NVML rejected the request to {action} ({e})")
        return JoulesError(f"{self._label}: NVML error trying to {action}: {e}")

    def _call(self, fn: Callable[..., Any], action: str, *args: Any, fix: str = "") -> Any:
        try:
            return fn(*args)
        except self._err as e:
            raise self._translate(e, action, fix) from e

    def _optional(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self._err:
            return None

    def _find_mig(self, mig_uuid: str) -> object:
        nvml, h = self._nvml, self._handle
        handle = self._optional(lambda: nvml.nvmlDeviceGetHandleByUUID(mig_uuid))
        if handle is not None:
            parent = self._optional(lambda: nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle))
            if parent is not None and self._optional(lambda: nvml.nvmlDeviceGetUUID(parent)) == self.gpu_uuid:
                return handle
        count = self._optional(lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(h)) or 0
        for k in range(count):
            mig = self._optional(lambda k=k: nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k))
            if mig is not None and self._optional(lambda m=mig: nvml.nvmlDeviceGetUUID(m)) == mig_uuid:
                return mig
        raise DeviceNotFoundError(
            f"no MIG device {mig_uuid} on GPU {self.physical_index} ({self.gpu_uuid}); "
            "list MIG devices with `nvidia-smi -L`"
        )

    @property
    def is_mig(self) -> bool:
        """Whether this is a MIG device (measured through its parent GPU)."""
        return self.mig_uuid is not None

    # -- energy and power -------------------------------------------------------------------
    def has_energy_counter(self) -> bool:
        return self._read_energy is not None

    def energy_j(self) -> float:
        read = self._read_energy
        if read is None:
            raise NotSupportedError(self._energy_error or f"{self._label} has no energy counter")
        try:
            return read(self._handle) / 1000.0
        except self._err as e:
            raise self._translate(e, "read the energy counter") from e

    @property
    def measured_uuid(self) -> str:
        """The physical GPU's UUID (also for a MIG instance, which reports the whole GPU)."""
        return self.gpu_uuid

    @property
    def control_uuid(self) -> str:
        """The physical GPU's UUID (also for a MIG instance: limits and clocks are the whole GPU's)."""
        return self.gpu_uuid

    def energy_counter_period_s(self) -> float | None:
        if self._read_energy is None:
            return None
        return _ARCH_TIMING.get(self.architecture, (None, None))[0]

    def power_w(self) -> float:
        try:
            return self._read_power() / 1000.0
        except self._err as e:
            raise self._translate(e, "read the power") from e

    def average_power_w(self) -> float:
        try:
            return self._read_average() / 1000.0
        except self._err as e:
            raise self._translate(e, "read the average power") from e

    def power_update_period_s(self) -> float | None:
        return _ARCH_TIMING.get(self.architecture, (None, None))[1]

    # -- power limit ------------------------------------------------------------------------
    def power_limit_w(self) -> float:
        mw = self._call(self._nvml.nvmlDeviceGetPowerManagementLimit, "read the power limit", self._handle)
        return mw / 1000.0

    def default_power_limit_w(self) -> float:
        if self._default_limit is None:
            mw = self._call(
                self._nvml.nvmlDeviceGetPowerManagementDefaultLimit, "read the default power limit",
                self._handle,
            )
            self._default_limit = mw / 1000.0
        return self._default_limit

    def power_limit_range_w(self) -> tuple[float, float]:
        if self._limit_range is None:
            lo, hi = self._call(
                self._nvml.nvmlDeviceGetPowerManagementLimitConstraints, "read the power limit range",
                self._handle,
            )
            self._limit_range = (lo / 1000.0, hi / 1000.0)
        return self._limit_range

    def set_power_limit_w(self, watts: float) -> None:
        self.check_power_limit(watts)
        fix = (
            f"run as root (sudo) or with CAP_SYS_ADMIN, or set it as root with "
            f"`sudo nvidia-smi -i {self.physical_index} -pl {watts:g}`; keep persistence mode on "
            "(`sudo nvidia-smi -pm 1`) so the limit is not lost when the driver unloads"
        )
        self._call(
            self._nvml.nvmlDeviceSetPowerManagementLimit, "set the power limit",
            self._handle, int(round(watts * 1000.0)), fix=fix,
        )

    # -- clocks -----------------------------------------------------------------------------
    def sm_clock_mhz(self) -> float:
        clock = _const(self._nvml, "NVML_CLOCK_SM", 1)
        return float(self._call(self._nvml.nvmlDeviceGetClockInfo, "read the SM clock", self._handle, clock))

    def memory_clock_mhz(self) -> float:
        clock = _const(self._nvml, "NVML_CLOCK_MEM", 2)
        return float(
            self._call(self._nvml.nvmlDeviceGetClockInfo, "read the memory clock", self._handle, clock)
        )

    def supported_memory_clocks_mhz(self) -> list[float]:
        """Memory clocks the GPU supports, highest first."""
        clocks = self._call(
            self._nvml.nvmlDeviceGetSupportedMemoryClocks, "list memory clocks", self._handle
        )
        return sorted({float(c) for c in clocks}, reverse=True)

    def supported_sm_clocks_mhz(self) -> list[float]:
        if self._sm_clocks is None:
            mems = self.supported_memory_clocks_mhz()
            if not mems:
                raise NotSupportedError(f"{self._label}: NVML lists no supported memory clocks")
            clocks = self._call(
                self._nvml.nvmlDeviceGetSupportedGraphicsClocks, "list SM clocks", self._handle, int(mems[0])
            )
            self._sm_clocks = sorted({float(c) for c in clocks}, reverse=True)
        return list(self._sm_clocks)

    def _check_clock_range(self, what: str, min_mhz: float, max_mhz: float, supported: list[float]) -> None:
        if not min_mhz <= max_mhz:
            raise ValueError(f"{self._label}: {what} clock range [{min_mhz:g}, {max_mhz:g}] MHz is empty")
        if supported and not (supported[-1] <= min_mhz and max_mhz <= supported[0]):
            raise ValueError(
                f"{self._label}: {what} clock range [{min_mhz:g}, {max_mhz:g}] MHz is outside the "
                f"supported range [{supported[-1]:g}, {supported[0]:g}] MHz"
            )

    def _lock_clock(
        self, what: str, flag: str, supported: Callable[[], list[float]], setter: Callable[..., Any],
        min_mhz: float, max_mhz: float,
    ) -> None:
        try:
            clocks = supported()
        except NotSupportedError:
            clocks = []
        self._check_clock_range(what, min_mhz, max_mhz, clocks)
        fix = (
            "run as root (sudo) or with CAP_SYS_ADMIN, or lock them as root with "
            f"`sudo nvidia-smi -i {self.physical_index} {flag} {min_mhz:g},{max_mhz:g}`"
        )
        self._call(setter, f"lock the {what} clock", self._handle, int(round(min_mhz)), int(round(max_mhz)),
                   fix=fix)

    def lock_sm_clock(self, min_mhz: float, max_mhz: float) -> None:
        self._lock_clock("SM", "-lgc", self.supported_sm_clocks_mhz,
                         self._nvml.nvmlDeviceSetGpuLockedClocks, min_mhz, max_mhz)

    def reset_sm_clock(self) -> None:
        fix = f"run as root (sudo), or reset as root with `sudo nvidia-smi -i {self.physical_index} -rgc`"
        self._call(self._nvml.nvmlDeviceResetGpuLockedClocks, "reset the SM clock", self._handle, fix=fix)

    def lock_memory_clock(self, min_mhz: float, max_mhz: float) -> None:
        self._lock_clock("memory", "-lmc", self.supported_memory_clocks_mhz,
                         self._nvml.nvmlDeviceSetMemoryLockedClocks, min_mhz, max_mhz)

    def reset_memory_clock(self) -> None:
        fix = f"run as root (sudo), or reset as root with `sudo nvidia-smi -i {self.physical_index} -rmc`"
        self._call(
            self._nvml.nvmlDeviceResetMemoryLockedClocks, "reset the memory clock", self._handle, fix=fix
        )

    # -- misc -------------------------------------------------------------------------------
    def temperature_c(self) -> float:
        nvml, h = self._nvml, self._handle
        sensor = _const(nvml, "NVML_TEMPERATURE_GPU", 0)
        if self._read_temperature is None:
            # nvmlDeviceGetTemperature is deprecated; the V form needs a recent driver.
            read_v = getattr(nvml, "nvmlDeviceGetTemperatureV", None)
            if read_v is not None and self._optional(lambda: read_v(h, sensor)) is not None:
                self._read_temperature = functools.partial(read_v, h, sensor)
            else:
                self._read_temperature = functools.partial(nvml.nvmlDeviceGetTemperature, h, sensor)
        return float(self._call(self._read_temperature, "read the temperature"))

    def problems(self) -> list[Problem]:
        where = f"GPU {self.index}"
        found: list[Problem] = []
        if self.mig_uuid is not None:
            found.append(
                Problem(
                    where,
                    f"{self.name} is MIG device {self.mig_uuid} on physical GPU {self.physical_index} "
                    f"({self.gpu_name}): NVML reports power and energy only for the whole GPU, so "
                    "readings include every other MIG device on it, and power limits and clocks are "
                    "per physical GPU (setting them affects every MIG device on it)",
                    "for per-job energy, run on a whole GPU (disable MIG with "
                    f"`sudo nvidia-smi -i {self.physical_index} -mig 0`) or run nothing else on this GPU",
                )
            )
        elif self.mig_mode:
            found.append(
                Problem(
                    where,
                    f"MIG mode is enabled on physical GPU {self.physical_index}: readings cover all "
                    "of its MIG devices",
                    "select the MIG device by its UUID in CUDA_VISIBLE_DEVICES (`nvidia-smi -L`), "
                    f"or disable MIG with `sudo nvidia-smi -i {self.physical_index} -mig 0`",
                )
            )
        if self._read_energy is None:
            found.append(
                Problem(
                    where,
                    f"{self._energy_error}; energy comes from integrating power samples, which is "
                    "less accurate",
                    "use a Volta or newer GPU for counter-based energy",
                )
            )
        if self.persistence_mode is False:
            found.append(
                Problem(
                    where,
                    "persistence mode is off: the driver may unload between programs, which slows "
                    "the first NVML call and drops power limit and clock settings",
                    "sudo nvidia-smi -pm 1",
                )
            )
        version = _parse_version(self.driver_version or "")
        if version and version < MIN_DRIVER_VERSION:
            lacking = (
                "the instant power field is missing, so power readings are 1 s averages"
                if self.power_usage_averaged and not self._instant_field
                else "newer power fields and power scopes are missing"
            )
            found.append(
                Problem(
                    where,
                    f"NVIDIA driver {self.driver_version} is older than "
                    f"{'.'.join(map(str, MIN_DRIVER_VERSION))}: {lacking}",
                    "upgrade the NVIDIA driver to R525 or newer",
                )
            )
        elif not self._instant_field and self.power_usage_averaged:
            found.append(
                Problem(
                    where,
                    "the driver does not report NVML_FI_DEV_POWER_INSTANT: power readings are 1 s "
                    "averages, which smear short phases (energy from the counter is unaffected)",
                    "upgrade the NVIDIA driver",
                )
            )
        return found

    def describe(self) -> dict[str, object]:
        info = super().describe()
        info.update(
            {
                "architecture": self.architecture,
                "driver_version": self.driver_version,
                "persistence_mode": self.persistence_mode,
                "power_scope": self.power_scope,
                "power_source": self.power_source,
                "average_power_source": self.average_power_source,
                "power_usage_averaged": self.power_usage_averaged,
                "mig": None
                if self.mig_uuid is None
                else {
                    "uuid": self.mig_uuid,
                    "parent_index": self.physical_index,
                    "parent_uuid": self.gpu_uuid,
                    "parent_name": self.gpu_name,
                    "measures": "the whole physical GPU (every MIG device on it)",
                },
                "mig_mode": self.mig_mode,
            }
        )
        return info

    def __repr__(self) -> str:
        mig = f", mig={self.mig_uuid!r}" if self.mig_uuid else ""
        return f"NVMLGPU(index={self.index}, physical_index={self.physical_index}, name={self.name!r}{mig})"


# -- discovery --------------------------------------------------------------------------------


def _init_problem(nvml: ModuleType, e: Exception) -> Problem:
    code = getattr(e, "value", None)
    fixes = {
        _const(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", 9): (
            "the NVIDIA driver is not loaded",
            "install the NVIDIA driver or load it (`sudo modprobe nvidia`); check with `nvidia-smi`",
        ),
        _const(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12): (
            "the NVML library (libnvidia-ml.so.1) was not found",
            "install the NVIDIA driver; in a container, run it with the NVIDIA Container Toolkit "
            "(`docker run --gpus all ...`)",
        ),
        _const(nvml, "NVML_ERROR_NO_PERMISSION", 4): (
            "no permission to open the NVIDIA devices",
            "give the user access to /dev/nvidia* (for example, add it to the `video` group)",
        ),
        _const(nvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", 18): (
            "the NVML library and the loaded kernel driver have different versions",
            "reboot (or reload the nvidia kernel modules) after the driver upgrade",
        ),
    }
    what, fix = fixes.get(code, ("NVML could not be initialized", "check that `nvidia-smi` works"))
    return Problem("nvml", f"{what} (nvmlInit: {e}); no NVIDIA GPU can be measured", fix)


def _mig_devices(nvml: ModuleType, handle: object) -> list[MigDevice]:
    err = nvml.NVMLError
    try:
        mode = nvml.nvmlDeviceGetMigMode(handle)[0]
    except err:
        return []
    if mode != _const(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return []
    found: list[MigDevice] = []
    try:
        count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except err:
        return []
    for k in range(count):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, k)
        except err:
            continue  # an empty slot
        try:
            uuid = nvml.nvmlDeviceGetUUID(mig)
        except err:
            continue
        gi = ci = None
        try:
            gi = int(nvml.nvmlDeviceGetGpuInstanceId(mig))
            ci = int(nvml.nvmlDeviceGetComputeInstanceId(mig))
        except err:
            pass
        found.append(MigDevice(uuid, gi, ci))
    return found


def discover_nvml(
    env: Mapping[str, str] | None = None,
    *,
    power_scope: str = "gpu",
) -> tuple[list[GPU], list[Problem]]:
    """Find the NVIDIA GPUs this process can see, through NVML.

    ``CUDA_VISIBLE_DEVICES`` is applied as CUDA applies it (see
    :mod:`joules.devices.visible`): each GPU's ``index`` is its position among the visible
    devices, ``physical_index`` its NVML index.

    Args:
        env: Environment to read ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` from
            (default: ``os.environ``).
        power_scope: ``"gpu"`` or ``"module"`` (see :class:`NVMLGPU`).

    Returns:
        The GPUs, and the problems found, each with its fix: discovery problems followed by
        each GPU's ``problems()`` (no energy counter, MIG, persistence mode, old driver).
        When NVML is missing or cannot start: no GPUs and one problem saying why.

    Raises:
        DeviceNotFoundError: When ``CUDA_VISIBLE_DEVICES`` has a UUID that matches no device or
            several.

    """
    env = os.environ if env is None else env
    if power_scope not in POWER_SCOPES:
        raise ValueError(f"power_scope must be one of {POWER_SCOPES}, got {power_scope!r}")
    try:
        nvml = _import_nvml()
    except ImportError as e:
        message = f"cannot import pynvml ({e}): no NVIDIA GPU can be measured"
        return [], [Problem("nvml", message, "pip install nvidia-ml-py")]
    err = nvml.NVMLError
    try:
        _ensure_init(nvml)
    except err as e:
        return [], [_init_problem(nvml, e)]
    except OSError as e:  # a broken library: nvidia-ml-py normally turns this into an NVMLError
        return [], [Problem("nvml", f"cannot load NVML ({e})", "reinstall the NVIDIA driver")]

    problems: list[Problem] = []
    devices: list[tuple[int, str, list[MigDevice]]] = []
    names: set[str] = set()
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except err as e:
        return [], [Problem("nvml", f"NVML cannot count GPUs: {e}", "check that `nvidia-smi` works")]
    for i in range(count):
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(h)
            names.add(nvml.nvmlDeviceGetName(h))
        except err as e:
            fix = "check `nvidia-smi`; reset the GPU or reboot"
            problems.append(Problem(f"physical GPU {i}", f"NVML cannot open it: {e}", fix))
            continue
        devices.append((i, uuid, _mig_devices(nvml, h)))
    if count == 0:
        problems.append(Problem("nvml", "NVML found no NVIDIA GPU", "check `nvidia-smi`"))

    value = env.get("CUDA_VISIBLE_DEVICES")
    visibility = resolve_visible_devices(value, devices)
    if visibility.note:
        problems.append(
            Problem(
                "CUDA_VISIBLE_DEVICES",
                f"{visibility.note} (entries not applied: {', '.join(visibility.ignored) or 'none'})",
                "list only valid, distinct GPU indices or UUIDs (see `nvidia-smi -L`)",
            )
        )
    by_ordinal = value is None or not value.strip().startswith(("GPU-", "MIG-"))
    if by_ordinal and len(names) > 1 and env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID":
        problems.append(
            Problem(
                "CUDA_VISIBLE_DEVICES",
                f"GPUs of different models are present ({', '.join(sorted(names))}) and "
                "CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers GPUs fastest first and NVML by "
                "PCI bus, so GPU indices may not be those your framework uses",
                "export CUDA_DEVICE_ORDER=PCI_BUS_ID, or select GPUs by UUID in CUDA_VISIBLE_DEVICES",
            )
        )

    gpus: list[GPU] = []
    for pos, (physical, mig_uuid) in enumerate(visibility.targets):
        try:
            gpus.append(NVMLGPU(physical, index=pos, mig_uuid=mig_uuid, power_scope=power_scope, nvml=nvml))
        except (err, JoulesError) as e:
            problems.append(
                Problem(f"GPU {pos}", f"cannot use physical GPU {physical}: {e}", "check `nvidia-smi`")
            )
    for gpu in gpus:
        problems.extend(gpu.problems())
    return gpus, problems
