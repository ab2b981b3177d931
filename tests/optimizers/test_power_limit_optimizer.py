"""The online power-limit optimizer on simulated GPUs (virtual clock)."""

from __future__ import annotations

import json
import logging

import pytest

from joules.devices.sim import Constant, Simulator
from joules.errors import DevicePermissionError
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.power_limit import LimitPoint, MinCost, MinEnergy, Sweep
from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer, State
from joules.optimizers.power_limit.store import ProfileStore

WORK_S = 0.2
CF = 0.8


@pytest.fixture(autouse=True)
def _state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JOULES_STATE_DIR", str(tmp_path / "state"))


def truth(spec: str, limit: float) -> LimitPoint:
    """Exact time and energy of one step at ``limit`` on every GPU of ``spec``."""
    sim = Simulator(spec)
    sim.set_workload(Constant(1.0), cpus=False)
    for g in sim.gpus:
        g.set_power_limit_w(limit)
    e0 = sum(sim.true_gpu_energy_j().values())
    t = sim.run(WORK_S, CF)
    return LimitPoint(limit, t, sum(sim.true_gpu_energy_j().values()) - e0)


def make(spec: str = "A100", **kw):
    sim = Simulator(spec)
    sim.set_workload(Constant(1.0), cpus=False)
    monitor = EnergyMonitor(devices=sim.devices())
    kw.setdefault("warmup_steps", 3)
    kw.setdefault("profile_steps", 20)
    kw.setdefault("handle_signals", False)
    return sim, monitor, PowerLimitOptimizer(monitor, **kw)


def train(sim, opt, epochs: int, steps: int, eval_s: float = 0.0, limits_seen=None) -> None:
    opt.on_train_begin()
    for _ in range(epochs):
        opt.on_epoch_begin()
        for _ in range(steps):
            opt.on_step_begin()
            if limits_seen is not None:
                limits_seen.append(tuple(g.power_limit_w() for g in sim.gpus))
            sim.run(WORK_S, CF)
            opt.on_step_end()
        opt.on_epoch_end()
        if eval_s:
            sim.set_workload(Constant(0.3), cpus=False)
            sim.advance(eval_s)
            sim.set_workload(Constant(1.0), cpus=False)
    opt.on_train_end()


def test_profiles_then_applies_best_limit_and_restores_previous_limit():
    sim, monitor, opt = make("A100", selector="energy")
    sim.gpus[0].set_power_limit_w(275.0)  # what the admin had set: comes back at the end
    seen: list[tuple[float, ...]] = []
    train(sim, opt, epochs=1, steps=400, limits_seen=seen)

    assert opt.state is State.DONE
    lo, hi = sim.gpus[0].power_limit_range_w()
    assert opt.limits_w[0] == hi and min(opt.limits_w) >= lo
    assert set(opt.points) <= set(opt.limits_w)
    # Measured per-step time and energy agree with the simulator's truth.
    for limit, p in opt.points.items():
        t = truth("A100", limit)
        assert p.time_s == pytest.approx(t.time_s, rel=2e-3)
        assert p.energy_j == pytest.approx(t.energy_j, rel=5e-3)
    # The choice is the best limit in hindsight over the whole grid.
    best = MinEnergy().choose([truth("A100", x) for x in opt.limits_w]).limit_w
    assert opt.chosen_limit_w == best
    assert hi > best > lo
    # Fewer limits than a sweep, and the chosen limit ran for the rest of training.
    assert len(opt.points) < len(opt.limits_w)
    assert seen[-1] == (best,)
    assert sim.gpus[0].power_limit_w() == 275.0


def test_epoch_boundary_in_the_middle_of_a_profile_is_paused_not_measured():
    # 7 steps per epoch and 20 profiled steps: every profile spans several epochs, and each
    # epoch ends with 30 s of evaluation that must not be counted.
    sim, monitor, opt = make("A100", selector="energy", warmup_steps=2)
    train(sim, opt, epochs=60, steps=7, eval_s=30.0)
    assert opt.state is State.DONE
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(truth("A100", limit).time_s, rel=2e-3)
        assert p.energy_j == pytest.approx(truth("A100", limit).energy_j, rel=1e-2)


def test_on_step_begin_is_optional():
    sim, monitor, opt = make("A100", selector="energy")
    opt.on_train_begin()
    while opt.state is not State.DONE:
        sim.run(WORK_S, CF)
        opt.on_step_end()
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(truth("A100", limit).time_s, rel=2e-3)
    opt.on_train_end()


def test_sweep_profiles_every_limit_and_agrees():
    sim, _, opt = make("A100", selector="cost:0.5", search="sweep")
    train(sim, opt, epochs=1, steps=20 * 23 + 50)
    assert list(opt.points) == opt.limits_w
    sim2, _, adaptive = make("A100", selector="cost:0.5")
    train(sim2, adaptive, epochs=1, steps=400)
    assert adaptive.chosen_limit_w == opt.chosen_limit_w
    assert len(adaptive.points) < len(opt.points)


def test_several_gpus_in_one_process_share_the_limit_and_energy_adds_up():
    sim, _, opt = make("A100x2", selector="energy")
    seen: list[tuple[float, ...]] = []
    train(sim, opt, epochs=1, steps=300, limits_seen=seen)
    assert opt.total_gpus == 2
    assert all(a == b for a, b in seen)
    for limit, p in opt.points.items():
        assert p.energy_j == pytest.approx(truth("A100x2", limit).energy_j, rel=5e-3)
    assert [g.power_limit_w() for g in sim.gpus] == [400.0, 400.0]


def test_selectors_time_and_slowdown():
    sim, _, fastest = make("A100", selector="time")
    train(sim, fastest, epochs=1, steps=300)
    assert fastest.chosen_limit_w == 400.0
    sim, _, slow = make("A100", selector="slowdown:1.1")
    train(sim, slow, epochs=1, steps=400)
    chosen = truth("A100", slow.chosen_limit_w)
    assert chosen.time_s <= 1.1 * truth("A100", 400.0).time_s
    assert slow.chosen_limit_w < 400.0
    custom = MinCost(0.9, gpus=1)
    sim, _, c = make("A100", selector=custom)
    train(sim, c, epochs=1, steps=400)
    assert c.selector is custom


def test_saved_profile_is_reused_by_the_next_job(tmp_path):
    store = ProfileStore(tmp_path / "profiles")
    sim, _, first = make("A100", selector="energy", workload="resnet/b256", store=store)
    train(sim, first, epochs=1, steps=400)
    saved = json.loads(store.path(sim.gpus[0].name, 1, "resnet/b256").read_text())
    assert saved["gpu_model"] == "NVIDIA A100-SXM4-40GB" and saved["profile_steps"] == 20
    assert [p["limit_w"] for p in saved["points"]] == list(first.points)

    sim2, _, second = make("A100", selector="energy", workload="resnet/b256", store=store)
    seen: list[tuple[float, ...]] = []
    train(sim2, second, epochs=1, steps=5, limits_seen=seen)
    assert second.reused_profile and second.chosen_limit_w == first.chosen_limit_w
    assert seen == [(first.chosen_limit_w,)] * 5  # no profiling at all
    # Another selector over the same saved points; another GPU count profiles anew.
    sim3, _, third = make("A100", selector="time", workload="resnet/b256", store=store)
    third.on_train_begin()
    assert third.state is State.DONE and third.chosen_limit_w == 400.0
    third.on_train_end()
    sim4, _, fourth = make("A100x2", selector="energy", workload="resnet/b256", store=store)
    fourth.on_train_begin()
    assert fourth.state is State.WARMUP and not fourth.reused_profile
    fourth.on_train_end()


def test_no_permission_is_a_clear_error_and_nothing_changes():
    sim, _, opt = make("A100x2", selector="energy")
    sim.gpus[1].set_power_limit_w(300.0)
    for g in sim.gpus:
        g.allow_control = False
    with pytest.raises(DevicePermissionError, match="SYS_ADMIN") as e:
        opt.on_train_begin()
    assert "No GPU was changed" in str(e.value)
    assert [g.power_limit_w() for g in sim.gpus] == [400.0, 300.0]


def test_dry_run_measures_without_changing_anything():
    sim, _, opt = make("A100", selector="energy", dry_run=True)
    seen: list[tuple[float, ...]] = []
    train(sim, opt, epochs=1, steps=13 * 23 + 10, limits_seen=seen)
    assert set(seen) == {(400.0,)}
    assert opt.state is State.DONE and opt.chosen_limit_w is not None


def test_exception_in_the_with_block_restores():
    sim, _, opt = make("A100", selector="energy")
    sim.gpus[0].set_power_limit_w(350.0)
    with pytest.raises(RuntimeError), opt:
        for _ in range(40):
            opt.on_step_begin()
            sim.run(WORK_S, CF)
            opt.on_step_end()
        assert sim.gpus[0].power_limit_w() != 350.0
        raise RuntimeError("boom")
    assert sim.gpus[0].power_limit_w() == 350.0


def test_bad_arguments_are_named():
    sim = Simulator("A100")
    monitor = EnergyMonitor(devices=sim.devices())
    with pytest.raises(ValueError, match="outside the allowed range"):
        PowerLimitOptimizer(monitor, limits_w=[500.0, 300.0], handle_signals=False)
    with pytest.raises(ValueError, match="profile_steps"):
        PowerLimitOptimizer(monitor, profile_steps=0, handle_signals=False)
    with pytest.raises(ValueError, match="search"):
        PowerLimitOptimizer(monitor, search="random", handle_signals=False)
    with pytest.raises(ValueError, match="not measured by the monitor"):
        PowerLimitOptimizer(monitor, gpu_indices=[3], handle_signals=False)
    opt = PowerLimitOptimizer(monitor, selector="cost:2", handle_signals=False)
    with pytest.raises(Exception, match="eta"):
        opt.on_train_begin()
    nogpu = EnergyMonitor(devices=Simulator("XEON8480").devices())
    with pytest.raises(ValueError, match="no GPU"):
        PowerLimitOptimizer(nogpu)


def test_explicit_limits_and_custom_search(caplog):
    sim, _, opt = make("A100", selector="energy", limits_w=[400.0, 300.0, 200.0],
                       search=lambda limits, sel: Sweep(limits, sel))
    with caplog.at_level(logging.INFO, logger="joules.power_limit"):
        train(sim, opt, epochs=1, steps=100)
    assert list(opt.points) == [400.0, 300.0, 200.0]
    assert "chose" in caplog.text
    report = opt.report()
    assert report["chosen_limit_w"] == opt.chosen_limit_w and len(report["points"]) == 3


def test_a_second_fit_with_the_same_optimizer_reapplies_or_resumes():
    sim, _, opt = make("A100", selector="energy")
    sim.gpus[0].set_power_limit_w(300.0)
    train(sim, opt, epochs=1, steps=30)  # ends in the middle of profiling
    assert opt.state is not State.DONE and sim.gpus[0].power_limit_w() == 300.0
    profiled = dict(opt.points)
    train(sim, opt, epochs=1, steps=400)  # resumes, keeps what it measured
    assert opt.state is State.DONE and set(profiled) <= set(opt.points)
    assert sim.gpus[0].power_limit_w() == 300.0
    seen: list[tuple[float, ...]] = []
    train(sim, opt, epochs=1, steps=3, limits_seen=seen)
    assert seen == [(opt.chosen_limit_w,)] * 3
    assert sim.gpus[0].power_limit_w() == 300.0


def test_epochs_no_longer_than_the_warmup_are_still_profiled(caplog):
    # 10 steps per epoch and warmup_steps=10: warming up fully after every epoch end would
    # never measure a step, and the GPU would run at the highest limit, above the admin's.
    sim, monitor, opt = make("A100", selector="energy", warmup_steps=10, profile_steps=40)
    sim.gpus[0].set_power_limit_w(250.0)  # what the admin had set
    seen: list[tuple[float, ...]] = []
    with caplog.at_level(logging.WARNING, logger="joules.power_limit"):
        train(sim, opt, epochs=200, steps=10, limits_seen=seen)
    assert opt.state is State.DONE and opt.chosen_limit_w is not None
    assert "epochs of 10 steps are short" in caplog.text
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(truth("A100", limit).time_s, rel=2e-3)
        assert p.energy_j == pytest.approx(truth("A100", limit).energy_j, rel=1e-2)
    assert seen[-1] == (opt.chosen_limit_w,)
    assert sim.gpus[0].power_limit_w() == 250.0


def test_the_warmup_after_a_limit_change_goes_on_across_an_epoch_end():
    sim, monitor, opt = make("A100", selector="energy", warmup_steps=6, profile_steps=20)
    opt.on_train_begin()
    for _ in range(4):  # 4 of the 6 warm-up steps at the first limit, then the epoch ends
        opt.on_step_begin()
        sim.run(WORK_S, CF)
        opt.on_step_end()
    opt.on_epoch_end()
    states = []
    for _ in range(3):
        opt.on_step_begin()
        sim.run(WORK_S, CF)
        opt.on_step_end()
        states.append(opt.state)
    # Fewer than half of the 4-step epoch (1 step) would do after a pause, but the limit
    # set 4 steps ago still needs 2 more.
    assert states == [State.WARMUP, State.PROFILING, State.PROFILING]
    opt.on_train_end()


def test_profiling_that_can_measure_nothing_gives_up_and_keeps_the_admins_limit(caplog):
    # One step per epoch and no on_step_begin: a window opens at a step's end and the epoch
    # ends right after it, so no step is ever measured.
    sim, monitor, opt = make("A100", selector="energy", warmup_steps=2)
    sim.gpus[0].set_power_limit_w(250.0)
    opt.on_train_begin()
    assert sim.gpus[0].power_limit_w() == 400.0  # the reference limit, while profiling
    with caplog.at_level(logging.WARNING, logger="joules.power_limit"):
        for _ in range(50):
            opt.on_epoch_begin()
            sim.run(WORK_S, CF)
            opt.on_step_end()
            opt.on_epoch_end()
    assert opt.state is State.DONE and opt.chosen_limit_w is None and opt.points == {}
    assert "profiling is given up" in caplog.text
    assert sim.gpus[0].power_limit_w() == 250.0  # for the rest of the run
    opt.on_train_end()
    assert sim.gpus[0].power_limit_w() == 250.0
