"""Replay the power-limit searches on recorded profiles: choice and profiling overhead.

Every profile in ``DATA/power-limit-profiles/*.csv`` and every (workload, batch size,
optimizer) of ``DATA/nsdi23-traces/summary_power_*.csv`` is replayed with the full sweep and
with the adaptive search, for each selector. Reported per selector: how often the adaptive
search chooses what the sweep chooses, how often each matches the best limit in hindsight,
the limits profiled, and the adaptive search's profiling overhead (extra energy and time
against running each profiled window at the chosen limit) relative to the sweep's.

Run: ``python benchmarks/power_limit_replay.py [--data ../shared/data] [--patience N]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from joules.optimizers.power_limit import Adaptive, Sweep, parse_selector, profiles_in, replay

SELECTORS = ("time", "energy", "cost:0.5", "slowdown:1.1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    ap.add_argument("--patience", type=int, default=2)
    args = ap.parse_args()
    files = sorted((args.data / "power-limit-profiles").glob("*.csv"))
    files += sorted((args.data / "nsdi23-traces").glob("summary_power_*.csv"))
    if not files:
        print(f"no profiles under {args.data} (expected power-limit-profiles/ and nsdi23-traces/)",
              file=sys.stderr)
        return 1
    profiles = profiles_in(files)
    t = Table(title=f"Power-limit search replay: {len(profiles)} profiles, adaptive patience {args.patience}")
    for col in ("selector", "same as sweep", "sweep = hindsight", "adaptive = hindsight",
                "limits (adaptive / sweep)", "energy overhead vs sweep", "time overhead vs sweep"):
        t.add_column(col, justify="right")
    for spec in SELECTORS:
        same = sweep_best = adaptive_best = 0
        n_sweep = n_adaptive = 0
        energy = {"sweep": 0.0, "adaptive": 0.0}
        time = {"sweep": 0.0, "adaptive": 0.0}
        for p in profiles:
            sel = parse_selector(spec, p.gpus)
            rs = replay(p, Sweep(p.limits_w, sel))
            ra = replay(p, Adaptive(p.limits_w, sel, args.patience))
            same += rs.chosen_w == ra.chosen_w
            sweep_best += rs.chosen_w == rs.best_w
            adaptive_best += ra.chosen_w == ra.best_w
            n_sweep += len(rs.profiled_limits_w)
            n_adaptive += len(ra.profiled_limits_w)
            for name, r in (("sweep", rs), ("adaptive", ra)):
                energy[name] += r.overhead_energy_j
                time[name] += r.overhead_time_s
        n = len(profiles)
        t.add_row(spec, f"{100 * same / n:.1f} %", f"{100 * sweep_best / n:.1f} %",
                  f"{100 * adaptive_best / n:.1f} %", f"{n_adaptive / n:.1f} / {n_sweep / n:.1f}",
                  f"{energy['adaptive'] / energy['sweep']:.2f}x", f"{time['adaptive'] / time['sweep']:.2f}x")
    Console(width=150).print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
