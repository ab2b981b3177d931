"""The batch-size optimizer on recurring jobs: joules vs the original NSDI'23 (Zeus) simulator.

Reproduces the trace-driven evaluation of the Zeus paper (NSDI'23) on every workload of the
training trace and every GPU with a power trace (v100, a40), for several seeds, with:

- **joules**: ``joules.optimizers.batch_size`` (both policy variants, ``joules`` and
  ``nsdi23``) in joules' simulator (:func:`joules.optimizers.batch_size.simulator.simulate`),
  whose power limits come from joules' adaptive power-limit search;
- **Zeus**: the original simulator and policies of ``zeus._legacy`` (Zeus 0.16,
  ``PruningGTSBatchSizeOptimizer`` + ``JITPowerLimitOptimizer``), run in ``.bench-venv``
  by ``benchmarks/_zeus_recurring.py`` on the same traces, seeds, eta, beta and recurrences.

Reported per (GPU, workload), averaged over the seeds: energy saved against the default
configuration (default batch size at the highest power limit), and the gap to the best
configuration in hindsight (cost above the oracle's, %). Both baselines are expected values
computed by joules from the traces (the same for every policy). The goal, per row: joules'
energy savings at least the original's, and joules' gap at most half the original's.

``--ablation`` adds rows for joules' policy with one part turned off (the cost-based end of
an exploration direction; the end predicted by the rising trend of the estimates; the
per-epoch cost model shared across batch sizes; the temperature of Thompson sampling; the
upward-first pass; that pass going on to the end), so each part's worth shows. ``--set
NAME=VALUE`` runs joules' policy with a setting changed (``margin``, ``temperature``, ...).
``--stop-after`` makes joules' simulator stop a trial after the epoch that crossed the stop
cost, not before it. ``--blocks K`` judges the goal again on each block of K consecutive seeds
(with ``--seeds 20 --blocks 5``: how a 5-seed verdict moves with the seeds). ``--ceiling``
adds two reference policies that know the best configuration in hindsight, in joules'
simulator with the same seeds: ``oracle from the start`` runs the oracle's batch size in every
recurrence, and ``joules, then oracle`` runs joules' policy until its exploration ends, then
the oracle's batch size. Both are charged like any policy (power limit from joules' search,
its profiling, early stopping), so they bound what a policy that minimizes the cost can save.

Run: ``python benchmarks/recurring.py [--seeds 5] [--eta 0.5] [--beta 2] [--gpus v100,a40]
[--ablation] [--ceiling] [--set NAME=VALUE ...] [--stop-after] [--no-zeus] [--blocks K]
[--json PATH]`` (from the repository root; ``.bench-venv`` must have Zeus, see
``benchmarks/README.md``; ``--no-zeus`` runs joules alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from joules.optimizers.batch_size.policy import JoulesPolicy, make_policy
from joules.optimizers.batch_size.simulator import oracle_config, simulate
from joules.optimizers.batch_size.traces import JOBS, JobTrace, known_gpus, load_job
from joules.optimizers.batch_size.types import Policy, PolicyConfig, PolicyState

ROOT = Path(__file__).resolve().parents[1]
ZEUS_PYTHON = ROOT / ".bench-venv" / "bin" / "python"
ZEUS_RUNNER = ROOT / "benchmarks" / "_zeus_recurring.py"


class NoCostStop(JoulesPolicy):
    """joules without the cost-based end of a direction: a direction goes on until a failure."""

    margin = float("inf")


class NoTrend(JoulesPolicy):
    """joules without the trend: a direction is not ended by the extrapolated cost of its next candidate."""

    extrapolate = False


class LogCostModel(JoulesPolicy):
    """joules without the per-epoch model: Thompson sampling on log costs with a shared variance."""

    per_epoch = False


class NoTemperature(JoulesPolicy):
    """joules with plain Thompson sampling: each mean is drawn with its whole posterior variance."""

    temperature = 1.0


class DownFirst(JoulesPolicy):
    """joules exploring downwards first whatever the default's epochs (as the original)."""

    up_first_fraction = 0.0


class UpFirstJudged(JoulesPolicy):
    """joules whose upward-first direction is ended by the estimated costs, like any direction."""

    up_first_to_end = False


class OracleFromStart(JoulesPolicy):
    """Reference: the oracle's batch size in every recurrence, no exploration.

    Its power limit is joules' choice for that batch size, its profiling charged to the first
    trial, and its trials stopped early like any policy's (the simulator does all that).
    """

    def __init__(self, config: PolicyConfig, oracle: int) -> None:
        super().__init__(config)
        self.oracle = oracle

    def _choose(self, state: PolicyState, rng: Any) -> tuple[int, str]:
        return self.oracle, "exploit"


class ExploreThenOracle(OracleFromStart):
    """Reference: joules' policy until its exploration ends, then the oracle's batch size."""

    def _initial(self) -> dict[str, Any]:
        return {**super()._initial(), "oracle_now": False}

    def _choose(self, state: PolicyState, rng: Any) -> tuple[int, str]:
        if not state["oracle_now"]:
            bs, phase = JoulesPolicy._choose(self, state, rng)
            if phase == "explore":
                return bs, phase
            state["oracle_now"] = True  # the first exploitation: from now on, the oracle
        return self.oracle, "exploit"


def tuned(settings: list[str]) -> type[JoulesPolicy]:
    """``JoulesPolicy`` with class attributes set from ``NAME=VALUE`` strings (``--set``)."""
    attrs: dict[str, object] = {}
    for item in settings:
        name, sep, text = item.partition("=")
        default = getattr(JoulesPolicy, name, None)
        if not sep or name.startswith("_") or not isinstance(default, bool | int | float):
            raise SystemExit(f"bad --set {item!r}: expected NAME=VALUE with NAME a JoulesPolicy setting "
                             "(margin, temperature, up_first_fraction, extrapolate, ...)")
        try:
            attrs[name] = text.lower() in ("1", "true", "yes") if isinstance(default, bool) else float(text)
        except ValueError:
            raise SystemExit(f"bad --set {item!r}: {text!r} is not a number") from None
    return type("TunedJoulesPolicy", (JoulesPolicy,), attrs)


POLICIES: dict[str, Callable[[PolicyConfig], Policy]] = {
    "joules": make_policy,
    "nsdi23": lambda c: make_policy(PolicyConfig(**{**c.__dict__, "variant": "nsdi23"})),
}
ABLATIONS: dict[str, Callable[[PolicyConfig], Policy]] = {
    "joules - cost stop": NoCostStop,
    "joules - trend": NoTrend,
    "joules - per-epoch model": LogCostModel,
    "joules - temperature": NoTemperature,
    "joules - up first": DownFirst,
    "joules - to the end": UpFirstJudged,
}
CEILING: dict[str, type[OracleFromStart]] = {
    "oracle from the start": OracleFromStart,
    "joules, then oracle": ExploreThenOracle,
}


def run_joules(job: JobTrace, factory: Callable[[PolicyConfig], Policy], seeds: list[int], eta: float,
               beta: float, stop_before: bool = True) -> dict[str, Any]:
    runs = {}
    t0 = time.perf_counter()
    for seed in seeds:
        r = simulate(job, seed=seed, eta=eta, beta=beta, factory=factory, stop_before=stop_before)
        runs[str(seed)] = {**{k: r.to_dict()[k] for k in ("energy_j", "time_s", "cost")},
                           "trials": len(r.trials)}
    return {"runs": runs, "wall_s": time.perf_counter() - t0}


def run_zeus(traces: Path, job: JobTrace, seeds: list[int], eta: float, beta: float) -> dict[str, Any]:
    spec = job.spec
    arg = {"traces": str(traces), "gpu": job.gpu, "dataset": spec.dataset, "network": spec.network,
           "optimizer": job.optimizer, "target_metric": spec.target_metric, "max_epochs": spec.max_epochs,
           "default_batch_size": spec.default_batch_size, "eta": eta, "beta": beta,
           "recurrences": job.default_recurrences(), "seeds": seeds}
    t0 = time.perf_counter()
    proc = subprocess.run([str(ZEUS_PYTHON), str(ZEUS_RUNNER), json.dumps(arg)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"Zeus failed on {spec.workload} ({job.gpu}):\n{proc.stderr[-3000:]}")
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"runs": runs, "wall_s": time.perf_counter() - t0}


def summarize(res: dict[str, Any], job: JobTrace, eta: float) -> None:
    """Add means, savings and gap to one policy's result."""
    from joules.optimizers.batch_size.simulator import default_config, oracle_config

    runs = list(res["runs"].values())
    n = job.default_recurrences()
    d, o = default_config(job, eta), oracle_config(job, eta)
    energy = sum(r["energy_j"] for r in runs) / len(runs)
    cost = sum(r["cost"] for r in runs) / len(runs)
    res.update(energy_j=energy, time_s=sum(r["time_s"] for r in runs) / len(runs), cost=cost,
               energy_saved_pct=100 * (1 - energy / (n * d.energy_j)),
               cost_saved_pct=100 * (1 - cost / (n * d.cost)),
               gap_pct=100 * (cost / (n * o.cost) - 1),
               gap_pct_per_seed=[100 * (r["cost"] / (n * o.cost) - 1) for r in runs])


def goal_met(j: dict[str, Any], z: dict[str, Any]) -> tuple[bool, bool]:
    """The goal on one pair: (joules saves at least the original's energy, its gap is at most half)."""
    return j["energy_saved_pct"] >= z["energy_saved_pct"], j["gap_pct"] <= 0.5 * z["gap_pct"]


def judge_blocks(console: Console, rows: list[dict[str, Any]], jobs: list[JobTrace], seeds: list[int],
                 k: int, eta: float) -> None:
    """Judge the goal again on each block of ``k`` consecutive seeds, as a ``k``-seed run would."""
    for start in range(0, len(seeds) - k + 1, k):
        block = {str(s) for s in seeds[start:start + k]}
        missed = []
        for row, job in zip(rows, jobs, strict=True):
            part = {}
            for name in ("joules", "zeus (original)"):
                res = {"runs": {s: r for s, r in row["policies"][name]["runs"].items() if s in block}}
                summarize(res, job, eta)
                part[name] = res
            j, z = part["joules"], part["zeus (original)"]
            if not all(goal_met(j, z)):
                saved = j["energy_saved_pct"] - z["energy_saved_pct"]
                missed.append(f"{job.gpu} {job.spec.workload} (saved {saved:+.2f} points, "
                              f"gap {j['gap_pct']:.2f} % against {z['gap_pct']:.2f} %)")
        met = len(rows) - len(missed)
        console.print(f"seeds {seeds[start]}-{seeds[start + k - 1]}: goal met on {met} of {len(rows)}"
                      + (f"; missed: {', '.join(missed)}" if missed else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "data" / "nsdi23-traces")
    ap.add_argument("--seeds", type=int, default=5, help="seeds 1..N (default: %(default)s)")
    ap.add_argument("--eta", type=float, default=0.5)
    ap.add_argument("--beta", type=float, default=2.0)
    ap.add_argument("--gpus", default=None, help="comma-separated (default: every power trace)")
    ap.add_argument("--ablation", action="store_true", help="also joules with one part turned off")
    ap.add_argument("--ceiling", action="store_true",
                    help="also the oracle's batch size from the start, and after joules' exploration")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="run joules' policy with this setting changed (e.g. margin=0.2; repeatable)")
    ap.add_argument("--stop-after", action="store_true",
                    help="joules' simulator stops a trial after the epoch that crossed the stop cost")
    ap.add_argument("--no-zeus", action="store_true", help="skip the original (Zeus) simulator")
    ap.add_argument("--blocks", type=int, default=0, metavar="K",
                    help="also judge the goal on each block of K consecutive seeds "
                         "(e.g. --seeds 20 --blocks 5)")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the raw results")
    args = ap.parse_args()
    if args.blocks and (args.no_zeus or not 1 <= args.blocks <= args.seeds):
        ap.error(f"--blocks {args.blocks}: needs Zeus (no --no-zeus) and 1 <= K <= --seeds ({args.seeds})")
    if not args.traces.is_dir():
        print(f"trace directory not found: {args.traces}", file=sys.stderr)
        return 1
    if not args.no_zeus and not ZEUS_PYTHON.exists():
        print(f"{ZEUS_PYTHON} not found: set up .bench-venv (benchmarks/README.md) or pass --no-zeus",
              file=sys.stderr)
        return 1
    gpus = args.gpus.split(",") if args.gpus else [g for g in ("v100", "a40") if g in known_gpus(args.traces)]
    seeds = list(range(1, args.seeds + 1))
    jobs = [load_job(args.traces, g, w) for g in gpus for w in JOBS]
    policies = {**POLICIES, **(ABLATIONS if args.ablation else {})}
    if args.set:
        policies["joules"] = tuned(args.set)
    console = Console(width=180)
    t0 = time.perf_counter()

    zeus: dict[int, Any] = {}
    with ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1)) as pool:
        futures = {}
        if not args.no_zeus:
            futures = {i: pool.submit(run_zeus, args.traces, job, seeds, args.eta, args.beta)
                       for i, job in enumerate(jobs)}
        rows = []
        for job in jobs:
            row: dict[str, Any] = {"gpu": job.gpu, "workload": job.spec.workload,
                                   "recurrences": job.default_recurrences(), "policies": {}}
            factories = dict(policies)
            if args.ceiling:
                row["oracle_batch_size"] = oracle = oracle_config(job, args.eta).batch_size
                factories.update({n: partial(cls, oracle=oracle) for n, cls in CEILING.items()})
            for name, factory in factories.items():
                res = run_joules(job, factory, seeds, args.eta, args.beta, not args.stop_after)
                summarize(res, job, args.eta)
                row["policies"][name] = res
            rows.append(row)
            console.print(f"[dim]{job.gpu} {job.spec.workload}: joules done[/dim]")
        for i, f in futures.items():
            zeus[i] = f.result()
    joules_wall = sum(p["wall_s"] for r in rows for p in r["policies"].values())
    for i, row in enumerate(rows):
        if i in zeus:
            summarize(zeus[i], jobs[i], args.eta)
            row["policies"]["zeus (original)"] = zeus[i]
            z, j = zeus[i], row["policies"]["joules"]
            row["goal_savings"], row["goal_gap"] = goal_met(j, z)
    wall = time.perf_counter() - t0

    zeus_name = "zeus (original)"
    main_names = ["joules"] + ([] if args.no_zeus else [zeus_name]) + ["nsdi23"]
    t = Table(title=f"Batch-size optimizer on recurring jobs: {len(seeds)} seeds, eta {args.eta:g}, "
                    f"beta {args.beta:g}, 2 x |B| x |P| recurrences (N)")
    for col in ("GPU", "workload", "N"):
        t.add_column(col, justify="left" if col != "N" else "right")
    for name in main_names:
        t.add_column(f"energy saved\n{name}", justify="right")
    for name in main_names:
        t.add_column(f"gap\n{name}", justify="right")
    if not args.no_zeus:
        t.add_column("gap ratio\njoules/zeus", justify="right")
        t.add_column("goal\nsaved, gap", justify="center")

    def mean(name: str, key: str) -> float:
        return sum(r["policies"][name][key] for r in rows) / len(rows)

    for row in rows:
        pol = row["policies"]
        cells = [row["gpu"], row["workload"], str(row["recurrences"])]
        cells += [f"{pol[n]['energy_saved_pct']:.1f} %" for n in main_names]
        cells += [f"{pol[n]['gap_pct']:.2f} %" for n in main_names]
        if not args.no_zeus:
            cells.append(f"{pol['joules']['gap_pct'] / pol[zeus_name]['gap_pct']:.2f}")
            cells.append(f"{'yes' if row['goal_savings'] else 'NO'}, {'yes' if row['goal_gap'] else 'NO'}")
        t.add_row(*cells)
    cells = ["mean", "", ""]
    cells += [f"{mean(n, 'energy_saved_pct'):.1f} %" for n in main_names]
    cells += [f"{mean(n, 'gap_pct'):.2f} %" for n in main_names]
    if not args.no_zeus:
        met = sum(r["goal_savings"] and r["goal_gap"] for r in rows)
        cells += [f"{mean('joules', 'gap_pct') / mean(zeus_name, 'gap_pct'):.2f}", f"{met} of {len(rows)}"]
    t.add_row(*cells, style="bold")
    zeus_wall = sum(z["wall_s"] for z in zeus.values())
    t.caption = ("energy saved: vs the default batch size at the highest power limit; gap: cost above the "
                 "best configuration in hindsight. nsdi23: joules' implementation of the original policy. "
                 f"Wall time {wall:.0f} s (joules simulations {joules_wall:.1f} s"
                 + ("" if args.no_zeus else f"; Zeus {zeus_wall:.0f} s in parallel subprocesses") + ").")
    console.print(t)
    if not args.no_zeus:
        console.print(f"goal (joules saves at least the original's energy, at most half its gap) met on "
                      f"{met} of {len(rows)}: savings on {sum(r['goal_savings'] for r in rows)}, "
                      f"gap on {sum(r['goal_gap'] for r in rows)}")
    if args.blocks:
        judge_blocks(console, rows, jobs, seeds, args.blocks, args.eta)
    if args.ablation:
        names = ["joules", *ABLATIONS, "nsdi23"]
        a = Table(title="Ablation: gap to the best configuration in hindsight (cost above it)")
        for col in ("GPU", "workload", *names):
            a.add_column(col, justify="left" if col in ("GPU", "workload") else "right")
        for row in rows:
            a.add_row(row["gpu"], row["workload"], *(f"{row['policies'][n]['gap_pct']:.2f} %" for n in names))
        a.add_row("mean", "", *(f"{mean(n, 'gap_pct'):.2f} %" for n in names), style="bold")
        console.print(a)
    if args.ceiling:
        names = ["joules", *([] if args.no_zeus else [zeus_name]), *CEILING]
        c = Table(title="Ceiling: the oracle's batch size (known in hindsight), charged like any policy")
        c.add_column("GPU", no_wrap=True)
        c.add_column("workload", no_wrap=True)
        c.add_column("oracle\nbatch size", justify="right")
        for name in names:
            c.add_column(f"energy saved\n{name}", justify="right")
        for name in names:
            c.add_column(f"gap\n{name}", justify="right")
        for row in rows:
            pol = row["policies"]
            c.add_row(row["gpu"], row["workload"], str(row["oracle_batch_size"]),
                      *(f"{pol[n]['energy_saved_pct']:.2f} %" for n in names),
                      *(f"{pol[n]['gap_pct']:.2f} %" for n in names))
        c.add_row("mean", "", "", *(f"{mean(n, 'energy_saved_pct'):.2f} %" for n in names),
                  *(f"{mean(n, 'gap_pct'):.2f} %" for n in names), style="bold")
        console.print(c)
    means = {n: mean(n, "gap_pct") for n in rows[0]["policies"]}
    if args.json:
        out = {"seeds": seeds, "eta": args.eta, "beta": args.beta, "rows": rows, "mean_gap_pct": means,
               "wall_s": wall}
        if args.ceiling:
            out["mean_energy_saved_pct"] = {n: mean(n, "energy_saved_pct") for n in rows[0]["policies"]}
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
