"""Benchmark 4: energy error against ground truth on short and bursty windows, joules vs Zeus.

Each (GPU model, load) pair gets its own simulator on a :class:`~joules.clock.VirtualClock`
and one fake NVML over it, read by every tool:

* joules: ``EnergyMonitor`` on ``discover_nvml()`` GPUs with ``DeviceSet(clock=sim.clock)`` (its
  sampler ticks on the virtual clock's timers);
* Zeus: ``ZeusMonitor(cpu_indices=[])`` (default) and ``ZeusMonitor(approx_instant_energy=True)``
  (Zeus' option for windows shorter than the counter's update period: a window whose counter
  difference is zero is estimated as instant power x duration), with ``zeus.monitor.energy.time``
  replaced by the virtual clock.

Windows of 10 ms, 50 ms, 330 ms, 1.07 s, 4.7 s and 4.73 s are opened at random offsets (random gaps of
50-500 ms, so edges fall at every phase of the counter, the power sensor and the load), after a
5 s warm-up; every window's energy is compared with the simulator's exact energy
(``SimGPU.true_energy_j`` at both edges). Loads: constant (60 % utilization) and bursty (a
200 ms cycle of 60 ms at 100 %, 25 ms at 20 %, 40 ms at 80 %, 75 ms at 10 %).

GPUs: A100 and H100 (counter updated every 100 ms), V100 (every 20 ms), P100 (no counter).
On the P100, Zeus 0.16 cannot measure at all (no supported power field); it is measured with
the Pascal shim ("Zeus+shim", see ``_harness.zeus_pascal_shim``). On the V100 (no
``NVML_FI_DEV_POWER_INSTANT`` field in the simulation) ``approx_instant_energy=True`` makes Zeus'
``end_window`` raise ``ZeusGPUNotSupportedError``; the shim is applied there too (it does not
change Zeus' default mode, which reads only the counter). Its ``PowerMonitor`` polling
function (``zeus.monitor.power._domain_polling_process``) is run unchanged, in this process,
on the virtual clock: Zeus infers a polling period of 0 (see docs/benchmarks.md), i.e. it polls
back to back; here every ``time()`` call in that module advances the virtual clock by 1 ms,
so the loop polls every 2 ms (real back-to-back polling is faster; 2 ms is far below the
P100's 20 ms sensor period). Window edges are events on the same timeline.

Run: ``.bench-venv/bin/python benchmarks/accuracy.py [--windows N] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Generator
from pathlib import Path

import _harness as H
from joules.devices.base import DeviceSet
from joules.devices.sim import Constant, Periodic, Simulator
from joules.monitoring.monitor import EnergyMonitor

warnings.filterwarnings("ignore", message="The energy consumption of one or more GPUs")

# 4.7 s is an exact multiple of the 100 ms and 20 ms counter periods (both edges then sit at
# the same counter phase, which favours a plain counter difference); 4.73 s is not.
LENGTHS_S = (0.010, 0.050, 0.330, 1.07, 4.7, 4.73)
# Windows per length (short windows are cheap and noisier, so more of them).
COUNTS = (200, 200, 80, 40, 40, 40)
QUICK_COUNTS = (20, 20, 10, 10, 10, 10)
TIE_PCT = 0.01  # |difference| below this many percentage points counts as a tie
MODELS = ("A100", "H100", "V100", "P100")
LOADS: dict[str, Callable[[], object]] = {
    "constant": lambda: Constant(0.6),
    "bursty": lambda: Periodic([(0.060, 1.0), (0.025, 0.2), (0.040, 0.8), (0.075, 0.1)]),
}
WARMUP_S = 5.0
ZEUS_TIME_STEP_S = 0.001  # virtual time per time() call in Zeus' polling loop


class Timeline:
    """Runs an experiment (a generator yielding the virtual times it wants to act at)."""

    def __init__(self, clock: object, experiment: Generator[float, None, None]) -> None:
        self.clock = clock
        self.experiment = experiment
        self.next_t: float | None = next(experiment, None)

    @property
    def done(self) -> bool:
        return self.next_t is None

    def advance_to(self, t: float) -> None:
        """Move the clock to ``t``, running every experiment step due on the way."""
        while self.next_t is not None and self.next_t <= t:
            self.clock.advance_to(max(self.next_t, self.clock.now()))
            try:
                self.next_t = self.experiment.send(None)
            except StopIteration:
                self.next_t = None
        if t > self.clock.now():
            self.clock.advance_to(t)

    def run(self) -> None:
        while self.next_t is not None:
            self.advance_to(self.next_t)


class _StopWhenDone:
    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline

    def is_set(self) -> bool:
        return self.timeline.done

    def set(self) -> None:
        pass


def run_case(model: str, load: str, counts: tuple[int, ...], seed: int) -> dict:
    """All window lengths for one GPU model and load; returns errors per tool and length."""
    sim = Simulator(f"{model},nocpu")
    sim.set_workload(LOADS[load]())
    gpu = sim.gpus[0]
    H.install_fake(sim, 0.0)
    clock = sim.clock

    gpus = H.joules_nvml_gpus()
    jmon = EnergyMonitor(devices=DeviceSet(gpus=gpus, cpus=[], clock=clock))

    import zeus.monitor.power as zpo

    H.zeus_use_clock(clock.now)  # plain virtual time during construction
    deferred = H.zeus_inprocess_power_monitor()
    if model in ("P100", "V100"):
        # P100: no power field at all; V100: no POWER_INSTANT field, which
        # approx_instant_energy reads (unmodified, its end_window raises NotSupported).
        H.zeus_pascal_shim()
    from zeus.monitor import ZeusMonitor

    z_default = ZeusMonitor(cpu_indices=[])
    z_approx = ZeusMonitor(cpu_indices=[], approx_instant_energy=True)
    poller = None
    if z_default.power_monitor is not None:
        # One poller feeds both Zeus monitors (they would each start their own).
        z_approx.power_monitor.stop()
        z_approx.power_monitor = z_default.power_monitor
        poller = deferred[0]
    tools = {"joules": None, "zeus": z_default, "zeus_approx": z_approx}

    rng = random.Random(seed)
    plan = [length for length, n in zip(LENGTHS_S, counts, strict=True) for _ in range(n)]
    rng.shuffle(plan)
    errors: dict[str, dict[float, list[tuple[float, float]]]] = {
        t: {length: [] for length in LENGTHS_S} for t in tools
    }
    truths: dict[float, list[float]] = {length: [] for length in LENGTHS_S}

    def experiment() -> Generator[float, None, None]:
        t = clock.now() + WARMUP_S
        for length in plan:
            t = clock.now() + rng.uniform(0.05, 0.5)
            yield t
            e0 = gpu.true_energy_j()
            jmon.begin_window("w")
            for z in tools.values():
                if z is not None:
                    z.begin_window("w", sync_execution=False)
            yield t + length
            truth = gpu.true_energy_j() - e0
            truths[length].append(truth)
            got = {"joules": jmon.end_window("w").gpu[0].energy_j}
            for name, z in tools.items():
                if z is not None:
                    got[name] = z.end_window("w", sync_execution=False).gpu_energy[0]
            for name, value in got.items():
                errors[name][length].append((value - truth, truth))

    def warmup_then(gen: Generator[float, None, None]) -> Generator[float, None, None]:
        yield clock.now() + WARMUP_S
        yield from gen

    timeline = Timeline(clock, warmup_then(experiment()))
    wall0 = time.perf_counter()
    if poller is None:
        timeline.run()
    else:
        def polling_time() -> float:
            timeline.advance_to(clock.now() + ZEUS_TIME_STEP_S)
            return clock.now()

        zpo.time = polling_time
        zpo.sleep = lambda s: timeline.advance_to(clock.now() + max(0.0, s))
        kwargs = dict(poller.kwargs)
        kwargs["stop_event"] = _StopWhenDone(timeline)
        zpo._domain_polling_process(**kwargs)
        zpo.time = clock.now
        if not timeline.done:
            raise RuntimeError("Zeus' polling loop stopped before the experiment ended")
    wall = time.perf_counter() - wall0
    jmon.close()
    if poller is not None:
        z_default.power_monitor.stop()

    out: dict = {"model": model, "load": load, "wall_s": wall, "tools": {}}
    for name, per_len in errors.items():
        out["tools"][name] = {}
        for length, pairs in per_len.items():
            abs_j = [abs(d) for d, _ in pairs]
            rel = [abs(d) / tr for d, tr in pairs if tr > 0]
            out["tools"][name][str(length)] = {
                "mae_j": statistics.fmean(abs_j),
                "mape_pct": statistics.fmean(rel) * 100,
                "bias_pct": statistics.fmean(d / tr for d, tr in pairs) * 100,
                "n": len(pairs),
            }
    out["truth_mean_j"] = {str(k): statistics.fmean(v) for k, v in truths.items()}
    return out


def _fmt_len(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the number of windows")
    ap.add_argument("--quick", action="store_true", help="about 10 windows per case")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    counts = tuple(max(1, round(n * args.scale)) for n in (QUICK_COUNTS if args.quick else COUNTS))

    H.install_fake(Simulator("A100,nocpu"))
    H.import_zeus()
    results = []
    t0 = time.perf_counter()
    for i, model in enumerate(args.models.split(",")):
        for j, load in enumerate(LOADS):
            r = run_case(model, load, counts, seed=1000 + 10 * i + j)
            results.append(r)
            print(f"  {model} {load}: {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0

    rows = []
    tally = {"win": 0, "tie": 0, "loss": 0}
    for r in results:
        for length in LENGTHS_S:
            k = str(length)
            j, z, za = (r["tools"][t][k] for t in ("joules", "zeus", "zeus_approx"))
            best = min(z["mape_pct"], za["mape_pct"])
            if abs(j["mape_pct"] - best) < TIE_PCT:
                verdict = "tie"
            else:
                verdict = "win" if j["mape_pct"] < best else "loss"
            tally[verdict] += 1
            rows.append([
                f"{r['model']} {r['load'][:5]}", _fmt_len(length), str(j["n"]), f"{r['truth_mean_j'][k]:.2f}",
                f"{j['mae_j']:.3f}", f"{z['mae_j']:.3f}", f"{za['mae_j']:.3f}",
                f"{j['mape_pct']:.2f}", f"{z['mape_pct']:.2f}", f"{za['mape_pct']:.2f}", verdict,
            ])
    H.print_table(
        "Energy error vs ground truth: mean absolute error per window, J and % (virtual clock)",
        ["GPU load", "window", "n", "true J", "joules J", "Zeus J", "Z-approx J",
         "joules %", "Zeus %", "Z-approx %", "joules"],
        rows,
        note=(
            f"joules vs the better Zeus mode: {tally['win']} wins, {tally['tie']} ties (within {TIE_PCT} "
            f"points), {tally['loss']} losses. Z-approx = approx_instant_energy=True.\n"
            "Zeus on P100 = Zeus+shim (both modes); on V100 Z-approx uses the shim (unmodified it raises).\n"
            f"Windows at random offsets after {WARMUP_S:.0f} s warm-up. Total wall time {wall:.0f} s. "
            + H.machine()
        ),
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
