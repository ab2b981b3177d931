"""All torch.distributed ranks agree on one power limit from their combined measurements.

Run as a script (``python test_power_limit_distributed.py --launch PORT OUTDIR STORE``), this
file starts the ranks of the real two-process test (gloo backend).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from joules.testing.processes import free_port, run_forked

WORLD = 2
SPECS = ("A100", "V100")  # different GPUs: the ranks must also agree on the candidate limits
CF = (0.9, 0.6)  # and they slow down differently under a lower limit
WORK_S = 0.2


def _truth(rank: int, limit: float) -> tuple[float, float]:
    from joules.devices.sim import Constant, Simulator

    sim = Simulator(SPECS[rank])
    sim.set_workload(Constant(1.0), cpus=False)
    sim.gpus[0].set_power_limit_w(limit)
    e0 = sim.gpus[0].true_energy_j()
    t = sim.run(WORK_S, CF[rank])
    return t, sim.gpus[0].true_energy_j() - e0


def _worker(rank: int, port: int, out: Path, store: Path, shared: bool = False, stall: bool = False) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from joules.devices.sim import Constant, Simulator
    from joules.monitoring.monitor import EnergyMonitor
    from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer, State

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        # shared: both ranks see both GPUs of one node (torchrun without CUDA_VISIBLE_DEVICES)
        sim = Simulator("A100x2" if shared else SPECS[rank])
        sim.set_workload(Constant(1.0), cpus=False)
        monitor = EnergyMonitor(devices=sim.devices())
        opt = PowerLimitOptimizer(monitor, selector="energy", warmup_steps=2, profile_steps=10,
                                  workload="mlp", store=store, handle_signals=False)
        seen = []
        opt.on_train_begin()
        step = 0
        for _epoch in range(4):
            opt.on_epoch_begin()
            for _ in range(60):
                opt.on_step_begin()
                seen.append(sim.gpus[0].power_limit_w())
                if stall and rank == 0 and step == 8:
                    sim.advance(1.0)  # a stall on this rank only: it alone measures steps one by one
                sim.run(WORK_S, CF[0] if shared else CF[rank])
                if stall:
                    dist.all_reduce(torch.ones(64))  # the step's gradient sync, as DDP's
                    if step == 15:
                        opt.pause()  # within the step, on every rank (an accumulation cycle)
                opt.on_step_end()
                step += 1
            opt.on_epoch_end()
        assert opt.state is State.DONE
        opt.on_train_end()
        (out / f"rank{rank}.json").write_text(json.dumps({
            "report": opt.report(), "seen": seen, "after": sim.gpus[0].power_limit_w(),
        }))
    finally:
        dist.destroy_process_group()


def _launch(port: int, out: Path, store: Path, shared: bool, stall: bool) -> int:
    import torch.distributed  # noqa: F401 - imported once here, inherited by every rank

    return run_forked(_worker, [(r, port, out, store, shared, stall) for r in range(WORLD)], timeout_s=60)


def _run_world(out: Path, store: Path, shared: bool = False, stall: bool = False) -> list[dict]:
    out.mkdir()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "JOULES_SIM": "",
           "JOULES_STATE_DIR": str(store.parent)}
    for _attempt in range(2):  # a second try in case another process took the free port
        cmd = [sys.executable, __file__, "--launch", str(free_port()), str(out), str(store)]
        cmd += ["--shared"] if shared else []
        cmd += ["--stall"] if stall else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    pytest.fail(f"distributed workers failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def test_ranks_agree_on_the_limit_from_combined_measurements(tmp_path):
    pytest.importorskip("torch.distributed")
    from joules.optimizers.power_limit import LimitPoint, MinEnergy

    store = tmp_path / "state" / "profiles"
    first = _run_world(tmp_path / "run1", store)
    r0, r1 = (d["report"] for d in first)
    # Same candidates (the limits both GPU models allow), same points, same choice.
    assert r0["limits_w"] == r1["limits_w"]
    assert r0["limits_w"][0] == 300.0 and r0["limits_w"][-1] == 100.0  # V100 max, both mins
    assert r0["points"] == r1["points"] and r0["gpus"] == r1["gpus"] == 2
    assert r0["chosen_limit_w"] == r1["chosen_limit_w"]
    # Each point is the job's: the slower rank's time per step, both GPUs' energy.
    for p in r0["points"]:
        (t0, e0), (t1, e1) = _truth(0, p["limit_w"]), _truth(1, p["limit_w"])
        assert p["time_per_step_s"] == pytest.approx(max(t0, t1), rel=2e-3)
        assert p["energy_per_step_j"] == pytest.approx(e0 + e1, rel=1e-2)
    # The choice is the best in hindsight for the job, and both ranks ran it in lockstep.
    combined = []
    for x in r0["limits_w"]:
        (t0, e0), (t1, e1) = _truth(0, x), _truth(1, x)
        combined.append(LimitPoint(x, max(t0, t1), e0 + e1))
    assert r0["chosen_limit_w"] == MinEnergy().choose(combined).limit_w
    assert first[0]["seen"] == first[1]["seen"]
    assert first[0]["seen"][-1] == r0["chosen_limit_w"]
    assert [d["after"] for d in first] == [400.0, 300.0]  # defaults back after training
    # Only rank 0 saved the profile; the next job reuses it on both ranks.
    assert len(list(store.glob("*.json"))) == 1
    second = _run_world(tmp_path / "run2", store)
    for d in second:
        assert d["report"]["reused_profile"] is True
        assert d["report"]["chosen_limit_w"] == r0["chosen_limit_w"]
        assert set(d["seen"]) == {r0["chosen_limit_w"]}


def test_ranks_stay_in_step_when_only_one_sees_a_stall(tmp_path):
    """A stall on rank 0 alone made it measure steps one window each; a pause within a step then
    dropped a different number of steps on each rank, which reached the limit's end (and its
    collectives) at different steps: gloo failed, or the ranks ran at different limits."""
    pytest.importorskip("torch.distributed")
    r0, r1 = _run_world(tmp_path / "run", tmp_path / "state" / "profiles", stall=True)
    assert r0["seen"] == r1["seen"]  # the same limit at every step, on both ranks
    assert r0["report"]["chosen_limit_w"] == r1["report"]["chosen_limit_w"] is not None


def test_ranks_that_see_the_same_gpus_count_each_once(tmp_path):
    """torchrun on one node sets no CUDA_VISIBLE_DEVICES per rank: every rank sees every GPU."""
    pytest.importorskip("torch.distributed")
    from joules.devices.sim import Constant, Simulator

    runs = _run_world(tmp_path / "run", tmp_path / "state" / "profiles", shared=True)
    r0, r1 = (d["report"] for d in runs)
    assert r0["gpus"] == r1["gpus"] == 2 and r0["points"] == r1["points"]
    for p in r0["points"]:  # the node's two GPUs, once (not once per rank)
        sim = Simulator("A100x2")
        sim.set_workload(Constant(1.0), cpus=False)
        for g in sim.gpus:
            g.set_power_limit_w(p["limit_w"])
        e0 = sum(g.true_energy_j() for g in sim.gpus)
        sim.run(WORK_S, CF[0])
        node_j = sum(g.true_energy_j() for g in sim.gpus) - e0
        assert p["energy_per_step_j"] == pytest.approx(node_j, rel=1e-2)


if __name__ == "__main__" and len(sys.argv) >= 5 and sys.argv[1] == "--launch":
    sys.exit(_launch(int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), "--shared" in sys.argv[5:],
                     "--stall" in sys.argv[5:]))
