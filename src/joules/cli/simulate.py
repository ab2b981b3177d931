"""``joules simulate``: replay optimizers on recorded profiles."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

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
        is_trace = "power_limit" in next(csv.reader(f), [])
    if is_trace:
        if workload is None or batch_size is None:
            raise JoulesError("a trace needs --workload DATASET/NETWORK and --batch-size N")
        prof = load_power_trace(profile, workload, batch_size, optimizer)
    else:
        prof = load_profile_csv(profile)
    sel = parse_selector(selector, prof.gpus)
    strategy = Adaptive(prof.limits_w, sel, prof.gpus) if search == "adaptive" else Sweep(prof.limits_w, sel)
    result = replay(prof, strategy)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    t = Table(title=f"{prof.name}: {sel.name}, {search} search")
    for col in ("chosen (W)", "best in hindsight (W)", "profiled (W)", "overhead energy (J)",
                "overhead time (s)"):
        t.add_column(col, justify="right")
    t.add_row(f"{result.chosen_w:g}", f"{result.best_w:g}",
              " ".join(f"{x:g}" for x in result.profiled_limits_w),
              f"{result.overhead_energy_j:,.1f}", f"{result.overhead_time_s:,.1f}")
    Console().print(t)


def register(app: typer.Typer) -> None:
    """Add the command group to the app."""
    app.add_typer(simulate_app, name="simulate")
