"""Simulated hardware: GPUs and CPU packages with realistic sensors, on a clock of choice.

Select it with ``--sim SPEC`` on any command or ``JOULES_SIM=SPEC``. A SPEC is a
comma-separated list of items ``MODEL`` or ``MODELxN``: GPU models (``P100``, ``V100``,
``A40``, ``A100``, ``H100``, ``H200``), CPU models (``XEON8480``, ``XEON6248``,
``EPYC7763``) or ``nocpu``. Without a CPU item, one ``XEON8480`` package is added.
Examples: ``A100``, ``H100x4``, ``V100,A40``, ``A100x2,EPYC7763x2``, ``H200,nocpu``.

A simulated GPU forgets its power limit and locked clocks when its process exits, unlike a
real one. With ``JOULES_SIM_STATE=path`` (or ``Simulator(..., state_file=path)``) they are
kept in a JSON file instead: each GPU starts from what the file records for its index and
records every change (see :mod:`joules.devices.sim.state`), so several processes can share
the same simulated GPUs' settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from joules.clock import Clock, RealClock, VirtualClock
from joules.devices.base import DeviceSet
from joules.devices.sim.catalog import (
    CPU_MODELS,
    DEFAULT_CPU,
    GPU_MODELS,
    CPUModel,
    GPUModel,
    cpu_model,
    gpu_model,
)
from joules.devices.sim.cpu import SimCPU
from joules.devices.sim.gpu import SimGPU
from joules.devices.sim.workload import Constant, Idle, Periodic, Trace, Workload
from joules.errors import InvalidSpecError

__all__ = [
    "CPU_MODELS", "GPU_MODELS", "CPUModel", "Constant", "GPUModel", "Idle", "Periodic",
    "SimCPU", "SimGPU", "Simulator", "Trace", "Workload", "parse_spec",
]

_ITEM = re.compile(r"^([A-Za-z][A-Za-z0-9]*?)(?:[xX](\d+))?$")


def parse_spec(spec: str) -> tuple[list[GPUModel], list[CPUModel]]:
    """Parse a SPEC string into GPU and CPU models. InvalidSpecError names what is wrong."""
    if not spec or not spec.strip():
        raise InvalidSpecError("empty simulated-hardware SPEC (example: A100x2)")
    gpus: list[GPUModel] = []
    cpus: list[CPUModel] = []
    nocpu = False
    for raw in spec.split(","):
        item = raw.strip()
        if item.lower() == "nocpu":
            nocpu = True
            continue
        m = _ITEM.match(item)
        if not m:
            raise InvalidSpecError(f"bad SPEC item {item!r} (expected MODEL or MODELxN, e.g. A100x2)")
        key, count = m.group(1).upper(), int(m.group(2) or 1)
        if count < 1 or count > 64:
            raise InvalidSpecError(f"bad count in SPEC item {item!r} (1 to 64)")
        if key in GPU_MODELS:
            gpus.extend([gpu_model(key)] * count)
        elif key in CPU_MODELS:
            cpus.extend([cpu_model(key)] * count)
        else:
            known = ", ".join([*GPU_MODELS, *CPU_MODELS])
            raise InvalidSpecError(f"unknown model {m.group(1)!r} in SPEC (known: {known}, nocpu)")
    if nocpu and cpus:
        raise InvalidSpecError("SPEC names CPU models and 'nocpu' at once")
    if not cpus and not nocpu:
        cpus.append(cpu_model(DEFAULT_CPU))
    return gpus, cpus


@dataclass
class Simulator:
    """A set of simulated devices sharing one clock.

    Args:
        spec: Hardware SPEC (see module docs).
        clock: Clock to run on; a new :class:`VirtualClock` by default. Use a
            :class:`RealClock` to measure real programs on simulated hardware.
        state_file: A JSON file that keeps the GPUs' power limits and SM clock locks across
            processes (see module docs); ``None`` keeps them in memory only.

    """

    spec: str
    clock: Clock = field(default_factory=VirtualClock)
    state_file: str | Path | None = None
    gpus: list[SimGPU] = field(init=False)
    cpus: list[SimCPU] = field(init=False)

    def __post_init__(self) -> None:
        gpu_models, cpu_models = parse_spec(self.spec)
        self.gpus = [SimGPU(m, self.clock, index=i) for i, m in enumerate(gpu_models)]
        self.cpus = [SimCPU(m, self.clock, index=i) for i, m in enumerate(cpu_models)]
        if self.state_file is not None:
            from joules.devices.sim.state import SimStateFile

            SimStateFile(self.state_file).attach(self.gpus)

    @classmethod
    def realtime(cls, spec: str, state_file: str | Path | None = None) -> Simulator:
        """Simulated devices on the real clock (for measuring real programs)."""
        return cls(spec, clock=RealClock(), state_file=state_file)

    def set_workload(self, workload: Workload, gpus: bool = True, cpus: bool = True) -> None:
        """Run ``workload`` on every simulated device from now on."""
        for d in (self.gpus if gpus else []) + (self.cpus if cpus else []):  # type: ignore[operator]
            d.set_workload(workload)

    def advance(self, seconds: float) -> None:
        """Advance a virtual clock (TypeError on the real clock)."""
        if not isinstance(self.clock, VirtualClock):
            raise TypeError("only a simulator on a VirtualClock can be advanced by hand")
        self.clock.advance(seconds)

    def step_time_s(self, work_s: float, compute_fraction: float = 1.0,
                    utilization: float | None = None) -> float:
        """How long ``work_s`` seconds of full-speed work take at the current limits and clocks.

        A ``compute_fraction`` of the work scales with the SM clock, the rest (memory- or
        input-bound) does not; the slowest GPU sets the pace, as in data-parallel training.
        Each GPU's clock is the one its current workload gets (or the one at ``utilization``).
        """
        if work_s < 0 or not 0.0 <= compute_fraction <= 1.0:
            raise ValueError("work_s must be >= 0 and compute_fraction within [0, 1]")
        return max((g.step_time_s(work_s, compute_fraction, utilization) for g in self.gpus), default=work_s)

    def run(self, work_s: float, compute_fraction: float = 1.0, utilization: float | None = None) -> float:
        """Advance a virtual clock through ``work_s`` of work (see :meth:`step_time_s`); return the time."""
        elapsed = self.step_time_s(work_s, compute_fraction, utilization)
        self.advance(elapsed)
        return elapsed

    def devices(self) -> DeviceSet:
        """The simulated devices as a :class:`DeviceSet`."""
        return DeviceSet(
            gpus=list(self.gpus), cpus=list(self.cpus), clock=self.clock,
            problems=[p for d in [*self.gpus, *self.cpus] for p in d.problems()],
            backend=f"sim:{self.spec}", simulator=self,
        )

    def true_gpu_energy_j(self) -> dict[int, float]:
        """Exact energy of each GPU since creation."""
        return {g.index: g.true_energy_j() for g in self.gpus}
