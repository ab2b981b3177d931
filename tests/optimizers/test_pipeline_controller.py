"""The pipeline frequency controller: locks each computation's clock, and always puts it back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from joules.devices.restore import RestoreGuard
from joules.devices.sim import Simulator
from joules.errors import DevicePermissionError
from joules.optimizers.pipeline.controller import (
    FrequencyController,
    Instruction,
    PlanMismatchError,
    snap_frequency,
)
from joules.optimizers.pipeline.frontier import Frontier, PlanError, evaluate
from joules.optimizers.pipeline.profile import synthetic_profile
from joules.optimizers.pipeline.schedule import build_dag
from joules.testing.processes import sim_child_env, start_ready

JOULES = str(Path(sys.executable).parent / "joules")

# Stage 1 of a 2-stage, 2-microbatch 1F1B pipeline: F0 F1 B0 B1 (A100 clocks are 1410 - 15k MHz).
PLAN = [
    {"computation": "forward", "microbatch": 0, "frequency": 1410},
    {"computation": "forward", "microbatch": 1, "frequency": 1200},
    {"computation": "backward", "microbatch": 0, "frequency": 1200},
    {"computation": "backward", "microbatch": 1, "frequency": 1005},
]


def journals(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json")) if directory.is_dir() else []


@pytest.fixture
def sim() -> Simulator:
    return Simulator("A100x2")


def test_locks_each_planned_clock_in_order_and_skips_repeats(sim: Simulator, tmp_path: Path) -> None:
    gpu = sim.gpus[0]
    jdir = tmp_path / "journal"
    with FrequencyController(gpu, PLAN, journal_dir=jdir) as ctl:
        for iteration in range(2):
            for ins in PLAN:
                got = ctl.on_instruction_begin(str(ins["computation"]), int(ins["microbatch"]))  # type: ignore[call-overload]
                f = float(ins["frequency"])  # type: ignore[arg-type]
                assert got == f
                assert gpu.sm_clock_locked() == (f, f)  # locked while the computation runs
                assert len(journals(jdir)) == 1  # journaled: a SIGKILL now is healed later
                ctl.on_instruction_end(str(ins["computation"]), int(ins["microbatch"]))  # type: ignore[call-overload]
                assert gpu.sm_clock_locked() == (f, f)
            assert ctl.stats.iterations == iteration + 1
        # 1410, 1200, (1200 skipped), 1005, then 1410, 1200, (skip), 1005 again
        assert ctl.stats.locks_applied == 6
        assert ctl.stats.locks_skipped == 2
        assert ctl.stats.instructions == 8
        assert ctl.stats.out_of_order == 0
        assert [r.frequency_mhz for r in ctl.records] == [1410, 1200, 1005, 1410, 1200, 1005]
        assert all(r.applied for r in ctl.records)
    assert gpu.sm_clock_locked() is None  # the context exit reset the clock
    assert journals(jdir) == []
    assert sim.gpus[1].sm_clock_locked() is None


def test_counts_every_lock_call_on_the_gpu(sim: Simulator, tmp_path: Path, monkeypatch) -> None:
    gpu = sim.gpus[0]
    calls: list[tuple[float, float]] = []
    real = gpu.lock_sm_clock
    monkeypatch.setattr(gpu, "lock_sm_clock", lambda lo, hi: (calls.append((lo, hi)), real(lo, hi))[1])
    with FrequencyController(gpu, PLAN, journal_dir=tmp_path) as ctl:
        for ins in PLAN:
            ctl.on_instruction_begin(ins["computation"], ins["microbatch"])  # type: ignore[arg-type]
            ctl.on_instruction_end(ins["computation"], ins["microbatch"])  # type: ignore[arg-type]
    assert calls == [(1410, 1410), (1200, 1200), (1005, 1005)]


def test_frequencies_are_snapped_to_supported_clocks(sim: Simulator, tmp_path: Path) -> None:
    gpu = sim.gpus[0]
    plan = [{"computation": "forward", "microbatch": 0, "frequency": 1203},
            {"computation": "backward", "microbatch": 0, "frequency": 5000},
            {"computation": "forward", "microbatch": 1, "frequency": 100}]
    with FrequencyController(gpu, plan, journal_dir=tmp_path) as ctl:
        assert ctl.on_instruction_begin("forward", 0) == 1200.0
        assert gpu.sm_clock_locked() == (1200.0, 1200.0)
        assert ctl.on_instruction_begin("backward", 0) == 1410.0
        assert ctl.on_instruction_begin("forward", 1) == 210.0
        assert gpu.sm_clock_locked() == (210.0, 210.0)
    assert snap_frequency(1207.5, [1200.0, 1215.0]) == 1215.0  # a tie goes up


def test_dry_run_never_touches_the_gpu(sim: Simulator, tmp_path: Path, monkeypatch) -> None:
    gpu = sim.gpus[0]
    gpu.allow_control = False  # any change would raise
    monkeypatch.setenv("JOULES_STATE_DIR", str(tmp_path))
    ctl = FrequencyController(gpu, PLAN, dry_run=True)
    assert ctl.guard is None
    for ins in PLAN:
        ctl.on_instruction_begin(ins["computation"], ins["microbatch"])  # type: ignore[arg-type]
        ctl.on_instruction_end(ins["computation"], ins["microbatch"])  # type: ignore[arg-type]
    assert gpu.sm_clock_locked() is None
    assert [(r.computation, r.microbatch, r.frequency_mhz, r.applied) for r in ctl.records] == [
        ("forward", 0, 1410.0, False), ("forward", 1, 1200.0, False), ("backward", 1, 1005.0, False)]
    assert (ctl.stats.locks_applied, ctl.stats.locks_skipped) == (3, 1)
    assert ctl.locked_mhz == 1005.0
    assert ctl.restore() == []
    assert journals(tmp_path / "restore") == []


def test_no_permission_raises_a_clear_error_and_changes_nothing(sim: Simulator, tmp_path: Path) -> None:
    gpu = sim.gpus[0]
    gpu.lock_sm_clock(1305.0, 1305.0)  # what the GPU had
    gpu.allow_control = False
    ctl = FrequencyController(gpu, PLAN, journal_dir=tmp_path)
    with pytest.raises(DevicePermissionError) as err:
        ctl.on_instruction_begin("forward", 0)
    msg = str(err.value)
    assert "GPU 0" in msg and "SYS_ADMIN" in msg and "dry_run=True" in msg and "not changed" in msg
    assert gpu.sm_clock_locked() == (1305.0, 1305.0)
    assert ctl.guard is not None and ctl.guard.changed == []
    assert journals(tmp_path) == []
    assert ctl.stats.locks_applied == 0 and ctl.locked_mhz is None


def test_a_failed_lock_leaves_the_computation_not_begun(sim: Simulator, tmp_path: Path) -> None:
    gpu = sim.gpus[0]
    gpu.allow_control = False
    with FrequencyController(gpu, PLAN, journal_dir=tmp_path, strict=True) as ctl:
        with pytest.raises(DevicePermissionError):
            ctl.on_instruction_begin("forward", 0)
        assert ctl.stats.instructions == 0 and ctl.stats.out_of_order == 0
        gpu.allow_control = True  # e.g. permission granted, the job retries the step
        assert ctl.on_instruction_begin("forward", 0) == 1410.0  # not "still running"
        ctl.on_instruction_end("forward", 0)
        assert ctl.stats.instructions == 1 and ctl.stats.locks_applied == 1
    assert gpu.sm_clock_locked() is None


def test_exception_in_the_with_block_restores(sim: Simulator, tmp_path: Path) -> None:
    gpu = sim.gpus[0]
    with pytest.raises(RuntimeError, match="training crashed"):
        with FrequencyController(gpu, PLAN, journal_dir=tmp_path) as ctl:
            ctl.on_instruction_begin("forward", 0)
            ctl.on_instruction_begin("forward", 1)
            assert gpu.sm_clock_locked() == (1200.0, 1200.0)
            raise RuntimeError("training crashed")
    assert gpu.sm_clock_locked() is None
    assert journals(tmp_path) == []
    assert ctl.stats.restores == 1


def test_restore_then_go_on_locks_again(sim: Simulator, tmp_path: Path) -> None:
    gpu = sim.gpus[0]
    ctl = FrequencyController(gpu, PLAN, journal_dir=tmp_path)
    ctl.on_instruction_begin("forward", 0)
    assert ctl.restore() == []
    assert gpu.sm_clock_locked() is None and ctl.locked_mhz is None
    ctl.on_instruction_begin("forward", 0)  # same frequency as before the restore: not skipped
    assert gpu.sm_clock_locked() == (1410.0, 1410.0)
    assert ctl.close() == []
    assert gpu.sm_clock_locked() is None
    assert ctl.stats.restores == 2 and ctl.stats.locks_skipped == 0


def test_shared_guard_restores_every_stage(tmp_path: Path) -> None:
    sim = Simulator("A100x2")
    guard = RestoreGuard(sim.gpus, journal_dir=tmp_path, handle_signals=False)
    a = FrequencyController(sim.gpus[0], PLAN, guard=guard)
    b = FrequencyController(sim.gpus[1], PLAN, guard=guard)
    a.on_instruction_begin("forward", 1)
    b.on_instruction_begin("backward", 1)
    assert [g.sm_clock_locked() for g in sim.gpus] == [(1200.0, 1200.0), (1005.0, 1005.0)]
    assert [c.index for c in guard.changed] == [0, 1]
    a.restore()
    assert [g.sm_clock_locked() for g in sim.gpus] == [None, None]


def test_a_clock_another_controller_locked_on_the_gpu_is_locked_again(tmp_path: Path) -> None:
    # Two stages on one GPU (two ranks, or MIG instances of it) sharing a guard: a skip of a
    # repeated clock must not trust a lock that the other one has since replaced.
    sim = Simulator("A100")
    gpu = sim.gpus[0]
    guard = RestoreGuard([gpu], journal_dir=tmp_path, handle_signals=False)
    fast = [{"computation": k, "microbatch": 0, "frequency": 1410} for k in ("forward", "backward")]
    slow = [{"computation": k, "microbatch": 0, "frequency": 1005} for k in ("forward", "backward")]
    a = FrequencyController(gpu, fast, guard=guard)
    b = FrequencyController(gpu, slow, guard=guard)
    a.on_instruction_begin("forward", 0)
    a.on_instruction_end("forward", 0)
    b.on_instruction_begin("forward", 0)
    b.on_instruction_end("forward", 0)
    assert a.locked_mhz is None  # its lock was replaced
    assert a.on_instruction_begin("backward", 0) == 1410.0
    assert gpu.sm_clock_locked() == (1410.0, 1410.0) and a.stats.locks_skipped == 0
    a.on_instruction_end("backward", 0)
    assert a.on_instruction_begin("forward", 0) == 1410.0 and a.stats.locks_skipped == 1
    guard.restore()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_clock_reset_through_a_shared_guard_is_locked_again(tmp_path: Path, asynchronous: bool) -> None:
    sim = Simulator("A100x2")
    guard = RestoreGuard(sim.gpus, journal_dir=tmp_path, handle_signals=False)
    a = FrequencyController(sim.gpus[0], PLAN, guard=guard, asynchronous=asynchronous)
    b = FrequencyController(sim.gpus[1], PLAN, guard=guard, asynchronous=asynchronous)
    try:
        for ctl in (a, b):
            ctl.on_instruction_begin("forward", 1)  # 1200
            ctl.flush(timeout=10)
            ctl.on_instruction_end("forward", 1)
        a.restore()  # e.g. stage 0 pauses between runs: the guard resets both GPUs
        assert [g.sm_clock_locked() for g in sim.gpus] == [None, None]
        b_locked_after_restore = b.locked_mhz
        for ctl in (a, b):
            assert ctl.on_instruction_begin("backward", 0) == 1200.0  # the clock b had locked before
            ctl.flush(timeout=10)
        assert [g.sm_clock_locked() for g in sim.gpus] == [(1200.0, 1200.0)] * 2
        assert b.stats.locks_skipped == 0 and b.stats.locks_applied == 2
        assert b_locked_after_restore is None and b.locked_mhz == 1200.0
        b.on_instruction_end("backward", 0)
        guard.restore()  # the guard's own restore too
        assert b.on_instruction_begin("forward", 1) == 1200.0
        b.flush(timeout=10)
        assert sim.gpus[1].sm_clock_locked() == (1200.0, 1200.0)
        assert b.stats.locks_skipped == 0
        b.on_instruction_end("forward", 1)
        assert b.on_instruction_begin("backward", 0) == 1200.0  # nothing reset it: skipped
        assert b.stats.locks_skipped == 1
        a.close()
        b.close()
        assert [g.sm_clock_locked() for g in sim.gpus] == [None, None]
    finally:
        a.restore()
        b.restore()

def test_lookup_by_computation_tolerates_another_order(sim: Simulator, tmp_path: Path) -> None:
    gpu = sim.gpus[0]
    with FrequencyController(gpu, PLAN, journal_dir=tmp_path) as ctl:
        assert ctl.on_instruction_begin("B", 1) == 1005.0  # aliases: F/B, fwd/bwd
        assert gpu.sm_clock_locked() == (1005.0, 1005.0)
        ctl.on_instruction_end("bwd", 1)
        assert ctl.on_instruction_begin("FWD", 0) == 1410.0  # after the last one: in order
        ctl.on_instruction_end("forward", 1)  # not the one running
        assert ctl.stats.out_of_order == 2
        assert ctl.frequency_of("backward", 0) == 1200.0
        with pytest.raises(PlanMismatchError, match="no forward of microbatch 7"):
            ctl.on_instruction_begin("forward", 7)
        for odd in (0.5, "x", True):  # not a microbatch of the plan (True is not 1)
            with pytest.raises(PlanMismatchError, match=f"no forward of microbatch {odd}"):
                ctl.on_instruction_begin("forward", odd)  # type: ignore[arg-type]
        with pytest.raises(PlanMismatchError, match="unknown computation 'optimizer'"):
            ctl.on_instruction_begin("optimizer", 0)


def test_strict_order(sim: Simulator, tmp_path: Path) -> None:
    with FrequencyController(sim.gpus[0], PLAN, journal_dir=tmp_path, strict=True) as ctl:
        ctl.on_instruction_begin("forward", 0)
        with pytest.raises(PlanMismatchError, match="forward 0 was running"):
            ctl.on_instruction_end("forward", 1)
        ctl.on_instruction_end("forward", 0)
        with pytest.raises(PlanMismatchError, match="plan's next computation is forward 1"):
            ctl.on_instruction_begin("backward", 0)
        assert sim.gpus[0].sm_clock_locked() == (1410.0, 1410.0)
        ctl.on_instruction_begin("forward", 1)
        with pytest.raises(PlanMismatchError, match="forward 1 was still running .no on_instruction_end"):
            ctl.on_instruction_begin("backward", 0)  # forward 1's end never came
    with FrequencyController(sim.gpus[0], PLAN, journal_dir=tmp_path) as ctl:  # not strict: counted
        ctl.on_instruction_begin("forward", 0)
        ctl.on_instruction_begin("forward", 1)
        assert ctl.stats.out_of_order == 1


def test_a_strict_controller_goes_on_after_an_iteration_cut_short(sim: Simulator, tmp_path: Path) -> None:
    ctl = FrequencyController(sim.gpus[0], PLAN, journal_dir=tmp_path, strict=True)
    with pytest.raises(RuntimeError, match="out of memory"), ctl:
        ctl.on_instruction_begin("forward", 0)
        ctl.on_instruction_end("forward", 0)
        ctl.on_instruction_begin("forward", 1)
        raise RuntimeError("out of memory")  # between begin and end
    with ctl:  # the same iteration again, from its first computation
        for i in PLAN:
            ctl.on_instruction_begin(str(i["computation"]), int(i["microbatch"]))  # type: ignore[call-overload]
            ctl.on_instruction_end(str(i["computation"]), int(i["microbatch"]))  # type: ignore[call-overload]
    assert ctl.stats.iterations == 1 and sim.gpus[0].sm_clock_locked() is None


def test_another_pipelines_plan_is_named_once(sim: Simulator, tmp_path: Path, caplog) -> None:
    with FrequencyController(sim.gpus[0], PLAN, journal_dir=tmp_path) as ctl, caplog.at_level("WARNING"):
        for kind, mb in (("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)):  # GPipe order
            ctl.on_instruction_begin(kind, mb)
            ctl.on_instruction_end(kind, mb)
    assert ctl.stats.out_of_order == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "backward 0 began, but the plan's next computation is forward 1" in warnings[0]


def test_the_first_begin_out_of_order_is_named_after_other_mismatches(
        sim: Simulator, tmp_path: Path, caplog) -> None:
    with FrequencyController(sim.gpus[0], PLAN, journal_dir=tmp_path) as ctl, caplog.at_level("WARNING"):
        ctl.on_instruction_begin("forward", 0)
        ctl.on_instruction_end("forward", 1)  # a mismatched end: counted first
        assert ctl.stats.out_of_order == 1
        ctl.on_instruction_begin("backward", 1)  # out of the plan's order
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "backward 1 began, but the plan's next computation is forward 1" in warnings[0]


def test_set_plan_switches_at_the_next_instruction(sim: Simulator, tmp_path: Path) -> None:
    gpu = sim.gpus[0]
    slower = [Instruction(str(i["computation"]), int(i["microbatch"]), 900)  # type: ignore[arg-type, call-overload]
              for i in PLAN]
    with FrequencyController(gpu, PLAN, journal_dir=tmp_path, strict=True) as ctl:
        ctl.on_instruction_begin("forward", 0)
        ctl.on_instruction_end("forward", 0)
        ctl.set_plan(slower)  # a straggler: every pipeline slows down
        assert gpu.sm_clock_locked() == (1410.0, 1410.0)  # nothing changes until the next one
        ctl.on_instruction_begin("forward", 1)  # still in order
        assert gpu.sm_clock_locked() == (900.0, 900.0)
        assert ctl.stats.plan_switches == 1
        assert [i.to_dict() for i in ctl.instructions] == [i.to_dict() for i in slower]


@pytest.mark.parametrize("bad, match", [
    ([], "no instructions"),
    ([PLAN[0], PLAN[0]], "listed twice"),
    ([{"computation": "forward", "microbatch": 0}], "malformed"),
    ([{"computation": "sideways", "microbatch": 0, "frequency": 1000}], "malformed"),
    ([{"computation": "forward", "microbatch": 0, "frequency": -5}], "positive frequency"),
    ([{"computation": "forward", "microbatch": 1.7, "frequency": 1410}], "microbatch 1.7 is not a whole"),
])
def test_bad_plans_are_rejected(sim: Simulator, bad: list[dict[str, object]], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        FrequencyController(sim.gpus[0], bad, dry_run=True)


def test_from_frontier_and_from_rank_file(sim: Simulator, tmp_path: Path) -> None:
    dag = build_dag("1f1b", 2, 2)
    profile = synthetic_profile(2)
    fast = evaluate(dag, profile, [1410] * len(dag.nodes), 85.0)
    slow = evaluate(dag, profile, [1200] * len(dag.nodes), 85.0)
    frontier = Frontier(dag, [fast, slow], fast, 85.0, 0.001)
    ctl = FrequencyController.from_frontier(frontier, 1, sim.gpus[1], dry_run=True)
    assert [i.to_dict() for i in ctl.instructions] == frontier.rank_plan(fast, 1)
    ctl = FrequencyController.from_frontier(frontier, 1, sim.gpus[1], time_s=slow.time_s * 1.01, dry_run=True)
    assert [i.to_dict() for i in ctl.instructions] == frontier.rank_plan(slow, 1)
    assert ctl.on_instruction_begin("forward", 0) == 1200.0
    frontier.save(tmp_path)
    ctl = FrequencyController.from_file(tmp_path / "rank0.json", sim.gpus[0], dry_run=True)
    assert [i.to_dict() for i in ctl.instructions] == frontier.rank_plan(fast, 0)
    (tmp_path / "bad.json").write_text(json.dumps({"stage": 0}))
    with pytest.raises(PlanError, match="instructions"):
        FrequencyController.from_file(tmp_path / "bad.json", sim.gpus[0], dry_run=True)


def test_from_rank_file_checks_the_stage(sim: Simulator, tmp_path: Path) -> None:
    dag = build_dag("1f1b", 2, 2)
    profile = synthetic_profile(2)
    fast = evaluate(dag, profile, [1410] * len(dag.nodes), 85.0)
    frontier = Frontier(dag, [fast], fast, 85.0, 0.001)
    frontier.save(tmp_path)
    ctl = FrequencyController.from_file(tmp_path / "rank1.json", sim.gpus[1], stage=1, dry_run=True)
    assert [i.to_dict() for i in ctl.instructions] == frontier.rank_plan(fast, 1)
    rank = json.loads((tmp_path / "rank1.json").read_text())
    assert rank["schedule"] == "1f1b" and rank["microbatches"] == 2
    rank1 = tmp_path / "rank1.json"
    FrequencyController.from_file(rank1, sim.gpus[1], stage=1, microbatches=2, dry_run=True)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(PlanMismatchError, match=r"plans 2 microbatches per iteration, but this rank runs 4"):
        FrequencyController.from_file(rank1, sim.gpus[1], stage=1, microbatches=4, asynchronous=True,
                                      journal_dir=tmp_path / "restore")
    assert signal.getsignal(signal.SIGTERM) == handler  # no controller was left behind
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe[]")
    with pytest.raises(PlanError, match=r"binary\.json: not JSON \(UnicodeDecodeError"):
        FrequencyController.from_file(tmp_path / "binary.json", sim.gpus[1], dry_run=True)
    with pytest.raises(PlanMismatchError, match=r"rank0\.json is the plan of stage 0, but this rank runs "
                                                r"stage 1; load rank1\.json"):
        FrequencyController.from_file(tmp_path / "rank0.json", sim.gpus[1], stage=1, dry_run=True)
    (tmp_path / "list.json").write_text(json.dumps(frontier.rank_plan(fast, 1)))
    with pytest.raises(PlanMismatchError, match=r"list\.json records no stage"):
        FrequencyController.from_file(tmp_path / "list.json", sim.gpus[1], stage=1, dry_run=True)
    unchecked = FrequencyController.from_file(tmp_path / "list.json", sim.gpus[1], dry_run=True)
    assert len(unchecked.instructions) == 4
    odd = {"stage": "1", "instructions": frontier.rank_plan(fast, 1)}
    (tmp_path / "odd.json").write_text(json.dumps(odd))
    with pytest.raises(PlanError, match="malformed stage '1'"):
        FrequencyController.from_file(tmp_path / "odd.json", sim.gpus[1], stage=1, dry_run=True)
    # The number of stages: a plan for 2 stages run on a pipeline of 4 (or another count).
    assert rank["stages"] == 2
    FrequencyController.from_file(rank1, sim.gpus[1], stage=1, stages=2, dry_run=True)
    with pytest.raises(PlanMismatchError, match=r"rank1\.json is a plan for 2 stages, but this pipeline has"):
        FrequencyController.from_file(rank1, sim.gpus[1], stage=1, stages=4, dry_run=True)
    with pytest.raises(PlanMismatchError, match=r"odd\.json records no number of stages"):
        FrequencyController.from_file(tmp_path / "odd.json", sim.gpus[1], stages=2, dry_run=True)


# -- real processes: what a job leaves when it ends, is stopped, or is killed -----------------

CHILD = textwrap.dedent("""
    import json, sys, time
    from joules.devices.sim import Simulator
    from joules.optimizers.pipeline.controller import FrequencyController

    sim = Simulator("A100", state_file=sys.argv[1])
    ctl = FrequencyController(sim.gpus[0], json.loads(sys.argv[2]))
    ctl.on_instruction_begin("forward", 0)
    ctl.on_instruction_end("forward", 0)
    ctl.on_instruction_begin("forward", 1)  # mid-plan
    print("locked", ctl.locked_mhz, flush=True)
    while True:
        time.sleep(0.05)
""")


def _lock(state: Path) -> tuple[float, float] | None:
    return Simulator("A100", state_file=state).gpus[0].sm_clock_locked()


@pytest.fixture
def job(tmp_path: Path):
    state, env = sim_child_env(tmp_path)

    def start() -> subprocess.Popen[str]:
        p = start_ready([sys.executable, "-c", CHILD, str(state), json.dumps(PLAN)], env, "locked 1200.0")
        assert _lock(state) == (1200.0, 1200.0)
        return p

    return state, env, tmp_path / "joules-state" / "restore", start


def test_sigterm_mid_plan_restores(job) -> None:
    state, _, jdir, start = job
    p = start()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == -signal.SIGTERM, err
    assert _lock(state) is None
    assert journals(jdir) == []


@pytest.mark.parametrize("how", ["guard", "cli"])
def test_sigkill_mid_plan_is_healed_later(job, how: str) -> None:
    state, env, jdir, start = job
    p = start()
    p.kill()
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert _lock(state) == (1200.0, 1200.0)  # SIGKILL cannot be caught: the clock stays locked...
    [journal] = journals(jdir)
    assert json.loads(journal.read_text())["gpus"][0]["sm_clock_locked"] is True
    if how == "guard":  # ...but the next guard on that GPU resets it
        guard = RestoreGuard(Simulator("A100", state_file=state).gpus, journal_dir=jdir, recover_stale=True)
        assert len(guard.recovered) == 1 and "SM clock unlocked" in guard.recovered[0]
    else:  # ...or `joules restore`
        r = subprocess.run([JOULES, "restore", "--sim", "A100"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert "SM clock unlocked" in r.stdout
    assert _lock(state) is None
    assert journals(jdir) == []


# -- asynchronous locking ----------------------------------------------------------------------

def test_asynchronous_locks_land_in_the_background_and_restore_stops_the_thread(
        sim: Simulator, tmp_path: Path) -> None:
    gpu = sim.gpus[0]
    ctl = FrequencyController(gpu, PLAN, journal_dir=tmp_path, asynchronous=True)
    for ins in PLAN:
        kind, mb, f = str(ins["computation"]), int(ins["microbatch"]), float(ins["frequency"])  # type: ignore[call-overload, arg-type]
        assert ctl.on_instruction_begin(kind, mb) == f
        ctl.flush(timeout=10)
        assert gpu.sm_clock_locked() == (f, f)
        ctl.on_instruction_end(kind, mb)
    assert ctl.stats.locks_applied == 3 and ctl.stats.locks_skipped == 1  # 1200 twice in a row
    thread = ctl._thread
    assert thread is not None and thread.is_alive()
    ctl.restore()
    assert gpu.sm_clock_locked() is None
    assert not thread.is_alive()
    ctl.on_instruction_begin("forward", 0)  # goes on after a restore, with a new thread
    ctl.flush(timeout=10)
    assert gpu.sm_clock_locked() == (1410.0, 1410.0)
    ctl.restore()


def test_asynchronous_begin_does_not_wait_for_a_slow_driver(
        sim: Simulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    gpu = sim.gpus[0]
    ctl = FrequencyController(gpu, PLAN, journal_dir=tmp_path, asynchronous=True)
    assert ctl.guard is not None
    release = threading.Event()
    entered = threading.Event()
    real = ctl.guard.lock_sm_clock

    def slow(g, lo, hi):  # type: ignore[no-untyped-def]
        entered.set()
        assert release.wait(10)
        real(g, lo, hi)

    monkeypatch.setattr(ctl.guard, "lock_sm_clock", slow)
    ctl.on_instruction_begin("forward", 0)  # returns although the driver call is stuck
    assert entered.wait(10)
    assert gpu.sm_clock_locked() is None
    ctl.on_instruction_begin("forward", 1)  # 1200: posted while 1410 is being applied...
    ctl.on_instruction_begin("backward", 1)  # ...and superseded by 1005 before it lands
    assert ctl.stats.locks_dropped == 1
    release.set()
    ctl.flush(timeout=10)
    assert gpu.sm_clock_locked() == (1005.0, 1005.0)  # the latest clock asked for
    assert [r.frequency_mhz for r in ctl.records] == [1410.0, 1005.0]
    ctl.restore()
    assert gpu.sm_clock_locked() is None


def test_asynchronous_permission_error_reaches_the_training_thread(tmp_path: Path) -> None:
    from joules.devices.sim.gpu import SimGPU

    sim = Simulator("A100")
    locked = SimGPU(sim.gpus[0].model, sim.clock, index=0, allow_control=False)
    ctl = FrequencyController(locked, PLAN, journal_dir=tmp_path, asynchronous=True)
    ctl.on_instruction_begin("forward", 0)
    with pytest.raises(DevicePermissionError, match="SYS_ADMIN"):
        ctl.flush(timeout=10)
    assert locked.sm_clock_locked() is None
    ctl.restore()


def _fail_at(ctl: FrequencyController, mhz: float, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Make ``ctl``'s locks to ``mhz`` fail as without permission; the event returned is set at each try."""
    import threading

    assert ctl.guard is not None
    tried = threading.Event()
    real = ctl.guard.lock_sm_clock

    def lock(g, lo, hi):  # type: ignore[no-untyped-def]
        if lo == mhz:
            tried.set()
            raise DevicePermissionError(f"GPU {g.index}: no permission to change SM clocks")
        real(g, lo, hi)

    monkeypatch.setattr(ctl.guard, "lock_sm_clock", lock)
    return tried


def test_asynchronous_lock_failing_last_is_raised_at_the_end_of_the_with_block(
        sim: Simulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = sim.gpus[0]
    with pytest.raises(DevicePermissionError, match="no permission"):
        with FrequencyController(gpu, PLAN, journal_dir=tmp_path, asynchronous=True) as ctl:
            tried = _fail_at(ctl, 1200.0, monkeypatch)
            ctl.on_instruction_begin("forward", 0)
            ctl.flush(timeout=10)
            assert gpu.sm_clock_locked() == (1410.0, 1410.0)
            ctl.on_instruction_begin("forward", 1)  # the last lock: fails in the background
            assert tried.wait(10)
    assert gpu.sm_clock_locked() is None  # reset all the same
    assert journals(tmp_path) == []
    assert ctl._thread is None
    assert ctl.close() == []  # raised once


def test_asynchronous_lock_failure_at_close_and_end_of_instruction(
        sim: Simulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = sim.gpus[0]
    ctl = FrequencyController(gpu, PLAN, journal_dir=tmp_path, asynchronous=True)
    try:
        tried = _fail_at(ctl, 1200.0, monkeypatch)
        ctl.on_instruction_begin("forward", 0)
        ctl.flush(timeout=10)
        ctl.on_instruction_end("forward", 0)
        ctl.on_instruction_begin("forward", 1)
        assert tried.wait(10)
        with ctl._cond:
            assert ctl._cond.wait_for(lambda: ctl._error is not None, 10)
        with pytest.raises(DevicePermissionError):
            ctl.on_instruction_end("forward", 1)
        tried.clear()
        ctl.on_instruction_begin("forward", 0)  # the error was raised once: the controller goes on
        ctl.on_instruction_begin("forward", 1)
        assert tried.wait(10)
        with pytest.raises(DevicePermissionError):
            ctl.close()
        assert gpu.sm_clock_locked() is None and journals(tmp_path) == []
    finally:
        ctl.restore()


def test_asynchronous_lock_failure_does_not_hide_the_blocks_own_exception(
        sim: Simulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    gpu = sim.gpus[0]
    with pytest.raises(RuntimeError, match="training crashed"):
        with FrequencyController(gpu, PLAN, journal_dir=tmp_path, asynchronous=True) as ctl:
            tried = _fail_at(ctl, 1200.0, monkeypatch)
            ctl.on_instruction_begin("forward", 0)
            ctl.flush(timeout=10)
            ctl.on_instruction_begin("forward", 1)
            assert tried.wait(10)
            raise RuntimeError("training crashed")
    assert gpu.sm_clock_locked() is None
    assert "a clock lock also failed in the background" in caplog.text
    assert "no permission" in caplog.text


ASYNC_CHILD = textwrap.dedent("""
    import json, sys
    from joules.devices.sim import Simulator
    from joules.optimizers.pipeline.controller import FrequencyController

    sim = Simulator("A100", state_file=sys.argv[1])
    ctl = FrequencyController(sim.gpus[0], json.loads(sys.argv[2]), asynchronous=True)
    ctl.on_instruction_begin("forward", 1)
    ctl.flush(timeout=10)
    print("locked", sim.gpus[0].sm_clock_locked(), flush=True)
    ctl.on_instruction_begin("backward", 1)  # posted, and the program ends without restoring
""")


def test_asynchronous_job_ending_without_restore_leaves_no_lock(tmp_path: Path) -> None:
    state, env = sim_child_env(tmp_path)
    r = subprocess.run([sys.executable, "-c", ASYNC_CHILD, str(state), json.dumps(PLAN)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "locked (1200.0, 1200.0)\n"
    assert _lock(state) is None  # the worker stopped before the guard's exit handler restored
    assert journals(tmp_path / "joules-state" / "restore") == []


def test_asynchronous_sigterm_resets_a_clock_locked_by_the_background_thread(
        sim: Simulator, tmp_path: Path) -> None:
    calls: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        gpu = sim.gpus[0]
        with FrequencyController(gpu, PLAN, journal_dir=tmp_path, asynchronous=True) as ctl:
            ctl.on_instruction_begin("forward", 0)
            ctl.flush(timeout=10)
            assert gpu.sm_clock_locked() == (1410.0, 1410.0)
            signal.raise_signal(signal.SIGTERM)
            assert calls == [signal.SIGTERM]  # passed on to the handler that was there
            assert gpu.sm_clock_locked() is None and journals(tmp_path) == []
            ctl.on_instruction_begin("forward", 1)  # training goes on: still protected
            ctl.flush(timeout=10)
            signal.raise_signal(signal.SIGTERM)
            assert gpu.sm_clock_locked() is None and calls == [signal.SIGTERM] * 2
            assert ctl.guard is not None and signal.getsignal(signal.SIGTERM) == ctl.guard._handle_signal
        assert signal.getsignal(signal.SIGTERM) is not ctl.guard._handle_signal  # released at the end
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGTERM] * 3
    finally:
        signal.signal(signal.SIGTERM, before)


def test_asynchronous_controller_used_again_is_protected_again(sim: Simulator, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    ctl = FrequencyController(sim.gpus[0], PLAN, journal_dir=tmp_path, asynchronous=True)
    for _ in range(2):  # one with-block per epoch
        with ctl:
            ctl.on_instruction_begin("forward", 0)
            ctl.flush(timeout=10)
            assert ctl.guard is not None and signal.getsignal(signal.SIGTERM) == ctl.guard._handle_signal
            ctl.on_instruction_end("forward", 0)
        assert signal.getsignal(signal.SIGTERM) == before


ASYNC_WAIT_CHILD = textwrap.dedent("""
    import json, sys, time
    from joules.devices.sim import Simulator
    from joules.optimizers.pipeline.controller import FrequencyController

    sim = Simulator("A100", state_file=sys.argv[1])
    with FrequencyController(sim.gpus[0], json.loads(sys.argv[2]), asynchronous=True) as ctl:
        ctl.on_instruction_begin("forward", 1)
        ctl.flush(timeout=10)
        print("locked", sim.gpus[0].sm_clock_locked(), flush=True)
        while True:
            time.sleep(0.05)
""")


def test_asynchronous_job_stopped_by_sigterm_leaves_no_lock(tmp_path: Path) -> None:
    state, env = sim_child_env(tmp_path)
    p = start_ready([sys.executable, "-c", ASYNC_WAIT_CHILD, str(state), json.dumps(PLAN)], env,
                    "locked (1200.0, 1200.0)")
    try:
        assert _lock(state) == (1200.0, 1200.0)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    assert p.returncode == -signal.SIGTERM, err
    assert _lock(state) is None
    assert journals(tmp_path / "joules-state" / "restore") == []


def test_instruction_objects_are_checked_like_dicts() -> None:
    gpu = Simulator("A100").gpus[0]
    ctl = FrequencyController(gpu, [Instruction("F", 0, 1410), Instruction("B", 0, 1200)], dry_run=True)
    assert ctl.on_instruction_begin("forward", 0) == 1410.0
    ctl.on_instruction_end("forward", 0)
    assert ctl.on_instruction_begin("backward", 0) == 1200.0
    with pytest.raises(PlanError, match="malformed"):
        FrequencyController(gpu, [Instruction("sideways", 0, 1410)], dry_run=True)


def test_one_begin_out_of_order_counts_once(sim: Simulator, tmp_path: Path) -> None:
    # A begin repeated without its end is both "the previous one still running" and "not the
    # plan's next": one mismatch, not two.
    with FrequencyController(sim.gpus[0], PLAN, journal_dir=tmp_path) as ctl:
        ctl.on_instruction_begin("forward", 0)
        ctl.on_instruction_begin("forward", 0)
        assert ctl.stats.out_of_order == 1


def test_a_controller_ending_inside_another_gives_the_clock_back_at_the_outer_ones_frequency(
        tmp_path: Path) -> None:
    """Nested controllers on one GPU, each with its own guard: when the inner one ended, the
    clock stayed at its 1005 MHz, and the outer one, taking it for its own 1410 MHz, never
    locked it again (the GPU ran its plan's computations 30 % slower)."""
    gpu = Simulator("A100").gpus[0]
    outer_plan = [{"computation": c, "microbatch": 0, "frequency": 1410} for c in ("forward", "backward")]
    inner_plan = [{"computation": c, "microbatch": 0, "frequency": 1005} for c in ("forward", "backward")]
    with FrequencyController(gpu, outer_plan, journal_dir=tmp_path) as outer:
        outer.on_instruction_begin("forward", 0)
        outer.on_instruction_end("forward", 0)
        with FrequencyController(gpu, inner_plan, journal_dir=tmp_path) as inner:
            inner.on_instruction_begin("forward", 0)
            assert gpu.sm_clock_locked() == (1005.0, 1005.0)
            inner.on_instruction_end("forward", 0)
        assert gpu.sm_clock_locked() == (1410.0, 1410.0)
        assert outer.on_instruction_begin("backward", 0) == 1410.0
        assert gpu.sm_clock_locked() == (1410.0, 1410.0)
        outer.on_instruction_end("backward", 0)
    assert gpu.sm_clock_locked() is None
    # Three deep: the clock goes to the one that locked last, and the other locks again.
    plans = [[{"computation": c, "microbatch": 0, "frequency": f} for c in ("forward", "backward")]
             for f in (1410, 1200, 1005)]
    with FrequencyController(gpu, plans[0], journal_dir=tmp_path) as a:
        a.on_instruction_begin("forward", 0)
        a.on_instruction_end("forward", 0)
        with FrequencyController(gpu, plans[1], journal_dir=tmp_path) as b:
            b.on_instruction_begin("forward", 0)
            b.on_instruction_end("forward", 0)
            with FrequencyController(gpu, plans[2], journal_dir=tmp_path) as c:
                c.on_instruction_begin("forward", 0)
                c.on_instruction_end("forward", 0)
            assert gpu.sm_clock_locked() == (1200.0, 1200.0)
            b.on_instruction_begin("backward", 0)
            assert gpu.sm_clock_locked() == (1200.0, 1200.0)
            b.on_instruction_end("backward", 0)
        a.on_instruction_begin("backward", 0)
        assert gpu.sm_clock_locked() == (1410.0, 1410.0)
        a.on_instruction_end("backward", 0)
    assert gpu.sm_clock_locked() is None
