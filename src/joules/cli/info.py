"""``joules info``: the devices found, what each supports, and every problem with its fix."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from joules.cli import SIM_HELP, use_sim
from joules.devices.base import DeviceSet
from joules.devices.discovery import discover


def info_dict(devices: DeviceSet) -> dict[str, object]:
    """JSON-ready description of a device set."""
    return {
        "backend": devices.backend,
        "gpus": [g.describe() for g in devices.gpus],
        "cpus": [c.describe() for c in devices.cpus],
        "problems": [
            {"device": p.device, "message": p.message, "fix": p.fix} for p in devices.problems
        ],
    }


def _fmt(value: object, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}{unit}"
    if isinstance(value, tuple | list):
        return "–".join(f"{v:g}" for v in value) + unit
    return f"{value}{unit}"


def render(devices: DeviceSet, console: Console) -> None:
    """Print the device tables and problems."""
    console.print(f"backend: [bold]{devices.backend}[/bold]")
    if devices.gpus:
        t = Table(title="GPUs")
        for col in ("#", "name", "energy counter", "power", "limit", "default", "range", "SM clock"):
            t.add_column(col)
        for g in devices.gpus:
            d = g.describe()
            counter = "yes" if d["energy_counter"] else "no (sampled power)"
            t.add_row(
                str(d["index"]), str(d["name"]), counter, _fmt(d["power_w"], " W"),
                _fmt(d["power_limit_w"], " W"), _fmt(d["default_power_limit_w"], " W"),
                _fmt(d["power_limit_range_w"], " W"), _fmt(d["sm_clock_mhz"], " MHz"),
            )
        console.print(t)
    else:
        console.print("GPUs: none found")
    if devices.cpus:
        t = Table(title="CPU packages (RAPL)")
        for col in ("#", "name", "vendor", "DRAM zone"):
            t.add_column(col)
        for c in devices.cpus:
            t.add_row(str(c.index), c.name, c.vendor, "yes" if c.has_dram() else "no")
        console.print(t)
    else:
        console.print("CPU packages: none found")
    if devices.problems:
        console.print("[bold]problems:[/bold]")
        for p in devices.problems:
            fix = f"\n    fix: {p.fix}" if p.fix else ""
            console.print(f"  - {p.device}: {p.message}{fix}", highlight=False, markup=False)
    else:
        console.print("problems: none")


def register(app: typer.Typer) -> None:
    """Add the command to the app."""

    @app.command()
    def info(
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
        sim: str | None = typer.Option(None, "--sim", metavar="SPEC", help=SIM_HELP),
    ) -> None:
        """Show the devices found, what each supports, and every problem with its fix."""
        use_sim(sim)
        devices = discover()
        if as_json:
            print(json.dumps(info_dict(devices), indent=2, default=str))
        else:
            render(devices, Console())
