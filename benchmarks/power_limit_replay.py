"""Replay the power-limit searches on recorded profiles: choice and profiling overhead.

Every profile in ``DATA/power-limit-profiles/*.csv`` and every (workload, batch size,
optimizer) of ``DATA/nsdi23-traces/summary_power_*.csv`` is replayed with the full sweep and
with the adaptive search, for each selector. Reported per selector: how often the adaptive
search chooses what the sweep chooses, how often each matches the best limit in hindsight,
the limits profiled, and the adaptive search's profiling overhead (extra energy and time
against running each profiled window at the chosen limit, summed over the profiles) relative
to the sweep's; also in the selector's own cost units (energy for ``slowdown``). One table
for all profiles, then one per source (real training runs, traces).

Goal: same choice as the sweep on at least 95 % of the profiles, and overhead at most half
the sweep's, in energy and in time. Where the sweep's total overhead is negative (marked †:
its profiling saved energy or time, as slower low limits do for ``time``), "at most half"
means the adaptive search saves at least half as much, i.e. a ratio of 0.5 or more.

Run: ``python benchmarks/power_limit_replay.py [--data ../shared/data] [--selectors time,energy]``
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from joules.optimizers.power_limit import (
    Adaptive,
    LimitPoint,
    MaxSlowdown,
    Profile,
    Selector,
    Sweep,
    parse_selector,
    profiles_in,
    replay,
)

SELECTORS = ("time", "energy", "cost:0.5", "slowdown:1.1")


@dataclass
class Totals:
    """One selector over a set of profiles."""

    n: int = 0
    same: int = 0
    sweep_best: int = 0
    adaptive_best: int = 0
    limits_sweep: int = 0
    limits_adaptive: int = 0
    energy_sweep: float = 0.0
    energy_adaptive: float = 0.0
    time_sweep: float = 0.0
    time_adaptive: float = 0.0
    cost_sweep: float = 0.0
    cost_adaptive: float = 0.0

    def meets_goal(self) -> bool:
        return (self.same >= 0.95 * self.n and self.energy_adaptive <= 0.5 * self.energy_sweep
                and self.time_adaptive <= 0.5 * self.time_sweep)


def objective(selector: Selector, point: LimitPoint, reference: LimitPoint) -> float:
    """The selector's cost, or energy for a slowdown bound (whose cost is infinite beyond it)."""
    return point.energy_j if isinstance(selector, MaxSlowdown) else selector.cost(point, reference)


def run(profiles: list[Profile], spec: str, min_margin: float, noise_gain: float) -> Totals:
    t = Totals()
    for p in profiles:
        sel = parse_selector(spec, p.gpus)
        rs = replay(p, Sweep(p.limits_w, sel))
        ra = replay(p, Adaptive(p.limits_w, sel, p.gpus, min_margin=min_margin, noise_gain=noise_gain))
        ref = p.points[0]
        t.n += 1
        t.same += rs.chosen_w == ra.chosen_w
        t.sweep_best += rs.chosen_w == rs.best_w
        t.adaptive_best += ra.chosen_w == ra.best_w
        t.limits_sweep += len(rs.profiled_limits_w)
        t.limits_adaptive += len(ra.profiled_limits_w)
        t.energy_sweep += rs.overhead_energy_j
        t.energy_adaptive += ra.overhead_energy_j
        t.time_sweep += rs.overhead_time_s
        t.time_adaptive += ra.overhead_time_s
        for r, attr in ((rs, "cost_sweep"), (ra, "cost_adaptive")):
            chosen = objective(sel, p.at(r.chosen_w), ref)
            extra = sum(objective(sel, p.at(x), ref) - chosen for x in r.profiled_limits_w)
            setattr(t, attr, getattr(t, attr) + extra)
    return t


def ratio(adaptive: float, sweep: float) -> str:
    if sweep == 0:
        return "-"
    return f"{adaptive / sweep:.2f}x" + ("†" if sweep < 0 else "")


def table(title: str, rows: list[tuple[str, Totals]]) -> Table:
    t = Table(title=title)
    for col in ("selector", "same as sweep", "sweep = hindsight", "adaptive = hindsight",
                "limits (adaptive / sweep)", "energy overhead vs sweep", "time overhead vs sweep",
                "cost overhead vs sweep", "goal met"):
        t.add_column(col, justify="right")
    for spec, s in rows:
        n = s.n
        t.add_row(spec, f"{100 * s.same / n:.1f} %", f"{100 * s.sweep_best / n:.1f} %",
                  f"{100 * s.adaptive_best / n:.1f} %",
                  f"{s.limits_adaptive / n:.1f} / {s.limits_sweep / n:.1f}",
                  ratio(s.energy_adaptive, s.energy_sweep), ratio(s.time_adaptive, s.time_sweep),
                  ratio(s.cost_adaptive, s.cost_sweep), "yes" if s.meets_goal() else "no")
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    ap.add_argument("--selectors", default=",".join(SELECTORS),
                    help="comma-separated selectors (default: %(default)s)")
    ap.add_argument("--min-margin", type=float, default=0.04, help="Adaptive min_margin")
    ap.add_argument("--noise-gain", type=float, default=2.0, help="Adaptive noise_gain")
    args = ap.parse_args()
    sources = {
        "real runs": sorted((args.data / "power-limit-profiles").glob("*.csv")),
        "traces": sorted((args.data / "nsdi23-traces").glob("summary_power_*.csv")),
    }
    if not any(sources.values()):
        print(f"no profiles under {args.data} (expected power-limit-profiles/ and nsdi23-traces/)",
              file=sys.stderr)
        return 1
    groups = {name: profiles_in(files) for name, files in sources.items() if files}
    everything = [p for ps in groups.values() for p in ps]
    specs = [s.strip() for s in args.selectors.split(",") if s.strip()]
    console = Console(width=170)
    caption = (f"adaptive: min_margin {args.min_margin:g}, noise_gain {args.noise_gain:g}. "
               "† the sweep's overhead is negative (it saved): the goal needs a ratio >= 0.5 there")
    for name, profiles in [("all", everything), *groups.items()]:
        rows = [(spec, run(profiles, spec, args.min_margin, args.noise_gain)) for spec in specs]
        t = table(f"Power-limit search replay, {name}: {len(profiles)} profiles", rows)
        t.caption = caption
        console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
