"""Pipeline frontier: joules' solver vs lowtime 0.3.0 (Perseus) on the same profiles.

For each case (GPU-like frequency curve, stages x microbatches, time unit), a synthetic
profile is written to a CSV file (:func:`joules.optimizers.pipeline.profile.synthetic_profile`,
forward ``--forward-ms`` at the highest clock, backward twice that, stages up to 15 % apart,
clocks from 900 MHz up in 15 MHz steps), and both solvers plan a 1F1B iteration from it:

- **joules**: :func:`joules.optimizers.pipeline.solver.solve` (``method="auto"``, which is
  ``"fast"`` on all these sizes), in this process;
- **lowtime**: ``benchmarks/_lowtime_frontier.py`` in ``.bench-venv`` (``pip install
  lowtime==0.3.0``), set up as lowtime's own Perseus example.

Both solve times cover reading the options and solving (lowtime's excludes recording its
per-iteration frequencies). Each is the best of ``--repeat`` runs (default 3; lowtime, in a
fresh process each time, is run again only while its runs take under 10 s, so the large
cases are timed once; joules' runs are spread between lowtime's, so both are timed through
the same spells of a shared machine's speed): a single run of a 50 ms solve moves by 10-20 %
with what else the machine is doing and with first-call costs. Every plan lowtime yields is evaluated with its
real profiled times and energies (iteration time = longest path; energy = computations +
blocking power x idle GPU time), the same evaluation joules' plans get. At each lowtime
plan's iteration time T, joules' energy is that of its least-energy plan no slower than T.
Reported: solve times and speed-up, how many of lowtime's points joules beats / ties / loses
and by how much, and the energy saved at the fastest iteration time against running
everything at the highest clock.
Where joules is higher, a line says at how many distinct lowtime plans, from how far into
lowtime's time range, and how joules' clocks differ from lowtime's at the worst point.
With ``--bound N``, both frontiers are also compared with the relaxation's lower bound
(:func:`joules.optimizers.pipeline.solver.energy_lower_bounds`, below every plan) at up to N
of lowtime's points spread over its range and up to N of those where joules is higher: how
far above the optimum each tool can at most be. Where joules is higher, a last table compares
each tool's plan with the bound at that plan's own iteration time (joules' plan there is the
one no slower than lowtime's, so it is earlier): two plans each at the bound are both optimal
and differ only in when they finish. It also counts, of the distinct lowtime plans where joules
is higher, those *pinned* to their time: the bound ``PIN_MS`` earlier is already above the
plan's energy, so a plan at least as low must finish less than ``PIN_MS`` before it (and be
that close to optimal); no frontier is lower there without a plan that close to lowtime's.

Goal: joules at least 10x faster on every case, with energy no higher at any point.

Run: ``python benchmarks/pipeline_frontier.py [--quick] [--case CURVE:SxM:MS ...] [--bound N] [--json PATH]``
from the repository root.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from joules.optimizers.pipeline import solver
from joules.optimizers.pipeline.frontier import Frontier, evaluate
from joules.optimizers.pipeline.profile import CURVES, blocking_power_w, synthetic_profile
from joules.optimizers.pipeline.schedule import Computation, build_dag
from joules.optimizers.pipeline.solver import energy_lower_bounds, solve

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".bench-venv" / "bin" / "python"
RUNNER = ROOT / "benchmarks" / "_lowtime_frontier.py"

FULL = [
    ("a100", 4, 8, 0.001), ("a100", 4, 8, 0.005),
    ("h100", 4, 8, 0.001), ("h100", 4, 8, 0.005),
    ("v100", 4, 8, 0.001), ("v100", 4, 8, 0.005),
    ("a40", 4, 8, 0.001), ("a40", 4, 8, 0.005),
    ("a100", 8, 16, 0.001), ("a100", 8, 16, 0.005),
    ("h100", 8, 16, 0.005),
    ("a100", 4, 32, 0.001), ("a100", 4, 32, 0.005),
    ("v100", 4, 32, 0.005),
    ("h100", 8, 32, 0.005),
]
QUICK = [("a100", 4, 8, 0.005), ("h100", 4, 8, 0.005), ("a100", 4, 32, 0.005)]


@dataclass
class Row:
    curve: str
    stages: int
    microbatches: int
    unit_ms: float
    joules_s: float
    lowtime_s: float
    speedup: float
    points: int
    better: int
    equal: int
    worse: int
    worst_pct: float
    mean_pct: float
    joules_points: int
    saved_joules_pct: float
    saved_lowtime_pct: float
    lowtime_min_time_s: float
    joules_min_time_s: float
    lowtime_max_time_s: float
    joules_max_time_s: float
    cuts: int
    rebuilds: int
    refreshes: int
    higher_plans: int  # distinct lowtime plans (time, energy) where joules is higher
    higher_from_pct: float  # earliest of them, % into lowtime's time range (fastest = 0)
    worst_changes: list[str]  # at the worst point, computations where joules' clock differs
    # Distance to the relaxation's lower bound (--bound), % of the bound, at the points sampled:
    bound_points: int = 0
    bound_higher_points: int = 0  # of them, where joules is higher
    bound_s: float = 0.0  # time of the bound's linear programs, all points together
    joules_bound_max_pct: float = 0.0
    joules_bound_mean_pct: float = 0.0
    lowtime_bound_max_pct: float = 0.0
    lowtime_bound_mean_pct: float = 0.0
    joules_bound_max_higher_pct: float = 0.0  # where joules is higher than lowtime
    lowtime_bound_max_higher_pct: float = 0.0  # (lowtime's plan is at the point: its own time)
    lowtime_bound_mean_higher_pct: float = 0.0
    # There, joules' plan (the least-energy one no slower than the point) against the bound at
    # the plan's own iteration time, and how much earlier than the point that time is:
    joules_own_bound_max_higher_pct: float = 0.0
    joules_own_bound_mean_higher_pct: float = 0.0
    joules_lag_max_ms: float = 0.0
    higher_pinned: int = 0  # distinct lowtime plans where joules is higher, pinned (PIN_MS)


PIN_MS = 0.1  # a lowtime plan is pinned when the bound this much earlier is above its energy
REPEAT_UNDER_S = 10.0  # lowtime is run again (up to --repeat times) only while a run takes less


def run_case(curve: str, stages: int, mbs: int, unit: float, forward_ms: float, seed: int, tmp: Path,
             repeat: int = 3, bound: int = 0) -> Row:
    profile = synthetic_profile(stages, curve, forward_time_s=forward_ms / 1000, seed=seed)
    path = tmp / f"{curve}-{stages}x{mbs}.csv"
    profile.to_csv(path)
    pb = blocking_power_w(curve)
    dag = build_dag("1f1b", stages, mbs)
    joules_times: list[float] = []

    def run_joules() -> Frontier:
        t0 = time.perf_counter()
        result = solve(dag, profile, pb, unit)
        joules_times.append(time.perf_counter() - t0)
        return result

    # joules' runs are spread between lowtime's (one before, one after each), so that both
    # tools are timed through the same spells of a shared machine's speed.
    frontier = run_joules()
    lt_times: list[float] = []
    while not lt_times or (len(lt_times) < repeat and lt_times[-1] < REPEAT_UNDER_S):
        out = subprocess.run(
            [str(PEER_PYTHON), str(RUNNER), str(path), str(stages), str(mbs), str(unit), str(pb)],
            capture_output=True, text=True, check=True,
        )
        lt = json.loads(out.stdout)
        lt_times.append(lt["solve_time_s"])
        if len(joules_times) < repeat:
            run_joules()
    while len(joules_times) < repeat:
        run_joules()
    joules_s, lowtime_s = min(joules_times), min(lt_times)
    plans = []
    for raw in lt["plans"]:
        freqs = [0] * len(dag.nodes)
        for s, insts in raw.items():
            for kind, mb, f in insts:
                freqs[dag.index(Computation(int(s), mb, kind))] = f
        plans.append(evaluate(dag, profile, freqs, pb))
    diffs = [(frontier.energy_at(p.time_s) - p.energy_j) / p.energy_j * 100 for p in plans]
    tol = 1e-7
    fastest_lt = min(plans, key=lambda p: (p.time_s, p.energy_j))
    higher = [p for p, d in zip(plans, diffs, strict=True) if d > tol]
    lt_lo, lt_hi = fastest_lt.time_s, max(p.time_s for p in plans)
    worst_changes = []
    if higher:
        worst = plans[max(range(len(plans)), key=diffs.__getitem__)]
        ours = frontier.plan_for_time(worst.time_s)
        worst_changes = [f"stage {c.stage} {c.kind} {c.microbatch}: {a - b:+d}"
                         for c, a, b in zip(dag.nodes, ours.frequencies, worst.frequencies, strict=True)
                         if a != b]
    top = frontier.max_frequency
    gaps: dict[str, dict[str, list[float]]] = {}
    bound_s = 0.0
    lags: list[float] = []
    pinned = 0
    if bound:
        # Up to `bound` of lowtime's points evenly spread, and up to `bound` where joules is higher.
        spread = set(range(0, len(plans), max(1, len(plans) // bound)))
        worse_at = [i for i, d in enumerate(diffs) if d > tol]
        picked = sorted(spread | set(worse_at[:: max(1, len(worse_at) // bound)]))
        t0 = time.perf_counter()
        lbs = energy_lower_bounds(dag, profile, pb, [plans[i].time_s for i in picked])
        bound_s = time.perf_counter() - t0
        # Where joules is higher: its plan there, against the bound at that plan's own time.
        higher_at = [i for i in picked if diffs[i] > tol]
        own = [frontier.plan_for_time(plans[i].time_s) for i in higher_at]
        own_lbs = energy_lower_bounds(dag, profile, pb, [q.time_s for q in own])
        own_gaps = [(q.energy_j - lb) / lb * 100 for q, lb in zip(own, own_lbs, strict=True)]
        gaps["joules_own"] = {"higher": own_gaps}
        lags = [(plans[i].time_s - q.time_s) * 1000 for i, q in zip(higher_at, own, strict=True)]
        # Every distinct plan of lowtime's where joules is higher: is the bound PIN_MS earlier
        # already above it?
        distinct = list({(round(p.time_s, 9), round(p.energy_j, 6)): p for p in higher}.values())
        early = energy_lower_bounds(dag, profile, pb, [p.time_s - PIN_MS / 1000 for p in distinct])
        pinned = sum(lb > p.energy_j for p, lb in zip(distinct, early, strict=True))
        for name, energy in (("joules", lambda i: frontier.energy_at(plans[i].time_s)),
                             ("lowtime", lambda i: plans[i].energy_j)):
            gaps[name] = {"all": [], "higher": []}
            for i, lb in zip(picked, lbs, strict=True):
                g = (energy(i) - lb) / lb * 100
                gaps[name]["all"].append(g)
                if diffs[i] > tol:
                    gaps[name]["higher"].append(g)

    def gap(name: str, which: str, f) -> float:
        values = gaps.get(name, {}).get(which, [])
        return f(values) if values else 0.0

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return Row(
        curve=curve, stages=stages, microbatches=mbs, unit_ms=unit * 1000,
        joules_s=joules_s, lowtime_s=lowtime_s, speedup=lowtime_s / joules_s,
        points=len(plans),
        better=sum(d < -tol for d in diffs), equal=sum(abs(d) <= tol for d in diffs),
        worse=sum(d > tol for d in diffs), worst_pct=max(diffs), mean_pct=sum(diffs) / len(diffs),
        joules_points=len(frontier.plans),
        saved_joules_pct=(1 - frontier.fastest.energy_j / top.energy_j) * 100,
        saved_lowtime_pct=(1 - fastest_lt.energy_j / top.energy_j) * 100,
        lowtime_min_time_s=fastest_lt.time_s, joules_min_time_s=frontier.min_time_s,
        lowtime_max_time_s=lt_hi, joules_max_time_s=frontier.plans[-1].time_s,
        cuts=int(frontier.meta.get("relaxation_cuts", 0)),  # type: ignore[call-overload]
        rebuilds=int(frontier.meta.get("rebuilds", 0)),  # type: ignore[call-overload]
        refreshes=int(frontier.meta.get("refreshes", 0)),  # type: ignore[call-overload]
        higher_plans=len({(round(p.time_s, 9), round(p.energy_j, 6)) for p in higher}),
        higher_from_pct=(100 * (min(p.time_s for p in higher) - lt_lo) / (lt_hi - lt_lo)
                         if higher and lt_hi > lt_lo else 0.0),
        worst_changes=worst_changes,
        bound_points=len(gaps.get("joules", {}).get("all", [])), bound_s=bound_s,
        bound_higher_points=len(lags),
        joules_bound_max_pct=gap("joules", "all", max), joules_bound_mean_pct=gap("joules", "all", mean),
        lowtime_bound_max_pct=gap("lowtime", "all", max), lowtime_bound_mean_pct=gap("lowtime", "all", mean),
        joules_bound_max_higher_pct=gap("joules", "higher", max),
        lowtime_bound_max_higher_pct=gap("lowtime", "higher", max),
        lowtime_bound_mean_higher_pct=gap("lowtime", "higher", mean),
        joules_own_bound_max_higher_pct=gap("joules_own", "higher", max),
        joules_own_bound_mean_higher_pct=gap("joules_own", "higher", mean),
        joules_lag_max_ms=max(lags, default=0.0),
        higher_pinned=pinned,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="three small cases")
    parser.add_argument("--forward-ms", type=float, default=100.0, help="forward time at the highest clock")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3,
                        help="time each solver as the best of this many runs (lowtime: while under 10 s)")
    parser.add_argument("--case", action="append", default=[], metavar="CURVE:SxM:MS",
                        help="run this case only (e.g. v100:4x8:1; repeatable)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--bound", type=int, default=0, metavar="N",
                        help="also compare both frontiers with the relaxation's lower bound at up to N "
                             "of lowtime's points spread over its range, and up to N where joules is higher")
    parser.add_argument("--span-parts", type=int, default=solver.SPAN_PARTS,
                        help="joules' hull chords span at most 1/N of a computation's time range "
                             "(1: only the SPAN_UNITS cap, as before it)")
    parser.add_argument("--span-units", type=int, default=solver.SPAN_UNITS,
                        help="joules' hull chords span at most N time units (0: chords not merged)")
    parser.add_argument("--plans-per-unit", type=int, default=solver.PLANS_PER_UNIT,
                        help="joules plans this many iteration times per unit")
    args = parser.parse_args()
    if args.span_parts < 1 or args.plans_per_unit < 1:
        sys.exit("--span-parts and --plans-per-unit must be at least 1")
    if args.bound < 0 or args.span_units < 0:
        sys.exit("--bound and --span-units must be 0 or more")
    solver.SPAN_PARTS, solver.PLANS_PER_UNIT = args.span_parts, args.plans_per_unit
    solver.SPAN_UNITS = args.span_units
    cases = QUICK if args.quick else FULL
    if args.case:
        try:
            cases = [(c, int(sm.split("x")[0]), int(sm.split("x")[1]), float(ms) / 1000)
                     for c, sm, ms in (item.split(":") for item in args.case)]
        except ValueError:
            sys.exit(f"bad --case {args.case!r}: expected CURVE:SxM:MS, e.g. v100:4x8:1")
        unknown = sorted({c for c, *_ in cases} - set(CURVES))
        if unknown:
            sys.exit(f"bad --case: unknown GPU curve {', '.join(unknown)}; "
                     f"choose one of {', '.join(CURVES)}")
    if not PEER_PYTHON.exists():
        sys.exit(f"{PEER_PYTHON} not found: python3 -m venv .bench-venv && "
                 ".bench-venv/bin/pip install lowtime==0.3.0")
    console = Console()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for curve, s, m, unit in cases:
            console.print(f"[dim]{curve} {s}x{m} @ {unit * 1000:g} ms ...[/dim]")
            rows.append(run_case(curve, s, m, unit, args.forward_ms, args.seed, Path(tmp),
                                 max(1, args.repeat), args.bound))
    table = Table(title="1F1B time-energy frontier: joules vs lowtime 0.3.0")
    for col in ("GPU curve", "S x M", "unit", "lowtime s", "joules s", "speed-up", "lowtime points",
                "joules lower / equal / higher", "max diff", "mean diff",
                "saved at fastest joules", "saved at fastest lowtime"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.curve, f"{r.stages}x{r.microbatches}", f"{r.unit_ms:g} ms", f"{r.lowtime_s:.2f}",
            f"{r.joules_s:.3f}", f"{r.speedup:.0f}x", str(r.points), f"{r.better} / {r.equal} / {r.worse}",
            f"{r.worst_pct:+.3f} %", f"{r.mean_pct:+.3f} %", f"{r.saved_joules_pct:.1f} %",
            f"{r.saved_lowtime_pct:.1f} %",
        )
    console.print(table)
    walk = Table(title="joules' relaxation walk, and the iteration times each frontier spans")
    for col in ("GPU curve", "S x M", "unit", "lowtime iterations", "cuts", "rebuilds", "refreshes",
                "joules times (s)", "lowtime times (s)"):
        walk.add_column(col, justify="right")
    for r in rows:
        walk.add_row(r.curve, f"{r.stages}x{r.microbatches}", f"{r.unit_ms:g} ms", str(r.points),
                     str(r.cuts), str(r.rebuilds), str(r.refreshes),
                     f"{r.joules_min_time_s:.3f}-{r.joules_max_time_s:.3f}",
                     f"{r.lowtime_min_time_s:.3f}-{r.lowtime_max_time_s:.3f}")
    console.print(walk)
    if args.bound:
        lb = Table(title="Above the relaxation's lower bound (% of the bound) at lowtime's points sampled")
        for col in ("GPU curve", "S x M", "unit", "points", "bound s", "joules max", "joules mean",
                    "lowtime max", "lowtime mean", "where joules is higher: joules max", "lowtime max"):
            lb.add_column(col, justify="right")
        for r in rows:
            higher = (f"{r.joules_bound_max_higher_pct:.3f} %", f"{r.lowtime_bound_max_higher_pct:.3f} %") \
                if r.worse else ("-", "-")
            lb.add_row(r.curve, f"{r.stages}x{r.microbatches}", f"{r.unit_ms:g} ms", str(r.bound_points),
                       f"{r.bound_s:.2f}",
                       f"{r.joules_bound_max_pct:.3f} %", f"{r.joules_bound_mean_pct:.3f} %",
                       f"{r.lowtime_bound_max_pct:.3f} %", f"{r.lowtime_bound_mean_pct:.3f} %", *higher)
        console.print(lb)
        if any(r.worse for r in rows):
            own = Table(title="Where joules is higher: each tool's plan against the bound at the plan's own "
                              "iteration time (% of the bound)")
            for col in ("GPU curve", "S x M", "unit", "points", "joules max", "joules mean", "lowtime max",
                        "lowtime mean", "joules' plan earlier by, max",
                        f"lowtime plans pinned ({PIN_MS:g} ms)"):
                own.add_column(col, justify="right")
            for r in rows:
                if r.worse:
                    own.add_row(r.curve, f"{r.stages}x{r.microbatches}", f"{r.unit_ms:g} ms",
                                str(r.bound_higher_points),
                                f"{r.joules_own_bound_max_higher_pct:.4f} %",
                                f"{r.joules_own_bound_mean_higher_pct:.4f} %",
                                f"{r.lowtime_bound_max_higher_pct:.4f} %",
                                f"{r.lowtime_bound_mean_higher_pct:.4f} %", f"{r.joules_lag_max_ms:.2f} ms",
                                f"{r.higher_pinned} of {r.higher_plans}")
            console.print(own)
    for r in rows:
        if r.worse:
            console.print(f"{r.curve} {r.stages}x{r.microbatches} @ {r.unit_ms:g} ms: joules is higher at "
                          f"{r.worse} points ({r.higher_plans} distinct lowtime plans), the fastest of them "
                          f"{r.higher_from_pct:.0f} % into lowtime's time range; at the worst point joules' "
                          f"clock differs (MHz, joules - lowtime) on {len(r.worst_changes)} computations: "
                          + ", ".join(r.worst_changes))
    met = sum(r.speedup >= 10 and r.worse == 0 for r in rows)
    ok = met == len(rows)
    console.print(f"goal (>= 10x faster, energy never higher) met on {met}"
                  f" of {len(rows)} cases" + ("" if ok else " [bold red](not all)[/bold red]"))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
