"""Profiling a pipeline stage during (simulated) training, through the controller's callbacks."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from joules.cli import main
from joules.devices.restore import RestoreGuard
from joules.devices.sim import Constant, SimGPU, Simulator
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.pipeline.execution import StageWork, measure_blocking_power_w, profile_simulated
from joules.optimizers.pipeline.profile import PipelineProfile, PipelineProfileError
from joules.optimizers.pipeline.profiler import ProfilingError, StageProfiler, default_frequencies
from joules.optimizers.pipeline.schedule import build_dag
from joules.testing.processes import sim_child_env, start_ready

WORK = [StageWork(0.030, 0.060), StageWork(0.034, 0.068)]
GAP_S = 0.004  # each computation is followed by this long blocked on communication


def stage_order(stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    dag = build_dag("1f1b", stages, microbatches)
    return [(dag.nodes[n].kind, dag.nodes[n].microbatch) for n in dag.stage_order[stage]]


def run_computation(sim: Simulator, gpu: SimGPU, work: StageWork, kind: str) -> None:
    gpu.set_workload(Constant(work.utilization))
    sim.advance(gpu.step_time_s(work.work_s(kind), work.compute_fraction, work.utilization))
    gpu.set_workload(Constant(0.0))


def train(sim: Simulator, gpu: SimGPU, work: StageWork, prof: StageProfiler, order: list[tuple[str, int]],
          max_iterations: int = 200) -> int:
    """Run iterations of one stage until the profiler is done; the number of iterations."""
    for it in range(1, max_iterations + 1):
        for kind, mb in order:
            prof.on_instruction_begin(kind, mb)
            run_computation(sim, gpu, work, kind)
            prof.on_instruction_end(kind, mb)
            sim.advance(GAP_S)
        if prof.done:
            return it
    raise AssertionError("the profiler never finished")


@pytest.fixture
def rig(tmp_path: Path):
    sim = Simulator("A100x2")
    mon = EnergyMonitor(devices=sim.devices(), cpu_indices=[])
    sim.advance(2.0)  # the sampler learns the energy counters' update timing
    guard = RestoreGuard(sim.gpus, journal_dir=tmp_path / "journal", handle_signals=False,
                         recover_stale=False)
    yield sim, mon, guard
    mon.close()
    guard.restore()


def test_profiles_each_clock_as_training_runs_and_matches_the_hardware(rig) -> None:
    sim, mon, guard = rig
    gpu = sim.gpus[1]
    prof = StageProfiler(mon, stage=1, gpu=1, step=6, guard=guard)
    clocks = prof.frequencies
    assert list(clocks) == sorted(clocks, reverse=True) and len(clocks) >= 5  # highest first
    assert clocks[0] == max(gpu.supported_sm_clocks_mhz())
    assert prof.min_span_s == pytest.approx(2.0)  # 20 periods of the A100's 100 ms counter
    t0 = sim.clock.now()
    iterations = train(sim, gpu, WORK[1], prof, stage_order(2, 4, 1))
    # Each clock is held for 2 s (whole iterations of about 0.45 s) and then left at once.
    assert 2.0 * len(clocks) <= sim.clock.now() - t0 <= 2.6 * len(clocks)
    assert iterations >= 4 * len(clocks)
    assert prof.done and prof.progress == (len(clocks), len(clocks))
    assert gpu.sm_clock_locked() is None  # reset when done
    assert prof.on_instruction_begin("forward", 0) is None  # quiet afterwards

    measured = prof.profile()
    assert prof.attributed == sorted(int(round(f)) for f in clocks)
    truth = profile_simulated(Simulator("A100x2"), WORK, frequencies=clocks)
    errors = []
    for kind in ("forward", "backward"):
        got, want = measured.of(1, kind), truth.of(1, kind)
        assert [o.frequency for o in got] == [o.frequency for o in want]
        for g, w in zip(got, want, strict=True):
            assert g.time_s == pytest.approx(w.time_s, rel=1e-9)
            errors.append(g.energy_j / w.energy_j - 1)
    # 30-70 ms computations on a counter updated every 100 ms: each window's own edges are
    # several % off; attributed to the counter's updates, the energies are within 2 % (mean 0.5 %).
    assert max(abs(e) for e in errors) < 0.02 and sum(abs(e) for e in errors) / len(errors) < 0.005
    assert prof.blocking_power_w == pytest.approx(measure_blocking_power_w(Simulator("A100"), 1), rel=0.01)
    kept = prof.measured()
    assert {s.frequency for s in kept} == {int(round(f)) for f in clocks}
    for f in clocks:
        for kind in ("forward", "backward"):
            assert sum(s.frequency == int(round(f)) and s.computation == kind for s in kept) >= 3


def test_warmup_computations_are_left_out_of_the_energies_too(rig) -> None:
    # A clock that takes effect late: the first forward and backward after each change still
    # run at the previous clock. They are left out of the times, and must be out of the
    # counter fit that attributes the energies as well.
    sim, mon, guard = rig
    gpu, work, clocks = sim.gpus[0], WORK[0], [1410, 1200, 1005, 810]
    prof = StageProfiler(mon, stage=0, gpu=0, frequencies=clocks, guard=guard)
    assert prof.warmup == 1
    begun: dict[float, dict[str, int]] = {}
    previous = current = None
    while not prof.done:
        for kind, mb in stage_order(2, 4, 1):
            f = prof.on_instruction_begin(kind, mb)
            if f is None:
                break
            if f != current:
                previous, current = current, f
            n = begun.setdefault(f, {"forward": 0, "backward": 0})
            n[kind] += 1
            late = previous is not None and n[kind] <= prof.warmup
            if late:
                gpu.lock_sm_clock(previous, previous)
            run_computation(sim, gpu, work, kind)
            if late:
                gpu.lock_sm_clock(f, f)
            prof.on_instruction_end(kind, mb)
            sim.advance(GAP_S)
    measured = prof.profile()
    assert prof.attributed == sorted(clocks)
    truth = profile_simulated(Simulator("A100"), [work], frequencies=clocks)
    for kind in ("forward", "backward"):
        for g, w in zip(measured.of(0, kind), truth.of(0, kind), strict=True):
            assert g.energy_j == pytest.approx(w.energy_j, rel=0.01)


def test_without_enough_counter_updates_energies_come_from_the_windows(rig) -> None:
    sim, mon, guard = rig
    gpu = sim.gpus[0]
    prof = StageProfiler(mon, stage=0, gpu=0, frequencies=[1410, 1200], min_span_s=0, guard=guard)
    train(sim, gpu, WORK[0], prof, stage_order(2, 4, 0))  # about 0.4 s per clock: 4 counter updates
    assert prof.attributed == [] and prof.blocking_power_w is None
    means = {}
    for s in prof.measured():
        means.setdefault((s.computation, s.frequency), []).append(s.energy_j)
    rows = prof.rows()
    assert len(rows) == 4
    truth = profile_simulated(Simulator("A100"), [WORK[0]], frequencies=[1410, 1200])
    for _, kind, f, _, e in rows:
        assert e == pytest.approx(sum(means[(kind, f)]) / len(means[(kind, f)]))
        # 30-60 ms windows on a 100 ms counter: each edge estimated, up to about 30 % off
        (want,) = [o.energy_j for o in truth.of(0, kind) if o.frequency == f]
        assert e == pytest.approx(want, rel=0.35)


@pytest.mark.parametrize(("gap_s", "attributed"), [(0.0045, True), (0.005, False)])
def test_work_in_step_with_the_counter_stays_longer_then_warns(rig, caplog, gap_s: float,
                                                               attributed: bool) -> None:
    # A forward (30 ms), a backward (60 ms) and two gaps: a cycle of 99 or 100 ms at 1410 MHz,
    # the A100 counter's period. Every counter interval then holds about the same mix of work,
    # which the fit cannot split. At 99 ms the mix drifts: staying longer at the clock splits
    # it. At exactly 100 ms it never does: the windows' energies are kept, with a warning.
    sim, mon, guard = rig
    gpu = sim.gpus[0]
    prof = StageProfiler(mon, stage=0, gpu=0, frequencies=[1410], guard=guard)
    work = StageWork(0.030, 0.060)
    with caplog.at_level("WARNING", logger="joules"):
        while not prof.done:
            for kind, mb in stage_order(1, 8, 0):
                prof.on_instruction_begin(kind, mb)
                run_computation(sim, gpu, work, kind)
                prof.on_instruction_end(kind, mb)
                sim.advance(gap_s)
    assert (prof.attributed == [1410]) is attributed
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert bool(warned) is not attributed
    if not attributed:
        assert "do not tell forwards, backwards and gaps apart" in warned[0] and "1410 MHz" in warned[0]
    else:
        truth = profile_simulated(Simulator("A100"), [work], frequencies=[1410])
        for kind in ("forward", "backward"):
            (got,), (want,) = prof.profile().of(0, kind), truth.of(0, kind)
            assert got.energy_j == pytest.approx(want.energy_j, rel=0.01)


def test_clocks_are_locked_from_the_highest_down_and_warmup_is_left_out(rig) -> None:
    sim, mon, guard = rig
    gpu = sim.gpus[0]
    seen: list[tuple[float, float] | None] = []
    prof = StageProfiler(mon, stage=0, gpu=0, frequencies=[1410, 1005, 1200, 1199], warmup=2, samples=2,
                         min_span_s=0, guard=guard)
    assert prof.frequencies == (1410.0, 1200.0, 1005.0)  # snapped to supported clocks, repeats once
    order = stage_order(2, 2, 0)  # F0 F1 B0 B1 per iteration: 2 of each kind
    for _ in range(6):
        for kind, mb in order:
            if prof.done:
                break
            seen.append((prof.on_instruction_begin(kind, mb), gpu.sm_clock_mhz()))
            run_computation(sim, gpu, WORK[0], kind)
            prof.on_instruction_end(kind, mb)
    assert prof.done
    assert all(want == got for want, got in seen)  # the GPU ran at the clock being profiled
    kept = prof.measured()
    # 2 warm-up and 2 kept of each kind per clock; the pipeline's order makes forwards run ahead.
    assert [(s.frequency, s.computation) for s in kept].count((1200, "forward")) == 2
    assert [s.frequency for s in kept] == sorted((s.frequency for s in kept), reverse=True)
    assert len(kept) == 3 * 2 * 2


def test_a_partial_run_profiles_the_clocks_done_and_close_resets(rig) -> None:
    sim, mon, guard = rig
    gpu = sim.gpus[0]
    clocks = [1410, 1200, 1005]
    with StageProfiler(mon, stage=0, gpu=0, frequencies=clocks, min_span_s=0, guard=guard) as prof:
        with pytest.raises(ProfilingError, match="no clock measured in full"):
            prof.profile()
        order = stage_order(1, 4, 0)
        for kind, mb in order + order[:3]:  # one clock in full, part of the next
            prof.on_instruction_begin(kind, mb)
            run_computation(sim, gpu, WORK[0], kind)
            prof.on_instruction_end(kind, mb)
        assert gpu.sm_clock_locked() == (1200.0, 1200.0)
        assert sorted({o.frequency for o in prof.profile().of(0, "forward")}) == [1410]
    assert gpu.sm_clock_locked() is None
    assert prof.done and mon.open_windows == []
    assert prof.progress == (1, 3)
    assert {s.frequency for s in prof.measured()} == {1410, 1200}  # a 1200 MHz forward was kept...
    assert sorted({o.frequency for o in prof.profile().of(0, "forward")}) == [1410]  # ...but not profiled
    assert prof.on_instruction_begin("forward", 0) is None and gpu.sm_clock_locked() is None


def test_an_exception_in_training_resets_the_clock(rig) -> None:
    sim, mon, guard = rig
    gpu = sim.gpus[0]
    with pytest.raises(RuntimeError, match="out of memory"):
        with StageProfiler(mon, stage=0, gpu=0, frequencies=[1200], guard=guard) as prof:
            prof.on_instruction_begin("forward", 0)
            assert gpu.sm_clock_locked() == (1200.0, 1200.0)
            raise RuntimeError("CUDA out of memory")
    assert gpu.sm_clock_locked() is None
    assert mon.open_windows == []


def test_the_clock_is_reset_even_when_the_monitor_was_closed_first(rig) -> None:
    sim, mon, guard = rig
    gpu = sim.gpus[0]
    # Training crashes mid-computation, and a ``finally`` closed the monitor before the profiler.
    with pytest.raises(RuntimeError, match="crashed"):
        with StageProfiler(mon, stage=0, gpu=0, frequencies=[1200], guard=guard) as prof:
            prof.on_instruction_begin("forward", 0)
            mon.close()
            raise RuntimeError("training crashed")
    assert gpu.sm_clock_locked() is None
    # A monitor that refuses the window right after the clock was locked.
    with pytest.raises(Exception, match="the monitor is closed"):
        with StageProfiler(mon, stage=0, gpu=0, frequencies=[1200], guard=guard) as prof:
            prof.on_instruction_begin("forward", 0)
    assert gpu.sm_clock_locked() is None


def test_dry_run_never_locks_and_has_no_profile(rig) -> None:
    sim, mon, _ = rig
    gpu = sim.gpus[0]
    prof = StageProfiler(mon, stage=0, gpu=0, frequencies=[1410, 1200], min_span_s=0, dry_run=True)
    train(sim, gpu, WORK[0], prof, stage_order(1, 4, 0))
    assert gpu.sm_clock_locked() is None
    assert prof.would_lock == [1410.0, 1200.0]
    assert len(prof.measured()) == 12
    with pytest.raises(ProfilingError, match="dry run"):
        prof.profile()


def test_driven_wrongly_or_set_up_wrongly_it_says_so(rig) -> None:
    sim, mon, guard = rig
    prof = StageProfiler(mon, stage=0, gpu=0, frequencies=[1200], guard=guard)
    with pytest.raises(ProfilingError, match="ended, but nothing was running"):
        prof.on_instruction_end("forward", 0)
    prof.on_instruction_begin("forward", 0)
    with pytest.raises(ProfilingError, match="began while forward 0 was still running"):
        prof.on_instruction_begin("backward", 0)
    with pytest.raises(ProfilingError, match="backward 1 ended, but forward 0 was running"):
        prof.on_instruction_end("backward", 1)
    prof.close()
    with pytest.raises(ValueError, match="pass gpu="):
        StageProfiler(mon, stage=0)
    with pytest.raises(ValueError, match="does not measure GPU 5"):
        StageProfiler(mon, stage=0, gpu=5)
    with pytest.raises(ValueError, match="stage must be"):
        StageProfiler(mon, stage=-1, gpu=0)
    with pytest.raises(ValueError, match="samples"):
        StageProfiler(mon, stage=0, gpu=0, samples=0)
    with pytest.raises(ValueError, match="no supported SM clock at or above 5000"):
        default_frequencies(sim.gpus[0], lowest_mhz=5000)


def test_rank_profiles_merge_and_plan(rig, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sim, mon, guard = rig
    paths = []
    for stage in (0, 1):
        prof = StageProfiler(mon, stage=stage, gpu=stage, step=8, guard=guard)
        train(sim, sim.gpus[stage], WORK[stage], prof, stage_order(2, 4, stage))
        paths.append(tmp_path / f"rank{stage}.csv")
        prof.to_csv(paths[-1])
    merged = PipelineProfile.merge([PipelineProfile.from_csv(p) for p in paths])
    merged.check_covers(2)
    with pytest.raises(PipelineProfileError, match="both have backward rows for stage 0"):
        PipelineProfile.merge([PipelineProfile.from_csv(paths[0])] * 2)
    out = tmp_path / "plans"
    args = ["pipeline", "plan", "--stages", "2", "--microbatches", "4", "--out", str(out)]
    assert main([*args, "--profile", str(paths[0]), "--profile", str(paths[1]), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["energy_at_min_time_j"] < summary["max_frequency_energy_j"]
    assert PipelineProfile.from_csv(out / "profile.csv").options == merged.options
    assert main([*args, "--profile", str(paths[0]), "--profile", str(paths[0])]) == 2
    assert "both have backward rows for stage 0" in capsys.readouterr().err


CHILD = textwrap.dedent("""
    import sys, time
    from joules.devices.sim import Simulator
    from joules.monitoring.monitor import EnergyMonitor
    from joules.optimizers.pipeline.profiler import StageProfiler

    sim = Simulator("A100", state_file=sys.argv[1])
    prof = StageProfiler(EnergyMonitor(devices=sim.devices(), cpu_indices=[]), stage=0,
                         frequencies=[1410, 1200], min_span_s=0)
    for mb in range(4):
        prof.on_instruction_begin("forward", mb)
        prof.on_instruction_end("forward", mb)
    for mb in range(4):
        prof.on_instruction_begin("backward", mb)
        prof.on_instruction_end("backward", mb)
    prof.on_instruction_begin("forward", 0)  # the second clock, mid-profile
    print("locked", sim.gpus[0].sm_clock_locked(), flush=True)
    while True:
        time.sleep(0.05)
""")


def test_a_stage_done_first_leaves_a_shared_guards_other_clocks_locked(tmp_path: Path) -> None:
    # Stage 0 finishes first; its reset must not unlock stage 1's GPU, whose 900 MHz samples
    # would then run at the top clock (0.050 s) while recorded at 900 MHz (0.074 s).
    sim = Simulator("A100x2")
    monitor = EnergyMonitor(devices=sim.devices(), cpu_indices=[])
    sim.advance(2.0)
    guard = RestoreGuard(sim.gpus, journal_dir=tmp_path, handle_signals=False, recover_stale=False)
    p0 = StageProfiler(monitor, stage=0, gpu=0, frequencies=[1410], min_span_s=0, warmup=1, samples=2,
                       guard=guard)
    p1 = StageProfiler(monitor, stage=1, gpu=1, frequencies=[1410, 900], min_span_s=0, warmup=0, samples=2,
                       guard=guard)

    def run(p: StageProfiler, g: SimGPU, kind: str, mb: int) -> None:
        p.on_instruction_begin(kind, mb)
        g.set_workload(Constant(1.0))
        sim.advance(g.step_time_s(0.05, 0.85, 1.0))
        g.set_workload(Constant(0.0))
        p.on_instruction_end(kind, mb)

    for mb in range(4):
        for p, g in ((p1, sim.gpus[1]), (p0, sim.gpus[0])):
            run(p, g, "forward", mb)
            run(p, g, "backward", mb)
    assert p0.done and p1.done
    slow = [s.time_s for s in p1.measured() if s.frequency == 900 and s.computation == "forward"]
    assert slow == pytest.approx([0.0741] * 2, abs=1e-4)
    assert sim.gpus[0].sm_clock_locked() is None and sim.gpus[1].sm_clock_locked() is None
    assert guard.changed == []


def test_sigterm_mid_profile_resets_the_clock(tmp_path: Path) -> None:
    state, env = sim_child_env(tmp_path)
    p = start_ready([sys.executable, "-c", CHILD, str(state)], env, "locked (1200.0, 1200.0)")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == -signal.SIGTERM, err
    assert Simulator("A100", state_file=state).gpus[0].sm_clock_locked() is None
