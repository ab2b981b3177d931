"""Power-limit profiles, selectors, searches and their replay."""

from __future__ import annotations

from pathlib import Path

import pytest

from joules.errors import JoulesError
from joules.optimizers.power_limit import (
    Adaptive,
    FunctionSelector,
    LimitPoint,
    MaxSlowdown,
    MinCost,
    MinEnergy,
    MinTime,
    Profile,
    ProfileError,
    Sweep,
    load_power_trace,
    load_profile_csv,
    parse_selector,
    profiles_in,
    replay,
)

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")


def synthetic() -> Profile:
    # Time rises and power falls as the limit drops; energy is lowest at 175 W.
    rows = {300: (10.0, 2500.0), 275: (10.0, 2400.0), 250: (10.2, 2200.0), 225: (10.6, 2000.0),
            200: (11.2, 1850.0), 175: (12.0, 1800.0), 150: (13.5, 1900.0), 125: (16.0, 2100.0),
            100: (22.0, 2400.0)}
    return Profile("synthetic", tuple(LimitPoint(w, t, e) for w, (t, e) in rows.items()))


def test_selectors_choose_by_their_definition() -> None:
    points = list(synthetic().points)
    assert MinTime().choose(points).limit_w == 300  # 300 and 275 tie: the higher wins
    assert MinEnergy().choose(points).limit_w == 175
    # eta * E + (1 - eta) * 300 W * T: at eta=0.5, 225 W gives 0.5*2000 + 0.5*3180 = 2590.
    assert MinCost(0.5).choose(points).limit_w == 225
    assert MinCost(1.0).choose(points).limit_w == 175 and MinCost(0.0).choose(points).limit_w == 300
    assert MaxSlowdown(1.1).choose(points).limit_w == 225  # 10.6 s <= 11.0 s; 200 W is 11.2 s
    assert MaxSlowdown(1.0).choose(points).limit_w == 275  # as fast as 300 W, less energy
    custom = FunctionSelector(lambda p, ref: abs(p.limit_w - 200), "near-200")
    assert custom.choose(points).limit_w == 200


def test_parse_selector_and_errors() -> None:
    assert isinstance(parse_selector("time"), MinTime)
    assert isinstance(parse_selector("energy"), MinEnergy)
    assert parse_selector("cost:0.3").eta == 0.3  # type: ignore[attr-defined]
    assert parse_selector("slowdown:1.2").factor == 1.2  # type: ignore[attr-defined]
    for bad in ("fast", "cost", "cost:x", "cost:2", "slowdown:0.5", "time:1"):
        with pytest.raises(JoulesError, match="bad selector"):
            parse_selector(bad)


def test_sweep_profiles_every_limit_and_matches_hindsight() -> None:
    profile = synthetic()
    result = replay(profile, Sweep(profile.limits_w, MinEnergy()))
    assert result.profiled_limits_w == profile.limits_w
    assert result.chosen_w == result.best_w == 175
    expected = sum(p.energy_j for p in profile.points) - 9 * 1800.0
    assert result.overhead_energy_j == pytest.approx(expected)


def test_adaptive_stops_after_the_optimum_and_costs_less() -> None:
    profile = synthetic()
    sweep = replay(profile, Sweep(profile.limits_w, MinEnergy()))
    adaptive = replay(profile, Adaptive(profile.limits_w, MinEnergy()))
    assert adaptive.chosen_w == sweep.chosen_w == 175
    # 300 W draws 250 W: 275 and 250 W are presumed no-ops, skipped once lower limits save
    # energy; the descent stops one past the optimum (see test_power_limit_search.py).
    assert adaptive.profiled_limits_w == [300, 225, 200, 175, 150]
    assert adaptive.overhead_time_s < sweep.overhead_time_s
    assert adaptive.overhead_energy_j < sweep.overhead_energy_j
    fast = replay(profile, Adaptive(profile.limits_w, MinTime()))
    assert fast.chosen_w == 300 and fast.profiled_limits_w == [300, 225, 275, 250]


def test_searches_only_propose_allowed_limits() -> None:
    search = Sweep([250, 200], MinEnergy())
    with pytest.raises(ValueError, match="not a limit of this search"):
        search.record(LimitPoint(225, 1.0, 1.0))
    with pytest.raises(ValueError, match="no power limit"):
        Sweep([], MinEnergy())


def test_profile_errors(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="not found"):
        load_profile_csv(tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("window_name,elapsed_time\nx_250,1.0\n")
    with pytest.raises(ProfileError, match="no gpuN_energy column"):
        load_profile_csv(bad)
    bad.write_text("window_name,elapsed_time,gpu0_energy\nwindow_high,1.0,5\n")
    with pytest.raises(ProfileError, match="does not end in a limit"):
        load_profile_csv(bad)
    for limit in ("0", "-300", "inf", "nan"):
        bad.write_text(f"window_name,elapsed_time,gpu0_energy\nw_300,1.0,5\nw_{limit},1.0,5\n")
        with pytest.raises(ProfileError, match=f"'w_{limit}' ends in .* W, not a positive power limit"):
            load_profile_csv(bad)
    bad.write_bytes("window_name,elapsed_time,gpu0_energy\nw_300,1.0,5\n".encode("utf-8-sig"))
    assert [p.limit_w for p in load_profile_csv(bad).points] == [300.0]
    bad.write_text("window_name,elapsed_time,gpu0_energy\nw_300,2.0,700,99\n")  # a field too many
    with pytest.raises(ProfileError, match=r"line 2: more fields than the header's 3"):
        load_profile_csv(bad)
    bad.write_text("window_name, elapsed_time, gpu0_energy\nw_300, 2.0, 700\n")  # as spreadsheets write
    assert load_profile_csv(bad).at(300) == LimitPoint(300, 2.0, 700.0)
    with pytest.raises(ProfileError, match="has no 123 W limit"):
        synthetic().at(123)


def test_profile_csv_adds_gpus_and_averages_repeated_windows(tmp_path: Path) -> None:
    f = tmp_path / "A100+toy+gpu0-1.csv"
    f.write_text(
        "start_time,window_name,elapsed_time,gpu0_energy,gpu1_energy\n"
        "0,__GlobalPowerLimitOptimizer_400,2.0,700,650\n"
        "3,__GlobalPowerLimitOptimizer_300,2.5,600,580\n"
        "6,__GlobalPowerLimitOptimizer_300,2.5,610,590\n"
    )
    profile = load_profile_csv(f)
    assert profile.gpus == 2 and profile.limits_w == [400, 300]
    # Each window is the same number of steps: a repeat is averaged, not added.
    assert profile.at(300) == LimitPoint(300, 2.5, 1190.0)
    assert profile.at(400) == LimitPoint(400, 2.0, 1350.0)


@needs_data
def test_shared_traces_load() -> None:
    profiles = profiles_in(sorted((DATA / "power-limit-profiles").glob("*.csv"))
                           + sorted((DATA / "nsdi23-traces").glob("summary_power_*.csv")))
    assert len(profiles) == 128
    v100 = load_profile_csv(DATA / "power-limit-profiles" / "V100+resnet50+gpu0.csv")
    assert v100.limits_w == [250, 225, 200, 175, 150, 125, 100]
    assert v100.at(150).energy_j == pytest.approx(4830.296)
    trace = DATA / "nsdi23-traces" / "summary_power_v100.csv"
    with pytest.raises(ProfileError, match="several optimizers"):
        load_power_trace(trace, "cifar100/shufflenetv2", 1024)
    p = load_power_trace(trace, "cifar100/shufflenetv2", 1024, "adam")
    assert p.at(100).time_s == pytest.approx(11.086666666666668)
    assert p.at(100).energy_j == pytest.approx(11.086666666666668 * 91.0042349567595)


def test_cli_simulate_power_limit_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from joules.cli import main

    f = tmp_path / "toy.csv"
    f.write_text(
        "start_time,window_name,elapsed_time,gpu0_energy\n"
        + "".join(f"0,__GlobalPowerLimitOptimizer_{p.limit_w:g},{p.time_s},{p.energy_j}\n"
                  for p in synthetic().points)
    )
    assert main(["simulate", "power-limit", "--profile", str(f), "--selector", "energy",
                 "--search", "sweep", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"chosen_w", "best_w", "profiled_limits_w", "overhead_energy_j", "overhead_time_s"}
    assert out["chosen_w"] == out["best_w"] == 175 and len(out["profiled_limits_w"]) == 9
    assert main(["simulate", "power-limit", "--profile", str(f), "--selector", "fast"]) == 2
    assert "bad selector 'fast'" in capsys.readouterr().err
    assert main(["simulate", "power-limit", "--profile", str(f), "--workload", "a/b",
                 "--batch-size", "8"]) == 2
    assert "--workload and --batch-size select a profile in a trace" in capsys.readouterr().err


@needs_data
def test_cli_simulate_needs_workload_for_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    from joules.cli import main

    trace = str(DATA / "nsdi23-traces" / "summary_power_a40.csv")
    assert main(["simulate", "power-limit", "--profile", trace]) == 2
    assert "needs --workload" in capsys.readouterr().err
    assert main(["simulate", "power-limit", "--profile", trace, "--workload", "cifar100/shufflenetv2",
                 "--batch-size", "1024", "--json"]) == 0
