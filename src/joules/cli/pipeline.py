"""``joules pipeline``: plan GPU frequencies of a pipeline-parallel training iteration.

* ``plan`` solves the time-energy frontier of one iteration from a profile and writes
  ``frontier.json``, ``rank{stage}.json`` (the fastest plan, per GPU), ``profile.csv`` (a copy of
  the profile, so ``show`` can draw any plan later) and ``schedule.svg`` (the fastest plan).
* ``show`` picks the plan for an iteration time (as when waiting for a straggler), draws it
  and prints each stage's frequencies.
* ``profile`` writes a synthetic GPU-like profile, to try the above without measurements.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table
from rich.text import Text

from joules.cli import Console, check_duration, print_out
from joules.errors import JoulesError

if TYPE_CHECKING:
    from joules.optimizers.pipeline.frontier import Frontier, Plan

pipeline_app = typer.Typer(help="Plan per-computation GPU frequencies of pipeline-parallel training.",
                           no_args_is_help=True)

MAX_COMPUTATIONS = 20_000  # per iteration (16 stages x 64 microbatches, 2,048, take minutes): a typo's guard
PROFILE_COPY = "profile.csv"
PICTURE = "schedule.svg"


def _schedule(value: str) -> str:
    from joules.optimizers.pipeline.schedule import SCHEDULES

    name = value.strip().lower()
    if name not in SCHEDULES:
        raise JoulesError(f"bad --schedule {value!r} (expected {' or '.join(SCHEDULES)})")
    return name


def _pct(value: float, reference: float) -> str:
    return f"{100 * (value / reference - 1):+.1f} %" if reference else "n/a"


def _check_out_directory(out: Path, folder: Path | None = None) -> None:
    """Fail early when an ``--out`` folder is a file.

    ``folder`` (default: ``out`` itself), or the nearest folder above it that exists.
    """
    folder = out if folder is None else folder
    for p in (folder, *folder.parents):
        if p.exists():
            if not p.is_dir():
                raise JoulesError(f"--out {out} is a file; give a directory" if p == out
                                  else f"--out {out}: {p} is a file; give a directory")
            return


@pipeline_app.command("plan")
def plan(
    profile: list[Path] = typer.Option(..., "--profile", metavar="FILE",
                                       help="Profile CSV: stage,instruction,frequency,time,energy. Repeat "
                                            "it to join per-rank files (each with its own stages)."),
    stages: int = typer.Option(..., "--stages", min=1, help="Pipeline stages (one GPU each)."),
    microbatches: int = typer.Option(..., "--microbatches", min=1, help="Microbatches per iteration."),
    schedule: str = typer.Option("1f1b", "--schedule", help="1f1b or gpipe."),
    unit_time: float = typer.Option(0.001, "--unit-time", metavar="SECONDS",
                                    help="Resolution of the frontier: a plan at least every half unit "
                                         "of iteration time (the exact method rounds times to it)."),
    p2p_power: float = typer.Option(0.0, "--p2p-power", metavar="W",
                                    help="Power of a GPU blocked on communication (default 0: count "
                                         "only computation energy). Measure it, or see `joules pipeline "
                                         "profile`."),
    out: Path = typer.Option(..., "--out", metavar="DIR", help="Directory to write the plans to."),
    method: str = typer.Option("auto", "--method", help="auto, fast or exact (see docs/pipeline.md)."),
    as_json: bool = typer.Option(False, "--json", help="Print the frontier summary as one JSON object."),
) -> None:
    """Solve the time-energy frontier of one iteration and write its plans."""
    from joules.optimizers.pipeline.picture import save_picture
    from joules.optimizers.pipeline.profile import PipelineProfile
    from joules.optimizers.pipeline.schedule import build_dag
    from joules.optimizers.pipeline.solver import FINE_UNIT_S, MAX_UNIT_S, METHODS, solve

    name = _schedule(schedule)
    _check_out_directory(out)
    if not FINE_UNIT_S <= unit_time <= MAX_UNIT_S:
        raise JoulesError(f"bad --unit-time {unit_time:g} "
                          f"(expected a number of seconds from {FINE_UNIT_S:g} to {MAX_UNIT_S:g})")
    if not (math.isfinite(p2p_power) and p2p_power >= 0):
        raise JoulesError(f"bad --p2p-power {p2p_power:g} (expected a finite number of watts, at least 0)")
    copy = out / PROFILE_COPY
    if len(profile) > 1 and any(p.resolve() == copy.resolve() for p in profile):
        # The joined profile is written there: it would replace an input and lose its raw rows.
        raise JoulesError(f"--profile {copy} is where the joined profile is written; move it, or "
                          f"give another --out")
    parts = [PipelineProfile.from_csv(p) for p in profile]
    prof = parts[0] if len(parts) == 1 else PipelineProfile.merge(parts)
    prof.check_covers(stages)
    if prof.stages > stages:
        print(f"joules: warning: {prof.name} has {prof.stages} stages; planning for the first {stages}",
              file=sys.stderr)
    shortest = min(o.time_s for opts in prof.options.values() for o in opts)
    if unit_time > shortest:
        print(f"joules: warning: --unit-time {unit_time:g} s is longer than the shortest profiled "
              f"computation ({shortest:.3g} s), so the frontier is coarse; a smaller unit gives "
              f"more plans", file=sys.stderr)
    computations = 2 * stages * microbatches
    if computations > MAX_COMPUTATIONS:
        raise JoulesError(f"--stages {stages} x --microbatches {microbatches} is {computations:,} "
                          f"computations, beyond the {MAX_COMPUTATIONS:,} the planner takes (a typo?)")
    dag = build_dag(name, stages, microbatches)
    if method not in METHODS:
        raise JoulesError(f"bad --method {method!r} (expected {', '.join(METHODS)})")
    frontier = solve(dag, prof, p2p_power, unit_time, method=method)
    frontier.meta.setdefault("profile_file", PROFILE_COPY)
    frontier.save(out)
    if not (len(profile) == 1 and copy.exists() and copy.resolve() == profile[0].resolve()):
        prof.to_csv(copy)
    save_picture(out / PICTURE, dag, prof, frontier.fastest)

    summary = frontier.summary()
    if as_json:
        print_out(json.dumps(summary))
        return
    fastest, top = frontier.fastest, frontier.max_frequency
    t = Table(title=Text(f"{prof.name}: {name}, {stages} stages x {microbatches} microbatches, "
                         f"blocking {p2p_power:g} W"))  # a file name's "[...]" is not markup
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("frontier points", str(len(frontier.plans)))
    t.add_row("shortest iteration", f"{fastest.time_s * 1e3:,.1f} ms")
    t.add_row("energy at the shortest iteration", f"{fastest.energy_j:,.1f} J")
    t.add_row("all at the highest frequency", f"{top.time_s * 1e3:,.1f} ms, {top.energy_j:,.1f} J")
    saved = 100 * (1 - fastest.energy_j / top.energy_j) if top.energy_j else 0.0
    t.add_row("energy saved at the shortest iteration", f"{saved:.1f} %")
    t.add_row("solve time", f"{frontier.solve_time_s:,.2f} s")
    console = Console()
    console.print(t)

    points = Table(title="frontier (sampled)")
    for col in ("time (ms)", "vs shortest", "energy (J)", "vs highest frequency"):
        points.add_column(col, justify="right")
    n = len(frontier.plans)
    picks = sorted({round(i * (n - 1) / 7) for i in range(8)}) if n > 1 else [0]
    for i in picks:
        p = frontier.plans[i]
        points.add_row(f"{p.time_s * 1e3:,.1f}", _pct(p.time_s, fastest.time_s), f"{p.energy_j:,.1f}",
                       _pct(p.energy_j, top.energy_j))
    console.print(points)
    console.print(f"wrote {out / 'frontier.json'}, rank0..{stages - 1}.json, {PROFILE_COPY} and {PICTURE} "
                  f"to {out}", highlight=False, soft_wrap=True, markup=False)


@pipeline_app.command("show")
def show(
    path: Path = typer.Argument(..., metavar="DIR_OR_FRONTIER_JSON",
                                help="A directory `joules pipeline plan` wrote, or its frontier.json."),
    time: float | None = typer.Option(None, "--time", metavar="SECONDS",
                                      help="Iteration time to plan for (default: the shortest)."),
    out: Path | None = typer.Option(None, "--out", metavar="FILE",
                                    help="Picture to write, .svg or .png (default: DIR/schedule-<ms>ms.svg "
                                         "with --time, DIR/schedule.svg without it or when no plan is "
                                         "that fast)."),
    profile: Path | None = typer.Option(None, "--profile", metavar="FILE",
                                        help="Profile CSV the frontier was planned from (default: "
                                             "DIR/profile.csv)."),
) -> None:
    """Draw the plan for an iteration time and print each stage's frequencies."""
    from joules.optimizers.pipeline.frontier import Frontier, PlanError, evaluate
    from joules.optimizers.pipeline.picture import FORMATS, save_picture
    from joules.optimizers.pipeline.profile import PipelineProfile, PipelineProfileError

    check_duration("--time", time)
    if out is not None and out.suffix.lower() not in FORMATS:
        raise PlanError(f"bad --out {str(out)!r}: use a .svg or .png file name")
    frontier = Frontier.load(path)
    directory = path if path.is_dir() else path.parent
    if profile is None:
        profile = directory / PROFILE_COPY
        if not profile.is_file():
            raise PipelineProfileError(
                f"no {PROFILE_COPY} next to the frontier in {directory}: pass --profile FILE"
            )
    prof = PipelineProfile.from_csv(profile)
    dag = frontier.dag
    if time is not None and frontier.min_time_s > time * (1 + 1e-12):
        print(f"joules: warning: no plan is as fast as --time {time:g} s; the shortest iteration is "
              f"{frontier.min_time_s * 1e3:,.1f} ms: showing that plan", file=sys.stderr)
        time = None  # the picture and the headline are the shortest iteration's
    chosen = frontier.fastest if time is None else frontier.plan_for_time(time)
    check = evaluate(dag, prof, chosen.frequencies, frontier.blocking_power_w)
    if abs(check.time_s - chosen.time_s) > max(0.02 * chosen.time_s, 2 * frontier.unit_time_s):
        print(f"joules: warning: {profile} gives this plan {check.time_s * 1e3:,.1f} ms, the frontier "
              f"{chosen.time_s * 1e3:,.1f} ms: is it the profile the frontier was planned from?",
              file=sys.stderr)
    if out is None:
        out = directory / (PICTURE if time is None else f"schedule-{time * 1e3:g}ms.svg")
    else:
        _check_out_directory(out, out.parent)  # the picture's folder
    save_picture(out, dag, prof, chosen)

    console = Console()
    top = frontier.max_frequency
    console.print(
        f"plan for {'the shortest iteration' if time is None else f'{time * 1e3:,.1f} ms'}: "
        f"{chosen.time_s * 1e3:,.1f} ms, {chosen.energy_j:,.1f} J "
        f"({_pct(chosen.energy_j, top.energy_j)} vs all at the highest frequency: "
        f"{top.time_s * 1e3:,.1f} ms, {top.energy_j:,.1f} J)",
        highlight=False, soft_wrap=True, markup=False,
    )
    t = Table(title=f"{dag.schedule}, {dag.stages} stages x {dag.microbatches} microbatches: "
                    "frequencies per stage")
    for col in ("stage", "computations", "min MHz", "mean MHz", "max MHz"):
        t.add_column(col, justify="right")
    for s, stats in enumerate(stage_frequencies(frontier, chosen)):
        t.add_row(str(s), str(stats["computations"]), f"{stats['min_mhz']:g}", f"{stats['mean_mhz']:,.0f}",
                  f"{stats['max_mhz']:g}")
    console.print(t)
    console.print(f"wrote {out}", highlight=False, soft_wrap=True, markup=False)


def stage_frequencies(frontier: Frontier, chosen: Plan) -> list[dict[str, float]]:
    """Per stage of ``frontier``'s pipeline: computation count and min/mean/max MHz of ``chosen``.

    Args:
        frontier: The frontier (for its pipeline).
        chosen: One of its plans.

    Returns:
        One ``{"computations", "min_mhz", "mean_mhz", "max_mhz"}`` per stage, in stage order.
    """
    rows: list[dict[str, float]] = []
    for order in frontier.dag.stage_order:
        freqs = [chosen.frequencies[n] for n in order]
        rows.append({"computations": len(freqs), "min_mhz": min(freqs), "mean_mhz": sum(freqs) / len(freqs),
                     "max_mhz": max(freqs)})
    return rows


@pipeline_app.command("profile")
def profile(
    gpu: str = typer.Option(..., "--gpu", help="GPU-like curve: a100, h100, v100 or a40."),
    stages: int = typer.Option(..., "--stages", min=1, help="Pipeline stages."),
    seed: int = typer.Option(0, "--seed", min=0, help="Random seed (stage imbalance, noise)."),
    noise: float = typer.Option(0.0, "--noise", metavar="X",
                                help="Relative standard deviation of measurement noise, e.g. 0.02."),
    out: Path = typer.Option(..., "--out", metavar="FILE", help="CSV file to write."),
) -> None:
    """Write a synthetic GPU-like profile, to try planning without measurements."""
    from joules.optimizers.pipeline.profile import blocking_power_w, synthetic_profile

    if not 0 <= noise < 1:
        raise JoulesError(f"bad --noise {noise:g} (expected a fraction within [0, 1))")
    prof = synthetic_profile(stages, gpu, noise=noise, seed=seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.to_csv(out)
    freqs = prof.frequencies()
    Console().print(
        f"wrote {out}: {stages} stages, {len(freqs)} clocks from {freqs[0]} to {freqs[-1]} MHz; "
        f"a blocked {gpu.lower()} draws about {blocking_power_w(gpu):g} W "
        f"(joules pipeline plan --p2p-power {blocking_power_w(gpu):g})",
        highlight=False, soft_wrap=True, markup=False,
    )


def register(app: typer.Typer) -> None:
    """Add the command group to the app."""
    app.add_typer(pipeline_app, name="pipeline")
