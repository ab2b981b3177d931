"""``joules pipeline``: plan, show and profile, through the CLI's entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from joules.cli import main
from joules.optimizers.pipeline.frontier import Frontier, evaluate, option_table
from joules.optimizers.pipeline.profile import PipelineProfile, synthetic_profile
from joules.optimizers.pipeline.schedule import PipelineDAG, build_dag

SUMMARY_KEYS = {"points", "min_time_s", "energy_at_min_time_j", "max_frequency_energy_j", "solve_time_s"}
SOLVER = "joules.optimizers.pipeline.solver"
SVG = "{http://www.w3.org/2000/svg}"
JOULES = str(Path(sys.executable).parent / "joules")


def two_point_frontier(dag: PipelineDAG, profile: PipelineProfile, blocking_power_w: float,
                       unit_time_s: float = 0.001) -> Frontier:
    """A stand-in for the solver: every computation at its highest, then its lowest, frequency."""
    table = option_table(dag, profile)
    fast = evaluate(dag, profile, [max(opts) for opts in table], blocking_power_w)
    slow = evaluate(dag, profile, [min(opts) for opts in table], blocking_power_w)
    plans = [fast, slow] if slow.energy_j < fast.energy_j else [fast]
    return Frontier(dag, plans, max_frequency=fast, blocking_power_w=blocking_power_w,
                    unit_time_s=unit_time_s, solve_time_s=0.25, profile_name=profile.name)


@pytest.fixture
def fake_solver(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    """Install the stand-in as the solver module; returns the calls it gets."""
    calls: list[tuple[object, ...]] = []

    def solve(dag, profile, blocking_power_w, unit_time_s=0.001, method="auto"):
        calls.append((dag, profile, blocking_power_w, unit_time_s))
        return two_point_frontier(dag, profile, blocking_power_w, unit_time_s)

    from joules.optimizers.pipeline.solver import FINE_UNIT_S, MAX_UNIT_S, METHODS

    fake = types.SimpleNamespace(solve=solve, METHODS=METHODS, FINE_UNIT_S=FINE_UNIT_S, MAX_UNIT_S=MAX_UNIT_S)
    monkeypatch.setitem(sys.modules, SOLVER, fake)
    return calls


@pytest.fixture
def profile_csv(tmp_path: Path) -> Path:
    path = tmp_path / "profile.in.csv"
    synthetic_profile(3, "a100", seed=4).to_csv(path)
    return path


def plan_args(profile: Path, out: Path, *extra: str, stages: int = 3, microbatches: int = 4) -> list[str]:
    return ["pipeline", "plan", "--profile", str(profile), "--stages", str(stages),
            "--microbatches", str(microbatches), "--out", str(out), *extra]


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("joules: error: ")
    return lines[0]


# -- plan ------------------------------------------------------------------------------------

def test_plan_json_is_the_summary_and_nothing_else(fake_solver, profile_csv: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plans"
    assert main(plan_args(profile_csv, out, "--json", "--p2p-power", "85", "--unit-time", "0.002",
                          "--schedule", "GPipe")) == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout)  # the whole of stdout is one JSON document
    assert stdout == json.dumps(summary) + "\n"
    assert set(summary) == SUMMARY_KEYS
    (dag, profile, power, unit), = fake_solver
    assert (dag.schedule, dag.stages, dag.microbatches, power, unit) == ("gpipe", 3, 4, 85.0, 0.002)
    expected = two_point_frontier(dag, profile, 85.0, 0.002)
    assert len(expected.plans) == 2  # the stand-in's two plans, both printed
    assert summary == json.loads(json.dumps(expected.summary()))


def test_plan_writes_frontier_rank_files_profile_copy_and_picture(fake_solver, profile_csv: Path,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plans"
    assert main(plan_args(profile_csv, out, "--json")) == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == [
        "frontier.json", "profile.csv", "rank0.json", "rank1.json", "rank2.json", "schedule.svg"]
    frontier = Frontier.load(out)
    assert frontier.dag == build_dag("1f1b", 3, 4)
    assert frontier.blocking_power_w == 0.0 and frontier.unit_time_s == 0.001  # the defaults
    assert frontier.meta["profile_file"] == "profile.csv"
    original = PipelineProfile.from_csv(profile_csv)
    assert PipelineProfile.from_csv(out / "profile.csv").options == original.options
    top = max(original.frequencies())
    for stage in range(3):
        rank = json.loads((out / f"rank{stage}.json").read_text())
        assert rank["stage"] == stage
        assert rank["time_s"] == frontier.fastest.time_s and rank["energy_j"] == frontier.fastest.energy_j
        instructions = rank["instructions"]
        assert len(instructions) == 2 * 4
        assert instructions == frontier.rank_plan(frontier.fastest, stage)
        assert {i["frequency"] for i in instructions} == {top}
        assert sorted((i["computation"], i["microbatch"]) for i in instructions) == sorted(
            (k, m) for k in ("forward", "backward") for m in range(4))
        # 1F1B: stage s warms up with 3 - s - 1 forwards before its first backward.
        first_backward = next(n for n, i in enumerate(instructions) if i["computation"] == "backward")
        assert first_backward == 3 - stage
    svg = ET.parse(out / "schedule.svg").getroot()
    rects = [r for r in svg.iter(f"{SVG}rect") if "computation" in (r.get("class") or "")]
    assert len(rects) == len(frontier.dag.nodes)
    assert {int(r.get("data-frequency")) for r in rects} == {top}


def test_plan_table(fake_solver, profile_csv: Path, tmp_path: Path,
                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(plan_args(profile_csv, tmp_path / "plans", "--p2p-power", "85")) == 0
    out = capsys.readouterr().out
    frontier = Frontier.load(tmp_path / "plans")
    saved = 100 * (1 - frontier.fastest.energy_j / frontier.max_frequency.energy_j)
    assert "frontier points" in out and f"{saved:.1f} %" in out
    assert f"{frontier.plans[-1].time_s * 1e3:,.1f}" in out  # the slowest point is sampled
    assert "solve time" in out and "0.25 s" in out


def test_plan_errors_are_one_line(fake_solver, profile_csv: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plans"
    assert main(plan_args(tmp_path / "missing.csv", out)) == 2
    assert "pipeline profile not found" in error_line(capsys)
    assert main(plan_args(profile_csv, out, stages=4)) == 2
    assert "does not cover 4 stages: no rows for stage 3 forward, stage 3 backward" in error_line(capsys)
    assert main(plan_args(profile_csv, out, "--schedule", "zigzag")) == 2
    assert "bad --schedule 'zigzag' (expected 1f1b or gpipe)" in error_line(capsys)
    assert main(plan_args(profile_csv, out, "--unit-time", "0")) == 2
    assert "--unit-time" in error_line(capsys)
    assert main(plan_args(profile_csv, out, "--p2p-power", "-1")) == 2
    assert "--p2p-power" in error_line(capsys)
    assert main(plan_args(profile_csv, out, microbatches=10_000_000)) == 2  # built a huge DAG, for hours
    assert "--stages 3 x --microbatches 10000000 is 60,000,000 computations, beyond the 20,000" in error_line(
        capsys)
    # A stage with forward rows only.
    lacking = tmp_path / "lacking.csv"
    lines = profile_csv.read_text().splitlines()
    lacking.write_text("\n".join(ln for ln in lines if not ln.startswith("1,backward,")) + "\n")
    assert main(plan_args(lacking, out)) == 2
    assert "no rows for stage 1 backward" in error_line(capsys)
    bad = tmp_path / "bad.csv"
    bad.write_text("stage,instruction,frequency,time\n0,forward,1410,0.1\n")
    assert main(plan_args(bad, out)) == 2
    assert "missing column(s) energy" in error_line(capsys)
    assert not out.exists()
    assert fake_solver == []


def test_plan_never_overwrites_a_profile_it_joins(fake_solver, profile_csv: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # Per-rank files joined into one: the joined copy goes to DIR/profile.csv, so an input
    # there would lose its raw rows (duplicates are averaged in the copy).
    header, *rows = profile_csv.read_text().splitlines()
    out = tmp_path / "plans"
    out.mkdir()
    first = out / "profile.csv"
    first.write_text("\n".join([header, *(r for r in rows if r.startswith("0,")), rows[0]]) + "\n")
    rest = tmp_path / "rest.csv"
    rest.write_text("\n".join([header, *(r for r in rows if not r.startswith("0,"))]) + "\n")
    before = first.read_text()
    args = ["pipeline", "plan", "--profile", str(first), "--profile", str(rest), "--stages", "3",
            "--microbatches", "4", "--out", str(out)]
    assert main(args) == 2
    assert error_line(capsys) == (f"joules: error: --profile {first} is where the joined profile is "
                                  "written; move it, or give another --out")
    assert first.read_text() == before and fake_solver == []
    moved = tmp_path / "rank0.csv"
    first.rename(moved)
    args[3] = str(moved)
    assert main([*args, "--json"]) == 0
    capsys.readouterr()
    assert moved.read_text() == before and first.exists() and len(fake_solver) == 1


def test_plan_out_must_be_a_directory(fake_solver, profile_csv: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "taken"
    taken.write_text("not plans\n")
    assert main(plan_args(profile_csv, taken)) == 2
    assert error_line(capsys) == f"joules: error: --out {taken} is a file; give a directory"
    assert main(plan_args(profile_csv, taken / "plans")) == 2
    assert error_line(capsys) == (f"joules: error: --out {taken / 'plans'}: {taken} is a file; "
                                  "give a directory")
    assert taken.read_text() == "not plans\n"
    assert fake_solver == []  # refused before solving


@pytest.mark.parametrize("value", ["inf", "1e999", "-inf", "nan", "1e-300", "1e303", "3601"])
def test_plan_refuses_a_unit_time_that_is_not_from_a_microsecond_to_an_hour(
        value: str, profile_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plans"
    assert main(plan_args(profile_csv, out, "--unit-time", value)) == 2
    line = error_line(capsys)  # one line, no traceback
    assert "bad --unit-time" in line and "number of seconds from 1e-06 to 3600" in line
    assert not out.exists()


@pytest.mark.parametrize("value", ["inf", "1e999"])
def test_plan_refuses_an_infinite_p2p_power(value: str, profile_csv: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plans"
    assert main(plan_args(profile_csv, out, "--p2p-power", value)) == 2
    assert "bad --p2p-power inf (expected a finite number of watts" in error_line(capsys)
    assert not out.exists()


def test_plan_bad_method_is_a_clean_error(profile_csv: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(plan_args(profile_csv, tmp_path / "plans", "--method", "greedy")) == 2
    assert "--method 'greedy'" in error_line(capsys)


# -- show ------------------------------------------------------------------------------------

@pytest.fixture
def planned(tmp_path: Path) -> tuple[Path, Frontier]:
    """A directory as ``plan`` leaves it, made without the solver."""
    profile = synthetic_profile(2, "v100", seed=3)
    dag = build_dag("1f1b", 2, 3)
    frontier = two_point_frontier(dag, profile, 55.0)
    assert len(frontier.plans) == 2
    out = tmp_path / "plans"
    frontier.save(out)
    profile.to_csv(out / "profile.csv")
    return out, frontier


def test_show_draws_the_fastest_plan_and_prints_per_stage_frequencies(
        planned: tuple[Path, Frontier], capsys: pytest.CaptureFixture[str]) -> None:
    out, frontier = planned
    assert main(["pipeline", "show", str(out)]) == 0
    text = capsys.readouterr().out
    top = max(frontier.fastest.frequencies)
    assert f"{frontier.fastest.time_s * 1e3:,.1f} ms" in text
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("│")]
    cells = [[c for c in row if c != "│"] for row in rows]
    assert cells == [[str(s), "6", str(top), f"{top:,}", str(top)] for s in range(2)]
    svg = ET.parse(out / "schedule.svg").getroot()
    assert {int(r.get("data-frequency")) for r in svg.iter(f"{SVG}rect") if r.get("data-frequency")} == {top}


def test_show_picks_the_plan_for_a_time_and_writes_png(planned: tuple[Path, Frontier], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out, frontier = planned
    slow = frontier.plans[-1]
    low = min(slow.frequencies)
    picture = tmp_path / "pictures" / "slow.png"
    assert main(["pipeline", "show", str(out / "frontier.json"), "--time", repr(slow.time_s * 1.01),
                 "--out", str(picture)]) == 0
    text = capsys.readouterr().out
    assert f"{slow.time_s * 1e3:,.1f} ms" in text and f"{slow.energy_j:,.1f} J" in text
    assert f"│     0 │            6 │     {low} │" in text
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Between the two plans' times: the fastest (the slow one does not fit).
    middle = (frontier.fastest.time_s + slow.time_s) / 2
    assert main(["pipeline", "show", str(out), "--time", repr(middle)]) == 0
    capsys.readouterr()
    svg = ET.parse(out / f"schedule-{middle * 1e3:g}ms.svg").getroot()
    freqs = {int(r.get("data-frequency")) for r in svg.iter(f"{SVG}rect") if r.get("data-frequency")}
    assert freqs == set(frontier.fastest.frequencies)


def test_show_warns_when_no_plan_is_as_fast_as_the_time(planned: tuple[Path, Frontier],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out, frontier = planned
    fastest = frontier.fastest
    time = fastest.time_s / 2
    assert main(["pipeline", "show", str(out), "--time", repr(time)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"joules: warning: no plan is as fast as --time {time:g} s; the shortest "
                            f"iteration is {fastest.time_s * 1e3:,.1f} ms: showing that plan\n")
    assert captured.out.startswith(f"plan for the shortest iteration: {fastest.time_s * 1e3:,.1f} ms")
    assert f"wrote {out / 'schedule.svg'}" in captured.out
    assert not list(out.glob("schedule-*"))  # not named after a time no plan has
    svg = ET.parse(out / "schedule.svg").getroot()
    freqs = {int(r.get("data-frequency")) for r in svg.iter(f"{SVG}rect") if r.get("data-frequency")}
    assert freqs == set(fastest.frequencies)
    # At the fastest time itself: no warning, the picture named after the time.
    assert main(["pipeline", "show", str(out), "--time", repr(fastest.time_s)]) == 0
    assert capsys.readouterr().err == ""
    assert (out / f"schedule-{fastest.time_s * 1e3:g}ms.svg").is_file()


def test_show_errors(planned: tuple[Path, Frontier], tmp_path: Path,
                     capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = planned
    assert main(["pipeline", "show", str(tmp_path / "nowhere")]) == 2
    assert "frontier file not found" in error_line(capsys)
    assert main(["pipeline", "show", str(out), "--out", str(tmp_path / "x.jpg")]) == 2
    assert ".svg or .png" in error_line(capsys)
    (tmp_path / "afile").write_text("")
    assert main(["pipeline", "show", str(out), "--out", str(tmp_path / "afile" / "x.svg")]) == 2
    assert f"afile{os.sep}x.svg: {tmp_path / 'afile'} is a file; give a directory" in error_line(capsys)
    assert main(["pipeline", "show", str(out), "--time", "0"]) == 2
    assert "--time" in error_line(capsys)
    other = tmp_path / "other.csv"
    synthetic_profile(1, "v100").to_csv(other)
    assert main(["pipeline", "show", str(out), "--profile", str(other)]) == 2
    assert "does not cover 2 stages" in error_line(capsys)
    (out / "profile.csv").unlink()
    assert main(["pipeline", "show", str(out)]) == 2
    assert "pass --profile FILE" in error_line(capsys)
    (out / "frontier.json").write_text("{\"version\": 1}")
    assert main(["pipeline", "show", str(out), "--profile", str(other)]) == 2
    assert "malformed frontier" in error_line(capsys)


@pytest.mark.parametrize("value", ["inf", "1e999"])
def test_show_refuses_an_infinite_time(value: str, planned: tuple[Path, Frontier],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = planned
    before = sorted(p.name for p in out.iterdir())
    assert main(["pipeline", "show", str(out), "--time", value]) == 2
    assert "--time must be a positive number of seconds, got inf" in error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == before  # no picture drawn


def test_show_warns_when_the_profile_is_not_the_one_planned_from(
        planned: tuple[Path, Frontier], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = planned
    slower = tmp_path / "slower.csv"
    synthetic_profile(2, "v100", seed=3, forward_time_s=0.06).to_csv(slower)
    assert main(["pipeline", "show", str(out), "--profile", str(slower)]) == 0
    assert "is it the profile the frontier was planned from?" in capsys.readouterr().err


# -- profile ---------------------------------------------------------------------------------

def test_profile_writes_a_synthetic_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "data" / "h100.csv"
    assert main(["pipeline", "profile", "--gpu", "H100", "--stages", "4", "--seed", "7", "--noise", "0.02",
                 "--out", str(path)]) == 0
    assert "110 W" in capsys.readouterr().out  # the blocking power to plan with
    prof = PipelineProfile.from_csv(path)
    assert prof.stages == 4
    expected = synthetic_profile(4, "h100", seed=7, noise=0.02)
    assert prof.options.keys() == expected.options.keys()
    for key, opts in expected.options.items():
        assert [o.frequency for o in prof.options[key]] == [o.frequency for o in opts]
        assert [o.time_s for o in prof.options[key]] == pytest.approx([o.time_s for o in opts])
    assert main(["pipeline", "profile", "--gpu", "tpu", "--stages", "2", "--out", str(path)]) == 2
    assert "unknown GPU curve 'tpu'" in error_line(capsys)
    assert main(["pipeline", "profile", "--gpu", "a100", "--stages", "2", "--noise", "-1",
                 "--out", str(path)]) == 2
    assert "--noise" in error_line(capsys)


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipeline", "plan", "--stages", "2"]) == 2
    assert "--profile" in error_line(capsys)
    assert main(["pipeline", "profile", "--gpu", "a100", "--stages", "0", "--out", "x.csv"]) == 2
    assert "--stages" in error_line(capsys)


# -- with the real solver --------------------------------------------------------------------

def test_plan_and_show_with_the_solver(tmp_path: Path) -> None:
    profile = tmp_path / "a100.csv"
    out = tmp_path / "plans"

    def joules(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([JOULES, "pipeline", *args], capture_output=True, text=True, timeout=300)

    r = joules("profile", "--gpu", "a100", "--stages", "3", "--out", str(profile))
    assert r.returncode == 0, r.stderr
    r = joules("plan", "--profile", str(profile), "--stages", "3", "--microbatches", "4",
               "--p2p-power", "85", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert set(summary) == SUMMARY_KEYS
    points = summary["points"]
    assert len(points) >= 2
    assert all(a["time_s"] < b["time_s"] and a["energy_j"] > b["energy_j"]
               for a, b in zip(points, points[1:], strict=False))
    frontier = Frontier.load(out)
    # The fastest plan is as fast as running everything at the highest clock, for less energy.
    assert summary["min_time_s"] == pytest.approx(frontier.max_frequency.time_s, rel=1e-9)
    assert summary["energy_at_min_time_j"] <= summary["max_frequency_energy_j"] * (1 + 1e-9)
    prof = PipelineProfile.from_csv(out / "profile.csv")
    for p in frontier.plans:
        assert evaluate(frontier.dag, prof, p.frequencies, 85.0).time_s == pytest.approx(p.time_s, rel=1e-9)
    r = joules("show", str(out), "--time", repr(points[-1]["time_s"]), "--out", str(tmp_path / "slow.png"))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert (tmp_path / "slow.png").read_bytes()[:4] == b"\x89PNG"


def test_profile_with_large_noise_stays_positive_and_plans(tmp_path) -> None:
    out = tmp_path / "noisy.csv"
    assert main(["pipeline", "profile", "--gpu", "a100", "--stages", "2", "--noise", "0.5",
                 "--out", str(out)]) == 0
    profile = PipelineProfile.from_csv(out)  # every time and energy read back as positive
    options = [o for s in range(2) for k in ("forward", "backward") for o in profile.of(s, k)]
    assert min(min(o.time_s, o.energy_j) for o in options) > 0
    assert main(["pipeline", "plan", "--profile", str(out), "--stages", "2", "--microbatches", "2",
                 "--out", str(tmp_path / "plans")]) == 0


def test_paths_with_brackets_are_printed_as_they_are(tmp_path: Path) -> None:
    """Paths were rich markup: "[fast]" vanished from what was printed, and "[/b]" was a traceback."""
    folder = tmp_path / "exp[fast]"

    def joules(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([JOULES, "pipeline", *args], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "COLUMNS": "400"})

    for profile in (folder / "p[/b].csv", folder / "profile[red].csv"):
        r = joules("profile", "--gpu", "a100", "--stages", "2", "--out", str(profile))
        assert r.returncode == 0 and f"wrote {profile}:" in r.stdout, r.stdout + r.stderr
    r = joules("plan", "--profile", str(profile), "--stages", "2", "--microbatches", "2", "--out",
               str(folder / "plans"))
    assert r.returncode == 0, r.stderr
    assert "profile[red].csv:" in r.stdout and f"to {folder / 'plans'}" in r.stdout, r.stdout
    r = joules("show", str(folder / "plans"), "--out", str(folder / "s[1].svg"))
    assert r.returncode == 0 and f"wrote {folder / 's[1].svg'}" in r.stdout, r.stdout + r.stderr
    assert (folder / "s[1].svg").is_file()
