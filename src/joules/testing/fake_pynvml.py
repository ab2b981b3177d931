"""A fake ``pynvml`` (nvidia-ml-py) module backed by simulated GPUs.

Any NVML-based tool (joules' own :class:`~joules.devices.nvidia.NVMLGPU`, Zeus, CodeCarbon,
a script) runs unchanged on :class:`~joules.devices.sim.SimGPU` objects, so tools can be
compared side by side on the same simulated hardware, with exact ground truth::

    sim = Simulator("A100x2")                 # on a VirtualClock
    with fake_pynvml.installed(sim) as pynvml:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(h)    # mJ

The module follows nvidia-ml-py closely: the same function names, argument orders, return
types and units (mW, mJ, MHz, degrees C); the same constant values; ``NVMLError(code)``
builds the matching ``NVMLError_*`` subclass; field values come back as ctypes
``c_nvmlFieldValue_t`` arrays with a per-field ``nvmlReturn``; functions called before
``nvmlInit`` raise ``NVMLError_Uninitialized``. What a simulated model lacks is reported as
NVML does: ``nvmlDeviceGetTotalEnergyConsumption`` raises ``NVMLError_NotSupported`` on a
P100, and the ``NVML_FI_DEV_POWER_INSTANT`` field has ``nvmlReturn ==
NVML_ERROR_NOT_SUPPORTED`` on a V100. ``nvmlDeviceGetPowerUsage`` returns the model's 1 s
averaged reading on Ampere and newer, except on GA100 (the A100), where NVML documents it as
instantaneous, as on older GPUs.

MIG: ``mig={0: 3}`` enables MIG mode on GPU 0 with three MIG devices (reachable through
``nvmlDeviceGetMigDeviceHandleByIndex`` and ``nvmlDeviceGetHandleByUUID``). As on real
hardware, power, energy, limits and clock control are refused on MIG device handles
(``NVMLError_NotSupported``) and work on the parent GPU's handle.

Functions this module does not implement, if their name looks like ``nvmlXxx``, exist and
raise ``NVMLError_NotSupported``. Every integer or string ``NVML_*`` constant of the installed nvidia-ml-py is
copied in (read from its source, never executed), so constant look-ups behave as with the real
module. Calls are counted per function in ``module.fake_calls`` (a
:class:`collections.Counter`), and ``module.fake_state`` gives access to the simulated devices.

Modules that did ``import pynvml`` before :func:`installed` ran keep the module they got; pass
their names in ``patch`` (for Zeus: ``patch=["zeus.device.gpu.nvidia"]``) or import them inside
the ``with`` block.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import functools
import importlib.machinery
import re
import string
import sys
import threading
import time
import types
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from joules.devices.base import fork_safe_lock
from joules.devices.sim.catalog import GPUModel
from joules.devices.sim.gpu import SimGPU
from joules.errors import DevicePermissionError, NotSupportedError

__all__ = ["NVMLError", "c_nvmlFieldValue_t", "c_nvmlValue_t", "installed", "make_module"]

# -- constants (values as in nvidia-ml-py) ---------------------------------------------------

NVML_SUCCESS = 0
_ERROR_CODES: dict[str, int] = {
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_ALREADY_INITIALIZED": 5,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_INSUFFICIENT_SIZE": 7,
    "NVML_ERROR_INSUFFICIENT_POWER": 8,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_IRQ_ISSUE": 11,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_CORRUPTED_INFOROM": 14,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_RESET_REQUIRED": 16,
    "NVML_ERROR_OPERATING_SYSTEM": 17,
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": 18,
    "NVML_ERROR_IN_USE": 19,
    "NVML_ERROR_MEMORY": 20,
    "NVML_ERROR_NO_DATA": 21,
    "NVML_ERROR_VGPU_ECC_NOT_SUPPORTED": 22,
    "NVML_ERROR_INSUFFICIENT_RESOURCES": 23,
    "NVML_ERROR_FREQ_NOT_SUPPORTED": 24,
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH": 25,
    "NVML_ERROR_DEPRECATED": 26,
    "NVML_ERROR_NOT_READY": 27,
    "NVML_ERROR_GPU_NOT_FOUND": 28,
    "NVML_ERROR_INVALID_STATE": 29,
    "NVML_ERROR_RESET_TYPE_NOT_SUPPORTED": 30,
    "NVML_ERROR_UNKNOWN": 999,
}
_E = types.SimpleNamespace(**{k[len("NVML_ERROR_"):]: v for k, v in _ERROR_CODES.items()})

_CONSTANTS: dict[str, int] = {
    "NVML_SUCCESS": NVML_SUCCESS,
    **_ERROR_CODES,
    "NVML_FEATURE_DISABLED": 0,
    "NVML_FEATURE_ENABLED": 1,
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_TEMPERATURE_GPU_MAX": 1,
    "NVML_CLOCK_GRAPHICS": 0,
    "NVML_CLOCK_SM": 1,
    "NVML_CLOCK_MEM": 2,
    "NVML_CLOCK_VIDEO": 3,
    "NVML_CLOCK_COUNT": 4,
    "NVML_CLOCK_ID_CURRENT": 0,
    "NVML_CLOCK_ID_APP_CLOCK_TARGET": 1,
    "NVML_CLOCK_ID_APP_CLOCK_DEFAULT": 2,
    "NVML_CLOCK_ID_CUSTOMER_BOOST_MAX": 3,
    "NVML_CLOCK_LIMIT_ID_RANGE_START": 0xFFFFFF00,
    "NVML_CLOCK_LIMIT_ID_TDP": 0xFFFFFF01,
    "NVML_CLOCK_LIMIT_ID_UNLIMITED": 0xFFFFFF02,
    "NVML_VALUE_TYPE_DOUBLE": 0,
    "NVML_VALUE_TYPE_UNSIGNED_INT": 1,
    "NVML_VALUE_TYPE_UNSIGNED_LONG": 2,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 3,
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 4,
    "NVML_VALUE_TYPE_SIGNED_INT": 5,
    "NVML_VALUE_TYPE_UNSIGNED_SHORT": 6,
    "NVML_DEVICE_ARCH_KEPLER": 2,
    "NVML_DEVICE_ARCH_MAXWELL": 3,
    "NVML_DEVICE_ARCH_PASCAL": 4,
    "NVML_DEVICE_ARCH_VOLTA": 5,
    "NVML_DEVICE_ARCH_TURING": 6,
    "NVML_DEVICE_ARCH_AMPERE": 7,
    "NVML_DEVICE_ARCH_ADA": 8,
    "NVML_DEVICE_ARCH_HOPPER": 9,
    "NVML_DEVICE_ARCH_BLACKWELL": 10,
    "NVML_DEVICE_ARCH_UNKNOWN": 0xFFFFFFFF,
    "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 83,
    "NVML_FI_DEV_POWER_AVERAGE": 185,
    "NVML_FI_DEV_POWER_INSTANT": 186,
    "NVML_FI_DEV_POWER_MIN_LIMIT": 187,
    "NVML_FI_DEV_POWER_MAX_LIMIT": 188,
    "NVML_FI_DEV_POWER_DEFAULT_LIMIT": 189,
    "NVML_FI_DEV_POWER_CURRENT_LIMIT": 190,
    "NVML_FI_DEV_ENERGY": 191,
    "NVML_FI_DEV_POWER_REQUESTED_LIMIT": 192,
    "NVML_POWER_SCOPE_GPU": 0,
    "NVML_POWER_SCOPE_MODULE": 1,
    "NVML_POWER_SCOPE_MEMORY": 2,
    "NVML_DEVICE_MIG_DISABLE": 0,
    "NVML_DEVICE_MIG_ENABLE": 1,
    "NVML_BRAND_TESLA": 2,
    "NVML_BRAND_NVIDIA": 14,
    "NVML_PSTATE_0": 0,
    "NVML_COMPUTEMODE_DEFAULT": 0,
    "NVML_INIT_FLAG_NO_GPUS": 1,
    "NVML_INIT_FLAG_NO_ATTACH": 2,
    "NVML_DEVICE_UUID_BUFFER_SIZE": 80,
    "NVML_DEVICE_UUID_V2_BUFFER_SIZE": 96,
    "NVML_DEVICE_NAME_BUFFER_SIZE": 64,
    "NVML_DEVICE_NAME_V2_BUFFER_SIZE": 96,
    "NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE": 80,
    "nvmlTemperature_v1": 0x100000C,
    "nvmlPowerValue_v2": 0x0200000C,
    "nvmlC2cModeInfo_v1": 0x1000008,
}
_C = types.SimpleNamespace(**_CONSTANTS)

_ARCH = {
    "kepler": _C.NVML_DEVICE_ARCH_KEPLER,
    "maxwell": _C.NVML_DEVICE_ARCH_MAXWELL,
    "pascal": _C.NVML_DEVICE_ARCH_PASCAL,
    "volta": _C.NVML_DEVICE_ARCH_VOLTA,
    "turing": _C.NVML_DEVICE_ARCH_TURING,
    "ampere": _C.NVML_DEVICE_ARCH_AMPERE,
    "ada": _C.NVML_DEVICE_ARCH_ADA,
    "hopper": _C.NVML_DEVICE_ARCH_HOPPER,
    "blackwell": _C.NVML_DEVICE_ARCH_BLACKWELL,
}
_COMPUTE_CAPABILITY = {"pascal": (6, 0), "volta": (7, 0), "ampere": (8, 0), "hopper": (9, 0)}
_MIG_ARCHS = ("ampere", "hopper", "blackwell")


def _compute_capability(model: GPUModel) -> tuple[int, int]:
    """CUDA compute capability of a simulated model (8.6 for the A40, GA102)."""
    if model.name.endswith("A40"):
        return (8, 6)
    return _COMPUTE_CAPABILITY.get(model.arch, (0, 0))


def _is_ga100(model: GPUModel) -> bool:
    """Whether a simulated model is a GA100 (A100): its ``nvmlDeviceGetPowerUsage`` is instant."""
    return model.arch == "ampere" and _compute_capability(model) == (8, 0)
_MAX_MIG_DEVICES = 7


def _literal_int(node: ast.expr) -> int | None:
    """Value of an integer constant expression (literals, ``<<``, ``|``, ``+``, ``-``, ``*``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _literal_int(node.operand)
        return None if v is None else -v
    if isinstance(node, ast.BinOp):
        a, b = _literal_int(node.left), _literal_int(node.right)
        if a is None or b is None:
            return None
        ops: dict[type, Callable[[int, int], int]] = {
            ast.LShift: lambda x, y: x << y,
            ast.BitOr: lambda x, y: x | y,
            ast.Add: lambda x, y: x + y,
            ast.Sub: lambda x, y: x - y,
            ast.Mult: lambda x, y: x * y,
        }
        op = ops.get(type(node.op))
        return None if op is None else op(a, b)
    return None


@functools.lru_cache(maxsize=1)
def _real_constants() -> dict[str, int | str]:
    """Integer and string ``NVML_*``/``nvml*`` constants of the installed nvidia-ml-py, read (not run)."""
    try:
        spec = importlib.machinery.PathFinder.find_spec("pynvml")
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return {}
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return {}
    found: dict[str, int | str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.startswith(("NVML_", "nvml")):
                value: int | str | None = _literal_int(node.value)
                literal = node.value.value if isinstance(node.value, ast.Constant) else None
                if value is None and isinstance(literal, str):
                    value = literal
                if value is not None:
                    found[name] = value
    return found


# -- errors (same behaviour as nvidia-ml-py) -------------------------------------------------

_ERROR_STRINGS = {
    _E.UNINITIALIZED: "Uninitialized",
    _E.INVALID_ARGUMENT: "Invalid Argument",
    _E.NOT_SUPPORTED: "Not Supported",
    _E.NO_PERMISSION: "Insufficient Permissions",
    _E.ALREADY_INITIALIZED: "Already Initialized",
    _E.NOT_FOUND: "Not Found",
    _E.INSUFFICIENT_SIZE: "Insufficient Size",
    _E.INSUFFICIENT_POWER: "Insufficient External Power",
    _E.DRIVER_NOT_LOADED: "Driver Not Loaded",
    _E.TIMEOUT: "Timeout",
    _E.IRQ_ISSUE: "Interrupt Request Issue",
    _E.LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    _E.FUNCTION_NOT_FOUND: "Function Not Found",
    _E.CORRUPTED_INFOROM: "Corrupted infoROM",
    _E.GPU_IS_LOST: "GPU is lost",
    _E.RESET_REQUIRED: "GPU requires restart",
    _E.OPERATING_SYSTEM: "The operating system has blocked the request.",
    _E.LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    _E.MEMORY: "Insufficient Memory",
    _E.UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """An NVML error; ``NVMLError(code)`` builds the matching ``NVMLError_*`` subclass.

    ``value`` holds the NVML return code, as in nvidia-ml-py.
    """

    _valClassMapping: dict[int, type[NVMLError]] = {}
    _errcode_to_string = _ERROR_STRINGS
    value: int

    def __new__(cls, value: int, *args: object) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (NVMLError, (self.value,))


def _error_class(code_name: str, code: int) -> type[NVMLError]:
    name = "NVMLError_" + string.capwords(code_name.replace("NVML_ERROR_", ""), "_").replace("_", "")

    def __new__(cls: type[NVMLError], *args: object) -> NVMLError:
        obj = Exception.__new__(cls)
        obj.value = code
        return obj

    cls = type(name, (NVMLError,), {"__new__": __new__, "__module__": __name__})
    NVMLError._valClassMapping[code] = cls
    return cls


_ERROR_CLASSES: dict[str, type[NVMLError]] = {}
for _name, _code in _ERROR_CODES.items():
    _cls = _error_class(_name, _code)
    _ERROR_CLASSES[_cls.__name__] = _cls
    globals()[_cls.__name__] = _cls


class NVMLLibraryMismatchError(Exception):
    """Raised by nvidia-ml-py when the binding and the library disagree (never by the fake)."""


# -- ctypes structures (same layouts as nvidia-ml-py) ----------------------------------------


class c_nvmlValue_t(ctypes.Union):
    """The value union of a field value."""

    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class _Printable(ctypes.Structure):
    """Like nvidia-ml-py's structures: ``char`` array fields read as ``str`` and take ``str``."""

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        return value.decode() if isinstance(value, bytes) else value

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value.encode() if isinstance(value, str) else value)

    def __str__(self) -> str:
        parts = ", ".join(f"{name}: {getattr(self, name)}" for name, *_ in self._fields_)
        return f"{type(self).__name__}({parts})"


class c_nvmlFieldValue_t(_Printable):
    """One field-value request and its answer (``nvmlDeviceGetFieldValues``)."""

    _fields_ = [
        ("fieldId", ctypes.c_uint32),
        ("scopeId", ctypes.c_uint32),
        ("timestamp", ctypes.c_int64),
        ("latencyUsec", ctypes.c_int64),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", c_nvmlValue_t),
    ]


class c_nvmlMemory_t(_Printable):
    """Memory sizes in bytes (``nvmlDeviceGetMemoryInfo``)."""

    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class c_nvmlUtilization_t(_Printable):
    """Utilization percentages (``nvmlDeviceGetUtilizationRates``)."""

    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class c_nvmlC2cModeInfo_v1_t(_Printable):
    """C2C (Grace-Hopper chip-to-chip link) mode (``nvmlDeviceGetC2cModeInfoV``)."""

    _fields_ = [("isC2cEnabled", ctypes.c_uint)]


class nvmlPciInfo_t(_Printable):
    """PCI information (``nvmlDeviceGetPciInfo``)."""

    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


_STRUCTS = {
    "c_nvmlValue_t": c_nvmlValue_t,
    "c_nvmlFieldValue_t": c_nvmlFieldValue_t,
    "c_nvmlMemory_t": c_nvmlMemory_t,
    "c_nvmlUtilization_t": c_nvmlUtilization_t,
    "c_nvmlC2cModeInfo_v1_t": c_nvmlC2cModeInfo_v1_t,
    "nvmlPciInfo_t": nvmlPciInfo_t,
}

# -- the simulated driver --------------------------------------------------------------------


class _Handle:
    """A device handle: a physical GPU, or a MIG device on one."""

    __slots__ = ("compute_instance_id", "gpu", "gpu_instance_id", "index", "name", "parent", "uuid")

    def __init__(
        self,
        gpu: SimGPU,
        index: int,
        uuid: str,
        name: str,
        parent: _Handle | None = None,
        gpu_instance_id: int = 0,
        compute_instance_id: int = 0,
    ) -> None:
        self.gpu = gpu
        self.index = index
        self.uuid = uuid
        self.name = name
        self.parent = parent
        self.gpu_instance_id = gpu_instance_id
        self.compute_instance_id = compute_instance_id

    def __repr__(self) -> str:
        kind = "MIG device" if self.parent is not None else "GPU"
        return f"<fake nvmlDevice_t {kind} {self.index} {self.uuid}>"


def _mig_uuid(parent_uuid: str, k: int) -> str:
    h = f"{zlib.crc32(f'{parent_uuid}/{k}'.encode()):08x}"
    return f"MIG-{h}-{k:04x}-5{h[1:4]}-9{h[4:7]}-{h}{k:04x}"


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _ret_of(exc: Exception) -> int:
    """The NVML return code for an exception raised by a simulated GPU."""
    if isinstance(exc, DevicePermissionError):
        return _E.NO_PERMISSION
    if isinstance(exc, NotSupportedError):
        return _E.NOT_SUPPORTED
    return _E.INVALID_ARGUMENT


class FakeNVMLState:
    """The state behind one fake module: devices, init count, settings, call counts.

    Attributes:
        gpus: The simulated GPUs, in NVML index order.
        handles: One handle per GPU.
        mig_handles: MIG device handles per GPU index.
        persistence: Persistence mode per GPU index.
        calls: Number of calls per function name.
        init_count: Number of ``nvmlInit`` calls not yet matched by ``nvmlShutdown``.

    """

    def __init__(
        self,
        gpus: Sequence[SimGPU],
        *,
        mig: Mapping[int, int] | None,
        persistence: bool | Iterable[int],
        driver_version: str,
        allow_control: bool,
        module_scope: bool | Iterable[int],
        init_error: int | None,
    ) -> None:
        self.gpus = list(gpus)
        self.driver_version = driver_version
        self.allow_control = allow_control
        self.init_error = init_error
        self.init_count = 0
        major = re.match(r"\d+", driver_version)
        self.power_fields = major is None or int(major.group()) >= _POWER_FIELDS_DRIVER
        self.calls: Counter[str] = Counter()
        self.lock = fork_safe_lock(self, "lock", threading.RLock)
        n = len(self.gpus)
        if isinstance(persistence, bool):
            self.persistence = dict.fromkeys(range(n), persistence)
        else:
            on = set(persistence)
            self.persistence = {i: i in on for i in range(n)}
        if isinstance(module_scope, bool):
            self.module_scope = dict.fromkeys(range(n), module_scope)
        else:
            on = set(module_scope)
            self.module_scope = {i: i in on for i in range(n)}
        self.handles = [_Handle(g, i, g.uuid, g.name) for i, g in enumerate(self.gpus)]
        self.mig_handles: dict[int, list[_Handle]] = {}
        for i, count in (mig or {}).items():
            if not 0 <= i < n:
                raise ValueError(f"mig: no GPU {i} (the simulator has {n} GPUs)")
            gpu = self.gpus[i]
            if gpu.model.arch not in _MIG_ARCHS:
                raise ValueError(f"mig: GPU {i} ({gpu.name}) does not support MIG (Ampere or newer)")
            if not 1 <= count <= _MAX_MIG_DEVICES:
                raise ValueError(f"mig: GPU {i} needs 1 to {_MAX_MIG_DEVICES} MIG devices, got {count}")
            slices = _MAX_MIG_DEVICES // count
            mem = int(gpu.model.memory_gib * slices / 8)  # memory comes in eighths
            self.mig_handles[i] = [
                _Handle(
                    gpu, k, _mig_uuid(gpu.uuid, k), f"{gpu.name} MIG {slices}g.{mem}gb",
                    parent=self.handles[i], gpu_instance_id=k + 1, compute_instance_id=0,
                )
                for k in range(count)
            ]
        self._by_uuid = {h.uuid: h for h in self.handles}
        self._by_uuid.update({h.uuid: h for hs in self.mig_handles.values() for h in hs})

    # -- checks -----------------------------------------------------------------------------
    def handle(self, h: object, *, physical: bool = False) -> _Handle:
        """Validate a handle; ``physical`` refuses MIG handles with NOT_SUPPORTED."""
        if not isinstance(h, _Handle) or self._by_uuid.get(h.uuid) is not h:
            raise NVMLError(_E.INVALID_ARGUMENT)
        if physical and h.parent is not None:
            raise NVMLError(_E.NOT_SUPPORTED)
        return h

    def control(self, h: object) -> _Handle:
        """Validate a handle for a setting that needs root."""
        handle = self.handle(h, physical=True)
        if not self.allow_control:
            raise NVMLError(_E.NO_PERMISSION)
        return handle

    # -- field values ------------------------------------------------------------------------
    def field(self, h: _Handle, field_id: int, scope: int) -> tuple[int, int, str, int]:
        """(return code, value type, union member, value) of one field on one device."""
        ns = (_E.NOT_SUPPORTED, 0, "", 0)
        if h.parent is not None:
            return ns
        if field_id in _POWER_FIELDS and not self.power_fields:
            return ns  # added in R525
        gpu, m = h.gpu, h.gpu.model
        if scope == _C.NVML_POWER_SCOPE_GPU:
            pass
        elif scope == _C.NVML_POWER_SCOPE_MODULE and self.module_scope[h.index]:
            pass  # the simulated module is the GPU alone
        elif field_id in _POWER_FIELDS or field_id == _C.NVML_FI_DEV_ENERGY:
            return ns
        uint, ull = _C.NVML_VALUE_TYPE_UNSIGNED_INT, _C.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        if field_id == _C.NVML_FI_DEV_POWER_INSTANT:
            if not m.instant_power_field:
                return ns
            return (NVML_SUCCESS, uint, "uiVal", round(gpu.power_w() * 1000.0))
        if field_id == _C.NVML_FI_DEV_POWER_AVERAGE:
            if m.averaged_power_s is None:
                return ns
            return (NVML_SUCCESS, uint, "uiVal", round(gpu.average_power_w() * 1000.0))
        if field_id in (_C.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, _C.NVML_FI_DEV_ENERGY):
            if not m.energy_counter:
                return ns
            return (NVML_SUCCESS, ull, "ullVal", round(gpu.energy_j() * 1000.0))
        limits = {
            _C.NVML_FI_DEV_POWER_MIN_LIMIT: m.min_limit_w,
            _C.NVML_FI_DEV_POWER_MAX_LIMIT: m.max_limit_w,
            _C.NVML_FI_DEV_POWER_DEFAULT_LIMIT: m.default_limit_w,
            _C.NVML_FI_DEV_POWER_CURRENT_LIMIT: gpu.power_limit_w(),
            _C.NVML_FI_DEV_POWER_REQUESTED_LIMIT: gpu.power_limit_w(),
        }
        if field_id in limits:
            return (NVML_SUCCESS, uint, "uiVal", round(limits[field_id] * 1000.0))
        return ns

    def c_field_values(self, device: object, count: object, values: object) -> int:
        """``nvmlDeviceGetFieldValues`` at the C level: fills the array, returns a code."""
        try:
            h = self.handle(device)
        except NVMLError as e:
            return e.value
        n = int(getattr(count, "value", count))  # type: ignore[call-overload]
        arr: Any = getattr(values, "_obj", values)  # ctypes.byref(array) -> array
        if n < 0 or n > len(arr):
            return _E.INVALID_ARGUMENT
        now_us = round(h.gpu.clock.now() * 1e6)
        with self.lock:
            for i in range(n):
                fv = arr[i]
                ret, vtype, member, value = self.field(h, fv.fieldId, fv.scopeId)
                fv.nvmlReturn = ret
                fv.timestamp = now_us
                fv.latencyUsec = 0
                if ret == NVML_SUCCESS:
                    fv.valueType = vtype
                    setattr(fv.value, member, value)
        return NVML_SUCCESS


_POWER_FIELDS = frozenset(range(185, 193))
_POWER_FIELDS_DRIVER = 525  # the NVML_FI_DEV_POWER_* fields first appear in R525 drivers


def _sim_gpus(sim: object) -> list[SimGPU]:
    gpus = getattr(sim, "gpus", sim)
    try:
        result = list(gpus)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"expected a Simulator or a list of SimGPU, got {type(sim).__name__}") from None
    for g in result:
        if not isinstance(g, SimGPU):
            raise TypeError(f"expected SimGPU objects, got {type(g).__name__}")
    return result


def _api(st: FakeNVMLState) -> dict[str, Callable[..., Any]]:
    """The NVML functions over one state (unwrapped: no init check, latency or counting)."""
    C = _C

    def mw(watts: float) -> int:
        return round(watts * 1000.0)

    def call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (ValueError, DevicePermissionError, NotSupportedError) as e:
            raise NVMLError(_ret_of(e)) from e

    def as_str(s: str | bytes) -> str:
        return s.decode() if isinstance(s, bytes) else str(s)

    # -- system ---------------------------------------------------------------------------
    def nvmlSystemGetDriverVersion() -> str:
        return st.driver_version

    def nvmlSystemGetNVMLVersion() -> str:
        return f"12.{st.driver_version}"

    def nvmlSystemGetCudaDriverVersion() -> int:
        return 12040

    def nvmlErrorString(result: int) -> str:
        return _ERROR_STRINGS.get(result, "Unknown Error")

    # -- enumeration ------------------------------------------------------------------------
    def nvmlDeviceGetCount() -> int:
        return len(st.handles)

    def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
        if not isinstance(index, int) or not 0 <= index < len(st.handles):
            raise NVMLError(_E.INVALID_ARGUMENT)
        return st.handles[index]

    def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> _Handle:
        h = st._by_uuid.get(as_str(uuid))
        if h is None:
            raise NVMLError(_E.NOT_FOUND)
        return h

    def bus_id(h: _Handle) -> str:
        return f"00000000:{0x07 + 4 * h.index:02X}:00.0"

    def nvmlDeviceGetHandleByPciBusId(pci_bus_id: str | bytes) -> _Handle:
        wanted = as_str(pci_bus_id).upper()
        for h in st.handles:
            if bus_id(h) == wanted or bus_id(h)[4:] == wanted:
                return h
        raise NVMLError(_E.NOT_FOUND)

    def nvmlDeviceGetPciInfo(handle: object) -> nvmlPciInfo_t:
        h = st.handle(handle, physical=True)
        bid = bus_id(h)
        return nvmlPciInfo_t(
            busIdLegacy=bid[4:].encode(), domain=0, bus=0x07 + 4 * h.index, device=0,
            pciDeviceId=0x20B010DE, pciSubSystemId=0x134F10DE, busId=bid.encode(),
        )

    def nvmlDeviceGetIndex(handle: object) -> int:
        return st.handle(handle, physical=True).index

    def nvmlDeviceGetMinorNumber(handle: object) -> int:
        return st.handle(handle, physical=True).index

    def nvmlDeviceGetName(handle: object) -> str:
        return st.handle(handle).name

    def nvmlDeviceGetUUID(handle: object) -> str:
        return st.handle(handle).uuid

    def nvmlDeviceGetSerial(handle: object) -> str:
        return f"{1320000000000 + st.handle(handle, physical=True).index}"

    def nvmlDeviceGetBrand(handle: object) -> int:
        h = st.handle(handle)
        return C.NVML_BRAND_TESLA if h.gpu.model.arch in ("pascal", "volta") else C.NVML_BRAND_NVIDIA

    def nvmlDeviceGetArchitecture(handle: object) -> int:
        return _ARCH.get(st.handle(handle).gpu.model.arch, C.NVML_DEVICE_ARCH_UNKNOWN)

    def nvmlDeviceGetCudaComputeCapability(handle: object) -> tuple[int, int]:
        return _compute_capability(st.handle(handle).gpu.model)

    def nvmlDeviceGetMemoryInfo(handle: object, version: int | None = None) -> c_nvmlMemory_t:
        h = st.handle(handle)
        total = int(h.gpu.model.memory_gib * 2**30)
        if h.parent is not None:
            total //= len(st.mig_handles[h.parent.index])
        used = 0
        return c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetUtilizationRates(handle: object) -> c_nvmlUtilization_t:
        h = st.handle(handle, physical=True)
        try:  # the simulator keeps the workload private; read it without changing anything
            epoch = h.gpu._epochs[-1]
            u = epoch.workload.utilization(h.gpu.clock.now() - epoch.workload_t0)
        except (AttributeError, IndexError):
            u = 0.0
        return c_nvmlUtilization_t(gpu=round(100 * u), memory=round(60 * u))

    def nvmlDeviceGetComputeRunningProcesses(handle: object) -> list[object]:
        st.handle(handle)
        return []

    def nvmlDeviceGetPerformanceState(handle: object) -> int:
        st.handle(handle, physical=True)
        return C.NVML_PSTATE_0

    def nvmlDeviceGetComputeMode(handle: object) -> int:
        st.handle(handle)
        return C.NVML_COMPUTEMODE_DEFAULT

    # -- persistence, MIG, C2C ------------------------------------------------------------------
    def nvmlDeviceGetPersistenceMode(handle: object) -> int:
        h = st.handle(handle, physical=True)
        return C.NVML_FEATURE_ENABLED if st.persistence[h.index] else C.NVML_FEATURE_DISABLED

    def nvmlDeviceSetPersistenceMode(handle: object, mode: int) -> None:
        h = st.control(handle)
        if mode not in (C.NVML_FEATURE_ENABLED, C.NVML_FEATURE_DISABLED):
            raise NVMLError(_E.INVALID_ARGUMENT)
        st.persistence[h.index] = mode == C.NVML_FEATURE_ENABLED

    def nvmlDeviceGetMigMode(handle: object) -> list[int]:
        h = st.handle(handle, physical=True)
        if h.gpu.model.arch not in _MIG_ARCHS:
            raise NVMLError(_E.NOT_SUPPORTED)
        mode = C.NVML_DEVICE_MIG_ENABLE if h.index in st.mig_handles else C.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(handle: object) -> int:
        h = st.handle(handle, physical=True)
        return _MAX_MIG_DEVICES if h.index in st.mig_handles else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(handle: object, index: int) -> _Handle:
        h = st.handle(handle, physical=True)
        migs = st.mig_handles.get(h.index)
        if migs is None or not 0 <= index < _MAX_MIG_DEVICES:
            raise NVMLError(_E.INVALID_ARGUMENT)
        if index >= len(migs):
            raise NVMLError(_E.NOT_FOUND)
        return migs[index]

    def nvmlDeviceIsMigDeviceHandle(handle: object) -> ctypes.c_uint:
        # nvidia-ml-py returns the c_uint itself, not its value.
        return ctypes.c_uint(1 if st.handle(handle).parent is not None else 0)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: object) -> _Handle:
        h = st.handle(handle)
        if h.parent is None:
            raise NVMLError(_E.INVALID_ARGUMENT)
        return h.parent

    def mig_only(handle: object) -> _Handle:
        h = st.handle(handle)
        if h.parent is None:
            raise NVMLError(_E.INVALID_ARGUMENT)
        return h

    def nvmlDeviceGetGpuInstanceId(handle: object) -> int:
        return mig_only(handle).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(handle: object) -> int:
        return mig_only(handle).compute_instance_id

    def nvmlDeviceGetC2cModeInfoV(handle: object) -> c_nvmlC2cModeInfo_v1_t:
        h = st.handle(handle, physical=True)
        if not st.module_scope[h.index]:
            raise NVMLError(_E.NOT_SUPPORTED)
        return c_nvmlC2cModeInfo_v1_t(isC2cEnabled=1)

    # -- energy and power -----------------------------------------------------------------
    def nvmlDeviceGetTotalEnergyConsumption(handle: object) -> int:
        h = st.handle(handle, physical=True)
        return round(call(h.gpu.energy_j) * 1000.0)

    def nvmlDeviceGetPowerUsage(handle: object) -> int:
        gpu = st.handle(handle, physical=True).gpu
        # A 1 s average on Ampere and newer, except GA100, where it is the instant reading.
        return mw(call(gpu.power_w if _is_ga100(gpu.model) else gpu.average_power_w))

    def nvmlDeviceGetFieldValues(handle: object, fieldIds: Sequence[Any]) -> Any:
        values = (c_nvmlFieldValue_t * len(fieldIds))()
        for i, field_id in enumerate(fieldIds):
            try:
                values[i].fieldId, values[i].scopeId = field_id
            except TypeError:
                values[i].fieldId = field_id
        ret = st.c_field_values(handle, ctypes.c_int32(len(fieldIds)), ctypes.byref(values))
        if ret != NVML_SUCCESS:
            raise NVMLError(ret)
        return values

    # -- power limit ----------------------------------------------------------------------
    def nvmlDeviceGetPowerManagementMode(handle: object) -> int:
        st.handle(handle, physical=True)
        return C.NVML_FEATURE_ENABLED

    def nvmlDeviceGetPowerManagementLimit(handle: object) -> int:
        return mw(st.handle(handle, physical=True).gpu.power_limit_w())

    def nvmlDeviceGetEnforcedPowerLimit(handle: object) -> int:
        return mw(st.handle(handle, physical=True).gpu.power_limit_w())

    def nvmlDeviceGetPowerManagementDefaultLimit(handle: object) -> int:
        return mw(st.handle(handle, physical=True).gpu.default_power_limit_w())

    def nvmlDeviceGetPowerManagementLimitConstraints(handle: object) -> list[int]:
        lo, hi = st.handle(handle, physical=True).gpu.power_limit_range_w()
        return [mw(lo), mw(hi)]

    def nvmlDeviceSetPowerManagementLimit(handle: object, limit: int) -> None:
        h = st.control(handle)
        lo, hi = h.gpu.power_limit_range_w()
        if not mw(lo) <= limit <= mw(hi):
            raise NVMLError(_E.INVALID_ARGUMENT)
        call(lambda: h.gpu.set_power_limit_w(limit / 1000.0))

    def nvmlDeviceSetPowerManagementLimit_v2(
        device: object, powerScope: int, powerLimit: int, version: int = C.nvmlPowerValue_v2,
    ) -> int:
        if powerScope != C.NVML_POWER_SCOPE_GPU:
            st.handle(device, physical=True)
            raise NVMLError(_E.NOT_SUPPORTED)
        nvmlDeviceSetPowerManagementLimit(device, powerLimit)
        return NVML_SUCCESS

    # -- clocks ---------------------------------------------------------------------------
    def nvmlDeviceGetClockInfo(handle: object, type: int) -> int:
        h = st.handle(handle)
        if type in (C.NVML_CLOCK_GRAPHICS, C.NVML_CLOCK_SM):
            return int(h.gpu.sm_clock_mhz())
        if type == C.NVML_CLOCK_MEM:
            return int(h.gpu.memory_clock_mhz())
        if type == C.NVML_CLOCK_VIDEO:
            return int(h.gpu.sm_clock_mhz() * 0.85)
        raise NVMLError(_E.INVALID_ARGUMENT)

    def nvmlDeviceGetMaxClockInfo(handle: object, type: int) -> int:
        m = st.handle(handle).gpu.model
        if type in (C.NVML_CLOCK_GRAPHICS, C.NVML_CLOCK_SM):
            return int(m.max_sm_mhz)
        if type == C.NVML_CLOCK_MEM:
            return int(m.mem_mhz)
        if type == C.NVML_CLOCK_VIDEO:
            return int(m.max_sm_mhz * 0.85)
        raise NVMLError(_E.INVALID_ARGUMENT)

    def nvmlDeviceGetSupportedMemoryClocks(handle: object) -> list[int]:
        return [int(st.handle(handle, physical=True).gpu.model.mem_mhz)]

    def nvmlDeviceGetSupportedGraphicsClocks(handle: object, memoryClockMHz: int) -> list[int]:
        h = st.handle(handle, physical=True)
        if memoryClockMHz != int(h.gpu.model.mem_mhz):
            raise NVMLError(_E.NOT_FOUND)
        return [int(f) for f in h.gpu.supported_sm_clocks_mhz()]

    def clock_arg(value: int, top: float) -> float:
        return top if value >= C.NVML_CLOCK_LIMIT_ID_RANGE_START else float(value)

    def nvmlDeviceSetGpuLockedClocks(handle: object, minGpuClockMHz: int, maxGpuClockMHz: int) -> None:
        h = st.control(handle)
        top = h.gpu.model.max_sm_mhz
        lo, hi = clock_arg(minGpuClockMHz, top), clock_arg(maxGpuClockMHz, top)
        call(lambda: h.gpu.lock_sm_clock(lo, hi))

    def nvmlDeviceResetGpuLockedClocks(handle: object) -> None:
        call(st.control(handle).gpu.reset_sm_clock)

    def nvmlDeviceSetMemoryLockedClocks(handle: object, minMemClockMHz: int, maxMemClockMHz: int) -> None:
        h = st.control(handle)
        top = h.gpu.model.mem_mhz
        lo, hi = clock_arg(minMemClockMHz, top), clock_arg(maxMemClockMHz, top)
        if not 0 < lo <= hi:
            raise NVMLError(_E.INVALID_ARGUMENT)
        call(lambda: h.gpu.lock_memory_clock(lo, hi))

    def nvmlDeviceResetMemoryLockedClocks(handle: object) -> None:
        call(st.control(handle).gpu.reset_memory_clock)

    # -- temperature ----------------------------------------------------------------------
    def nvmlDeviceGetTemperature(handle: object, sensor: int) -> int:
        h = st.handle(handle, physical=True)
        if sensor != C.NVML_TEMPERATURE_GPU:
            raise NVMLError(_E.INVALID_ARGUMENT)
        return round(h.gpu.temperature_c())

    def nvmlDeviceGetTemperatureV(handle: object, sensor: int, version: int = C.nvmlTemperature_v1) -> int:
        if version != C.nvmlTemperature_v1:
            raise NVMLError(_E.ARGUMENT_VERSION_MISMATCH)
        return nvmlDeviceGetTemperature(handle, sensor)

    functions = {k: v for k, v in locals().items() if k.startswith("nvml") and callable(v)}
    functions["nvmlDeviceGetC2cModeInfoV1"] = nvmlDeviceGetC2cModeInfoV
    functions["nvmlDeviceGetTemperatureV1"] = nvmlDeviceGetTemperature
    functions["nvmlDeviceGetGraphicsRunningProcesses"] = nvmlDeviceGetComputeRunningProcesses
    functions["nvmlDeviceGetPowerState"] = nvmlDeviceGetPerformanceState
    return functions


def make_module(
    sim: object,
    *,
    call_latency_s: float = 0.0,
    mig: dict[int, int] | None = None,
    persistence: bool | Iterable[int] = True,
    driver_version: str = "550.54.15",
    allow_control: bool = True,
    module_scope: bool | Iterable[int] = False,
    init_error: int | None = None,
) -> types.ModuleType:
    """Build a fake ``pynvml`` module over simulated GPUs.

    Args:
        sim: A :class:`~joules.devices.sim.Simulator` or a list of
            :class:`~joules.devices.sim.SimGPU`; NVML index ``i`` is ``sim.gpus[i]``.
        call_latency_s: Busy-wait this long in every call, to mimic the CPU cost of real NVML
            calls (tens of microseconds to milliseconds).
        mig: GPU index -> number of MIG devices (1 to 7) on it; those GPUs are in MIG mode.
            Only Ampere and newer models.
        persistence: Persistence mode of every GPU (a bool), or the indices of the GPUs that
            have it on.
        driver_version: What ``nvmlSystemGetDriverVersion`` returns. Before R525 the
            ``NVML_FI_DEV_POWER_*`` fields are not supported, as with real drivers.
        allow_control: When false, settings (power limit, clocks, persistence) fail with
            ``NVMLError_NoPermission``, as for a non-root user.
        module_scope: GPUs (all, none, or these indices) that behave like Grace-Hopper
            modules: ``NVML_POWER_SCOPE_MODULE`` power fields are supported (they read the
            GPU's power: the simulation has no CPU in the module) and
            ``nvmlDeviceGetC2cModeInfoV`` reports C2C enabled.
        init_error: When set, ``nvmlInit`` raises ``NVMLError(init_error)`` (for example
            ``NVML_ERROR_DRIVER_NOT_LOADED``).

    Returns:
        A module named ``pynvml``; install it with :func:`installed` or put it in
        ``sys.modules`` yourself.

    """
    if call_latency_s < 0:
        raise ValueError(f"call_latency_s must be >= 0, got {call_latency_s}")
    st = FakeNVMLState(
        _sim_gpus(sim), mig=mig, persistence=persistence, driver_version=driver_version,
        allow_control=allow_control, module_scope=module_scope, init_error=init_error,
    )
    mod = types.ModuleType("pynvml", "Fake nvidia-ml-py over simulated GPUs (joules.testing.fake_pynvml).")
    ns: dict[str, Any] = mod.__dict__
    ns.update(_real_constants())
    ns.update(_CONSTANTS)
    ns.update(_ERROR_CLASSES)
    ns.update(_STRUCTS)
    ns["NVMLError"] = NVMLError
    ns["NVMLLibraryMismatchError"] = NVMLLibraryMismatchError
    ns["fake_state"] = st
    ns["fake_calls"] = st.calls
    ns["__joules_fake__"] = True
    ns["nvmlLib"] = None
    calls = st.calls
    latency = float(call_latency_s)

    def wrap(name: str, fn: Callable[..., Any], needs_init: bool = True) -> Callable[..., Any]:
        def nvml_call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            if latency:
                _busy_wait(latency)
            if needs_init and st.init_count <= 0:
                raise NVMLError(_E.UNINITIALIZED)
            return fn(*args, **kwargs)

        nvml_call.__name__ = nvml_call.__qualname__ = name
        nvml_call.__doc__ = f"Fake ``{name}`` over simulated GPUs."
        return nvml_call

    def nvmlInitWithFlags(flags: int = 0) -> None:
        if st.init_error is not None:
            raise NVMLError(st.init_error)
        with st.lock:
            st.init_count += 1
            ns["nvmlLib"] = _LIBRARY  # nvidia-ml-py keeps the loaded library here

    def nvmlInit() -> None:
        nvmlInitWithFlags(0)

    def nvmlShutdown() -> None:
        with st.lock:
            if st.init_count <= 0:
                raise NVMLError(_E.UNINITIALIZED)
            st.init_count -= 1

    for name, fn in _api(st).items():
        ns[name] = wrap(name, fn, needs_init=name != "nvmlErrorString")
    ns["nvmlInitWithFlags"] = wrap("nvmlInitWithFlags", nvmlInitWithFlags, needs_init=False)
    ns["nvmlInit"] = wrap("nvmlInit", nvmlInit, needs_init=False)
    ns["nvmlShutdown"] = wrap("nvmlShutdown", nvmlShutdown, needs_init=False)

    def c_field_values(device: object, count: object, values: object) -> int:
        calls["nvmlDeviceGetFieldValues"] += 1
        if latency:
            _busy_wait(latency)
        if st.init_count <= 0:
            return _E.UNINITIALIZED
        return st.c_field_values(device, count, values)

    c_functions: dict[str, Callable[..., int]] = {"nvmlDeviceGetFieldValues": c_field_values}

    def _nvmlGetFunctionPointer(name: str) -> Callable[..., int]:
        """C-level entry points; only ``nvmlDeviceGetFieldValues`` is provided."""
        if st.init_count <= 0:
            raise NVMLError(_E.UNINITIALIZED)
        try:
            return c_functions[name]
        except KeyError:
            raise NVMLError(_E.FUNCTION_NOT_FOUND) from None

    def nvmlExceptionClass(nvmlErrorCode: int) -> type[NVMLError]:
        if nvmlErrorCode not in NVMLError._valClassMapping:
            raise ValueError(f"nvmlErrorCode {nvmlErrorCode} is not valid")
        return NVMLError._valClassMapping[nvmlErrorCode]

    ns["_nvmlGetFunctionPointer"] = _nvmlGetFunctionPointer
    ns["nvmlExceptionClass"] = nvmlExceptionClass
    ns["_nvmlCheckReturn"] = _check_return

    def __getattr__(name: str) -> Any:
        if re.match(r"nvml[A-Z]\w*$", name):
            return wrap(name, _not_supported)
        raise AttributeError(f"fake pynvml has no attribute {name!r}")

    ns["__getattr__"] = __getattr__
    return mod


_LIBRARY = types.SimpleNamespace(name="fake libnvidia-ml.so.1 (joules.testing.fake_pynvml)")


def _not_supported(*args: object, **kwargs: object) -> None:
    raise NVMLError(_E.NOT_SUPPORTED)


def _check_return(ret: int) -> int:
    if ret != NVML_SUCCESS:
        raise NVMLError(ret)
    return ret


def mig_gpus(nvml: types.ModuleType, physical_index: int = 0) -> list[Any]:
    """One :class:`~joules.devices.nvidia.NVMLGPU` per MIG instance of a fake GPU, indexed 0, 1...

    A process enumerates one MIG device; tests of what several instances of one GPU do
    (counted once, one power limit) build them directly.
    """
    from joules.devices.nvidia import NVMLGPU

    nvml.nvmlInit()
    parent = nvml.nvmlDeviceGetHandleByIndex(physical_index)
    uuids = []
    for k in range(nvml.nvmlDeviceGetMaxMigDeviceCount(parent)):
        try:
            uuids.append(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, k)))
        except nvml.NVMLError:
            break
    return [NVMLGPU(physical_index, index=k, mig_uuid=u, nvml=nvml) for k, u in enumerate(uuids)]


@contextlib.contextmanager
def installed(sim: object, *, patch: Iterable[str] = (), **kwargs: Any) -> Iterator[types.ModuleType]:
    """Install a fake ``pynvml`` in ``sys.modules`` for the duration of a ``with`` block.

    Args:
        sim: A :class:`~joules.devices.sim.Simulator` or a list of SimGPU.
        patch: Names of already-imported modules whose ``pynvml`` attribute should point to
            the fake too (e.g. ``"zeus.device.gpu.nvidia"``); restored on exit.
        **kwargs: Passed to :func:`make_module`.

    Yields:
        The fake module.

    """
    mod = make_module(sim, **kwargs)
    missing = object()
    previous = sys.modules.get("pynvml", missing)
    patched: list[tuple[types.ModuleType, object]] = []
    sys.modules["pynvml"] = mod
    try:
        for name in patch:
            target = sys.modules.get(name)
            if target is None:
                raise ValueError(f"cannot patch {name!r}: it is not imported")
            patched.append((target, target.__dict__.get("pynvml", missing)))
            target.pynvml = mod  # type: ignore[attr-defined]
        yield mod
    finally:
        for target, old in reversed(patched):
            if old is missing:
                target.__dict__.pop("pynvml", None)
            else:
                target.pynvml = old  # type: ignore[attr-defined]
        if previous is missing:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = previous  # type: ignore[assignment]
