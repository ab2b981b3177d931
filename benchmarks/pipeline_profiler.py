"""Profiling pipeline stages during training: measured profile against the simulated truth.

Each stage of a 1F1B pipeline (default 4 stages x 8 microbatches, ``stage_work`` with 30 ms
forwards, 4 ms blocked after each computation) runs on its own simulated GPU, driven
through ``StageProfiler``'s callbacks on the virtual clock until every clock is profiled
(every ``--step``-th clock from the highest to 60 % of it). The profile it measures is
compared with ``profile_simulated``'s exact one:

- *windows*: each computation's energy as its own monitor window measured it (mean per clock
  and kind), error against the truth;
- *attributed*: the profiler's energies (counter updates split by least squares), error;
- blocking power: the profiler's estimate (mean over the stages) against the simulated idle power;
- *s per stage*: virtual time each stage spent profiling (the ranks profile at once in a real job);
- plans: the frontier solved from each measured profile, its plans at the fastest time and
  5 % and 10 % slower evaluated under the true profile, against the plans solved from the
  true profile (energy difference, %; the windows' profile is solved with the true blocking
  power, so only its energies differ).

No peer is run: Zeus' pipeline profiler (Perseus) needs its server and real GPUs.

Run: ``python benchmarks/pipeline_profiler.py [--gpus A100,V100,H100] [--stages 4]
[--microbatches 8] [--step 2]`` from the repository root.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from rich.console import Console
from rich.table import Table

from joules.devices.restore import RestoreGuard
from joules.devices.sim import Constant, Simulator
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.pipeline.execution import measure_blocking_power_w, profile_simulated, stage_work
from joules.optimizers.pipeline.frontier import evaluate
from joules.optimizers.pipeline.profile import PipelineProfile
from joules.optimizers.pipeline.profiler import StageProfiler
from joules.optimizers.pipeline.schedule import build_dag
from joules.optimizers.pipeline.solver import solve

GAP_S = 0.004


def profile_stages(spec: str, stages: int, microbatches: int, step: int):
    sim = Simulator(f"{spec}x{stages}")
    work = stage_work(stages, seed=1)
    dag = build_dag("1f1b", stages, microbatches)
    mon = EnergyMonitor(devices=sim.devices(), cpu_indices=[])
    sim.advance(2.0)
    journal = tempfile.TemporaryDirectory(prefix="joules-bench-")
    guard = RestoreGuard(sim.gpus, journal_dir=journal.name, handle_signals=False, recover_stale=False)
    profs = []
    t0 = sim.clock.now()
    for s in range(stages):
        gpu, w = sim.gpus[s], work[s]
        prof = StageProfiler(mon, stage=s, gpu=s, step=step, guard=guard)
        order = [(dag.nodes[n].kind, dag.nodes[n].microbatch) for n in dag.stage_order[s]]
        while not prof.done:
            for kind, mb in order:
                prof.on_instruction_begin(kind, mb)
                gpu.set_workload(Constant(w.utilization))
                sim.advance(gpu.step_time_s(w.work_s(kind), w.compute_fraction, w.utilization))
                gpu.set_workload(Constant(0.0))
                prof.on_instruction_end(kind, mb)
                sim.advance(GAP_S)
        profs.append(prof)
    mon.close()
    journal.cleanup()
    truth = profile_simulated(Simulator(f"{spec}x{stages}"), work, frequencies=profs[0].frequencies)
    return profs, truth, measure_blocking_power_w(Simulator(spec), 1), sim.clock.now() - t0, dag


def errors(measured: PipelineProfile, truth: PipelineProfile) -> list[float]:
    return [100 * (m.energy_j / t.energy_j - 1)
            for key, opts in truth.options.items() for m, t in zip(measured.options[key], opts, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="A100,V100,H100")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--step", type=int, default=2)
    args = ap.parse_args()
    table = Table(title=f"Profiling {args.stages} x {args.microbatches} 1F1B stages during training "
                        "(simulated GPUs, virtual clock)")
    for col in ("GPU", "clocks", "s per stage", "windows: error %, mean | max",
                "attributed: error %, mean | max", "blocking W (true)", "plans, windows %",
                "plans, attributed %"):
        table.add_column(col, justify="right")
    wall = time.perf_counter()
    for spec in args.gpus.split(","):
        profs, truth, pb_true, span, dag = profile_stages(spec.strip(), args.stages, args.microbatches,
                                                          args.step)
        windows = PipelineProfile.from_rows([(p.stage, s.computation, s.frequency, s.time_s, s.energy_j)
                                             for p in profs for s in p.measured()])
        attributed = PipelineProfile.merge([p.profile() for p in profs])
        pb = sum(p.blocking_power_w or 0.0 for p in profs) / len(profs)
        ew, ea = errors(windows, truth), errors(attributed, truth)
        ft = solve(dag, truth, pb_true, 0.001)
        diffs = {}
        for label, prof, power in (("attributed", attributed, pb), ("windows", windows, pb_true)):
            fm = solve(dag, prof, power, 0.001)
            out = []
            for slack in (1.0, 1.05, 1.10):
                t = ft.fastest.time_s * slack
                want = ft.plan_for_time(t)
                got = evaluate(dag, truth, list(fm.plan_for_time(t).frequencies), pb_true)
                out.append(100 * (got.energy_j / want.energy_j - 1))
            diffs[label] = out
        table.add_row(
            spec, str(len(profs[0].frequencies)), f"{span / len(profs):.0f}",
            f"{sum(abs(e) for e in ew) / len(ew):.3f} | {max(ew, key=abs):+.2f}",
            f"{sum(abs(e) for e in ea) / len(ea):.3f} | {max(ea, key=abs):+.2f}",
            f"{pb:.2f} ({pb_true:.0f})",
            " / ".join(f"{d:+.2f}" for d in diffs["windows"]),
            " / ".join(f"{d:+.2f}" for d in diffs["attributed"]),
        )
    console = Console(width=200)
    console.print(table)
    console.print("plans: at the fastest time / 5 % slower / 10 % slower, energy under the true profile "
                  f"against the true profile's own plan. Wall time {time.perf_counter() - wall:.0f} s.")


if __name__ == "__main__":
    main()
