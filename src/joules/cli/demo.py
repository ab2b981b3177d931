"""``joules demo``: simulated training, measured per epoch, with the power-limit optimizer."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from joules.cli import Console
from joules.devices.discovery import SIM_ENV
from joules.devices.restore import RestoreGuard
from joules.devices.sim import Constant, Periodic, Simulator
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer

DEFAULT_SPEC = "A100x4"


COMPUTE_FRACTION = 0.85  # of a step's time that scales with the SM clock


def _train_epoch(sim: Simulator, steps: int, step_s: float, imbalance: float,
                 opt: PowerLimitOptimizer | None, tick: Callable[[], None]) -> None:
    for k, g in enumerate(sim.gpus):
        g.set_workload(Constant(min(1.0, 0.94 + imbalance * (k % 3))))
    for c in sim.cpus:
        c.set_workload(Constant(0.35))
    for _ in range(steps):
        if opt is not None:
            opt.on_step_begin()
        sim.run(step_s, COMPUTE_FRACTION)
        if opt is not None:
            opt.on_step_end()
        tick()


def _evaluate(sim: Simulator, eval_s: float) -> None:
    sim.set_workload(Periodic([(0.2, 0.55), (0.1, 0.1)]))
    sim.advance(eval_s)


def run_demo(
    spec: str = DEFAULT_SPEC,
    epochs: int = 5,
    steps: int = 60,
    step_s: float = 0.35,
    eval_s: float = 6.0,
    selector: str = "cost:0.5",
    optimize: bool = True,
    real_seconds: float = 4.0,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the demo; return per-epoch rows and a summary of the optimizer's effect.

    A simulated data-parallel training job runs ``epochs * steps`` steps (``step_s`` each at
    full clocks) with ``eval_s`` of evaluation per epoch, measured epoch by epoch and checked
    against the simulator's exact energy. With ``optimize``, a :class:`PowerLimitOptimizer`
    finds the power limit during the run, and a twin of the job at the default limit shows
    what it saved. The run is paced to last about ``real_seconds`` (0: as fast as possible).
    """
    console = console or Console()
    sim = Simulator(spec)
    twin = Simulator(spec)  # the same job, left at the default limits
    state_dir = tempfile.TemporaryDirectory(prefix="joules-demo-")
    monitor = EnergyMonitor(devices=sim.devices())
    n_gpus = len(sim.gpus)
    opt = None
    if optimize and n_gpus:
        opt = PowerLimitOptimizer(monitor, selector=selector, warmup_steps=5, profile_steps=20,
                                  store=Path(state_dir.name),
                                  guard=RestoreGuard(sim.gpus, journal_dir=Path(state_dir.name)))
    console.print(
        f"Simulated training on [bold]{spec}[/bold]: {n_gpus} GPU(s) "
        f"({', '.join(sorted({g.name for g in sim.gpus})) or 'none'}), "
        f"{len(sim.cpus)} CPU package(s); {epochs} epochs x {steps} steps, virtual clock"
        + (f"; power-limit optimizer, selector {selector}." if opt else ".")
    )
    total_steps = epochs * steps
    pause = real_seconds / total_steps if real_seconds > 0 else 0.0
    rows: list[dict[str, Any]] = []
    table = Table(title="per-epoch energy (measured by joules; truth from the simulator)")
    for col in ("epoch", "power limit (W)", "time (s)", "GPU energy (J)", "avg GPU power (W)",
                "CPU+DRAM (J)", "GPU error vs truth"):
        table.add_column(col, justify="right")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("training", total=total_steps)

        seen: list[float] = []

        def tick() -> None:
            if sim.gpus and (not seen or seen[-1] != sim.gpus[0].power_limit_w()):
                seen.append(sim.gpus[0].power_limit_w())
            progress.update(task, advance=1)
            if pause:
                time.sleep(pause)

        if opt is not None:
            opt.on_train_begin()
        for epoch in range(1, epochs + 1):
            progress.update(task, description=f"epoch {epoch}/{epochs}")
            truth0 = sum(sim.true_gpu_energy_j().values())
            seen[:] = [sim.gpus[0].power_limit_w()] if sim.gpus else []
            monitor.begin_window(f"epoch{epoch}")
            if opt is not None:
                opt.on_epoch_begin()
            _train_epoch(sim, steps, step_s, 0.02, opt, tick)
            if opt is not None:
                opt.on_epoch_end()
            _evaluate(sim, eval_s)
            m = monitor.end_window(f"epoch{epoch}")
            _train_epoch(twin, steps, step_s, 0.02, None, lambda: None)
            _evaluate(twin, eval_s)
            truth = sum(sim.true_gpu_energy_j().values()) - truth0
            gpu = sum(m.gpu_energy_j.values())
            error = (gpu - truth) / truth if truth else 0.0
            host = sum(m.cpu_energy_j.values()) + sum(m.dram_energy_j.values())
            limits = list(seen)
            shown = " → ".join(f"{x:g}" for x in (limits if len(limits) <= 3 else limits[:2]))
            if len(limits) > 3:
                shown += f" → … → {limits[-1]:g}"
            rows.append({"epoch": epoch, "time_s": m.elapsed_s, "gpu_energy_j": gpu,
                         "true_gpu_energy_j": truth, "cpu_dram_energy_j": host, "limits_w": limits})
            table.add_row(str(epoch), shown or "-", f"{m.elapsed_s:,.1f}",
                          f"{gpu:,.0f}", f"{gpu / m.elapsed_s:,.0f}", f"{host:,.0f}",
                          f"{100 * error:+.3f} %")
    console.print(table)
    total = sum(r["gpu_energy_j"] for r in rows)
    true_total = sum(r["true_gpu_energy_j"] for r in rows)
    elapsed = sum(r["time_s"] for r in rows)
    console.print(f"Total GPU energy {total / 1000:,.2f} kJ (truth {true_total / 1000:,.2f} kJ) over "
                  f"{elapsed:,.0f} simulated seconds.")
    summary: dict[str, Any] = {"rows": rows, "gpu_energy_j": total, "time_s": elapsed}
    if opt is not None:
        summary.update(_optimizer_summary(console, opt, sim, twin, true_total, elapsed))
        opt.on_train_end()
        summary["limits_after_w"] = [g.power_limit_w() for g in sim.gpus]
        console.print("Power limits after training: "
                      + ", ".join(f"{x:g} W" for x in summary["limits_after_w"]) + " (as before).")
    monitor.close()
    state_dir.cleanup()
    return summary


def _optimizer_summary(console: Console, opt: PowerLimitOptimizer, sim: Simulator, twin: Simulator,
                       true_total: float, elapsed: float) -> dict[str, Any]:
    report = opt.report()
    if opt.chosen_limit_w is None:
        console.print(f"The optimizer is still profiling ({len(opt.points)} limit(s) so far): "
                      "train longer (--epochs/--steps) to see it converge.")
        return {"chosen_limit_w": None, "points": report["points"]}
    assert opt.selector is not None
    ref = max(opt.points.values(), key=lambda p: p.limit_w)
    t = Table(title=f"power limits profiled ({len(opt.points)} of {len(opt.limits_w)}; "
                    f"selector {opt.selector})")
    for col in ("limit (W)", "time/step (s)", "energy/step (J)", "cost", ""):
        t.add_column(col, justify="right")
    for p in sorted(opt.points.values(), key=lambda p: -p.limit_w):
        t.add_row(f"{p.limit_w:g}", f"{p.time_s:.3f}", f"{p.energy_j:,.1f}",
                  f"{opt.selector.cost(p, ref):,.1f}", "chosen" if p.limit_w == opt.chosen_limit_w else "")
    console.print(t)
    twin_energy = sum(twin.true_gpu_energy_j().values())
    twin_time = twin.clock.now()
    run_energy = sum(sim.true_gpu_energy_j().values())
    run_time = sim.clock.now()
    saved = 1.0 - run_energy / twin_energy
    slower = run_time / twin_time - 1.0
    console.print(
        f"Chosen limit [bold]{opt.chosen_limit_w:g} W[/bold]. Against the same job at the default "
        f"limit (true energy): GPU energy {run_energy / 1000:,.2f} vs {twin_energy / 1000:,.2f} kJ "
        f"([bold]{100 * saved:.1f} % saved[/bold], profiling included), time {100 * slower:+.1f} %."
    )
    return {"chosen_limit_w": opt.chosen_limit_w, "points": report["points"], "saved_fraction": saved,
            "slowdown": slower, "default_energy_j": twin_energy, "true_energy_j": run_energy}


def register(app: typer.Typer) -> None:
    """Add the command to the app."""

    @app.command()
    def demo(
        sim: str | None = typer.Option(None, "--sim", metavar="SPEC",
                                       help=f"Simulated hardware (default {DEFAULT_SPEC})."),
        epochs: int = typer.Option(5, "--epochs", min=1, help="Epochs to train."),
        steps: int = typer.Option(60, "--steps", min=1, help="Training steps per epoch."),
        selector: str = typer.Option("cost:0.5", "--selector",
                                     help="Power-limit selector: time, energy, cost:ETA, slowdown:FACTOR."),
        no_optimize: bool = typer.Option(False, "--no-optimize", help="Only measure; keep the limits."),
        fast: bool = typer.Option(False, "--fast", help="Do not pace the run in real time."),
    ) -> None:
        """Train on simulated GPUs: measure each epoch and let the power-limit optimizer work."""
        from joules.optimizers.power_limit import parse_selector

        parse_selector(selector)  # a bad selector is a one-line error before anything runs
        spec = sim or os.environ.get(SIM_ENV) or DEFAULT_SPEC
        run_demo(spec, epochs=epochs, steps=steps, selector=selector, optimize=not no_optimize,
                 real_seconds=0.0 if fast else 4.0)
