"""Catalog of simulated GPU and CPU models.

Power-limit ranges, defaults and clock ranges are those the drivers report for these
boards. Idle power and sensor timing (counter update period, power update period, fraction
of each power period actually sampled) follow public measurements of these boards; they are
model parameters, and each can be overridden when building a simulated device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from joules.errors import InvalidSpecError


@dataclass(frozen=True)
class GPUModel:
    """Static description of a GPU model.

    Attributes:
        name: Marketing name, as NVML reports it.
        arch: Architecture name (``volta``, ``ampere``, ``hopper``, ``pascal``).
        idle_w: Power drawn when idle, W.
        min_limit_w / max_limit_w / default_limit_w: Power-limit range and default, W.
        min_sm_mhz / max_sm_mhz: SM clock range, MHz.
        sm_step_mhz: Granularity of supported SM clocks, MHz.
        mem_mhz: Memory clock, MHz.
        memory_gib: Memory size, GiB.
        energy_counter: Whether the GPU has a cumulative energy counter (Volta and newer).
        counter_period_s: How often the energy counter is updated.
        power_period_s: How often the power readings are updated.
        sample_fraction: Fraction of each power period the instant sensor averages over
            (part-time sampling: 0.25 on A100/H100).
        averaged_power_s: Window of the averaged power reading (1 s on Ampere and newer:
            the ``NVML_FI_DEV_POWER_AVERAGE`` field, and ``nvmlDeviceGetPowerUsage`` except
            on GA100, the A100, where NVML documents that call as instantaneous); ``None``
            when there is only the instant reading.
        instant_power_field: Whether the ``NVML_FI_DEV_POWER_INSTANT`` field is supported.
        peak_w: Power a fully busy GPU would draw with no power limit, W.
        voltage_floor: Clock fraction below which the voltage stops scaling down: dynamic
            power goes as ``f**3`` above it and only as ``f`` below, so very low limits slow
            the GPU down more than they save power, as on real GPUs.
        counter_read_s: Wall-clock time one energy-counter read blocks its caller on the real
            clock (the simulated GPU sleeps that long; a virtual clock's reads are instant).
            3 ms on the H200, as measured there with driver 580 (``docs/hardware.md``); 0 on the
            others, whose call cost the fake NVML's ``call_latency_s`` models.

    """

    name: str
    arch: str
    idle_w: float
    min_limit_w: float
    max_limit_w: float
    default_limit_w: float
    min_sm_mhz: float
    max_sm_mhz: float
    sm_step_mhz: float
    mem_mhz: float
    memory_gib: float
    energy_counter: bool
    counter_period_s: float
    power_period_s: float
    sample_fraction: float
    averaged_power_s: float | None
    instant_power_field: bool
    peak_w: float
    voltage_floor: float = 0.8
    counter_read_s: float = 0.0

    def with_overrides(self, **kwargs: object) -> GPUModel:
        """A copy with some fields changed."""
        return replace(self, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CPUModel:
    """Static description of a CPU package model with RAPL-like counters.

    Attributes:
        name: Model name.
        vendor: ``intel`` or ``amd``.
        idle_w / tdp_w: Package power when idle and at full load, W.
        dram_idle_w / dram_peak_w: DRAM power when idle and at full load, W (``None``: no
            DRAM zone, as on AMD packages).
        counter_period_s: RAPL update period (about 1 ms).
        energy_unit_j: Counter resolution, J (Intel: 2**-14 J, which the kernel takes as
            61.035 µJ; AMD: 2**-16 J).
        wrap_j: Energy at which the counter wraps (``max_energy_range_uj``), J: 2**32 units,
            as the kernel computes it.
        dram_energy_unit_j / dram_wrap_j: The DRAM zone's, where it differs (Intel server
            CPUs before Sapphire Rapids count DRAM in a fixed 15.3 µJ unit); ``None``: the
            package's.

    """

    name: str
    vendor: str
    idle_w: float
    tdp_w: float
    dram_idle_w: float | None
    dram_peak_w: float | None
    counter_period_s: float = 0.001
    energy_unit_j: float = 61.035e-6
    wrap_j: float = 262143.328850
    dram_energy_unit_j: float | None = None
    dram_wrap_j: float | None = None

    def with_overrides(self, **kwargs: object) -> CPUModel:
        """A copy with some fields changed."""
        return replace(self, **kwargs)  # type: ignore[arg-type]


GPU_MODELS: dict[str, GPUModel] = {
    "P100": GPUModel(
        name="Tesla P100-PCIE-16GB", arch="pascal", idle_w=30.0,
        min_limit_w=125.0, max_limit_w=250.0, default_limit_w=250.0,
        min_sm_mhz=544.0, max_sm_mhz=1328.0, sm_step_mhz=13.0, mem_mhz=715.0, memory_gib=16,
        energy_counter=False, counter_period_s=0.0, power_period_s=0.02, sample_fraction=1.0,
        averaged_power_s=None, instant_power_field=False, peak_w=250.0,
    ),
    "V100": GPUModel(
        name="Tesla V100-SXM2-32GB", arch="volta", idle_w=40.0,
        min_limit_w=100.0, max_limit_w=300.0, default_limit_w=300.0,
        min_sm_mhz=135.0, max_sm_mhz=1530.0, sm_step_mhz=7.5, mem_mhz=877.0, memory_gib=32,
        energy_counter=True, counter_period_s=0.02, power_period_s=0.02, sample_fraction=1.0,
        averaged_power_s=None, instant_power_field=False, peak_w=290.0,
    ),
    "A40": GPUModel(
        name="NVIDIA A40", arch="ampere", idle_w=30.0,
        min_limit_w=100.0, max_limit_w=300.0, default_limit_w=300.0,
        min_sm_mhz=210.0, max_sm_mhz=1740.0, sm_step_mhz=15.0, mem_mhz=7251.0, memory_gib=48,
        energy_counter=True, counter_period_s=0.1, power_period_s=0.1, sample_fraction=0.25,
        averaged_power_s=1.0, instant_power_field=True, peak_w=300.0,
    ),
    "A100": GPUModel(
        name="NVIDIA A100-SXM4-40GB", arch="ampere", idle_w=55.0,
        min_limit_w=100.0, max_limit_w=400.0, default_limit_w=400.0,
        min_sm_mhz=210.0, max_sm_mhz=1410.0, sm_step_mhz=15.0, mem_mhz=1215.0, memory_gib=40,
        energy_counter=True, counter_period_s=0.1, power_period_s=0.1, sample_fraction=0.25,
        averaged_power_s=1.0, instant_power_field=True, peak_w=400.0,
    ),
    "H100": GPUModel(
        name="NVIDIA H100 80GB HBM3", arch="hopper", idle_w=70.0,
        min_limit_w=200.0, max_limit_w=700.0, default_limit_w=700.0,
        min_sm_mhz=345.0, max_sm_mhz=1980.0, sm_step_mhz=15.0, mem_mhz=2619.0, memory_gib=80,
        energy_counter=True, counter_period_s=0.1, power_period_s=0.1, sample_fraction=0.25,
        averaged_power_s=1.0, instant_power_field=True, peak_w=690.0,
    ),
    "H200": GPUModel(
        name="NVIDIA H200", arch="hopper", idle_w=75.0,
        min_limit_w=200.0, max_limit_w=700.0, default_limit_w=700.0,
        min_sm_mhz=345.0, max_sm_mhz=1980.0, sm_step_mhz=15.0, mem_mhz=3201.0, memory_gib=141,
        energy_counter=True, counter_period_s=0.1, power_period_s=0.1, sample_fraction=0.25,
        averaged_power_s=1.0, instant_power_field=True, peak_w=695.0, counter_read_s=0.003,
    ),
}

CPU_MODELS: dict[str, CPUModel] = {
    "XEON8480": CPUModel(
        name="Intel Xeon Platinum 8480+", vendor="intel", idle_w=95.0, tdp_w=350.0,
        dram_idle_w=12.0, dram_peak_w=45.0,
    ),
    "XEON6248": CPUModel(
        name="Intel Xeon Gold 6248", vendor="intel", idle_w=45.0, tdp_w=150.0,
        dram_idle_w=8.0, dram_peak_w=30.0, dram_energy_unit_j=15.3e-6, dram_wrap_j=65712.999613,
    ),
    "EPYC7763": CPUModel(
        name="AMD EPYC 7763", vendor="amd", idle_w=90.0, tdp_w=280.0,
        dram_idle_w=None, dram_peak_w=None, energy_unit_j=15.2587e-6, wrap_j=65532.610987,
    ),
}

DEFAULT_CPU = "XEON8480"


def gpu_model(key: str) -> GPUModel:
    """Look up a GPU model by catalog key (case-insensitive)."""
    try:
        return GPU_MODELS[key.upper()]
    except KeyError:
        known = ", ".join(GPU_MODELS)
        raise InvalidSpecError(f"unknown simulated GPU model {key!r} (known: {known})") from None


def cpu_model(key: str) -> CPUModel:
    """Look up a CPU model by catalog key (case-insensitive)."""
    try:
        return CPU_MODELS[key.upper()]
    except KeyError:
        known = ", ".join(CPU_MODELS)
        raise InvalidSpecError(f"unknown simulated CPU model {key!r} (known: {known})") from None
