"""benchmarks/power_limit_online.py: the online optimizer driven by recorded profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("power_limit_online")


@pytest.fixture(autouse=True)
def _state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JOULES_STATE_DIR", str(tmp_path / "state"))


@needs_data
@pytest.mark.parametrize(
    ("name", "chosen", "best", "adaptive_limits"),
    [
        # Two GPUs: the descent jumps below the power drawn at 250 W and stops past 100 W.
        ("V100+resnet18+gpu0-1", 100.0, 100.0, [250.0, 125.0, 100.0]),
        # Steps of 45 ms, windows of 1.8 s: the counter still measures them well enough.
        ("V100+shufflenetv2+gpu0", 100.0, 100.0, [250.0, 150.0, 125.0, 100.0]),
        # The adaptive search stops at 175 W and misses 125 W, online as in the replay.
        ("V100+bert-base-uncased+gpu0", 200.0, 125.0, [250.0, 225.0, 200.0, 175.0]),
    ],
)
def test_online_optimizer_matches_the_replay_and_profiles_less(bench, name, chosen, best, adaptive_limits):
    from joules.optimizers.power_limit import load_profile_csv

    profile = load_profile_csv(DATA / "power-limit-profiles" / f"{name}.csv")
    assert bench.model_for(profile, name).name.startswith("Tesla V100")
    adaptive = bench.simulate(profile, "energy", "adaptive", source=name)
    sweep = bench.simulate(profile, "energy", "sweep", source=name)

    assert adaptive.chosen_w == adaptive.replay_w == chosen
    assert adaptive.best_w == sweep.best_w == sweep.chosen_w == sweep.replay_w == best
    assert adaptive.profiled_limits_w == adaptive.replay_limits_w == adaptive_limits
    assert sweep.profiled_limits_w == profile.limits_w
    # 10 warm-up + 40 profiled steps per limit; epochs of 100 steps end between limits.
    assert adaptive.steps == 50 * len(adaptive_limits) and sweep.steps == 50 * len(profile.limits_w)
    assert adaptive.clamped == sweep.clamped == 0
    assert 0 < adaptive.overhead_energy_j < sweep.overhead_energy_j
    # Nothing clamped: the sweep's true energy is exactly the recorded windows' (50 steps of
    # 1/40 window each), whatever the counter measured.
    recorded = sum(p.energy_j for p in profile.points) * 50 / 40
    assert sweep.energy_j == pytest.approx(recorded, rel=1e-9)


@needs_data
def test_clamped_points_draw_the_limit(bench):
    from joules.optimizers.power_limit import load_profile_csv

    name = "A40+resnet18+gpu0"
    profile = load_profile_csv(DATA / "power-limit-profiles" / f"{name}.csv")
    over = [p for p in profile.points if p.average_power_w > p.limit_w]
    assert len(over) == 2
    result = bench.simulate(profile, "energy", "sweep", source=name)
    assert result.clamped == 2 and result.chosen_w == result.replay_w == 175.0
    drawn = sum(min(p.energy_j, p.limit_w * p.time_s) for p in profile.points) * 50 / 40
    assert result.energy_j == pytest.approx(drawn, rel=1e-9)
