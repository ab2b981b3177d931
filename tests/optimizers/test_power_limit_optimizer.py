"""The online power-limit optimizer on simulated GPUs (virtual clock)."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

from joules.devices.sim import Constant, Simulator
from joules.errors import DevicePermissionError
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.power_limit import LimitPoint, MinCost, MinEnergy, Sweep
from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer, State
from joules.optimizers.power_limit.profile import ProfileError
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


def train_with_stalls(sim, opt, work_s: float, every: int, stall_s: float, idle: float = 0.0,
                      max_steps: int = 5000) -> int:
    """Steps of ``work_s`` until the search is done, every ``every``-th one ``stall_s`` longer with
    the GPU at ``idle`` (host work inside the step); the steps run."""
    steps = 0
    opt.on_train_begin()
    while opt.state is not State.DONE and steps < max_steps:
        opt.on_step_begin()
        sim.run(work_s, CF)
        if steps % every == every - 1:
            sim.set_workload(Constant(idle), cpus=False)
            sim.advance(stall_s)
            sim.set_workload(Constant(1.0), cpus=False)
        opt.on_step_end()
        steps += 1
    opt.on_train_end()
    return steps


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
    assert opt.state is State.DONE and opt.chosen_limit_w is not None and len(opt.points) >= 3
    assert opt.chosen_limit_w == min(opt.points, key=lambda w: truth("A100", w).energy_j)
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(truth("A100", limit).time_s, rel=2e-3)
        assert p.energy_j == pytest.approx(truth("A100", limit).energy_j, rel=1e-2)


def test_on_step_begin_is_optional():
    sim, monitor, opt = make("A100", selector="energy")
    opt.on_train_begin()
    while opt.state is not State.DONE:
        sim.run(WORK_S, CF)
        opt.on_step_end()
    assert opt.chosen_limit_w is not None and len(opt.points) >= 3
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
    assert opt.chosen_limit_w is not None and len(opt.points) >= 3
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


def test_workload_names_that_slug_alike_keep_their_own_files(tmp_path):
    store = ProfileStore(tmp_path / "profiles")
    a, b = store.path("A100", 1, "resnet50/b256"), store.path("A100", 1, "resnet50 b256")
    assert a != b and a.parent == b.parent and "resnet50_b256" in a.name
    store.save("A100", 1, "resnet50/b256", [LimitPoint(300.0, 1.0, 200.0)])
    assert store.load("A100", 1, "resnet50 b256") is None
    # A file saved before names had the key's hash is still found, if it is this key's.
    legacy = a.parent / "A100-x1-resnet50_b256.json"
    a.rename(legacy)
    assert store.load("A100", 1, "resnet50/b256") == [LimitPoint(300.0, 1.0, 200.0)]
    assert store.load("A100", 1, "resnet50 b256") is None
    b.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="not a profile"):
        store.load("A100", 1, "resnet50 b256")


def test_a_long_workload_name_is_saved_under_a_name_the_file_system_takes(tmp_path):
    """A 250-character workload name made a file name longer than the 255 bytes allowed."""
    store = ProfileStore(tmp_path / "profiles")
    long_a, long_b = "x" * 249 + "a", "x" * 249 + "b"
    points = [LimitPoint(300.0, 1.0, 200.0)]
    store.save("NVIDIA H100 80GB HBM3 " * 4, 8, long_a, points)
    assert store.load("NVIDIA H100 80GB HBM3 " * 4, 8, long_a) == points
    assert store.load("NVIDIA H100 80GB HBM3 " * 4, 8, long_b) is None  # cut alike, kept apart
    assert all(len(p.name) <= 255 for p in (tmp_path / "profiles").iterdir())


def test_mig_instances_of_one_gpu_count_it_once(tmp_path):
    # Two MIG instances read the whole physical GPU: its energy per step is counted once,
    # and the job has one GPU (the saved profile's key, the cost's max power).
    from joules.devices.base import DeviceSet
    from joules.testing import fake_pynvml

    sim = Simulator("A100,nocpu")
    sim.set_workload(Constant(1.0), cpus=False)
    with fake_pynvml.installed(sim, mig={0: 2}) as nv:
        gpus = fake_pynvml.mig_gpus(nv)
        monitor = EnergyMonitor(devices=DeviceSet(gpus=gpus, cpus=[], clock=sim.clock))
        opt = PowerLimitOptimizer(monitor, selector="energy", search="sweep", warmup_steps=3,
                                  profile_steps=20, handle_signals=False, workload="mlp",
                                  store=tmp_path / "profiles")
        train(sim, opt, epochs=10, steps=40)
        assert opt.total_gpus == 1
        for limit, p in opt.points.items():
            assert p.energy_j == pytest.approx(truth("A100", limit).energy_j, rel=2e-2)
        (saved,) = (tmp_path / "profiles").glob("*.json")
        assert "-x1-mlp-" in saved.name
        monitor.close()


def test_an_unreadable_saved_profile_is_profiled_again_with_a_warning(tmp_path, caplog):
    store = ProfileStore(tmp_path / "profiles")
    sim, monitor, opt = make(workload="resnet/b256", store=store, selector="energy")
    path = store.path(sim.gpus[0].name, 1, "resnet/b256")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="joules.power_limit"):
        train(sim, opt, epochs=10, steps=40)
    assert "not using the saved power-limit profile" in caplog.text and "unreadable" in caplog.text
    assert opt.state is State.DONE and len(opt.points) >= 3
    assert path.read_text() == "{not json"  # left for the user to look at, not overwritten


def test_a_job_that_ends_before_the_search_does_saves_what_it_measured(tmp_path):
    # A recurring job's trials can be shorter than the search: each must go on from where
    # the last one stopped, not profile again from the highest limit.
    store = ProfileStore(tmp_path / "profiles")
    sim, monitor, first = make(workload="mlp/b8", store=store, selector="energy", search="sweep",
                               warmup_steps=2, profile_steps=5)
    train(sim, first, epochs=1, steps=30)  # about 4 of 9 limits
    assert first.state in (State.WARMUP, State.PROFILING)
    measured = sorted(first.points)
    assert len(measured) >= 3
    assert sorted(p.limit_w for p in store.load(sim.gpus[0].name, 1, "mlp/b8")) == measured
    sim, monitor, second = make(workload="mlp/b8", store=store, selector="energy", search="sweep",
                                warmup_steps=2, profile_steps=5)
    train(sim, second, epochs=3, steps=40)
    assert second.state is State.DONE
    assert sorted(second.reused_limits_w) == measured
    assert not set(second._measured) & set(measured)


def test_saved_profile_is_reused_by_the_next_job(tmp_path):
    store = ProfileStore(tmp_path / "profiles")
    sim, _, first = make("A100", selector="energy", workload="resnet/b256", store=store)
    train(sim, first, epochs=1, steps=400)
    saved = json.loads(store.path(sim.gpus[0].name, 1, "resnet/b256").read_text())
    assert saved["gpu_model"] == "NVIDIA A100-SXM4-40GB" and saved["profile_steps"] == 20
    assert [p["limit_w"] for p in saved["points"]] == sorted(first.points, reverse=True)

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
    for bad, why in (("cost:2", "eta"), ("cost:nan", "eta"), ("slowdown:0.5", "slowdown"),
                     ("energie", "expected time, energy"), (0.5, "Selector or a string")):
        with pytest.raises(ValueError, match=why):
            PowerLimitOptimizer(monitor, selector=bad, handle_signals=False)
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


def test_a_step_that_does_not_divide_the_range_stays_within_it():
    # H100: 200-700 W. 700 - 15 * (100 / 3) is a hair below 200 in floating point.
    sim, _, opt = make("H100", selector="energy", search="sweep", step_w=100 / 3, profile_steps=3)
    train(sim, opt, epochs=1, steps=200)  # each limit is set: none is refused
    assert opt.limits_w[0] == 700.0 and opt.limits_w[-1] == 200.0 and len(opt.limits_w) == 16
    assert all(200.0 <= w <= 700.0 for w in opt.limits_w)
    assert set(opt.points) == set(opt.limits_w) and sim.gpus[0].power_limit_w() == 700.0


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


def test_warm_ups_ending_at_pauses_do_not_give_profiling_up(caplog):
    # Epochs of 10 steps, evaluation every 7 and a checkpoint every 5: the warm-up after each
    # pause is sized from the last interval and ends three times in a row on the step before a
    # pause (steps 10, 14, 15). No step was ever due to be measured then; profiling goes on.
    sim, monitor, opt = make("A100", selector="energy", warmup_steps=10, profile_steps=40)
    opt.on_train_begin()
    done = 0
    with caplog.at_level(logging.WARNING, logger="joules.power_limit"):
        for _ in range(200):
            opt.on_epoch_begin()
            for _ in range(10):
                opt.on_step_begin()
                sim.run(WORK_S, CF)
                opt.on_step_end()
                done += 1
                if done % 7 == 0 or done % 5 == 0:
                    opt.pause()
            opt.on_epoch_end()
            if opt.state is State.DONE:
                break
    assert "profiling is given up" not in caplog.text
    assert opt.state is State.DONE and opt.chosen_limit_w is not None and len(opt.points) >= 3
    opt.on_train_end()


def test_a_pause_within_a_step_drops_only_what_it_cuts():
    # Evaluation inside every 5th step (between micro-batches of an accumulation cycle): the
    # cut step is not measured, nor is the 2 s evaluation; the points hold whole steps only.
    sim, monitor, opt = make("A100", selector="energy", warmup_steps=2, profile_steps=8)
    opt.on_train_begin()
    n = 0
    while opt.state is not State.DONE and n < 2000:
        opt.on_step_begin()
        sim.run(WORK_S / 2, CF)
        n += 1
        if n % 5 == 0:
            opt.pause()
            sim.advance(2.0)
        sim.run(WORK_S / 2, CF)
        opt.on_step_end()
    assert opt.state is State.DONE and len(opt.points) >= 3
    for limit, p in opt.points.items():
        t = truth("A100", limit)
        assert p.time_s == pytest.approx(t.time_s, rel=1e-3)
        assert p.energy_j == pytest.approx(t.energy_j, rel=1e-2)
    opt.on_train_end()


def test_after_a_pause_within_a_step_the_host_work_between_steps_still_counts():
    # Windows of one step each (after a cut step) must cover what windows of many steps
    # do: the host work between steps too, or later limits look faster than earlier ones.
    host_s = 0.1
    sim, monitor, opt = make("A100", selector="time", search="sweep", warmup_steps=3, profile_steps=20)
    opt.on_train_begin()
    n = 0
    while opt.state is not State.DONE and n < 2000:
        opt.on_step_begin()
        sim.set_workload(Constant(1.0), cpus=False)
        sim.run(WORK_S / 2, CF)
        if n == 30:
            opt.pause()  # a checkpoint between the micro-batches of one cycle
        sim.run(WORK_S / 2, CF)
        opt.on_step_end()
        sim.set_workload(Constant(0.05), cpus=False)
        sim.advance(host_s)  # data loading
        n += 1
    assert opt.state is State.DONE and len(opt.points) >= 5
    for limit, p in opt.points.items():
        # 19 or 20 of every 20 steps' host work is in the windows
        assert truth("A100", limit).time_s + 0.9 * host_s < p.time_s < truth("A100", limit).time_s + host_s
    assert opt.chosen_limit_w == 400.0
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


# -- saved profiles answer only what they measured ------------------------------------------
def test_a_saved_profile_of_another_selector_is_completed_not_trusted(tmp_path):
    # The time selector profiles only the top limits; an energy job on the same workload
    # must profile down to its own optimum rather than choose among those.
    store = ProfileStore(tmp_path / "profiles")
    sim, _, first = make("A100", selector="time", workload="bert/b32", store=store)
    train(sim, first, epochs=1, steps=400)
    assert list(first.points) == [400.0, 375.0, 350.0] and first.chosen_limit_w == 400.0

    sim2, _, second = make("A100", selector="energy", workload="bert/b32", store=store)
    seen: list[tuple[float, ...]] = []
    train(sim2, second, epochs=1, steps=400, limits_seen=seen)
    best = MinEnergy().choose([truth("A100", x) for x in second.limits_w]).limit_w
    assert best == 225.0
    assert second.chosen_limit_w == best and not second.reused_profile
    assert second.reused_limits_w == [400.0, 375.0, 350.0]
    assert seen[0] == (325.0,)  # the saved limits are not profiled again
    for limit, p in second.points.items():
        assert p.energy_j == pytest.approx(truth("A100", limit).energy_j, rel=5e-3)
    # What it measured is added to the saved profile: the next energy job skips profiling.
    saved = json.loads(store.path(sim.gpus[0].name, 1, "bert/b32").read_text())
    assert [p["limit_w"] for p in saved["points"]] == sorted(second.points, reverse=True)
    sim3, _, third = make("A100", selector="energy", workload="bert/b32", store=store)
    seen = []
    train(sim3, third, epochs=1, steps=5, limits_seen=seen)
    assert third.reused_profile and seen == [(225.0,)] * 5


def test_a_saved_profile_over_other_limits_gets_the_reference_profiled(tmp_path):
    # Saved at 300 and 275 W only: a slowdown limit must be judged against 400 W, not 300 W.
    store = ProfileStore(tmp_path / "profiles")
    sim, _, first = make("A100", selector="energy", workload="bert/b32", store=store,
                         limits_w=[300.0, 275.0])
    train(sim, first, epochs=1, steps=100)
    assert first.chosen_limit_w == 275.0

    sim2, _, second = make("A100", selector="slowdown:1.05", workload="bert/b32", store=store)
    seen: list[tuple[float, ...]] = []
    train(sim2, second, epochs=1, steps=400, limits_seen=seen)
    assert seen[0] == (400.0,)  # the reference is profiled first
    ref = truth("A100", 400.0)
    fastest_enough = [x for x in second.limits_w if truth("A100", x).time_s <= 1.05 * ref.time_s]
    assert second.chosen_limit_w == min(fastest_enough) == 350.0
    assert second.reused_limits_w == [300.0, 275.0] and not second.reused_profile
    assert second.points[400.0].time_s == pytest.approx(ref.time_s, rel=2e-3)


def test_a_saved_profile_of_other_gpu_models_is_not_reused(tmp_path):
    # Two A100s and an A100 with a V100 are both two GPUs: their profiles must not mix.
    store = ProfileStore(tmp_path / "profiles")
    sim, _, first = make("A100x2", selector="energy", workload="bert/b32", store=store)
    train(sim, first, epochs=1, steps=400)
    sim2, _, mixed = make("A100,V100", selector="energy", workload="bert/b32", store=store)
    try:
        mixed.on_train_begin()
        assert mixed.state is State.WARMUP and mixed.reused_limits_w == [] and not mixed.reused_profile
        assert mixed.current_limit_w == 300.0  # the highest limit both allow: profiling starts
    finally:
        mixed.on_train_end()


# -- training run again after a run that did not end -----------------------------------------
def crash(sim, opt, steps: int) -> None:
    """A run that raises in its ``steps``-th step: no on_step_end, epoch end or train end."""
    opt.on_train_begin()
    opt.on_epoch_begin()
    for i in range(steps):
        opt.on_step_begin()
        sim.run(WORK_S, CF)
        if i == steps - 1:
            return
        opt.on_step_end()


def test_a_run_again_after_an_exception_profiles_the_interrupted_limit_again():
    sim, _, clean = make("A100", selector="energy")
    train(sim, clean, epochs=1, steps=400)

    sim, _, opt = make("A100", selector="energy")
    try:
        crash(sim, opt, steps=35)  # in the middle of the second limit's measurement
        assert opt.state is State.PROFILING and opt.current_limit_w == 375.0
        sim.advance(300.0)  # the traceback is read, the script fixed
        train(sim, opt, epochs=1, steps=400)
    finally:
        opt.restore()
    assert opt.state is State.DONE
    for limit, p in opt.points.items():  # the idle 300 s are in no point
        assert p.time_s == pytest.approx(truth("A100", limit).time_s, rel=2e-3)
        assert p.energy_j == pytest.approx(truth("A100", limit).energy_j, rel=5e-3)
    assert opt.points[375.0].time_s < 0.21
    assert opt.chosen_limit_w == clean.chosen_limit_w == 225.0
    assert list(opt.points) == list(clean.points)


@pytest.mark.parametrize("interrupt_at", [30, 400])  # while profiling, and after the choice
def test_a_run_again_after_ctrl_c_sets_the_limit_the_guard_put_back(interrupt_at):
    sim, _, clean = make("A100", selector="energy")
    train(sim, clean, epochs=1, steps=400)

    sim, _, opt = make("A100", selector="energy", handle_signals=True)
    sim.gpus[0].set_power_limit_w(310.0)  # what the admin had set (not a candidate)
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.on_train_begin()
            for i in range(1000):
                opt.on_step_begin()
                sim.run(WORK_S, CF)
                if i == interrupt_at:
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the guard restores, then raises
                opt.on_step_end()
        assert sim.gpus[0].power_limit_w() == 310.0
        seen: list[tuple[float, ...]] = []
        train(sim, opt, epochs=1, steps=600, limits_seen=seen)
    finally:
        opt.restore()
    assert opt.state is State.DONE and opt.chosen_limit_w == clean.chosen_limit_w == 225.0
    assert seen[-200:] == [(225.0,)] * 200  # the rest of training ran at the chosen limit
    assert (310.0,) not in seen  # never at the admin's limit while the optimizer ran
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(truth("A100", limit).time_s, rel=2e-3)
    assert sim.gpus[0].power_limit_w() == 310.0


# -- warm-up after an epoch end ----------------------------------------------------------------
def test_the_warmup_after_an_epoch_end_follows_the_epoch_not_the_last_pause():
    # Epochs of 11 steps and a pause (checkpoint) every 10 steps: the last pause before an
    # epoch end can be 1 step before it; the next epoch must still warm up for 4 steps. Its
    # first 4 steps are slow (data loader restarting), which warm-up is there to skip.
    sim, _, opt = make("A100", selector="energy", warmup_steps=4, profile_steps=20)
    epochs: list[list[State]] = []
    done = 0
    opt.on_train_begin()
    while opt.state is not State.DONE:
        opt.on_epoch_begin()
        epochs.append([])
        for i in range(11):
            opt.on_step_begin()
            epochs[-1].append(opt.state)
            sim.run(WORK_S * (2.0 if i < 4 else 1.0), CF)
            opt.on_step_end()
            done += 1
            if done % 10 == 0:
                opt.pause()
        opt.on_epoch_end()
    opt.on_train_end()
    assert len(epochs) > 20
    for states in epochs:
        if State.DONE not in states:
            assert states[:4] == [State.WARMUP] * 4, states
    for limit, p in opt.points.items():  # no slow step was measured
        assert p.time_s == pytest.approx(truth("A100", limit).time_s, rel=2e-3)
    assert opt.chosen_limit_w == 225.0


def test_steps_that_take_no_time_give_profiling_up_instead_of_raising(caplog):
    # On a virtual clock a step can take no time at all (no GPU work, or on_step_end called
    # before on_step_begin): such a profile cannot rank limits, and dividing by its time
    # raised ZeroDivisionError out of on_step_end into the training loop.
    sim, monitor, opt = make("A100", selector="time", warmup_steps=1, profile_steps=3)
    sim.gpus[0].set_power_limit_w(300.0)  # what the admin had set
    with caplog.at_level(logging.WARNING, logger="joules.power_limit"):
        opt.on_train_begin()
        for _ in range(50):
            opt.on_step_begin()
            opt.on_step_end()
    assert opt.state is State.DONE and opt.chosen_limit_w is None and not opt.points
    assert "3 steps at 400 W took no measurable time" in caplog.text
    assert "profiling is given up" in caplog.text
    assert sim.gpus[0].power_limit_w() == 300.0
    opt.on_train_end()


def _failing_reads(monitor, every_begin: int, every_end: int):
    """Make every ``every_begin``-th window begin and ``every_end``-th end fail as a device read does
    (a failed end leaves the window open, as the monitor does)."""
    from joules.errors import JoulesError

    calls = {"begin": 0, "end": 0}
    begin, end = monitor.begin_window, monitor.end_window

    def failing_begin(name):
        calls["begin"] += 1
        if every_begin and calls["begin"] % every_begin == 0:
            raise JoulesError("GPU 0 (sim): NVML error trying to read the energy counter: Timeout")
        return begin(name)

    def failing_end(name):
        calls["end"] += 1
        if every_end and calls["end"] % every_end == 0:
            raise JoulesError("GPU 0 (sim): NVML error trying to read the energy counter: Timeout")
        return end(name)

    monitor.begin_window, monitor.end_window = failing_begin, failing_end
    return calls


def test_a_failed_device_read_while_profiling_does_not_stop_training(caplog):
    """A read error at a profiling window's edge went up into the training loop (3 of 10
    jobs stopped at 1 in 20 failing NVML reads): now those steps are left out."""
    sim, monitor, opt = make("A100", selector="energy", search="sweep", warmup_steps=2, profile_steps=6)
    calls = _failing_reads(monitor, every_begin=0, every_end=4)
    with caplog.at_level(logging.WARNING, logger="joules"):
        train(sim, opt, epochs=1, steps=300)  # one window per limit: every 4th end fails
    assert calls["end"] >= 8
    assert opt.state is State.DONE and opt.chosen_limit_w is not None
    assert "a device read failed while profiling" in caplog.text
    assert "profiling it again" in caplog.text
    for limit, p in opt.points.items():  # what was kept is measured as without failures
        t = truth("A100", limit)
        assert p.time_s == pytest.approx(t.time_s, rel=2e-2)
        assert p.energy_j == pytest.approx(t.energy_j, rel=2e-2)
    assert sim.gpus[0].power_limit_w() == sim.gpus[0].power_limit_range_w()[1]  # restored
    monitor.close()


def test_device_reads_that_keep_failing_give_profiling_up_and_restore(caplog):
    sim, monitor, opt = make("A100", selector="energy", search="sweep", warmup_steps=2, profile_steps=6)
    _failing_reads(monitor, every_begin=1, every_end=0)  # no window can begin
    with caplog.at_level(logging.WARNING, logger="joules"):
        opt.on_train_begin()
        for _ in range(200):
            opt.on_step_begin()
            sim.run(WORK_S, CF)
            opt.on_step_end()
        assert opt.state is State.DONE and opt.chosen_limit_w is None and not opt.points
        assert "at 400 W could not be measured, 3 times (device reads failed)" in caplog.text
        assert sim.gpus[0].power_limit_w() == 400.0  # the limits it had, for the rest of the run
        opt.on_train_end()
    monitor.close()


def test_a_limit_changed_by_something_else_while_profiling_is_set_again_and_not_measured(caplog):
    """Another optimizer on the same GPU (or an administrator) changed the limit under a profile:
    its windows measured another limit's steps as this one's."""
    sim, monitor, a = make("A100", selector="energy", search="sweep")
    b = PowerLimitOptimizer(monitor, selector="time", handle_signals=False, warmup_steps=3, profile_steps=20)
    with caplog.at_level(logging.WARNING, logger="joules"):
        a.on_train_begin()
        b.on_train_begin()
        for _ in range(600):
            a.on_step_begin()
            b.on_step_begin()
            sim.run(WORK_S, CF)
            a.on_step_end()
            b.on_step_end()
        a.on_train_end()
        b.on_train_end()
    assert "had their power limit changed by something else" in caplog.text
    assert a.state is State.DONE and len(a.points) >= 5
    for limit, p in a.points.items():  # each point measured at its own limit
        t = truth("A100", limit)
        assert p.time_s == pytest.approx(t.time_s, rel=1e-2), limit
        assert p.energy_j == pytest.approx(t.energy_j, rel=2e-2), limit
    assert sim.gpus[0].power_limit_w() == 400.0  # put back
    monitor.close()


@pytest.mark.parametrize("selector", ["energy", "cost:0.9"])
def test_an_idle_gpu_does_not_hide_the_limits_that_bind_on_a_busy_one(selector):
    """One busy V100 and one idle: the mean power per GPU at the highest limit (165 W) made the
    limits from 175 to 275 W, which bind on the busy GPU (290 W), presumed no-ops, and the
    adaptive search skipped the best one (175 W)."""
    from joules.optimizers.power_limit.selectors import parse_selector

    def run(search: str) -> tuple[PowerLimitOptimizer, Simulator]:
        sim = Simulator("V100x2")
        sim.gpus[0].set_workload(Constant(1.0))
        sim.gpus[1].set_workload(Constant(0.0))
        monitor = EnergyMonitor(devices=sim.devices())
        opt = PowerLimitOptimizer(monitor, selector=selector, search=search, warmup_steps=2, profile_steps=10,
                                  handle_signals=False)
        opt.on_train_begin()
        while opt.state is not State.DONE:
            opt.on_step_begin()
            sim.run(WORK_S, 1.0)
            opt.on_step_end()
        opt.on_train_end()
        monitor.close()
        return opt, sim

    adaptive, _ = run("adaptive")
    sweep, _ = run("sweep")
    sel = parse_selector(selector, 2)
    assert sel.choose(list(sweep.points.values())).limit_w == 175.0  # the best, as the sweep finds it
    assert adaptive.chosen_limit_w == 175.0
    assert len(adaptive.points) < len(sweep.points)


@pytest.mark.parametrize(("selector", "best"),
                         [("energy", 225.0), ("slowdown:1.1", 300.0), ("cost:0.5", 250.0)])
def test_a_stall_every_so_many_steps_does_not_mislead_the_search(selector, best, caplog):
    """A 1 s data-loader stall every 64 steps of 0.2 s fell into the window of 375 W: its time
    looked 15 % longer, the search stopped after two limits and chose 375 W (energy, 37 % above
    the best) or 400 W. Steps far longer than their limit's others are left out."""
    sim, monitor, opt = make("A100", selector=selector, warmup_steps=10, profile_steps=40)
    with caplog.at_level(logging.WARNING, logger="joules"):
        train_with_stalls(sim, opt, WORK_S, every=64, stall_s=1.0)  # the GPU idles while the host stalls
    assert "over 3 times the others" in caplog.text
    assert opt.chosen_limit_w == best
    for limit, p in opt.points.items():  # each point is the limit's steady steps
        t = truth("A100", limit)
        assert p.time_s == pytest.approx(t.time_s, rel=1e-2), limit
        assert p.energy_j == pytest.approx(t.energy_j, rel=2e-2), limit
    monitor.close()


def test_steps_too_short_for_the_energy_counter_are_measured_over_more_of_them(caplog):
    """Steps of 0.5 ms: 40 of them are a 20 ms window, a fifth of an A100's counter period,
    extrapolated from power readings (86 % off at the highest limit), and the search chose
    400 W where 225 W uses 30 % less energy. Such a limit is measured again over enough steps
    for ten counter periods."""
    work = 0.0005
    sim, monitor, opt = make("A100", selector="energy", warmup_steps=10, profile_steps=40)
    with caplog.at_level(logging.WARNING, logger="joules"):
        opt.on_train_begin()
        while opt.state is not State.DONE:
            opt.on_step_begin()
            sim.run(work, CF)
            opt.on_step_end()
        opt.on_train_end()
    assert "too short for the GPUs' energy counters: measuring" in caplog.text
    assert opt.chosen_limit_w == 225.0
    for limit, p in opt.points.items():
        t = Simulator("A100")
        t.set_workload(Constant(1.0), cpus=False)
        t.gpus[0].set_power_limit_w(limit)
        e0 = t.gpus[0].true_energy_j()
        seconds = t.run(work, CF)
        assert p.energy_j == pytest.approx(t.gpus[0].true_energy_j() - e0, rel=2e-2), limit
        assert p.time_s == pytest.approx(seconds, rel=1e-2), limit
    monitor.close()


def test_one_window_per_step_is_not_measured_over_more_steps():
    """Steps of 50 ms: after one stall each window is one step, shorter than the counter period
    whatever the steps measured; measuring more of them (up to 64 x profile_steps) took 50,900
    steps to profile instead of 500."""
    sim, monitor, opt = make("A100", selector="energy", warmup_steps=10, profile_steps=40)
    opt.on_train_begin()
    steps = 0
    while opt.state is not State.DONE and steps < 5000:
        opt.on_step_begin()
        if steps == 30:
            sim.advance(1.0)  # one stall
        sim.run(0.05, CF)
        opt.on_step_end()
        steps += 1
    opt.on_train_end()
    assert opt.state is State.DONE and opt.chosen_limit_w == 225.0
    assert steps <= 60 * len(opt.points)
    monitor.close()


def test_the_busiest_gpus_power_is_saved_with_the_profile(tmp_path):
    """A job that takes the highest limit's point from the saved profile had no per-GPU power:
    with an idle GPU beside a busy one it chose 150 W again where 175 W uses less."""

    def job(stop_after_reference: bool) -> PowerLimitOptimizer:
        sim = Simulator("V100x2")
        sim.gpus[0].set_workload(Constant(1.0))
        sim.gpus[1].set_workload(Constant(0.0))
        monitor = EnergyMonitor(devices=sim.devices())
        opt = PowerLimitOptimizer(monitor, selector="energy", warmup_steps=2, profile_steps=10,
                                  workload="mlp", store=tmp_path / "profiles", handle_signals=False)
        opt.on_train_begin()
        while opt.state is not State.DONE and not (stop_after_reference and opt.points):
            opt.on_step_begin()
            sim.run(WORK_S, 1.0)
            opt.on_step_end()
        opt.on_train_end()  # (interrupted: the partial search is saved)
        monitor.close()
        return opt

    first = job(stop_after_reference=True)
    assert list(first.points) == [300.0]
    (saved,) = (tmp_path / "profiles").glob("*.json")
    assert json.loads(saved.read_text())["busiest_gpu_w"] == pytest.approx(290.0, rel=1e-3)
    second = job(stop_after_reference=False)
    assert second.reused_limits_w == [300.0] and second.chosen_limit_w == 175.0


@pytest.mark.parametrize("period", [4, 8])
def test_long_steps_that_are_the_workloads_own_are_measured(period):
    """Every 4th (8th) step does 0.3 s more of host work (an optimizer step after micro-batches):
    taken for stalls, they were left out of the highest limit's point (its time 43 % short),
    and cost:0.5 chose 400 W where 250 W is best."""
    from joules.optimizers.power_limit.selectors import parse_selector

    sim, monitor, opt = make("A100", selector="cost:0.5", warmup_steps=10, profile_steps=40)
    train_with_stalls(sim, opt, 0.1, every=period, stall_s=0.3, idle=0.05)
    assert opt.state is State.DONE and opt.chosen_limit_w == 250.0
    truth_sim = Simulator("A100")
    truth_sim.set_workload(Constant(1.0), cpus=False)
    t0 = truth_sim.clock.now()
    for k in range(period):
        truth_sim.run(0.1, CF)
        if k == period - 1:
            truth_sim.set_workload(Constant(0.05), cpus=False)
            truth_sim.advance(0.3)
    per_step = (truth_sim.clock.now() - t0) / period
    assert opt.points[400.0].time_s == pytest.approx(per_step, rel=0.02)  # long steps included
    assert parse_selector("cost:0.5", 1).choose(list(opt.points.values())).limit_w == 250.0
    monitor.close()


def test_giving_up_saves_what_was_measured(tmp_path):
    """Profiling given up after three limits threw their points away: the next job measured them again."""
    sim, monitor, opt = make("A100", selector="energy", search="sweep", warmup_steps=2, profile_steps=6,
                             workload="mlp", store=tmp_path / "profiles")
    opt.on_train_begin()
    for _ in range(400):
        opt.on_step_begin()
        sim.run(WORK_S, CF)
        opt.on_step_end()
        if len(opt.points) == 3 and not hasattr(monitor, "_broken"):
            monitor._broken = True
            _failing_reads(monitor, every_begin=1, every_end=0)
        if opt.state is State.DONE:
            break
    opt.on_train_end()
    assert opt.chosen_limit_w is None and len(opt.points) == 3
    saved = ProfileStore(tmp_path / "profiles").load(opt._model, 1, "mlp")
    assert saved is not None and sorted(p.limit_w for p in saved) == sorted(opt.points)
    monitor.close()


def test_stalls_more_often_than_the_windows_end_shorten_them():
    """A 0.4 s stall every 25 steps of 0.1 s (every 2.9 s) fell into every 3 s window: each was
    dropped, the limit profiled again and again, and profiling given up. The windows shorten
    until most steps are measured."""
    sim, monitor, opt = make("A100", selector="energy", warmup_steps=10, profile_steps=40)
    steps = train_with_stalls(sim, opt, 0.1, every=25, stall_s=0.4, max_steps=3000)
    assert opt.chosen_limit_w == 225.0 and steps < 1000
    monitor.close()


def test_a_workload_changed_after_the_choice_is_profiled_again_and_not_saved(tmp_path) -> None:
    sim, _, opt = make(selector="energy", workload="job", store=tmp_path / "profiles")
    opt.on_train_begin()
    for _ in range(600):
        opt.on_step_begin()
        sim.run(WORK_S, CF)
        opt.on_step_end()
    assert opt.state is State.DONE
    saved = sorted(p.name for p in (tmp_path / "profiles").rglob("*.json"))
    assert saved
    opt.workload_changed("the batch size changed from 16 to 8")
    assert opt.state is State.WARMUP and opt.points == {} and opt.chosen_limit_w is None
    assert sim.gpus[0].power_limit_w() == opt.limits_w[0]  # from the highest limit again
    for _ in range(1200):  # steps of half the work now
        opt.on_step_begin()
        sim.run(WORK_S / 2, CF)
        opt.on_step_end()
    opt.on_train_end()
    assert opt.state is State.DONE
    for limit, p in opt.points.items():
        assert p.time_s == pytest.approx(truth("A100", limit).time_s / 2, rel=1e-2)
    before = {p.name: p.read_text() for p in (tmp_path / "profiles").rglob("*.json")}
    assert sorted(before) == saved  # the first profile is left as it was, none added
    assert sim.gpus[0].power_limit_w() == 400.0


def test_a_workload_changed_between_runs_waits_for_the_next_one_to_set_a_limit(tmp_path) -> None:
    """Called between two fit()s, it set the highest limit at once, over the limit on_train_end
    had just put back, while nothing trained."""
    sim, _, opt = make(selector="energy")
    sim.gpus[0].set_power_limit_w(300.0)  # the site's own limit
    train(sim, opt, epochs=2, steps=300)
    assert opt.state is State.DONE and sim.gpus[0].power_limit_w() == 300.0
    opt.workload_changed("the batch size will be 8 in the next fit()")
    assert sim.gpus[0].power_limit_w() == 300.0 and opt.guard.changed == []
    train(sim, opt, epochs=2, steps=600, limits_seen=(seen := []))
    assert seen[0] == (opt.limits_w[0],)  # profiled again, from the highest limit
    assert opt.state is State.DONE and sim.gpus[0].power_limit_w() == 300.0
