"""What the framework-callback tests share: the simulated step, its truth, the checks."""

from __future__ import annotations

import pytest

from joules.devices.sim import Constant, Simulator
from joules.optimizers.power_limit import LimitPoint
from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer, State

WORK_S, CF = 0.2, 0.8  # one training step on the simulated GPU
EVAL_WORK_S = 0.5  # one evaluation batch: must not be counted as training
PRESET_W = 300.0  # what the GPU had before training: comes back at the end


def truth(limit: float) -> LimitPoint:
    """Exact time and energy of one training step at ``limit`` on a simulated A100."""
    sim = Simulator("A100")
    sim.set_workload(Constant(1.0), cpus=False)
    sim.gpus[0].set_power_limit_w(limit)
    e0 = sim.gpus[0].true_energy_j()
    t = sim.run(WORK_S, CF)
    return LimitPoint(limit, t, sim.gpus[0].true_energy_j() - e0)


def check_profiled_chose_and_restored(sim: Simulator, opt: PowerLimitOptimizer,
                                      seen: list[tuple[State, float]]) -> None:
    """The optimizer measured exact points, chose the best, ran at it, and restored the GPU."""
    assert opt.state is State.DONE
    lo, hi = sim.gpus[0].power_limit_range_w()
    assert opt.chosen_limit_w is not None and lo < opt.chosen_limit_w < hi
    assert len(opt.points) >= 3
    # Neither the pauses nor the evaluation work leak into the points.
    for limit, p in opt.points.items():
        t = truth(limit)
        assert p.time_s == pytest.approx(t.time_s, rel=1e-2)
        assert p.energy_j == pytest.approx(t.energy_j, rel=3e-2)
    # The best limit in hindsight among those profiled (the simulated A100's optimum is near 225 W).
    assert opt.chosen_limit_w == min(opt.points, key=lambda x: truth(x).energy_j)
    assert 175.0 <= opt.chosen_limit_w <= 275.0
    # Every step after the choice ran at the chosen limit; there were many of them.
    done = [limit for state, limit in seen if state is State.DONE]
    assert len(done) >= 20 and set(done) == {opt.chosen_limit_w}
    # Training ended: the GPU is back at the limit it had before.
    assert sim.gpus[0].power_limit_w() == PRESET_W
