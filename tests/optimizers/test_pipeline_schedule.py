"""Pipeline schedules as DAGs, and profiles read from CSV."""

from __future__ import annotations

import math

import pytest

from joules.optimizers.pipeline.frontier import timeline
from joules.optimizers.pipeline.profile import (
    Option,
    PipelineProfile,
    PipelineProfileError,
    pareto_front,
    synthetic_profile,
)
from joules.optimizers.pipeline.schedule import Computation, build_dag


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "mbs"), [(1, 1), (2, 3), (4, 8), (8, 4), (3, 16)])
def test_every_stage_runs_each_microbatch_forward_then_backward(schedule, stages, mbs) -> None:
    dag = build_dag(schedule, stages, mbs)
    assert len(dag.nodes) == 2 * stages * mbs
    preds = dag.predecessors()
    for s, order in enumerate(dag.stage_order):
        seq = [dag.nodes[n] for n in order]
        assert all(c.stage == s for c in seq)
        assert sorted((c.kind, c.microbatch) for c in seq) == sorted(
            (k, m) for k in ("forward", "backward") for m in range(mbs)
        )
        for c in seq:
            if c.kind == "backward":
                assert seq.index(Computation(s, c.microbatch, "forward")) < seq.index(c)
    # Node ids are a topological order, and the cross-stage dependencies are there.
    for v, ps in enumerate(preds):
        assert all(u < v for u in ps)
    for s in range(1, stages):
        for m in range(mbs):
            f = dag.index(Computation(s, m, "forward"))
            assert dag.index(Computation(s - 1, m, "forward")) in preds[f]
            b = dag.index(Computation(s - 1, m, "backward"))
            assert dag.index(Computation(s, m, "backward")) in preds[b]


@pytest.mark.parametrize(("stages", "mbs"), [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_1f1b_warmup_and_iteration_time_with_unit_computations(stages, mbs) -> None:
    dag = build_dag("1f1b", stages, mbs)
    for s, order in enumerate(dag.stage_order):
        kinds = [dag.nodes[n].kind for n in order]
        warmup = min(stages - s - 1, mbs)
        assert kinds[:warmup] == ["forward"] * warmup
        assert kinds[warmup : warmup + 2] == ["forward", "backward"]
    # With forward = backward = 1, both schedules take 2 (M + S - 1) units.
    assert timeline(dag, [1.0] * len(dag.nodes)).time_s == 2 * (mbs + stages - 1)
    gpipe = build_dag("gpipe", stages, mbs)
    assert timeline(gpipe, [1.0] * len(gpipe.nodes)).time_s == 2 * (mbs + stages - 1)


def test_gpipe_runs_all_forwards_first() -> None:
    dag = build_dag("GPipe", 3, 4)
    assert dag.schedule == "gpipe"
    kinds = [dag.nodes[n].kind for n in dag.stage_order[1]]
    assert kinds == ["forward"] * 4 + ["backward"] * 4


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        build_dag("zb", 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        build_dag("1f1b", 0, 2)


def test_pareto_front_uses_effective_energy() -> None:
    opts = [Option(1400, 1.0, 10.0), Option(1200, 1.2, 9.0), Option(1000, 1.5, 9.5), Option(900, 2.0, 9.6)]
    assert [o.frequency for o in pareto_front(opts)] == [1400, 1200]
    # At 10 W blocking, the slower options avoid blocked time: 9.5 - 15 < 9.0 - 12.
    assert [o.frequency for o in pareto_front(opts, blocking_power_w=10.0)] == [1400, 1200, 1000, 900]


def test_profile_csv_round_trip_and_averaging(tmp_path) -> None:
    path = tmp_path / "p.csv"
    path.write_text(
        "stage,instruction,frequency,time,energy\n"
        "0,forward,1410,0.030,9.0\n0,forward,1410,0.032,11.0\n"
        "0,backward,1410,0.060,20.0\n0,forward,1200,0.035,8.0\n"
    )
    p = PipelineProfile.from_csv(path)
    assert p.of(0, "forward") == (Option(1200, 0.035, 8.0), Option(1410, 0.031, 10.0))
    assert p.stages == 1 and p.frequencies() == [1200, 1410]
    out = tmp_path / "again.csv"
    p.to_csv(out)
    assert PipelineProfile.from_csv(out).options == p.options


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stage,instruction,frequency,time\n", "missing column"),
        ("stage,instruction,frequency,time,energy\nx,forward,1,1,1\n", "line 2: stage 'x'"),
        ("stage,instruction,frequency,time,energy\n0,sideways,1,1,1\n", "instruction 'sideways'"),
        ("stage,instruction,frequency,time,energy\n0,forward,1,-1,1\n", "time '-1' must be a positive"),
        ("stage,instruction,frequency,time,energy\n0,forward,1,1,nan\n", "energy 'nan'"),
        ("stage,instruction,frequency,time,energy\n", "no rows"),
        ("stage,instruction,frequency,time,energy\n0,forward,inf,1,1\n", "frequency 'inf' is not a finite"),
        ("stage,instruction,frequency,time,energy\n0,forward,1e400,1,1\n", "frequency '1e400' is not"),
        ("stage,instruction,frequency,time,time\n0,forward,1,2,3\n", "header names 'time' more than once"),
        ("stage,instruction,frequency,time,energy, time\n0,forward,1410,0.1,1,0.5\n",
         "header names 'time' more than once"),  # spaces around a name do not make another column
        ("stage,instruction,frequency,time,energy\n0,forward,1410e6,1,1\n",
         "frequency '1410e6' is beyond 100000 .MHz are expected."),
        ("stage,instruction,frequency,time,energy\n0,forward,1,1,1e308\n", "energy '1e308' is beyond 1e"),
        ("stage,instruction,frequency,time,energy\n0,forward,1,1e300,1\n", "time '1e300' is beyond 86400"),
        ("stage,instruction,frequency,time,energy\n0,forward,1,200,0.034,8.0\n",
         "line 2: 6 fields where the header has 5 .*a comma inside a number"),
        ("stage,instruction,frequency,time,energy\n0,forward,1,1," + "9" * 200_000 + "\n",
         "line 2: field larger than field limit"),
    ],
)
def test_profile_errors_name_the_line_and_field(tmp_path, text, message) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(PipelineProfileError, match=message):
        PipelineProfile.from_csv(path)


def test_profile_errors_name_the_line_of_the_file_past_blank_lines(tmp_path) -> None:
    path = tmp_path / "blank.csv"
    path.write_text(
        "stage,instruction,frequency,time,energy\n"  # line 1
        "0,forward,1410,0.03,6\n"  # 2
        "\n\n"  # 3, 4
        "0,backward,1410,0.06,12\n"  # 5
        "0,backward,1200,0.07,abc\n"  # 6
    )
    with pytest.raises(PipelineProfileError, match=r"blank\.csv, line 6: energy 'abc' is not a number"):
        PipelineProfile.from_csv(path)
    path.write_bytes("stage,instruction,frequency,time,energy\r\n\r\n0,forward,x,1,1\r\n".encode("utf-8-sig"))
    with pytest.raises(PipelineProfileError, match="line 3: frequency 'x'"):
        PipelineProfile.from_csv(path)
    # Blank lines before the header too (the header was taken as missing).
    path.write_text("\n\nstage,instruction,frequency,time,energy\n0,forward,1410,0.03,6\n0,backward,1410,0.06,12\n"
                    "0,backward,1200,0.07,abc\n")
    with pytest.raises(PipelineProfileError, match="line 6: energy 'abc' is not a number"):
        PipelineProfile.from_csv(path)
    path.write_text("\nstage,instruction,frequency,time,energy\n0,forward,1410,0.03,6\n0,backward,1410,0.06,12\n")
    assert PipelineProfile.from_csv(path).options[(0, "backward")][0].energy_j == 12


@pytest.mark.parametrize(("row", "message"), [
    ((0, "forward", 1410, math.nan, 3.0), r"time nan must be a positive finite number"),
    ((0, "forward", 1410, 0.01, math.nan), r"energy nan must be"),
    ((0, "forward", 1410, -0.01, 3.0), r"time -0.01 must be"),
    ((0, "forward", 1410, 0.0, 3.0), r"time 0.0 must be"),
    ((0, "forward", 1410, 0.01, -3.0), r"energy -3.0 must be"),
    ((0, "forward", 1410, math.inf, 3.0), r"time inf must be"),
    ((0, "forward", math.nan, 0.01, 3.0), r"frequency nan is not a finite number"),
    ((0, "forward", 0.2, 0.01, 3.0), r"frequency 0.2 must be positive"),
    ((-1, "forward", 1410, 0.01, 3.0), r"stage -1 is negative"),
    ((0.5, "forward", 1410, 0.01, 3.0), r"stage 0.5 is not an integer"),
    ((0, "fwd", 1410, 0.01, 3.0), r"instruction 'fwd' is not one of"),
])
def test_profiles_built_in_code_are_checked_as_files_are(row, message) -> None:
    """Rows given in code (a profiler's, a synthetic profile's) skipped the file's checks: a NaN
    was dropped without a word, a negative time gave a frontier of negative times, and the
    profile was written to a file its own reader refused."""
    good = [(0, "forward", 1200, 0.04, 5.0), (0, "backward", 1410, 0.06, 12.0)]
    with pytest.raises(PipelineProfileError, match=r"profile 'p', row .*: " + message):
        PipelineProfile.from_rows([*good, row], name="p")
    with pytest.raises(PipelineProfileError, match=r"row \(0, .forward., 900, -0.04.*time -0.04\d* must be"):
        synthetic_profile(2, forward_time_s=-0.03)


def test_profile_frequencies_are_rounded_to_the_nearest_mhz(tmp_path) -> None:
    path = tmp_path / "p.csv"
    path.write_text(
        "stage,instruction,frequency,time,energy\n"
        "0,forward,1410,0.030,6.0\n"
        "0,forward,1410.9,0.050,60.0\n"  # 1411 MHz: another clock, not averaged with 1410
        "0,forward,1409.9999,0.032,5.8\n"  # 1410 MHz: a repeat of the first row, averaged
        "0,backward,1410,0.060,12.0\n"
    )
    p = PipelineProfile.from_csv(path)
    assert p.of(0, "forward") == (Option(1410, pytest.approx(0.031), pytest.approx(5.9)),
                                  Option(1411, 0.05, 60.0))
    assert all(type(o.frequency) is int for o in p.of(0, "forward"))
    rows = [(0, "forward", 1410.9, 0.05, 60.0), (0, "forward", 1411, 0.07, 80.0),
            (0, "forward", 1409.6, 0.03, 6.0)]
    assert PipelineProfile.from_rows(rows).of(0, "forward") == (
        Option(1410, 0.03, 6.0), Option(1411, pytest.approx(0.06), pytest.approx(70.0)))


def test_profile_with_a_byte_order_mark_reads_and_other_encodings_are_named(tmp_path) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes("stage,instruction,frequency,time,energy\n0,forward,1410,0.1,30\n".encode("utf-8-sig"))
    assert PipelineProfile.from_csv(path).of(0, "forward") == (Option(1410, 0.1, 30.0),)
    path.write_bytes("stage,instruction,frequency,time,energy\n0,forward,1410,0.1,3\xe9\n".encode("latin-1"))
    with pytest.raises(PipelineProfileError, match=r"excel\.csv: not a UTF-8 text file"):
        PipelineProfile.from_csv(path)


def test_profile_from_numpy_rows_writes_a_csv_that_reads_back(tmp_path) -> None:
    import numpy as np

    rows = [(0, "forward", np.int64(1410), np.float64(0.03), np.float64(9.0)),
            (0, "backward", np.int64(1410), np.float64(0.06), np.float64(18.0))]
    p = PipelineProfile.from_rows(rows)
    p.to_csv(tmp_path / "p.csv")
    assert PipelineProfile.from_csv(tmp_path / "p.csv").options == p.options


def test_missing_profile_and_missing_stage() -> None:
    with pytest.raises(PipelineProfileError, match="not found"):
        PipelineProfile.from_csv("/nonexistent/profile.csv")
    with pytest.raises(PipelineProfileError, match="stage 2 forward"):
        synthetic_profile(2).check_covers(3)


def test_synthetic_profiles_look_like_gpus() -> None:
    p = synthetic_profile(4, "h100", seed=0)
    fwd = p.of(0, "forward")
    times = [o.time_s for o in fwd]
    energies = [o.energy_j for o in fwd]
    assert times == sorted(times, reverse=True)  # faster at higher clocks
    lowest = energies.index(min(energies))
    assert 0 < lowest < len(energies) - 1  # energy is U-shaped in the clock
    with pytest.raises(PipelineProfileError, match="unknown GPU curve"):
        synthetic_profile(2, "tpu")


def test_stage_sequence_checks_its_arguments() -> None:
    """A global rank given for the stage gave a sequence of negative microbatches."""
    from joules.optimizers.pipeline.schedule import stage_sequence

    assert [(c.microbatch, c.kind) for c in stage_sequence("1F1B", 2, 3, 0)] == [
        (0, "forward"), (1, "forward"), (0, "backward"), (2, "forward"), (1, "backward"), (2, "backward")]
    for stage in (5, -1, True, 0.0):
        with pytest.raises(ValueError, match="stage must be one of 0..1"):
            stage_sequence("1f1b", 2, 3, stage)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        stage_sequence("zb", 2, 3, 0)
    with pytest.raises(ValueError, match="must be >= 1"):
        stage_sequence("gpipe", 2, 0, 0)
