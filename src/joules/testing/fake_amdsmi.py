"""A fake ``amdsmi`` module backed by simulated GPUs, for testing :mod:`joules.devices.amd`.

It implements the calls joules makes, with amdsmi's names, argument order, units and quirks:
energy as ``energy_accumulator`` ticks of 2**-16 J reported with rocm_smi's hard-coded
``counter_resolution`` (15.3 µJ, a float32), power
in whole watts with ``"N/A"`` for the field a generation does not report, power caps in µW,
clocks in MHz (supported frequencies in Hz, last one dropped as some amdsmi versions do),
errors as ``AmdSmiLibraryException`` with ``err_code``.

Example::

    clock = VirtualClock()
    sims = [SimGPU(MI300X, clock, index=i) for i in range(2)]
    with installed(sims) as amdsmi:
        gpus, problems = discover_amd({}, clock=clock)
"""

from __future__ import annotations

import sys
import types
import zlib
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from enum import IntEnum
from typing import Any

from joules.devices.sim.catalog import GPUModel
from joules.devices.sim.gpu import SimGPU
from joules.errors import DevicePermissionError

AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NO_PERM = 10

#: ``counter_resolution`` as amdsmi returns it (15.3 µJ stored in a C float): rocm_smi's
#: hard-coded figure, while the firmware counts in 2**-16 J (15.259 µJ), as the fake does.
COUNTER_RESOLUTION_UJ = 15.300000190734863
TICKS_PER_J = 65536

MI300X = GPUModel(
    name="AMD Instinct MI300X", arch="cdna3", idle_w=140.0,
    min_limit_w=200.0, max_limit_w=750.0, default_limit_w=750.0,
    min_sm_mhz=500.0, max_sm_mhz=2100.0, sm_step_mhz=100.0, mem_mhz=1300.0, memory_gib=192,
    energy_counter=True, counter_period_s=0.001, power_period_s=0.001, sample_fraction=1.0,
    averaged_power_s=1.0, instant_power_field=True, peak_w=750.0,
)
"""An MI300X-like model (``current_socket_power`` reported, ``average_socket_power`` N/A)."""

MI250X = GPUModel(
    name="AMD Instinct MI250X", arch="cdna2", idle_w=45.0,
    min_limit_w=200.0, max_limit_w=560.0, default_limit_w=560.0,
    min_sm_mhz=500.0, max_sm_mhz=1700.0, sm_step_mhz=100.0, mem_mhz=1600.0, memory_gib=64,
    energy_counter=True, counter_period_s=0.001, power_period_s=0.001, sample_fraction=1.0,
    averaged_power_s=1.0, instant_power_field=False, peak_w=500.0,
)
"""One GCD of an MI250X-like model (``average_socket_power`` reported, current N/A)."""

AMD_GPU_MODELS: dict[str, GPUModel] = {"MI300X": MI300X, "MI250X": MI250X}


class AmdSmiException(Exception):
    """Base of the fake amdsmi's exceptions."""


class AmdSmiLibraryException(AmdSmiException):
    """A library error with amdsmi's ``err_code``."""

    def __init__(self, err_code: int, err_info: str = "") -> None:
        self.err_code = err_code
        self.err_info = err_info or {
            AMDSMI_STATUS_INVAL: "AMDSMI_STATUS_INVAL - Invalid parameters",
            AMDSMI_STATUS_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
            AMDSMI_STATUS_NO_PERM: "AMDSMI_STATUS_NO_PERM - Permission Denied",
        }.get(err_code, f"error {err_code}")
        super().__init__(f"Error code:\n\t{err_code} | {self.err_info}")


class AmdSmiParameterException(AmdSmiException):
    """A wrong argument type."""


class AmdSmiInitFlags(IntEnum):
    """Which processors ``amdsmi_init`` opens."""

    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2


class AmdSmiClkType(IntEnum):
    """Clock domains (GFX is SYS)."""

    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4


class AmdSmiTemperatureType(IntEnum):
    """Temperature sensors (JUNCTION is HOTSPOT)."""

    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2


class AmdSmiTemperatureMetric(IntEnum):
    """Temperature metrics."""

    CURRENT = 0
    MAX = 1


class AmdSmiDevPerfLevel(IntEnum):
    """Performance levels."""

    AUTO = 0
    LOW = 1
    HIGH = 2
    MANUAL = 3


def amdsmi_uuid(unique_id: int, device_id: int, fcn: int = 0xFF) -> str:
    """The UUID amdsmi reports for a GPU (``amdsmi_uuid_gen``'s layout).

    The 64-bit unique id (ROCr's and ``rocminfo``'s ``GPU-%016llx``), bytes b7 (most
    significant) to b0, is spread as ``{b7}{fcn}{did}-0000-1000-80{b6}-{b5..b0}``.
    """
    b = unique_id.to_bytes(8, "big")
    return f"{b[0]:02x}{fcn & 0xFF:02x}{device_id & 0xFFFF:04x}-0000-1000-80{b[1]:02x}-{b[2:].hex()}"


class _Handle:
    """``amdsmi_processor_handle`` of one simulated GPU.

    Attributes:
        unique_id: The GPU's 64-bit unique id (what ROCr shows as ``GPU-<16 hex>``).
        device_id: PCI device id.
        uuid: What ``amdsmi_get_gpu_device_uuid`` returns (amdsmi's layout of the unique id).
        hip_uuid: The ``hip_uuid`` of ``amdsmi_get_gpu_enumeration_info`` (tests may change it).
        hip_id: Its ``hip_id``: HIP's device number, by KFD node, which need not be the
            handle's position (default: the position; tests may change it).

    """

    def __init__(self, sim: SimGPU, physical: int) -> None:
        self.sim = sim
        self.physical = physical
        name = sim.model.name
        self.unique_id = (zlib.crc32(f"{name}/{physical}".encode()) << 32) | zlib.crc32(
            f"{physical}/{name}".encode()
        )
        self.device_id = 0x74A1 if sim.model.arch == "cdna3" else 0x740C
        self.uuid = amdsmi_uuid(self.unique_id, self.device_id)
        self.hip_uuid = f"GPU-{self.unique_id:016x}"
        self.hip_id = physical
        self.frozen_ticks: int | None = None
        self.calls = 0

    def __repr__(self) -> str:
        return f"<amdsmi_processor_handle {self.physical}: {self.sim.model.name}>"


def make_module(
    sim_gpus: Sequence[SimGPU],
    *,
    broken_energy_counter: bool | str = False,
    broken_gpus: Collection[int] | None = None,
    legacy_energy_key: bool = False,
    fail_init: bool = False,
    enumeration_info: bool = False,
    counter_bits: int = 64,
) -> types.ModuleType:
    """Build a fake ``amdsmi`` module whose GPUs are ``sim_gpus`` (physical order).

    Args:
        sim_gpus: The simulated GPUs (use :data:`MI300X` or :data:`MI250X` models for AMD-like
            power fields; others report like an MI300X).
        broken_energy_counter: ``True`` or ``"frozen"``: the counter keeps the value of its
            first reading (the stale-counter bug); ``"erratic"``: it jumps by about 15 kJ per
            reading; ``False``: a correct counter.
        broken_gpus: Physical indices of the GPUs whose counter is broken (default: all,
            when ``broken_energy_counter`` is set).
        legacy_energy_key: Report the tick count as ``power`` (amdsmi before ROCm 6.1) rather
            than ``energy_accumulator``.
        fail_init: Make ``amdsmi_init`` fail as it does without a driver.
        enumeration_info: Provide ``amdsmi_get_gpu_enumeration_info`` (newer ROCm), whose
            ``hip_uuid`` is each handle's ``hip_uuid``.
        counter_bits: Width of the energy counter: 32 wraps every 2**32 ticks (65.5 kJ), as
            RDNA GPUs' counters do.

    Returns:
        A module object to put in ``sys.modules["amdsmi"]``.

    """
    mode: str | None
    if broken_energy_counter is True:
        mode = "frozen"
    elif broken_energy_counter is False:
        mode = None
    else:
        mode = broken_energy_counter
    if mode not in (None, "frozen", "erratic"):
        raise ValueError(f"broken_energy_counter must be a bool, 'frozen' or 'erratic', not {mode!r}")
    handles = [_Handle(s, i) for i, s in enumerate(sim_gpus)]
    state = {"initialized": False}
    mod = types.ModuleType("amdsmi")
    mod.__doc__ = "Fake amdsmi backed by joules simulated GPUs."

    def _check(handle: Any) -> _Handle:
        if not state["initialized"]:
            raise AmdSmiLibraryException(32, "AMDSMI_STATUS_NOT_INIT - Device not initialized")
        if not isinstance(handle, _Handle):
            raise AmdSmiParameterException(f"{handle!r} is not an amdsmi_processor_handle")
        return handle

    def _na_unless(ok: bool, value: Any) -> Any:
        return value if ok else "N/A"

    def amdsmi_init(flags: int = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        if fail_init:
            raise AmdSmiLibraryException(18, "AMDSMI_STATUS_INIT_ERROR - Initialization error")
        state["initialized"] = True

    def amdsmi_shut_down() -> None:
        state["initialized"] = False

    def amdsmi_get_processor_handles() -> list[_Handle]:
        if not state["initialized"]:
            raise AmdSmiLibraryException(32, "AMDSMI_STATUS_NOT_INIT - Device not initialized")
        return list(handles)

    def amdsmi_get_gpu_asic_info(handle: Any) -> dict[str, Any]:
        h = _check(handle)
        return {
            "market_name": h.sim.model.name, "vendor_id": 0x1002,
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]", "subvendor_id": 0x1002,
            "device_id": h.device_id, "rev_id": 0,
            "asic_serial": f"0x{h.unique_id:016X}", "oam_id": h.physical,
        }

    def amdsmi_get_gpu_device_uuid(handle: Any) -> str:
        return _check(handle).uuid

    def amdsmi_get_gpu_enumeration_info(handle: Any) -> dict[str, Any]:
        h = _check(handle)
        return {"drm_render": 128 + h.physical, "drm_card": h.physical, "hsa_id": h.physical + 1,
                "hip_id": h.hip_id, "hip_uuid": h.hip_uuid}

    def amdsmi_get_energy_count(handle: Any) -> dict[str, Any]:
        h = _check(handle)
        h.calls += 1
        ticks = int(h.sim.energy_j() * TICKS_PER_J)
        broken = broken_gpus is None or h.physical in broken_gpus
        if not broken:
            pass
        elif mode == "frozen":
            if h.frozen_ticks is None:
                h.frozen_ticks = ticks
            ticks = h.frozen_ticks
        elif mode == "erratic":
            ticks += h.calls * 1_000_000_000
        if counter_bits < 64:
            ticks %= 1 << counter_bits
        key = "power" if legacy_energy_key else "energy_accumulator"
        return {key: ticks, "counter_resolution": COUNTER_RESOLUTION_UJ,
                "timestamp": int(h.sim.clock.now() * 1e9)}

    def amdsmi_get_power_info(handle: Any) -> dict[str, Any]:
        h = _check(handle)
        current = h.sim.model.instant_power_field
        return {
            "current_socket_power": _na_unless(current, round(h.sim.power_w())),
            "average_socket_power": _na_unless(not current, round(h.sim.average_power_w())),
            "gfx_voltage": "N/A", "soc_voltage": "N/A", "mem_voltage": "N/A",
            "power_limit": int(h.sim.power_limit_w()),
        }

    def amdsmi_get_power_cap_info(handle: Any) -> dict[str, int]:
        h = _check(handle)
        m = h.sim.model
        return {
            "power_cap": int(h.sim.power_limit_w() * 1e6),
            "default_power_cap": int(m.default_limit_w * 1e6),
            "dpm_cap": int(m.max_sm_mhz),
            "min_power_cap": int(m.min_limit_w * 1e6),
            "max_power_cap": int(m.max_limit_w * 1e6),
        }

    def amdsmi_set_power_cap(handle: Any, sensor_ind: int, cap: int) -> None:
        h = _check(handle)
        try:
            h.sim.set_power_limit_w(float(cap // 1_000_000))  # the driver keeps whole watts
        except ValueError:
            raise AmdSmiLibraryException(AMDSMI_STATUS_INVAL) from None
        except DevicePermissionError:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NO_PERM) from None

    def amdsmi_get_clock_info(handle: Any, clock_type: int) -> dict[str, Any]:
        h = _check(handle)
        m = h.sim.model
        if clock_type == AmdSmiClkType.MEM:
            mem = int(m.mem_mhz)
            return {"clk": int(h.sim.memory_clock_mhz()), "min_clk": mem, "max_clk": mem,
                    "clk_locked": "N/A", "clk_deep_sleep": "N/A"}
        if clock_type != AmdSmiClkType.GFX:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        lock = h.sim.sm_clock_locked()
        return {"clk": int(h.sim.sm_clock_mhz()), "min_clk": int(m.min_sm_mhz), "max_clk": int(m.max_sm_mhz),
                "clk_locked": lock is not None, "clk_deep_sleep": False}

    def amdsmi_get_clk_freq(handle: Any, clock_type: int) -> dict[str, Any]:
        h = _check(handle)
        if clock_type != AmdSmiClkType.GFX:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        hz = [int(f * 1e6) for f in sorted(h.sim.supported_sm_clocks_mhz())]
        return {"num_supported": len(hz), "current": 0, "frequency": hz[: len(hz) - 1]}

    def amdsmi_set_gpu_clk_range(handle: Any, min_clk_value: int, max_clk_value: int, clk_type: int) -> None:
        h = _check(handle)
        try:
            h.sim.lock_sm_clock(min_clk_value, max_clk_value)
        except ValueError:
            raise AmdSmiLibraryException(AMDSMI_STATUS_INVAL) from None
        except DevicePermissionError:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NO_PERM) from None

    def amdsmi_set_gpu_perf_level(handle: Any, perf_level: int) -> None:
        h = _check(handle)
        if perf_level == AmdSmiDevPerfLevel.AUTO:
            try:
                h.sim.reset_sm_clock()
            except DevicePermissionError:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NO_PERM) from None

    def amdsmi_get_temp_metric(handle: Any, sensor_type: int, metric: int) -> int:
        h = _check(handle)
        if sensor_type == AmdSmiTemperatureType.EDGE and h.sim.model.arch == "cdna3":
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)  # MI300 has no edge sensor
        extra = 12.0 if sensor_type == AmdSmiTemperatureType.HOTSPOT else 0.0
        return int(h.sim.temperature_c() + extra)

    for obj in (
        AmdSmiException, AmdSmiLibraryException, AmdSmiParameterException, AmdSmiInitFlags,
        AmdSmiClkType, AmdSmiTemperatureType, AmdSmiTemperatureMetric, AmdSmiDevPerfLevel,
        amdsmi_init, amdsmi_shut_down, amdsmi_get_processor_handles, amdsmi_get_gpu_asic_info,
        amdsmi_get_gpu_device_uuid, amdsmi_get_energy_count, amdsmi_get_power_info,
        amdsmi_get_power_cap_info, amdsmi_set_power_cap, amdsmi_get_clock_info, amdsmi_get_clk_freq,
        amdsmi_set_gpu_clk_range, amdsmi_set_gpu_perf_level, amdsmi_get_temp_metric,
    ):
        setattr(mod, obj.__name__, obj)
    if enumeration_info:
        mod.amdsmi_get_gpu_enumeration_info = amdsmi_get_gpu_enumeration_info  # type: ignore[attr-defined]
    mod.AMDSMI_STATUS_NOT_SUPPORTED = AMDSMI_STATUS_NOT_SUPPORTED  # type: ignore[attr-defined]
    mod.AMDSMI_STATUS_NO_PERM = AMDSMI_STATUS_NO_PERM  # type: ignore[attr-defined]
    mod.handles = handles  # type: ignore[attr-defined]  # for tests
    return mod


@contextmanager
def installed(sim_gpus: Sequence[SimGPU], **options: Any) -> Iterator[types.ModuleType]:
    """Put a fake ``amdsmi`` (see :func:`make_module`) in ``sys.modules`` for the block.

    Yields:
        The fake module. The previous ``sys.modules["amdsmi"]`` (or its absence) is restored.

    """
    missing = object()
    previous = sys.modules.get("amdsmi", missing)
    module = make_module(sim_gpus, **options)
    sys.modules["amdsmi"] = module
    try:
        yield module
    finally:
        if previous is missing:
            sys.modules.pop("amdsmi", None)
        else:
            sys.modules["amdsmi"] = previous  # type: ignore[assignment]
