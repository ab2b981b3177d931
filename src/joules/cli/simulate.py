"""``joules simulate``: replay optimizers on recorded profiles and traces."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import typer
from rich.table import Table

from joules.cli import Console, print_out
from joules.errors import JoulesError

simulate_app = typer.Typer(help="Replay optimizers on recorded measurements.", no_args_is_help=True)


@simulate_app.command("power-limit")
def power_limit(
    profile: Path = typer.Option(..., "--profile", metavar="FILE",
                                 help="A power-limit profile CSV, or a per-power-limit trace CSV."),
    selector: str = typer.Option("energy", "--selector",
                                 help="time, energy, cost:ETA or slowdown:FACTOR."),
    search: str = typer.Option("adaptive", "--search", help="adaptive or sweep."),
    workload: str | None = typer.Option(None, "--workload", metavar="DATASET/NETWORK",
                                        help="With a trace: the workload."),
    batch_size: int | None = typer.Option(None, "--batch-size", help="With a trace: the batch size."),
    optimizer: str | None = typer.Option(None, "--optimizer",
                                         help="With a trace: the optimizer, if several."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Replay the power-limit search on one recorded profile."""
    from joules.optimizers.power_limit import (
        Adaptive,
        Sweep,
        load_power_trace,
        load_profile_csv,
        parse_selector,
        replay,
    )

    if search not in ("adaptive", "sweep"):
        raise JoulesError(f"bad --search {search!r} (expected adaptive or sweep)")
    if not profile.is_file():
        raise JoulesError(f"profile file not found: {profile}")
    with profile.open(newline="") as f:
        is_trace = "power_limit" in [c.strip() for c in next(csv.reader(f), [])]
    if is_trace:
        if workload is None or batch_size is None:
            raise JoulesError("a trace needs --workload DATASET/NETWORK and --batch-size N")
        prof = load_power_trace(profile, workload, batch_size, optimizer)
    else:
        given = [o for o, v in (("--workload", workload), ("--batch-size", batch_size),
                                ("--optimizer", optimizer)) if v is not None]
        if given:
            verb = "select" if len(given) > 1 else "selects"
            raise JoulesError(f"{' and '.join(given)} {verb} a profile in a trace; {profile} is a recorded "
                              "profile (window_name, elapsed_time, gpuN_energy), which holds one")
        prof = load_profile_csv(profile)
    sel = parse_selector(selector, prof.gpus)
    strategy = Adaptive(prof.limits_w, sel, prof.gpus) if search == "adaptive" else Sweep(prof.limits_w, sel)
    result = replay(prof, strategy)
    if as_json:
        print_out(json.dumps(result.to_dict()))
        return
    t = Table(title=f"{prof.name}: {sel.name}, {search} search")
    for col in ("chosen (W)", "best in hindsight (W)", "profiled (W)", "overhead energy (J)",
                "overhead time (s)"):
        t.add_column(col, justify="right")
    t.add_row(f"{result.chosen_w:g}", f"{result.best_w:g}",
              " ".join(f"{x:g}" for x in result.profiled_limits_w),
              f"{result.overhead_energy_j:,.1f}", f"{result.overhead_time_s:,.1f}")
    Console().print(t)


@simulate_app.command("recurring")
def recurring(
    traces: Path = typer.Option(..., "--traces", metavar="DIR",
                                help="Directory with summary_train.csv and summary_power_{gpu}.csv."),
    gpu: str = typer.Option(..., "--gpu", help="GPU of the power trace: v100 or a40 (any case)."),
    workload: str = typer.Option(..., "--workload", metavar="DATASET/NETWORK",
                                 help="e.g. cifar100/shufflenetv2."),
    recurrences: int | None = typer.Option(None, "--recurrences", min=1,
                                           help="Recurrences (default: 2 x batch sizes x power limits)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the policy and of the replayed runs."),
    eta: float = typer.Option(0.5, "--eta", help="Weight of energy in the cost, within [0, 1]."),
    beta: float = typer.Option(2.0, "--beta", help="Early-stopping factor (> 1)."),
    policy: str = typer.Option("joules", "--policy", help="joules or nsdi23."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Replay a recurring job on the NSDI'23 traces with the batch-size optimizer."""
    from joules.optimizers.batch_size.policy import VARIANTS
    from joules.optimizers.batch_size.simulator import simulate
    from joules.optimizers.batch_size.traces import load_job

    if policy not in VARIANTS:
        raise JoulesError(f"bad --policy {policy!r} (expected {' or '.join(VARIANTS)})")
    if not 0.0 <= eta <= 1.0:
        raise JoulesError(f"bad --eta {eta:g} (expected a number within [0, 1])")
    if not beta > 1.0:
        raise JoulesError(f"bad --beta {beta:g} (expected a number above 1)")
    job = load_job(traces, gpu, workload)
    if as_json:
        result = simulate(job, policy=policy, recurrences=recurrences, seed=seed, eta=eta, beta=beta)
        print_out(json.dumps(result.to_dict()))
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(f"{workload} on {job.gpu}, {policy}",
                            total=recurrences or job.default_recurrences())
        result = simulate(job, policy=policy, recurrences=recurrences, seed=seed, eta=eta, beta=beta,
                          progress=lambda done, total: bar.update(task, completed=done, total=total))
    r = result.to_dict()
    t = Table(title=f"{workload} on {job.gpu}: {r['recurrences']} recurrences, {policy} policy, "
                    f"eta {eta:g}, beta {beta:g}, seed {seed}")
    for col in ("run", "energy (MJ)", "time (h)", "cost", "vs default", "vs hindsight"):
        t.add_column(col, justify="right")
    d, o = r["default_cost"], r["oracle_cost"]
    dflt = result.default
    rows = [
        (policy, r["energy_j"], r["time_s"], r["cost"]),
        (f"default {dflt.batch_size} @ {dflt.power_limit_w:g} W",
         r["default_energy_j"], r["default_time_s"], d),
        (f"hindsight {result.oracle.batch_size} @ {result.oracle.power_limit_w:g} W",
         r["oracle_energy_j"], r["oracle_time_s"], o),
    ]
    for name, energy, time_s, cost in rows:
        t.add_row(name, f"{energy / 1e6:,.1f}", f"{time_s / 3600:,.1f}", f"{cost:.4g}",
                  f"{100 * (cost / d - 1):+.1f} %", f"{100 * (cost / o - 1):+.1f} %")
    trials = len(result.trials)
    saved = 100 * (1 - r["energy_j"] / r["default_energy_j"])
    t.caption = (f"{trials} trials ({trials - r['recurrences']} failed and retried); "
                 f"energy saved vs default: {saved:.1f} %")
    console.print(t)


def register(app: typer.Typer) -> None:
    """Add the command group to the app."""
    app.add_typer(simulate_app, name="simulate")
