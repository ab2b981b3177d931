"""benchmarks/recurring.py: the reference policies of ``--ceiling``."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "data" / "nsdi23-traces"
pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/data/nsdi23-traces is not present")


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("recurring")


@pytest.fixture(scope="module")
def job():
    from joules.optimizers.batch_size.traces import load_job

    return load_job(TRACES, "a40", "squad/bert_base_uncased")


def test_oracle_from_the_start_runs_only_the_oracle_charged_like_any_policy(bench, job) -> None:
    from joules.optimizers.batch_size.simulator import oracle_config, simulate

    oracle = oracle_config(job, 0.5).batch_size
    r = simulate(job, seed=1, factory=partial(bench.OracleFromStart, oracle=oracle))
    assert {t.batch_size for t in r.trials} == {oracle}
    assert [t.profiled for t in r.trials].count(True) == 1 and r.trials[0].profiled
    assert len(r.trials) >= r.recurrences


def test_exploration_then_the_oracle_follows_joules_until_it_exploits(bench, job) -> None:
    from joules.optimizers.batch_size.simulator import oracle_config, simulate

    oracle = oracle_config(job, 0.5).batch_size
    joules = simulate(job, seed=1)
    ceiling = simulate(job, seed=1, factory=partial(bench.ExploreThenOracle, oracle=oracle))
    k = next(i for i, t in enumerate(joules.trials) if t.phase == "exploit")
    assert ceiling.trials[:k] == joules.trials[:k]
    assert all(t.phase == "explore" for t in ceiling.trials[:k])
    assert all(t.batch_size == oracle and t.phase == "exploit" for t in ceiling.trials[k:])


def test_ceiling_flag_adds_the_rows(bench, tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["recurring.py", "--traces", str(TRACES), "--no-zeus", "--seeds", "1",
                                      "--gpus", "a40", "--ceiling", "--json", str(out)])
    assert bench.main() == 0
    assert "Ceiling" in capsys.readouterr().out
    data = json.loads(out.read_text())
    names = {"joules", "nsdi23", *bench.CEILING}
    assert set(data["mean_gap_pct"]) == set(data["mean_energy_saved_pct"]) == names
    for row in data["rows"]:
        assert set(row["policies"]) == names
        assert all("energy_saved_pct" in p and "gap_pct" in p for p in row["policies"].values())
    squad = next(r for r in data["rows"] if r["workload"] == "squad/bert_base_uncased")
    assert squad["oracle_batch_size"] == 32  # docs/benchmarks.md section 6
    assert squad["policies"]["oracle from the start"]["gap_pct"] < squad["policies"]["joules"]["gap_pct"]
