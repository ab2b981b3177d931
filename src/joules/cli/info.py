"""``joules info``: the devices found, what each supports, and every problem with its fix."""

from __future__ import annotations

import json
import statistics
import time

import typer
from rich.table import Table

from joules.cli import SIM_HELP, Console, print_out, use_sim
from joules.devices.base import GPU, DeviceSet
from joules.devices.discovery import discover


def counter_read_us(gpu: GPU, reads: int = 5) -> float | None:
    """Median wall-clock cost of one energy-counter read, µs (``None`` without a readable counter).

    Microseconds on most GPUs, milliseconds on some (3 ms on an H200): the monitor then
    avoids reading the counter at window edges (``EnergyMonitor(max_edge_read_s=...)``).
    """
    if not gpu.has_energy_counter():
        return None
    costs = []
    try:
        for _ in range(reads):
            t0 = time.perf_counter()
            gpu.energy_j()
            costs.append(time.perf_counter() - t0)
    except Exception:  # noqa: BLE001 - describe() reports the device; this is a timing only
        return None
    return statistics.median(costs) * 1e6


def info_dict(devices: DeviceSet) -> dict[str, object]:
    """JSON-ready description of a device set."""
    return {
        "backend": devices.backend,
        "gpus": [{**g.describe(), "energy_counter_read_us": counter_read_us(g)} for g in devices.gpus],
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
            cost = counter_read_us(g)
            counter = "no (sampled power)"
            if d["energy_counter"]:
                counter = "yes" if cost is None else (
                    f"yes (read {cost / 1e3:.1f} ms)" if cost >= 1000 else f"yes (read {cost:.0f} µs)")
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
            print_out(json.dumps(info_dict(devices), indent=2, default=str))  # (a closed stdout: quietly)
        else:
            render(devices, Console())
