"""``joules demo``: a simulated training run measured per epoch, on simulated GPUs."""

from __future__ import annotations

import os
import time

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from joules.devices.discovery import SIM_ENV
from joules.devices.sim import Periodic, Simulator
from joules.monitoring.monitor import EnergyMonitor

DEFAULT_SPEC = "A100x4"


def training_step(step_s: float, imbalance: float) -> Periodic:
    """One training step: forward/backward, gradient all-reduce, then waiting for data."""
    compute = min(1.0, 0.92 + imbalance)
    return Periodic([(0.62 * step_s, compute), (0.23 * step_s, 0.45), (0.15 * step_s, 0.08)])


def run_demo(
    spec: str = DEFAULT_SPEC,
    epochs: int = 3,
    steps: int = 60,
    step_s: float = 0.35,
    eval_s: float = 6.0,
    real_seconds: float = 4.0,
    console: Console | None = None,
) -> list[dict[str, float]]:
    """Run the demo; return one row per epoch (measured and true GPU energy, time).

    The simulated run takes ``epochs * (steps * step_s + eval_s)`` virtual seconds and is
    paced to last about ``real_seconds`` of real time (0 for as fast as possible).
    """
    console = console or Console()
    sim = Simulator(spec)
    monitor = EnergyMonitor(devices=sim.devices())
    n_gpus = len(sim.gpus)
    console.print(
        f"Simulated training on [bold]{spec}[/bold]: {n_gpus} GPU(s) "
        f"({', '.join(sorted({g.name for g in sim.gpus})) or 'none'}), "
        f"{len(sim.cpus)} CPU package(s); {epochs} epochs x {steps} steps, virtual clock."
    )
    total_steps = epochs * steps
    pause = real_seconds / total_steps if real_seconds > 0 else 0.0
    rows: list[dict[str, float]] = []
    table = Table(title="per-epoch energy (measured by joules; truth from the simulator)")
    for col in ("epoch", "time (s)", "GPU energy (J)", "avg GPU power (W)", "CPU+DRAM (J)",
                "GPU error vs truth"):
        table.add_column(col, justify="right")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("training", total=total_steps)
        for epoch in range(1, epochs + 1):
            truth0 = sum(sim.true_gpu_energy_j().values())
            monitor.begin_window(f"epoch{epoch}")
            for k, g in enumerate(sim.gpus):
                g.set_workload(training_step(step_s, imbalance=0.02 * (k % 3)))
            for c in sim.cpus:
                c.set_workload(Periodic([(0.85 * step_s, 0.25), (0.15 * step_s, 0.7)]))
            for _ in range(steps):
                sim.advance(step_s)
                progress.update(task, advance=1, description=f"epoch {epoch}/{epochs}")
                if pause:
                    time.sleep(pause)
            sim.set_workload(Periodic([(0.2, 0.55), (0.1, 0.1)]))  # evaluation
            sim.advance(eval_s)
            m = monitor.end_window(f"epoch{epoch}")
            truth = sum(sim.true_gpu_energy_j().values()) - truth0
            gpu = sum(m.gpu_energy_j.values())
            error = (gpu - truth) / truth if truth else 0.0
            host = sum(m.cpu_energy_j.values()) + sum(m.dram_energy_j.values())
            rows.append({"epoch": epoch, "time_s": m.elapsed_s, "gpu_energy_j": gpu,
                         "true_gpu_energy_j": truth, "cpu_dram_energy_j": host})
            table.add_row(str(epoch), f"{m.elapsed_s:,.1f}", f"{gpu:,.0f}",
                          f"{gpu / m.elapsed_s:,.0f}", f"{host:,.0f}", f"{100 * error:+.3f} %")
    monitor.close()
    console.print(table)
    total = sum(r["gpu_energy_j"] for r in rows)
    true_total = sum(r["true_gpu_energy_j"] for r in rows)
    console.print(
        f"Total GPU energy {total / 1000:,.2f} kJ (truth {true_total / 1000:,.2f} kJ) over "
        f"{sum(r['time_s'] for r in rows):,.0f} simulated seconds."
    )
    return rows


def register(app: typer.Typer) -> None:
    """Add the command to the app."""

    @app.command()
    def demo(
        sim: str | None = typer.Option(None, "--sim", metavar="SPEC",
                                       help=f"Simulated hardware (default {DEFAULT_SPEC})."),
        epochs: int = typer.Option(3, "--epochs", min=1, help="Epochs to train."),
        steps: int = typer.Option(60, "--steps", min=1, help="Training steps per epoch."),
        fast: bool = typer.Option(False, "--fast", help="Do not pace the run in real time."),
    ) -> None:
        """Run a simulated training job on simulated GPUs and measure each epoch."""
        spec = sim or os.environ.get(SIM_ENV) or DEFAULT_SPEC
        run_demo(spec, epochs=epochs, steps=steps, real_seconds=0.0 if fast else 4.0)
