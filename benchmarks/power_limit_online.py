"""Drive the real online power-limit optimizer with the recorded profiles, on simulated GPUs.

``power_limit_replay.py`` replays only the *search* on the recorded points. This benchmark
runs the whole :class:`~joules.optimizers.power_limit.PowerLimitOptimizer` instead: callbacks,
warm-up and profiling steps, epoch ends, limits set on (simulated) GPUs, and time and energy
*measured* by an :class:`~joules.monitoring.EnergyMonitor` from the GPUs' energy counters,
on a virtual clock.

For every profile in ``DATA/power-limit-profiles/*.csv`` and every (workload, batch size,
optimizer) of ``DATA/nsdi23-traces/summary_power_*.csv``:

* ``profile.gpus`` simulated GPUs of the profile's model (named in the profile or file name,
  else A100) whose allowed power limits are exactly the profile's range (the optimizer is
  given the profile's limits as candidates);
* a training step is ``1/S`` of the profile's unit of work (a recorded window of 40 steps,
  or an epoch; ``S = --steps-per-window``): at limit ``L`` it lasts ``time_s(L) / S`` and
  each GPU draws the recorded average power ``energy_j(L) / time_s(L) / gpus`` (a constant
  utilization that yields exactly that power). Where the recorded power exceeds ``L``
  (measurement noise in the recordings) the GPU draws ``L``: such points are counted as
  *clamped*.
* epochs of ``--epoch-steps`` steps, no evaluation between them, until the optimizer is done.

Virtual time is compressed per profile so that a step at the highest limit lasts at most
``--max-step-s`` (the traces' epochs last up to 12 h: simulating them in real time would
poll the simulated sensors millions of times). Power is unchanged, so every selector
compares the same ratios and the search takes the same decisions; only the energy
counter's resolution relative to a step changes. Times and energies below are scaled back.

Results per selector, for the joules defaults (``search="adaptive"``) and the classic full
sweep (every limit from the highest down) with the same step counts: how often the adaptive
optimizer chooses what the sweeping one chooses, how often each chooses the best limit in
hindsight (the selector over all the profile's points) and what the search-only replay
chooses, limits profiled and steps until done, and the profiling overhead: the true energy
(time) from train begin until the optimizer is done, minus what the same number of steps
takes at the chosen limit, summed over profiles. Overhead is in the profiles' own units: a
step is ``1/S`` of a recorded window or epoch.

Goal: same choice as the sweep on at least 95 % of the profiles, and adaptive overhead at
most half the sweep's (``adaptive <= 0.5 * sweep``), in energy and in time. Where the sweep's
total is negative (†: its profiling saved, as fast high limits do in time for ``energy``),
that inequality means the adaptive optimizer saves at least half as much.

Run: ``python benchmarks/power_limit_online.py [--data ../shared/data] [--selectors time,energy]``
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from joules.devices.restore import RestoreGuard
from joules.devices.sim import Constant, Simulator
from joules.devices.sim.catalog import GPU_MODELS, GPUModel
from joules.devices.sim.gpu import SimGPU
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.power_limit import (
    Adaptive,
    PowerLimitOptimizer,
    Profile,
    State,
    Sweep,
    parse_selector,
    profiles_in,
    replay,
)

SELECTORS = ("time", "energy", "cost:0.5", "slowdown:1.1")
SEARCHES = ("adaptive", "sweep")
STATE_ENV = "JOULES_STATE_DIR"


@dataclass(frozen=True)
class OnlineResult:
    """One run of the online optimizer on one profile.

    Attributes:
        chosen_w: The limit the optimizer chose.
        best_w: The best limit in hindsight (the selector over every point of the profile).
        replay_w: What the same search chooses when replayed on the recorded points.
        replay_limits_w: The limits that replay profiles, in order.
        profiled_limits_w: Limits profiled, in order.
        steps: Training steps from train begin until the optimizer was done.
        energy_j: True energy of those steps, all GPUs (profile units).
        time_s: Their time (profile units).
        overhead_energy_j: ``energy_j`` minus the energy of as many steps at the chosen limit.
        overhead_time_s: Likewise for time.
        clamped: Profiled limits where the recorded power exceeded the limit (drawn: the limit).
    """

    chosen_w: float
    best_w: float
    replay_w: float
    replay_limits_w: list[float]
    profiled_limits_w: list[float]
    steps: int
    energy_j: float
    time_s: float
    overhead_energy_j: float
    overhead_time_s: float
    clamped: int


def model_for(profile: Profile, source: str = "") -> GPUModel:
    """A catalog model named in the profile's or its file's name (else A100), fitted to the profile.

    Its limit range is exactly the profile's, its default limit the highest one; its peak power
    covers, and its idle power stays below, every recorded average power per GPU.
    """
    tokens = {t.upper() for t in re.split(r"[^A-Za-z0-9]+", f"{profile.name} {source}") if t}
    base = next((GPU_MODELS[k] for k in GPU_MODELS if k in tokens), GPU_MODELS["A100"])
    powers = [p.average_power_w / profile.gpus for p in profile.points]
    lo, hi = min(profile.limits_w), max(profile.limits_w)
    return base.with_overrides(
        min_limit_w=lo, max_limit_w=hi, default_limit_w=hi,
        peak_w=max(base.peak_w, max(powers)), idle_w=min(base.idle_w, 0.8 * min(powers)),
    )


@contextmanager
def private_state_dir() -> Iterator[Path]:
    """A temporary ``$JOULES_STATE_DIR`` (restore journals, saved profiles) for the duration."""
    old = os.environ.get(STATE_ENV)
    with tempfile.TemporaryDirectory(prefix="joules-plo-bench-") as d:
        os.environ[STATE_ENV] = d
        try:
            yield Path(d)
        finally:
            if old is None:
                os.environ.pop(STATE_ENV, None)
            else:
                os.environ[STATE_ENV] = old


def simulate(
    profile: Profile,
    selector: str,
    search: str = "adaptive",
    *,
    source: str = "",
    warmup_steps: int = 10,
    profile_steps: int = 40,
    steps_per_window: float = 40.0,
    epoch_steps: int = 100,
    max_step_s: float = 0.25,
    state_dir: Path | None = None,
) -> OnlineResult:
    """Run the online optimizer on simulated GPUs that behave as ``profile`` records.

    Args:
        profile: The recorded profile.
        selector: A selector spec (``time``, ``energy``, ``cost:ETA``, ``slowdown:FACTOR``).
        search: ``"adaptive"`` or ``"sweep"``.
        source: The file the profile came from (its name may name the GPU model).
        warmup_steps: The optimizer's warm-up steps per limit (and after each epoch end).
        profile_steps: The optimizer's measured steps per limit.
        steps_per_window: Training steps per recorded window or epoch (``S``).
        epoch_steps: Steps per training epoch.
        max_step_s: Longest simulated step at the highest limit; virtual time is compressed
            (power unchanged) for profiles whose steps are longer.
        state_dir: Restore journals go there (default: a temporary directory).
    """
    if state_dir is None:
        with private_state_dir() as d:
            return simulate(profile, selector, search, source=source, warmup_steps=warmup_steps,
                            profile_steps=profile_steps, steps_per_window=steps_per_window,
                            epoch_steps=epoch_steps, max_step_s=max_step_s, state_dir=d)
    n_gpus = profile.gpus
    model = model_for(profile, source)
    # Real-scale step: time and power per GPU at each limit (power clamped to the limit).
    step_t = {p.limit_w: p.time_s / steps_per_window for p in profile.points}
    recorded_w = {p.limit_w: p.average_power_w / n_gpus for p in profile.points}
    drawn_w = {x: min(w, x) for x, w in recorded_w.items()}
    scale = min(1.0, max_step_s / step_t[profile.limits_w[0]])  # simulated s per real s
    utilization = {x: (w - model.idle_w) / (model.peak_w - model.idle_w) for x, w in drawn_w.items()}

    sim = Simulator("nocpu")
    sim.gpus = [SimGPU(model, sim.clock, index=i) for i in range(n_gpus)]
    monitor = EnergyMonitor(devices=sim.devices())
    guard = RestoreGuard(sim.gpus, journal_dir=state_dir / "restore", handle_signals=False,
                         recover_stale=False)
    opt = PowerLimitOptimizer(
        monitor, selector, search=search, warmup_steps=warmup_steps, profile_steps=profile_steps,
        limits_w=profile.limits_w, distributed=False, handle_signals=False, guard=guard,
    )
    max_steps = 4 * (warmup_steps + profile_steps) * len(profile.limits_w) + 4 * epoch_steps
    try:
        e0, t0 = sum(sim.true_gpu_energy_j().values()), sim.clock.now()
        opt.on_train_begin()
        steps, current = 0, None
        while opt.state is not State.DONE:
            opt.on_epoch_begin()
            for _ in range(epoch_steps):
                opt.on_step_begin()
                limit = sim.gpus[0].power_limit_w()
                if limit != current:
                    for g in sim.gpus:
                        g.set_workload(Constant(utilization[limit]))
                    current = limit
                sim.advance(step_t[limit] * scale)
                opt.on_step_end()
                steps += 1
                if opt.state is State.DONE:
                    break
            opt.on_epoch_end()
            if steps > max_steps:
                raise RuntimeError(f"{profile.name}: the optimizer is not done after {steps} steps")
        energy = (sum(sim.true_gpu_energy_j().values()) - e0) / scale
        elapsed = (sim.clock.now() - t0) / scale
        opt.on_train_end()
    finally:
        monitor.close()
    chosen = opt.chosen_limit_w
    assert chosen is not None
    sel = parse_selector(selector, n_gpus)
    replayed = replay(profile, Sweep(profile.limits_w, sel) if search == "sweep"
                      else Adaptive(profile.limits_w, sel, n_gpus))
    profiled = list(opt.points)
    return OnlineResult(
        chosen_w=chosen,
        best_w=sel.choose(list(profile.points)).limit_w,
        replay_w=replayed.chosen_w,
        replay_limits_w=replayed.profiled_limits_w,
        profiled_limits_w=profiled,
        steps=steps,
        energy_j=energy,
        time_s=elapsed,
        overhead_energy_j=energy - steps * step_t[chosen] * drawn_w[chosen] * n_gpus,
        overhead_time_s=elapsed - steps * step_t[chosen],
        clamped=sum(recorded_w[x] > x for x in profiled),
    )


@dataclass
class Totals:
    """One selector and one search over a set of profiles."""

    n: int = 0
    same_as_sweep: int = 0
    hindsight: int = 0
    same_as_replay: int = 0
    limits_as_replay: int = 0
    limits: int = 0
    steps: int = 0
    energy: float = 0.0
    time: float = 0.0
    clamped: int = 0
    disagreements: list[str] = field(default_factory=list)

    def add(self, name: str, r: OnlineResult, sweep: OnlineResult) -> None:
        self.n += 1
        self.same_as_sweep += r.chosen_w == sweep.chosen_w
        self.hindsight += r.chosen_w == r.best_w
        self.same_as_replay += r.chosen_w == r.replay_w
        if r.chosen_w != r.replay_w:
            self.disagreements.append(f"{name}: online chose {r.chosen_w:g} W, replay {r.replay_w:g} W")
        self.limits_as_replay += r.profiled_limits_w == r.replay_limits_w
        if r.profiled_limits_w != r.replay_limits_w:
            self.disagreements.append(f"{name}: online profiled {r.profiled_limits_w}, replay "
                                      f"{r.replay_limits_w}")
        self.limits += len(r.profiled_limits_w)
        self.steps += r.steps
        self.energy += r.overhead_energy_j
        self.time += r.overhead_time_s
        self.clamped += r.clamped


def meets_goal(a: Totals, s: Totals) -> bool:
    return a.same_as_sweep >= 0.95 * a.n and a.energy <= 0.5 * s.energy and a.time <= 0.5 * s.time


def ratio(adaptive: float, sweep: float) -> str:
    if sweep == 0:
        return "-"
    return f"{adaptive / sweep:.2f}x" + ("†" if sweep < 0 else "")


def pair(adaptive: float, sweep: float, unit: str) -> str:
    """``adaptive / sweep UNIT (ratio)``, both with the prefix that suits the larger one."""
    big = max(abs(adaptive), abs(sweep))
    factor, prefix = next(((f, p) for f, p in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if big >= f), (1.0, ""))
    return f"{adaptive / factor:.3g} / {sweep / factor:.3g} {prefix}{unit} ({ratio(adaptive, sweep)})"


def table(title: str, rows: list[tuple[str, Totals, Totals]]) -> Table:
    t = Table(title=title)
    for col in ("selector", "same as sweep", "= hindsight a / s", "= replay a / s", "limits = replay (a)",
                "limits a / s", "steps a / s", "energy overhead a / s", "time overhead a / s",
                "clamped a / s", "goal met"):
        t.add_column(col, justify="right", no_wrap=True)
    for spec, a, s in rows:
        n = a.n
        t.add_row(
            spec, f"{100 * a.same_as_sweep / n:.1f} %",
            f"{100 * a.hindsight / n:.1f} / {100 * s.hindsight / n:.1f} %",
            f"{100 * a.same_as_replay / n:.1f} / {100 * s.same_as_replay / n:.1f} %",
            f"{100 * a.limits_as_replay / n:.1f} %",
            f"{a.limits / n:.1f} / {s.limits / n:.1f}", f"{a.steps / n:.0f} / {s.steps / n:.0f}",
            pair(a.energy, s.energy, "J"), pair(a.time, s.time, "s"),
            f"{a.clamped} / {s.clamped}", "yes" if meets_goal(a, s) else "no",
        )
    return t


def load(data: Path) -> dict[str, list[tuple[Profile, str]]]:
    """Profiles with the file each came from, by source (real runs, traces)."""
    sources = {
        "real runs": sorted((data / "power-limit-profiles").glob("*.csv")),
        "traces": sorted((data / "nsdi23-traces").glob("summary_power_*.csv")),
    }
    return {name: [(p, f.stem) for f in files for p in profiles_in([f])]
            for name, files in sources.items() if files}


def run_all(groups: dict[str, list[tuple[Profile, str]]], specs: Sequence[str],
            **kw: Any) -> dict[tuple[str, str, str], list[tuple[str, OnlineResult]]]:
    """Every (source, selector, search) -> [(profile name, result)]."""
    out: dict[tuple[str, str, str], list[tuple[str, OnlineResult]]] = {}
    with private_state_dir() as d:
        for source, items in groups.items():
            for spec in specs:
                for search in SEARCHES:
                    out[(source, spec, search)] = [
                        (f"{src}:{p.name}" if src != p.name else p.name,
                         simulate(p, spec, search, source=src, state_dir=d, **kw))
                        for p, src in items
                    ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    ap.add_argument("--selectors", default=",".join(SELECTORS),
                    help="comma-separated selectors (default: %(default)s)")
    ap.add_argument("--warmup-steps", type=int, default=10, help="default: %(default)s")
    ap.add_argument("--profile-steps", type=int, default=40, help="default: %(default)s")
    ap.add_argument("--steps-per-window", type=float, default=40.0,
                    help="training steps per recorded window or epoch, S (default: %(default)s)")
    ap.add_argument("--epoch-steps", type=int, default=100, help="default: %(default)s")
    ap.add_argument("--max-step-s", type=float, default=0.25,
                    help="longest simulated step; longer ones are compressed (default: %(default)s)")
    ap.add_argument("--show-disagreements", action="store_true",
                    help="list the profiles where the online optimizer chooses or profiles other "
                         "limits than the search-only replay")
    args = ap.parse_args()
    if not args.data.is_dir():
        print(f"data directory not found: {args.data} (pass --data; expected power-limit-profiles/ "
              "and nsdi23-traces/ in it)", file=sys.stderr)
        return 1
    groups = load(args.data)
    if not groups:
        print(f"no profiles under {args.data} (expected power-limit-profiles/*.csv and "
              "nsdi23-traces/summary_power_*.csv)", file=sys.stderr)
        return 1
    specs = [s.strip() for s in args.selectors.split(",") if s.strip()]
    start = time.perf_counter()
    results = run_all(groups, specs, warmup_steps=args.warmup_steps, profile_steps=args.profile_steps,
                      steps_per_window=args.steps_per_window, epoch_steps=args.epoch_steps,
                      max_step_s=args.max_step_s)
    wall = time.perf_counter() - start
    console = Console(width=210)
    caption = ("a / s: adaptive / sweep; = replay: the search-only replay's choice (limits = replay: "
               "same limits profiled, in the same order). "
               f"Warm-up {args.warmup_steps} + profile {args.profile_steps} steps per limit, "
               f"S = {args.steps_per_window:g} steps per recorded window/epoch, epochs of "
               f"{args.epoch_steps} steps, simulated steps <= {args.max_step_s:g} s. Overheads summed "
               "over profiles. † the sweep's overhead is negative (it saved): the goal needs "
               "adaptive <= 0.5 x sweep there too, i.e. saving at least half as much")
    n_all = sum(len(v) for v in groups.values())
    for name in ["all", *groups]:
        rows = []
        for spec in specs:
            tot = {s: Totals() for s in SEARCHES}
            for source in groups if name == "all" else [name]:
                sweep = results[(source, spec, "sweep")]
                for search in SEARCHES:
                    for (pname, r), (_, rs) in zip(results[(source, spec, search)], sweep, strict=True):
                        tot[search].add(pname, r, rs)
            rows.append((spec, tot["adaptive"], tot["sweep"]))
            if args.show_disagreements and name == "all":
                for search in SEARCHES:
                    for line in tot[search].disagreements:
                        console.print(f"[{spec}, {search}] {line}")
        count = n_all if name == "all" else len(groups[name])
        t = table(f"Online power-limit optimizer on recorded profiles, {name}: {count} profiles", rows)
        t.caption = caption
        console.print(t)
    runs = n_all * len(specs) * len(SEARCHES)
    steps = sum(r.steps for v in results.values() for _, r in v)
    console.print(f"{runs} optimizer runs, {steps} simulated training steps in {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
