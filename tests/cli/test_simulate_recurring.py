"""``joules simulate recurring``: the batch-size optimizer replayed on the NSDI'23 traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from joules.cli import main

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "nsdi23-traces"
needs_data = pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/data is not present")

KEYS = {"energy_j", "time_s", "default_energy_j", "default_time_s", "oracle_energy_j", "oracle_time_s",
        "cost", "default_cost", "oracle_cost", "recurrences"}


def recurring(*args: str) -> list[str]:
    return ["simulate", "recurring", "--traces", str(TRACES), *args]


@needs_data
def test_json_has_the_totals_and_is_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    args = recurring("--gpu", "a40", "--workload", "sentiment140/bert_base_uncased", "--seed", "2", "--json")
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == KEYS and out["recurrences"] == 50  # 2 x 5 batch sizes x 5 power limits
    assert out["oracle_cost"] <= out["cost"] < out["default_cost"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == out
    assert main([*args, "--policy", "nsdi23", "--recurrences", "12", "--eta", "1", "--beta", "3"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["recurrences"] == 12 and other["cost"] == pytest.approx(other["energy_j"])  # eta 1: energy


@needs_data
def test_table_shows_the_run_against_both_baselines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(recurring("--gpu", "v100", "--workload", "cifar100/shufflenetv2", "--recurrences", "20")) == 0
    out = capsys.readouterr().out
    assert "cifar100/shufflenetv2 on v100: 20 recurrences, joules policy" in out
    assert "default 1024" in out and "hindsight" in out and "128 @ 100 W" in out  # the table wraps at 80
    assert "energy saved vs default" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu", "v100", "--workload", "mnist/lenet"],
     "unknown workload 'mnist/lenet' (known: cifar100/shufflenetv2"),
    (["--gpu", "v100", "--workload", "squad/bert_base_uncased", "--policy", "zeus"],
     "bad --policy 'zeus' (expected joules or nsdi23)"),
    (["--gpu", "v100", "--workload", "squad/bert_base_uncased", "--eta", "2"], "bad --eta 2"),
    (["--gpu", "v100", "--workload", "squad/bert_base_uncased", "--beta", "1"], "bad --beta 1"),
])
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(recurring(*args)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_directory_and_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["simulate", "recurring", "--gpu", "v100", "--workload", "squad/bert_base_uncased", "--traces"]
    assert main([*args, str(tmp_path / "nope")]) == 2
    assert f"trace directory not found: {tmp_path / 'nope'}" in capsys.readouterr().err
    (tmp_path / "summary_power_a40.csv").write_text("dataset\n")
    assert main([*args, str(tmp_path)]) == 2
    assert "summary_power_v100.csv (GPUs with a trace: a40)" in capsys.readouterr().err


def test_traces_that_are_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    file = tmp_path / "summary_train.csv"
    file.write_text("dataset\n")
    assert main(["simulate", "recurring", "--gpu", "v100", "--workload", "squad/bert_base_uncased",
                 "--traces", str(file)]) == 2
    err = capsys.readouterr().err
    assert err == f"joules: error: not a trace directory: {file} is a file, not a directory\n"


def test_gpu_name_in_any_case(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "summary_power_a40.csv").write_text("dataset\n")
    args = ["simulate", "recurring", "--workload", "squad/bert_base_uncased", "--traces", str(tmp_path)]
    assert main([*args, "--gpu", "A40"]) == 2
    err = capsys.readouterr().err
    assert "power trace" not in err and "training trace not found" in err  # A40 found the a40 trace
    assert main([*args, "--gpu", "V100"]) == 2
    assert "summary_power_V100.csv (GPUs with a trace: a40)" in capsys.readouterr().err


@needs_data
def test_gpu_name_is_the_traces_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(recurring("--gpu", "V100", "--workload", "cifar100/shufflenetv2", "--recurrences", "3")) == 0
    assert "cifar100/shufflenetv2 on v100: 3 recurrences" in capsys.readouterr().out
