"""The NSDI'23 trace loaders and the recurring-job simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from joules.optimizers.batch_size.simulator import (
    SimulationError,
    choose_limit,
    default_config,
    expected,
    oracle_config,
    simulate,
)
from joules.optimizers.batch_size.traces import (
    JOBS,
    JobSpec,
    JobTrace,
    TraceError,
    load_job,
    load_train_trace,
)
from joules.optimizers.batch_size.types import TrialOutcome, trial_cost
from joules.optimizers.power_limit import LimitPoint, Profile

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
TRACES = DATA / "nsdi23-traces"
needs_data = pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/data is not present")

KEYS = {"energy_j", "time_s", "default_energy_j", "default_time_s", "oracle_energy_j", "oracle_time_s",
        "cost", "default_cost", "oracle_cost", "recurrences"}

TRAIN_HEADER = "dataset,network,batch_size,optimizer,learning_rate,run,target_metric,target_epoch\n"
POWER_HEADER = "dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power\n"


def write_traces(tmp_path: Path, train_rows: str, power_rows: str, gpu: str = "v100") -> Path:
    (tmp_path / "summary_train.csv").write_text(TRAIN_HEADER + train_rows)
    (tmp_path / f"summary_power_{gpu}.csv").write_text(POWER_HEADER + power_rows)
    return tmp_path


def small_traces(tmp_path: Path) -> Path:
    runs = {16: (3, 3), 32: (4, 6), 64: ("nan", 9)}
    train = "".join(f"toy,net,{b},adam,1e-3,{r},0.5,{e}\n"
                    for b, es in runs.items() for r, e in enumerate(es, 1))
    train += "toy,net,32,adam,1e-3,1,0.6000000000000001,8\ntoy,net,32,adam,1e-3,2,0.6000000000000001,\n"
    power = "".join(f"toy,net,{b},adam,{w},{t},{p}\n" for b, rows in {
        16: ((200, 10.0, 180.0), (100, 14.0, 95.0)),
        32: ((200, 6.0, 190.0), (100, 9.0, 98.0)),
        64: ((200, 4.0, 195.0), (100, 6.0, 99.0)),
        128: ((200, 3.0, 199.0), (100, 5.0, 99.0)),
    }.items() for w, t, p in rows)
    return write_traces(tmp_path, train, power)


def test_train_trace_matches_the_target_up_to_rounding_and_keeps_failed_runs(tmp_path: Path) -> None:
    path = small_traces(tmp_path) / "summary_train.csv"
    t = load_train_trace(path, "toy/net", 0.5)
    assert t.optimizer == "adam"
    assert dict(t.runs) == {16: (3, 3), 32: (4, 6), 64: (None, 9)}
    assert dict(load_train_trace(path, "toy/net", 0.6).runs) == {32: (8, None)}


def test_load_job_joins_both_traces(tmp_path: Path) -> None:
    spec = JobSpec("toy", "net", 0.5, max_epochs=8, default_batch_size=100)
    job = load_job(small_traces(tmp_path), "v100", spec)
    assert job.batch_sizes == (16, 32, 64)  # 128 has no training runs
    assert job.spec.default_batch_size == 64  # the largest candidate not above 100
    assert job.max_power_w == 200.0 and job.power_limits_w == [200.0, 100.0]
    assert job.default_recurrences() == 2 * 3 * 2
    assert job.profiles[32].at(100).energy_j == pytest.approx(9.0 * 98.0)
    assert not job.reaches(9) and job.reaches(8) and not job.reaches(None)


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda d: (d / "summary_train.csv").unlink(), "training trace not found"),
    (lambda d: (d / "summary_power_v100.csv").unlink(), r"power trace not found: .*summary_power_v100.csv"),
    (lambda d: (d / "summary_train.csv").write_text("dataset,network,batch_size\n"),
     "summary_train.csv: missing column.*optimizer, run, target_metric, target_epoch"),
    (lambda d: (d / "summary_train.csv").write_text(TRAIN_HEADER + "toy,net,32,adam,1,x,0.5,4\n"),
     "line 2: run='x' is not a number"),
    (lambda d: (d / "summary_train.csv").write_text(TRAIN_HEADER + "\n" + "toy,net,32,adam,1,x,0.5,4\n"),
     "line 3: run='x' is not a number"),  # the file's line: a blank line counts
    (lambda d: (d / "summary_train.csv").write_text(TRAIN_HEADER + "toy,net,32,adam,1,1,0.5,0\n"),
     "line 2: target_epoch='0': epochs count from 1"),
    (lambda d: (d / "summary_train.csv").write_text(TRAIN_HEADER + "toy,net,32,adam,1,1,0.5,4\n"
                                                     "toy,net,32,adam,1,1,0.5,5\n"),
     "line 3: batch size 32 run 1 listed twice"),
    (lambda d: (d / "summary_train.csv").write_text(TRAIN_HEADER + "toy,net,32,adam,1,1,0.7,4\n"),
     r"toy/net has no target_metric 0.5 \(has 0.7\)"),
    (lambda d: (d / "summary_train.csv").write_text(TRAIN_HEADER + "other,net,32,adam,1,1,0.5,4\n"),
     "no rows for workload toy/net"),
    (lambda d: (d / "summary_power_v100.csv").write_text(POWER_HEADER + "toy,net,32,adam,200,fast,100\n"),
     "summary_power_v100.csv, line 2: time_per_epoch='fast' is not a number"),
    (lambda d: (d / "summary_power_v100.csv").write_text(POWER_HEADER + "toy,net,32,adam,200,1,100\n"
                                                         "toy,net,32,adam,100,-5,60\n"),
     "summary_power_v100.csv, line 3: time_per_epoch='-5' is not a positive finite number"),
    (lambda d: (d / "summary_power_v100.csv").write_text(POWER_HEADER + "toy,net,32,adam,200,1,nan\n"),
     "summary_power_v100.csv, line 2: average_power='nan' is not a positive finite number"),
    (lambda d: (d / "summary_power_v100.csv").write_text(POWER_HEADER + "toy,net,32,adam,200,1,100\n"
                                                         "toy,net,32,adam,100,2,60\n"
                                                         "toy,net,32,adam,200,1,90\n"),
     r"summary_power_v100.csv, line 4: power_limit 200 W of toy/net/32/adam is already on line 2"),
    (lambda d: (d / "summary_train.csv").write_bytes(TRAIN_HEADER.encode()
                                                     + b"toy,net,32,adam\xe9,1,1,0.5,4\n"),
     r"summary_train.csv: not a UTF-8 text file"),
    (lambda d: (d / "summary_power_v100.csv").write_text(POWER_HEADER + "toy,net,32,sgd,200,1,100\n"),
     "no rows for workload toy/net with optimizer adam"),
    (lambda d: (d / "summary_power_v100.csv").write_text(POWER_HEADER + "toy,net,32,adam,200,1,100\n"
                                                         "toy,net/v2,32,adam,200,1,100\n"),
     r"summary_power_v100.csv, line 3: .*must not contain '/' \(row 'toy/net/v2/32/adam'\)"),
])
def test_trace_errors_name_the_file_and_column(tmp_path: Path, mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    d = small_traces(tmp_path)
    mutate(d)
    with pytest.raises(TraceError, match=match):
        load_job(d, "v100", JobSpec("toy", "net", 0.5, 8, 64))


def test_unknown_workload_gpu_and_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"unknown workload 'mnist/lenet' \(known: cifar100/shufflenetv2, "):
        load_job(tmp_path, "v100", "mnist/lenet")
    with pytest.raises(TraceError, match="trace directory not found"):
        load_job(tmp_path / "nope", "v100", "cifar100/shufflenetv2")
    small_traces(tmp_path)
    with pytest.raises(TraceError, match=r"summary_power_h100.csv \(GPUs with a trace: v100\)"):
        load_job(tmp_path, "h100", JobSpec("toy", "net", 0.5, 8, 64))


def toy_job(max_epochs: int = 8) -> JobTrace:
    # Per epoch at 200 W / 100 W. 32 reaches in 4 or 6 epochs, 16 in 3; 64 fails half the time.
    def profile(b: int, hi: tuple[float, float], lo: tuple[float, float]) -> Profile:
        points = (LimitPoint(200, hi[0], hi[0] * hi[1]), LimitPoint(100, lo[0], lo[0] * lo[1]))
        return Profile(f"toy/{b}", points)

    return JobTrace(
        spec=JobSpec("toy", "net", 0.5, max_epochs, 32), gpu="v100", optimizer="adam",
        batch_sizes=(16, 32, 64),
        runs={16: (3, 3), 32: (4, 6), 64: (None, 2)},
        profiles={16: profile(16, (10, 180), (14, 95)), 32: profile(32, (6, 190), (9, 98)),
                  64: profile(64, (4, 195), (6, 99))},
        max_power_w=200.0,
    )


def test_expected_costs_count_retries_of_failing_runs() -> None:
    job = toy_job()
    # 64 fails half its runs: 2 epochs when it reaches, plus 1/(1-0.5) - 1 = 1 failed run of 8 epochs.
    e = expected(job, 64, 200, 0.5)
    assert e is not None
    assert e.time_s == pytest.approx((2 + 8) * 4) and e.energy_j == pytest.approx((2 + 8) * 4 * 195)
    assert e.cost == pytest.approx(trial_cost(0.5, 200, e.energy_j, e.time_s))
    assert default_config(job, 0.5).batch_size == 32 and default_config(job, 0.5).power_limit_w == 200
    o = oracle_config(job, 0.5)
    costs = {(b, w): expected(job, b, w, 0.5).cost for b in (16, 32, 64) for w in (200, 100)}  # type: ignore[union-attr]
    assert (o.batch_size, o.power_limit_w) == min(costs, key=costs.__getitem__)
    never = JobTrace(**{**toy_job().__dict__, "runs": {16: (3,), 32: (None,), 64: (None,)}})
    assert expected(never, 32, 200, 0.5) is None
    with pytest.raises(SimulationError, match="default batch size 32 never reaches"):
        simulate(never, recurrences=2)


def test_simulation_keys_totals_and_determinism() -> None:
    job = toy_job()
    a = simulate(job, policy="joules", recurrences=12, seed=3)
    b = simulate(job, policy="joules", recurrences=12, seed=3)
    assert a.to_dict() == b.to_dict()
    r = a.to_dict()
    assert set(r) == KEYS and r["recurrences"] == 12
    assert r["energy_j"] == pytest.approx(sum(t.energy_j for t in a.trials))
    assert r["cost"] == pytest.approx(trial_cost(0.5, 200, r["energy_j"], r["time_s"]))
    assert r["default_cost"] == pytest.approx(12 * a.default.cost)
    assert sum(t.outcome == TrialOutcome.REACHED for t in a.trials) == 12
    assert a.trials[0].batch_size == 32 and a.trials[0].profiled
    assert [t.batch_size for t in a.trials[:3]] == [32, 16, 64]  # the pruning pass
    json.dumps(r)


def test_profiling_overhead_is_charged_to_the_first_trial_of_a_batch_size() -> None:
    job = toy_job()
    limit_w, extra_t, extra_e = choose_limit(job, 32, 0.5)
    # Per epoch at 200 W: 6 s, 1140 J -> cost 0.5*1140 + 0.5*200*6 = 1170; at 100 W: 9 s, 882 J ->
    # 1341: 200 W wins. The search profiles both limits: each takes half an epoch.
    assert limit_w == 200
    assert extra_t == pytest.approx(0.5 * (9 - 6)) and extra_e == pytest.approx(0.5 * (882 - 1140))
    job = JobTrace(**{**job.__dict__, "runs": {16: (3,), 32: (4,), 64: (None,)}})
    res = simulate(job, policy="nsdi23", recurrences=12, seed=0)
    runs32 = [t for t in res.trials if t.batch_size == 32]
    assert [t.profiled for t in runs32[:2]] == [True, False]
    assert runs32[0].epochs == runs32[1].epochs == 4
    assert runs32[0].time_s == pytest.approx(runs32[1].time_s + extra_t)
    assert runs32[0].energy_j == pytest.approx(runs32[1].energy_j + extra_e)
    assert runs32[1].time_s == pytest.approx(4 * 6.0)


def test_early_stopped_trials_never_cross_the_stop_cost() -> None:
    job = toy_job(max_epochs=40)
    job = JobTrace(**{**job.__dict__, "runs": {16: (30,), 32: (4,), 64: (None,)}})
    res = simulate(job, policy="nsdi23", recurrences=6, seed=1)
    # 32 reaches the target at 4766; 16 (30 epochs) and 64 (never) are stopped before 2 x that.
    assert [(t.batch_size, t.outcome.value, t.epochs) for t in res.trials[:3]] == [
        (32, "reached", 4), (16, "early_stopped", 4), (64, "early_stopped", 11)]
    stop = 2.0 * res.trials[0].cost
    for t in res.trials[1:3]:
        p = job.profiles[t.batch_size].at(t.power_limit_w)
        assert t.cost <= stop < t.cost + trial_cost(0.5, 200, p.energy_j, p.time_s)
    assert [t.batch_size for t in res.trials[3:]] == [32] * 5  # 16 and 64 pruned
    # Judging each epoch by the cost so far (as the server does), a trial stops just past it.
    after = simulate(job, policy="nsdi23", recurrences=6, seed=1, stop_before=False)
    assert [(t.batch_size, t.epochs) for t in after.trials[1:3]] == [(16, 5), (64, 12)]
    assert all(t.cost > stop for t in after.trials[1:3])


@needs_data
def test_real_traces_jobs() -> None:
    job = load_job(TRACES, "v100", "cifar100/shufflenetv2")
    assert job.batch_sizes == (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    assert job.optimizer == "adadelta" and job.max_power_w == 250.0 and job.default_recurrences() == 140
    assert job.runs[1024] == (74, 80, 71, 70, 80, 77, 97, 77, 90, 71)
    assert job.runs[2048][0] == 191 and not job.reaches(191)
    o = oracle_config(job, 0.5)
    assert (o.batch_size, o.power_limit_w) == (128, 100.0)
    img = load_job(TRACES, "v100", "imagenet/resnet50")
    assert img.batch_sizes == (64, 128, 192, 256, 360) and img.spec.default_batch_size == 256
    assert all(e is None for e in img.runs[64])
    a40 = load_job(TRACES, "a40", "sentiment140/bert_base_uncased")
    assert a40.batch_sizes == (8, 16, 32, 64, 128) and a40.default_recurrences() == 50
    assert load_job(TRACES, "a40", "librispeech/deepspeech2").spec.higher_is_better is False
    assert set(JOBS) == {"cifar100/shufflenetv2", "imagenet/resnet50", "squad/bert_base_uncased",
                         "librispeech/deepspeech2", "movielens-1m/ncf", "sentiment140/bert_base_uncased"}


@needs_data
@pytest.mark.parametrize("policy", ["joules", "nsdi23"])
def test_real_trace_simulation_beats_the_default(policy: str) -> None:
    job = load_job(TRACES, "v100", "cifar100/shufflenetv2")
    res = simulate(job, policy=policy, seed=1)
    r = res.to_dict()
    assert set(r) == KEYS and r["recurrences"] == 140
    assert r["oracle_cost"] < r["cost"] < 0.5 * r["default_cost"]  # saves over half the default's cost
    gap = r["cost"] / r["oracle_cost"] - 1
    assert gap < (0.05 if policy == "joules" else 0.10)
    assert simulate(job, policy=policy, seed=1).to_dict() == r
