"""Pipeline plans profiled on and run on simulated GPUs agree with the planner's model."""

from __future__ import annotations

import numpy as np
import pytest

from joules.devices.restore import RestoreGuard
from joules.devices.sim import Simulator
from joules.optimizers.pipeline import solver
from joules.optimizers.pipeline.controller import FrequencyController
from joules.optimizers.pipeline.execution import (
    StageWork,
    execute,
    measure_blocking_power_w,
    profile_simulated,
    stage_instructions,
    stage_work,
)
from joules.optimizers.pipeline.frontier import Plan, PlanError, evaluate, timeline
from joules.optimizers.pipeline.profile import PipelineProfile
from joules.optimizers.pipeline.schedule import PipelineDAG, build_dag

STAGES = 4


@pytest.fixture
def setup() -> tuple[Simulator, list[StageWork], PipelineProfile, float]:
    sim = Simulator(f"A100x{STAGES}")
    work = stage_work(STAGES, seed=1)
    profile = profile_simulated(sim, work, step=2)
    return sim, work, profile, measure_blocking_power_w(sim, STAGES)


def all_max(dag: PipelineDAG, profile: PipelineProfile, pb: float) -> Plan:
    return evaluate(dag, profile, [max(profile.frequencies())] * len(dag.nodes), pb)


def cheaper_same_time(dag: PipelineDAG, profile: PipelineProfile, pb: float) -> Plan:
    """Lower the clock of every computation with slack as far as the iteration time allows (greedy)."""
    best = all_max(dag, profile, pb)
    deadline = best.time_s * (1 + 1e-12)
    freqs = list(best.frequencies)
    for node in range(len(dag.nodes)):
        for f in profile.frequencies():  # lowest first
            if f >= freqs[node]:
                break
            trial = freqs.copy()
            trial[node] = f
            p = evaluate(dag, profile, trial, pb)
            if p.time_s <= deadline and p.energy_j < best.energy_j:
                freqs, best = trial, p
                break
    return best


def close(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * abs(b)


def test_profile_comes_from_the_simulated_gpus() -> None:
    sim = Simulator("A100x2")
    work = [StageWork(0.02, 0.04), StageWork(0.03, 0.06, compute_fraction=0.5)]
    profile = profile_simulated(sim, work, frequencies=[1410, 1200, 1203, 900])
    assert profile.frequencies() == [900, 1200, 1410]  # snapped to supported clocks, once each
    profile.check_covers(2)
    fwd = {o.frequency: o for o in profile.of(0, "forward")}
    assert fwd[1410].time_s == pytest.approx(0.02)
    assert fwd[1410].energy_j == pytest.approx(400.0 * 0.02)  # a fully busy A100 at its top clock
    assert fwd[900].time_s > fwd[1200].time_s > fwd[1410].time_s
    assert fwd[900].energy_j < fwd[1410].energy_j
    # less of stage 1's work depends on the clock: it slows down less
    b1 = {o.frequency: o for o in profile.of(1, "backward")}
    assert b1[900].time_s / b1[1410].time_s < fwd[900].time_s / fwd[1410].time_s
    # Clocks go through a restore guard, which resets them afterwards (as on real GPUs).
    assert [g.sm_clock_locked() for g in sim.gpus] == [None, None]
    assert measure_blocking_power_w(sim) == pytest.approx(sim.gpus[0].model.idle_w)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_all_max_plan_reproduces_evaluate(setup, schedule: str) -> None:
    sim, work, profile, pb = setup
    dag = build_dag(schedule, STAGES, 6)
    plan = all_max(dag, profile, pb)
    result = execute(dag, plan, sim, work, iterations=2)
    assert close(result.time_per_iteration_s, plan.time_s)
    assert close(result.energy_per_iteration_j, plan.energy_j)
    assert result.iteration_time_s[0] == pytest.approx(result.iteration_time_s[1])
    # every computation starts and ends when the planner's timeline says
    durations = [{o.frequency: o for o in profile.of(c.stage, c.kind)}[f].time_s
                 for c, f in zip(dag.nodes, plan.frequencies, strict=True)]
    tl = timeline(dag, durations)
    assert result.start_s == pytest.approx(tl.start_s, abs=1e-9)
    assert result.end_s == pytest.approx(tl.end_s, abs=1e-9)
    assert result.busy_s == pytest.approx([2 * sum(durations[n] for n in order) for order in dag.stage_order])
    # one lock per stage for the whole run, then the clocks are put back
    assert [s.locks_applied for s in result.controller_stats] == [1] * STAGES
    assert [g.sm_clock_locked() for g in sim.gpus] == [None] * STAGES


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_cheaper_plan_takes_the_same_time_for_less_energy(setup, schedule: str) -> None:
    sim, work, profile, pb = setup
    dag = build_dag(schedule, STAGES, 4)
    fast = all_max(dag, profile, pb)
    cheap = cheaper_same_time(dag, profile, pb)
    assert cheap.energy_j < 0.99 * fast.energy_j  # the planner thinks it saves energy...
    r_fast = execute(dag, fast, sim, work)
    r_cheap = execute(dag, cheap, sim, work)
    assert close(r_cheap.time_s, cheap.time_s) and close(r_cheap.energy_j, cheap.energy_j)
    assert r_cheap.time_s == pytest.approx(r_fast.time_s, rel=1e-9)  # ...and the GPUs agree
    assert r_cheap.energy_j < 0.99 * r_fast.energy_j
    assert sum(s.locks_applied for s in r_cheap.controller_stats) > STAGES


def test_frontier_plans_from_the_solver_run_as_planned(setup) -> None:
    sim, work, profile, pb = setup
    dag = build_dag("1f1b", STAGES, 4)
    frontier = solver.solve(dag, profile, pb)
    fast = execute(dag, frontier.max_frequency, sim, work)
    picks = [frontier.plans[0], frontier.plans[len(frontier.plans) // 2], frontier.plans[-1]]
    energies = []
    for plan in picks:
        expected = evaluate(dag, profile, plan.frequencies, pb)
        r = execute(dag, plan, sim, work)
        assert close(r.time_s, expected.time_s) and close(r.energy_j, expected.energy_j)
        energies.append(r.energy_j)
    assert close(execute(dag, frontier.plans[0], sim, work).time_s, fast.time_s)
    assert energies[0] < fast.energy_j
    assert energies[0] > energies[1] > energies[2]


def test_given_controllers_run_the_plan_and_are_left_to_their_owner(setup, tmp_path) -> None:
    sim, work, profile, pb = setup
    dag = build_dag("1f1b", STAGES, 4)
    cheap = cheaper_same_time(dag, profile, pb)
    guard = RestoreGuard(sim.gpus, journal_dir=tmp_path, handle_signals=False)
    ctls = [FrequencyController(g, ins, guard=guard)
            for g, ins in zip(sim.gpus, stage_instructions(dag, all_max(dag, profile, pb).frequencies),
                              strict=True)]
    r = execute(dag, cheap, sim, work, controllers=ctls, iterations=2)  # switches them to `cheap`
    assert close(r.energy_per_iteration_j, cheap.energy_j)
    assert all(c.stats.plan_switches == 1 and c.stats.iterations == 2 for c in ctls)
    assert any(g.sm_clock_locked() is not None for g in sim.gpus)  # still locked: the owner restores
    guard.restore()
    assert [g.sm_clock_locked() for g in sim.gpus] == [None] * STAGES


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_asynchronous_controllers_run_the_plan_as_evaluated(setup, tmp_path, schedule: str) -> None:
    sim, work, profile, pb = setup
    dag = build_dag(schedule, STAGES, 4)
    cheap = cheaper_same_time(dag, profile, pb)
    expected = evaluate(dag, profile, cheap.frequencies, pb)
    synchronous = execute(dag, cheap, sim, work, iterations=2)
    for attempt in range(3):  # the same every time, whenever the background locks land
        guard = RestoreGuard(sim.gpus, journal_dir=tmp_path / str(attempt), handle_signals=False)
        ctls = [FrequencyController(g, ins, guard=guard, asynchronous=True)
                for g, ins in zip(sim.gpus, stage_instructions(dag, cheap.frequencies), strict=True)]
        try:
            r = execute(dag, None, sim, work, controllers=ctls, iterations=2)
        finally:
            for c in ctls:
                c.close()
        assert r.time_per_iteration_s == pytest.approx(expected.time_s, rel=1e-9)
        assert r.energy_per_iteration_j == pytest.approx(expected.energy_j, rel=1e-9)
        assert r.iteration_time_s == pytest.approx(synchronous.iteration_time_s, rel=1e-12)
        assert r.gpu_energy_j == pytest.approx(synchronous.gpu_energy_j, rel=1e-12)
    assert [g.sm_clock_locked() for g in sim.gpus] == [None] * STAGES


def test_dry_run_controllers_run_everything_at_the_top_clock(setup) -> None:
    sim, work, profile, pb = setup
    dag = build_dag("gpipe", STAGES, 4)
    cheap = cheaper_same_time(dag, profile, pb)
    ctls = [FrequencyController(g, ins, dry_run=True)
            for g, ins in zip(sim.gpus, stage_instructions(dag, cheap.frequencies), strict=True)]
    r = execute(dag, None, sim, work, controllers=ctls)
    fast = all_max(dag, profile, pb)
    assert close(r.energy_j, fast.energy_j) and close(r.time_s, fast.time_s)
    assert sum(c.stats.locks_applied for c in ctls) > STAGES  # what it would have done


def test_energy_counters_agree_over_several_iterations(setup) -> None:
    sim, work, profile, pb = setup
    dag = build_dag("1f1b", STAGES, 8)
    plan = cheaper_same_time(dag, profile, pb)
    r = execute(dag, plan, sim, work, iterations=5, meter="counter")
    assert close(r.energy_per_iteration_j, plan.energy_j, rel=0.03)


def test_a_profile_read_from_energy_counters_is_close_to_the_truth(tmp_path) -> None:
    # A100 counters update every 100 ms, longer than these computations: each is repeated
    # over several periods (one reading of 20-60 ms would see 0 J, or one whole update).
    work = [StageWork(0.02, 0.04), StageWork(0.03, 0.06)]
    clocks = [1410, 1200, 900]
    truth = profile_simulated(Simulator("A100x2"), work, frequencies=clocks)
    counted = profile_simulated(Simulator("A100x2"), work, frequencies=clocks, meter="counter")
    for stage in (0, 1):
        for kind in ("forward", "backward"):
            exact = {o.frequency: o for o in truth.of(stage, kind)}
            for o in counted.of(stage, kind):
                assert o.time_s == exact[o.frequency].time_s
                assert close(o.energy_j, exact[o.frequency].energy_j, rel=0.1)
    counted.to_csv(tmp_path / "profile.csv")
    assert PipelineProfile.from_csv(tmp_path / "profile.csv").of(0, "forward") == counted.of(0, "forward")


def test_bad_arguments(setup) -> None:
    sim, work, profile, pb = setup
    dag = build_dag("1f1b", STAGES, 2)
    plan = all_max(dag, profile, pb)
    with pytest.raises(ValueError, match="need 4 simulated GPUs"):
        execute(dag, plan, Simulator("A100x2"), work)
    with pytest.raises(TypeError, match="VirtualClock"):
        execute(dag, plan, Simulator.realtime("A100x4"), work)
    with pytest.raises(PlanError, match="frequencies for"):
        execute(dag, [1410, 1410], sim, work)
    with pytest.raises(ValueError, match="work for 2 stages"):
        execute(dag, plan, sim, work[:2])
    with pytest.raises(ValueError, match="iterations"):
        execute(dag, plan, sim, work, iterations=0)
    with pytest.raises(ValueError, match="meter must be one of true, counter, got 'Ture'"):
        execute(dag, plan, sim, work, meter="Ture")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="meter must be one of"):
        profile_simulated(sim, work, meter="counters")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="probe_s must be a positive number"):
        measure_blocking_power_w(sim, probe_s=0.0)
    with pytest.raises(ValueError, match="stages must be at least 1"):
        measure_blocking_power_w(sim, stages=0)
    with pytest.raises(ValueError, match="utilization"):
        StageWork(0.01, 0.02, utilization=0.0)
    with pytest.raises(PlanError, match="instructions for 3 stages"):
        execute(dag, stage_instructions(dag, plan.frequencies)[:3], sim, work)
    # A plan given per computation (a list or a NumPy array) or per stage runs as promised.
    freqs = plan.frequencies
    for form in (list(freqs), np.array(freqs), stage_instructions(dag, freqs)):
        r = execute(dag, form, sim, work)
        assert close(r.energy_j, plan.energy_j) and close(r.time_s, plan.time_s)
