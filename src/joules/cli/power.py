"""``joules power``: live power per device, then total energy per device."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import typer
from rich.live import Live
from rich.table import Table

from joules.cli import SIM_HELP, Console, check_duration, print_out, silence_stdout, use_sim
from joules.cli.measure import (
    check_timeline_path,
    end_measurement,
    export_timeline,
    measurement_table,
    open_monitor,
)
from joules.errors import JoulesError
from joules.monitoring.monitor import EnergyMonitor


class _CpuPower:
    """Power of CPU zones from counter differences between two polls."""

    def __init__(self, monitor: EnergyMonitor) -> None:
        self.monitor = monitor
        self.last = self._read()

    def _read(self) -> tuple[float, dict[str, float]]:
        values: dict[str, float] = {}
        for c in self.monitor.cpus:
            values[f"cpu{c.index}"] = c.package_energy_j()
            if c.has_dram():
                values[f"dram{c.index}"] = c.dram_energy_j()
        return self.monitor.clock.now(), values

    def poll(self) -> dict[str, float]:
        t0, e0 = self.last
        self.last = t1, e1 = self._read()
        dt = t1 - t0
        return {k: (e1[k] - e0[k]) / dt if dt > 0 else 0.0 for k in e1}


def _table(sample: dict[str, float], elapsed: float) -> Table:
    t = Table(title=f"power (W) — {elapsed:,.1f} s")
    t.add_column("device")
    t.add_column("power (W)", justify="right")
    for k, v in sample.items():
        t.add_row(k, f"{v:,.1f}")
    return t


def _line(sample: dict[str, float], elapsed: float) -> str:
    """One reading as a plain line, for output that is not a terminal."""
    readings = ", ".join(f"{k} {v:,.1f} W" for k, v in sample.items()) or "no devices"
    return f"{elapsed:,.1f} s: {readings}"


def _interrupt(_signum: int, _frame: object) -> None:
    """SIGTERM ends the readings as Ctrl-C does."""
    raise KeyboardInterrupt


def register(app: typer.Typer) -> None:
    """Add the command to the app."""

    @app.command()
    def power(
        interval: float = typer.Option(1.0, "--interval", metavar="S", help="Seconds between readings."),
        duration: float | None = typer.Option(None, "--duration", metavar="S",
                                              help="Stop after S seconds (default: until Ctrl-C)."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object per reading, then totals."),
        timeline: str | None = typer.Option(None, "--timeline", metavar="FILE",
                                            help="Write GPU power samples to FILE (.csv or .jsonl)."),
        sim: str | None = typer.Option(None, "--sim", metavar="SPEC", help=SIM_HELP),
    ) -> None:
        """Show live power per device; on Ctrl-C, SIGTERM or after --duration, total energy per device.

        When stdout is not a terminal, each reading is one plain line.
        """
        check_duration("--interval", interval)
        check_duration("--duration", duration)
        use_sim(sim)
        check_timeline_path(timeline)
        monitor = open_monitor()
        cpu_power = _CpuPower(monitor)
        console = Console()
        start = time.monotonic()
        monitor.begin_window("power")

        failing: set[str] = set()

        def read(name: str, fn: Callable[[], Any]) -> Any:
            """A device's reading; ``None`` (said once, on stderr) while it fails."""
            try:
                value = fn()
            except JoulesError as e:
                if name not in failing:
                    print(f"joules: warning: {name} cannot be read ({e}); its readings are left out "
                          "while it fails", file=sys.stderr)
                failing.add(name)
                return None
            failing.discard(name)
            return value

        def sample() -> dict[str, float]:
            out = {f"gpu{g.index}": p for g in monitor.gpus
                   if (p := read(f"GPU {g.index}", g.power_w)) is not None}
            out.update(read("the CPU packages", cpu_power.poll) or {})
            return out

        # Live only redraws on a terminal that can move the cursor (not TERM=dumb).
        live_view = not as_json and console.is_terminal and not console.is_dumb_terminal
        previous_term = signal.signal(signal.SIGTERM, _interrupt)
        try:
            view = Live(console=console, auto_refresh=False) if live_view else nullcontext()
            with view as live:
                while True:
                    remaining = None if duration is None else duration - (time.monotonic() - start)
                    if remaining is not None and remaining <= 0:
                        break
                    time.sleep(interval if remaining is None else min(interval, remaining))
                    reading = sample()
                    elapsed = time.monotonic() - start
                    if as_json:
                        line = json.dumps({"time_s": round(elapsed, 3), "power_w": reading})
                    elif live_view:
                        live.update(_table(reading, elapsed), refresh=True)
                        continue
                    else:
                        line = _line(reading, elapsed)
                    if not print_out(line):  # the reader has gone (| head): stop as on Ctrl-C
                        break
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous_term)
            try:
                m = end_measurement(monitor, "power", "at the end")
            finally:
                monitor.close()
        export_timeline(monitor, timeline)  # first: the totals' reader may be gone
        if m is None:  # no totals (said on stderr)
            if as_json:
                print_out(json.dumps({"error": "the devices could not be read at the end: no totals"}))
            raise typer.Exit(1)
        if as_json:
            print_out(json.dumps({"time_s": m.elapsed_s, "energy_j": {
                **{f"gpu{k}": v for k, v in m.gpu_energy_j.items()},
                **{f"cpu{k}": v for k, v in m.cpu_energy_j.items()},
                **{f"dram{k}": v for k, v in m.dram_energy_j.items()},
            }, "total_energy_j": m.total_energy_j, "missing": list(m.missing)}))
        else:
            try:
                console.print(measurement_table(m, "energy"))
            except BrokenPipeError:
                silence_stdout()
