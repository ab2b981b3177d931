"""Profile and run pipeline plans on simulated GPUs.

The planner's model of an iteration (:func:`~joules.optimizers.pipeline.frontier.evaluate`)
is: every computation takes its profiled time and energy at its frequency, starts as soon as
its dependencies are done, and every GPU draws the blocking power while it waits. This module
checks that model against the simulated hardware of :mod:`joules.devices.sim`:

* :func:`profile_simulated` measures each stage's forward and backward on that stage's
  simulated GPU at each SM clock (lock the clock, run the computation on the virtual clock,
  read the energy), and :func:`measure_blocking_power_w` measures a blocked (idle) GPU's
  power, so profile and blocking power come from the hardware the plan will run on.
* :func:`execute` runs a plan event by event on the simulator's virtual clock: each stage's
  GPU runs its computations in stage order, each when its dependencies are done and its GPU
  is free, with its clock locked by a
  :class:`~joules.optimizers.pipeline.controller.FrequencyController` (the same callbacks a
  training framework makes); the energy comes from the GPUs' energy meters.

How the simulated GPU behaves (see :class:`~joules.devices.sim.SimGPU`): a computation is a
constant utilization ``u`` (:class:`StageWork.utilization`) for its duration; at SM clock
fraction ``s`` the GPU draws ``idle + u * (peak - idle) * s * max(s, floor)**2`` and the
computation takes ``work * ((1 - c) + c / s)`` where ``c`` is the share of the work bound by
the SM clock (:class:`StageWork.compute_fraction`). A blocked GPU has utilization 0 and draws
its idle power whatever its clock, which is the blocking power. Profiling and execution use
the same rules, so running the all-highest-clock plan reproduces ``evaluate``'s time and
energy (up to rounding).
"""

from __future__ import annotations

import contextlib
import heapq
import math
import numbers
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from joules.clock import VirtualClock
from joules.devices.restore import RestoreGuard
from joules.devices.sim import Constant, SimGPU, Simulator
from joules.optimizers.pipeline.controller import (
    ControllerStats,
    FrequencyController,
    Instruction,
    snap_frequency,
)
from joules.optimizers.pipeline.frontier import Plan, PlanError, stage_instructions
from joules.optimizers.pipeline.profile import PipelineProfile
from joules.optimizers.pipeline.profiler import default_frequencies
from joules.optimizers.pipeline.schedule import KINDS, PipelineDAG

Meter = Literal["true", "counter"]


@dataclass(frozen=True)
class StageWork:
    """What one stage computes per microbatch, as the simulated GPU sees it.

    Attributes:
        forward_s: Time of one forward at the highest SM clock, s.
        backward_s: Time of one backward at the highest SM clock, s.
        compute_fraction: Share of the time that scales with the SM clock (the rest is
            memory- or communication-bound).
        utilization: GPU utilization while computing, in (0, 1].
    """

    forward_s: float
    backward_s: float
    compute_fraction: float = 0.85
    utilization: float = 1.0

    def __post_init__(self) -> None:
        if not (self.forward_s > 0 and self.backward_s > 0):
            raise ValueError(
                f"forward_s and backward_s must be > 0 (got {self.forward_s}, {self.backward_s})")
        if not 0.0 <= self.compute_fraction <= 1.0:
            raise ValueError(f"compute_fraction must be within [0, 1], got {self.compute_fraction}")
        if not 0.0 < self.utilization <= 1.0:
            raise ValueError(f"utilization must be within (0, 1], got {self.utilization}")

    def work_s(self, kind: str) -> float:
        """Time of ``kind`` (``"forward"``/``"backward"``) at the highest clock, s."""
        return self.forward_s if kind == "forward" else self.backward_s


def stage_work(
    stages: int,
    *,
    forward_s: float = 0.030,
    backward_ratio: float = 2.0,
    imbalance: float = 0.15,
    compute_fraction: float = 0.85,
    utilization: float = 1.0,
    seed: int = 0,
) -> list[StageWork]:
    """Work of ``stages`` stages, each forward about ``forward_s``, differing by up to ``imbalance``.

    Args:
        stages: Number of stages.
        forward_s: Mean forward time at the highest clock, s.
        backward_ratio: Backward time over forward time.
        imbalance: Relative spread of stage times (layers never split evenly).
        compute_fraction: See :class:`StageWork`.
        utilization: See :class:`StageWork`.
        seed: Random seed.
    """
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(stages):
        f = forward_s * (1.0 + imbalance * float(rng.uniform(-1.0, 1.0)))
        out.append(StageWork(f, f * backward_ratio, compute_fraction, utilization))
    return out


def _stage_gpus(sim: Simulator, stages: int) -> list[SimGPU]:
    if len(sim.gpus) < stages:
        raise ValueError(
            f"{stages} pipeline stages need {stages} simulated GPUs, but the simulator has {len(sim.gpus)} "
            f"(use a SPEC like A100x{stages})"
        )
    if not isinstance(sim.clock, VirtualClock):
        raise TypeError("simulated pipeline profiling and execution need a simulator on a VirtualClock")
    return sim.gpus[:stages]


METERS = ("true", "counter")
COUNTER_PERIODS = 10  # with the counter, a profiled computation is repeated over this many of its periods


def _check_meter(meter: str) -> None:
    if meter not in METERS:
        raise ValueError(f"meter must be one of {', '.join(METERS)}, got {meter!r}")


def _energy(gpu: SimGPU, meter: Meter) -> float:
    return gpu.true_energy_j() if meter == "true" else gpu.energy_j()


@contextlib.contextmanager
def _sim_guard(sim: Simulator, gpus: Sequence[SimGPU]) -> Iterator[RestoreGuard]:
    """A guard over the simulated GPUs, restored (clocks back, GPUs idle) when the block ends.

    Its journal goes to the default directory when the simulator keeps its state in a file
    (so a killed process is healed like on real GPUs), to a temporary one otherwise.
    """
    journal_tmp = None if sim.state_file is not None else tempfile.mkdtemp(prefix="joules-pipeline-sim-")
    guard = RestoreGuard(gpus, journal_dir=journal_tmp, handle_signals=False, recover_stale=False)
    try:
        yield guard
    finally:
        guard.restore()
        for g in gpus:
            g.set_workload(Constant(0.0))
        if journal_tmp is not None:
            shutil.rmtree(journal_tmp, ignore_errors=True)


def profile_simulated(
    sim: Simulator | str,
    work: Sequence[StageWork],
    frequencies: Sequence[float] | None = None,
    *,
    lowest_mhz: float | None = None,
    step: int = 1,
    meter: Meter = "true",
    name: str | None = None,
) -> PipelineProfile:
    """Measure every stage's forward and backward on its simulated GPU at each SM clock.

    Stage ``s`` runs on ``sim.gpus[s]``. For each clock, the GPU's clock is locked (through a
    :class:`~joules.devices.restore.RestoreGuard`), the computation runs on the virtual clock,
    and its time and energy are recorded. Afterwards the clocks are reset and the GPUs idle.

    Args:
        sim: The simulator (on a virtual clock), or a SPEC to make one.
        work: One :class:`StageWork` per stage.
        frequencies: Clocks to profile, MHz (each snapped to a supported one); default
            :func:`~joules.optimizers.pipeline.profiler.default_frequencies`.
        lowest_mhz: Lowest default clock (see :func:`default_frequencies`).
        step: Spacing of the default clocks (see :func:`default_frequencies`).
        meter: ``"true"`` (exact energy) or ``"counter"`` (the GPU's energy counter, updated
            only every so often: each computation is then repeated back to back over at least
            ``COUNTER_PERIODS`` of its update periods, and its energy is the mean, as a real
            profile of a computation shorter than the period has to be made).
        name: Name of the profile.

    Returns:
        The profile; frequencies are whole MHz.

    Raises:
        ValueError: No work, too few GPUs or a bad meter.
    """
    _check_meter(meter)
    if isinstance(sim, str):
        sim = Simulator(sim)
    if not work:
        raise ValueError("no stage work to profile")
    gpus = _stage_gpus(sim, len(work))
    rows: list[tuple[int, str, int, float, float]] = []
    with _sim_guard(sim, gpus) as guard:
        for s, (gpu, w) in enumerate(zip(gpus, work, strict=True)):
            supported = gpu.supported_sm_clocks_mhz()
            clocks = (default_frequencies(gpu, lowest_mhz, step) if frequencies is None
                      else sorted({snap_frequency(float(f), supported) for f in frequencies}))
            for f in clocks:
                guard.lock_sm_clock(gpu, f, f)
                for kind in KINDS:
                    gpu.set_workload(Constant(w.utilization))
                    t = gpu.step_time_s(w.work_s(kind), w.compute_fraction, w.utilization)
                    period = gpu.energy_counter_period_s() if meter == "counter" else None
                    repeats = 1 if not period else max(1, math.ceil(COUNTER_PERIODS * period / t))
                    e0 = _energy(gpu, meter)
                    sim.advance(t * repeats)
                    e1 = _energy(gpu, meter)
                    gpu.set_workload(Constant(0.0))
                    rows.append((s, kind, int(round(f)), t, (e1 - e0) / repeats))
    return PipelineProfile.from_rows(rows, name=name or f"simulated-{sim.spec}-{len(work)}stages")


def measure_blocking_power_w(sim: Simulator, stages: int | None = None, probe_s: float = 1.0) -> float:
    """Power of a blocked (idle) stage GPU, measured on the virtual clock, W.

    With GPUs of several models, the mean over the stages' GPUs (the planner takes one value).

    Args:
        sim: The simulator (on a virtual clock).
        stages: How many of its GPUs are stages (default: all).
        probe_s: How long to measure, s (virtual time).
    """
    if not (probe_s > 0 and math.isfinite(probe_s)):
        raise ValueError(f"probe_s must be a positive number of seconds, got {probe_s!r}")
    if stages is not None and stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    gpus = _stage_gpus(sim, len(sim.gpus) if stages is None else stages)
    for g in gpus:
        g.set_workload(Constant(0.0))
    e0 = [g.true_energy_j() for g in gpus]
    sim.advance(probe_s)
    e1 = [g.true_energy_j() for g in gpus]
    return sum(b - a for a, b in zip(e0, e1, strict=True)) / (probe_s * len(gpus))


@dataclass(frozen=True)
class ExecutionResult:
    """What running a plan on simulated GPUs took.

    Attributes:
        iterations: Iterations run (each starts when the previous one has fully ended).
        time_s: Time of all iterations, s.
        gpu_energy_j: Energy of each stage's GPU over all iterations, blocking included, J.
        busy_s: Time each stage's GPU computed, over all iterations, s.
        iteration_time_s: Time of each iteration, s.
        start_s: Start of every DAG node in the first iteration, from its start, s.
        end_s: End of every DAG node in the first iteration, s.
        controller_stats: Each stage controller's stats at the end.
    """

    iterations: int
    time_s: float
    gpu_energy_j: tuple[float, ...]
    busy_s: tuple[float, ...]
    iteration_time_s: tuple[float, ...]
    start_s: tuple[float, ...]
    end_s: tuple[float, ...]
    controller_stats: tuple[ControllerStats, ...]

    @property
    def energy_j(self) -> float:
        """Energy of all GPUs over all iterations, J."""
        return sum(self.gpu_energy_j)

    @property
    def time_per_iteration_s(self) -> float:
        """Mean iteration time, s."""
        return self.time_s / self.iterations

    @property
    def energy_per_iteration_j(self) -> float:
        """Mean energy of one iteration on all GPUs, J."""
        return self.energy_j / self.iterations


PlanLike = Plan | Sequence[int] | Sequence[Sequence[Mapping[str, object] | Instruction]]


def _per_stage(dag: PipelineDAG, plan: PlanLike) -> list[Sequence[Mapping[str, object] | Instruction]]:
    if isinstance(plan, Plan):
        return list(stage_instructions(dag, plan.frequencies))
    items = list(plan)
    if items and all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in items):
        return list(stage_instructions(dag, [int(x) for x in items]))  # type: ignore[arg-type]
    if len(items) != dag.stages:
        raise PlanError(f"got instructions for {len(items)} stages; the pipeline has {dag.stages}")
    return items  # type: ignore[return-value]


def execute(
    dag: PipelineDAG,
    plan: PlanLike | None,
    sim: Simulator,
    work: Sequence[StageWork],
    *,
    controllers: Sequence[FrequencyController] | None = None,
    iterations: int = 1,
    meter: Meter = "true",
) -> ExecutionResult:
    """Run ``iterations`` iterations of ``plan`` on the simulator's GPUs, event by event.

    Stage ``s`` runs on ``sim.gpus[s]`` and does ``work[s]``. Each computation begins when
    its dependencies have ended and its GPU is free: its controller's
    :meth:`~FrequencyController.on_instruction_begin` locks the clock, the GPU turns busy
    (at ``work[s].utilization``) for as long as the work takes at that clock, then
    :meth:`~FrequencyController.on_instruction_end` is called and the GPU is blocked (idle)
    until its next computation can begin.

    Args:
        dag: The pipeline.
        plan: A :class:`Plan`, per-node frequencies, or per-stage instruction lists; ``None``
            runs the plans the ``controllers`` hold.
        sim: The simulator (on a virtual clock) with at least ``dag.stages`` GPUs.
        work: One :class:`StageWork` per stage (the work that was profiled).
        controllers: One controller per stage, on ``sim.gpus[s]``; they are given ``plan``
            (unless it is ``None``) and are not restored at the end. Default: new controllers
            sharing one guard (journaled in a temporary directory, or in the default one when
            the simulator keeps a state file), restored at the end. An ``asynchronous``
            controller's lock is waited for (:meth:`FrequencyController.flush`) before each
            computation starts, as the simulated computation takes no wall time.
        iterations: Iterations to run.
        meter: Read energy from ``"true"`` (exact) or ``"counter"`` (the GPUs' energy
            counters, with their coarse update period).

    Returns:
        The measured time and energy.

    Raises:
        PlanError: The plan does not fit the pipeline.
        ValueError: A bad argument.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    _check_meter(meter)
    if len(work) != dag.stages:
        raise ValueError(f"got work for {len(work)} stages; the pipeline has {dag.stages}")
    gpus = _stage_gpus(sim, dag.stages)
    with contextlib.ExitStack() as stack:
        if controllers is None:
            if plan is None:
                raise ValueError("execute needs a plan or controllers")
            per_stage = _per_stage(dag, plan)
            own_guard = stack.enter_context(_sim_guard(sim, gpus))
            ctls = [FrequencyController(g, ins, guard=own_guard)
                    for g, ins in zip(gpus, per_stage, strict=True)]
        else:
            ctls = list(controllers)
            if len(ctls) != dag.stages:
                raise ValueError(f"got {len(ctls)} controllers; the pipeline has {dag.stages} stages")
            for s, (c, g) in enumerate(zip(ctls, gpus, strict=True)):
                if c.gpu is not g:
                    raise ValueError(
                        f"controller {s} controls GPU {c.gpu.index}, not stage {s}'s simulated GPU")
            if plan is not None:
                for c, ins in zip(ctls, _per_stage(dag, plan), strict=True):
                    c.set_plan(ins)
        return _run(dag, sim, gpus, work, ctls, iterations, meter)


def _run(
    dag: PipelineDAG,
    sim: Simulator,
    gpus: Sequence[SimGPU],
    work: Sequence[StageWork],
    ctls: Sequence[FrequencyController],
    iterations: int,
    meter: Meter,
) -> ExecutionResult:
    clock = sim.clock
    preds = dag.predecessors()
    succs = dag.successors()
    for g in gpus:
        g.set_workload(Constant(0.0))
    e_start = [_energy(g, meter) for g in gpus]
    t_start = clock.now()
    busy = [0.0] * dag.stages
    iteration_times: list[float] = []
    first_start: list[float] = []
    first_end: list[float] = []

    for it in range(iterations):
        t0 = clock.now()
        start, end = _iteration(dag, sim, gpus, work, ctls, preds, succs, busy)
        iteration_times.append(clock.now() - t0)
        if it == 0:
            first_start, first_end = start, end

    energy = tuple(_energy(g, meter) - e0 for g, e0 in zip(gpus, e_start, strict=True))
    return ExecutionResult(
        iterations=iterations,
        time_s=clock.now() - t_start,
        gpu_energy_j=energy,
        busy_s=tuple(busy),
        iteration_time_s=tuple(iteration_times),
        start_s=tuple(first_start),
        end_s=tuple(first_end),
        controller_stats=tuple(ControllerStats(**c.stats.to_dict()) for c in ctls),
    )


def _iteration(
    dag: PipelineDAG,
    sim: Simulator,
    gpus: Sequence[SimGPU],
    work: Sequence[StageWork],
    ctls: Sequence[FrequencyController],
    preds: Sequence[Sequence[int]],
    succs: Sequence[Sequence[int]],
    busy: list[float],
) -> tuple[list[float], list[float]]:
    """Run one iteration from now; add each stage's busy time to ``busy``; return node starts and ends."""
    clock = sim.clock
    t0 = clock.now()
    n = len(dag.nodes)
    waiting = [len(p) for p in preds]
    pos = [0] * dag.stages
    running = [False] * dag.stages
    start = [0.0] * n
    end = [0.0] * n
    events: list[tuple[float, int]] = []
    done = 0

    def try_start(s: int) -> None:
        if running[s] or pos[s] >= len(dag.stage_order[s]):
            return
        node = dag.stage_order[s][pos[s]]
        if waiting[node]:
            return
        c = dag.nodes[node]
        w = work[s]
        ctls[s].on_instruction_begin(c.kind, c.microbatch)
        if ctls[s].asynchronous:
            # The simulated computation takes no wall time: wait for the lock to be in place
            # before it starts, as the background thread would long have made it on hardware.
            ctls[s].flush()
        gpus[s].set_workload(Constant(w.utilization))
        dur = gpus[s].step_time_s(w.work_s(c.kind), w.compute_fraction, w.utilization)
        now = clock.now()
        start[node] = now - t0
        end[node] = now - t0 + dur
        busy[s] += dur
        running[s] = True
        heapq.heappush(events, (now + dur, node))

    for s in range(dag.stages):
        try_start(s)
    while events:
        t, node = heapq.heappop(events)
        dt = t - clock.now()
        if dt > 0:
            sim.advance(dt)
        c = dag.nodes[node]
        s = c.stage
        ctls[s].on_instruction_end(c.kind, c.microbatch)
        gpus[s].set_workload(Constant(0.0))
        running[s] = False
        pos[s] += 1
        done += 1
        touched = {s}
        for v in succs[node]:
            waiting[v] -= 1
            touched.add(dag.nodes[v].stage)
        for s2 in sorted(touched):
            try_start(s2)
    if done != n:  # pragma: no cover - stage orders follow the DAG's edges
        raise RuntimeError(f"pipeline execution stalled after {done} of {n} computations")
    return start, end


__all__ = [
    "ExecutionResult", "StageWork", "execute",
    "measure_blocking_power_w", "profile_simulated", "stage_instructions", "stage_work",
]
