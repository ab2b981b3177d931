"""Check joules' measurement paths on the GPUs of this machine. Read only: changes no setting.

For every visible NVIDIA GPU it reports

* the cost of one NVML call for each reading joules uses (energy counter, instant power,
  averaged power);
* how often the energy counter and the power reading actually change (the update periods
  joules' sampler relies on), found by polling them back to back;
* the cost of one ``begin_window`` + ``end_window`` once the sampler has learned the
  counter's phase, and how many NVML reads the windows needed;
* how the counter and the sampled power agree over 1 s windows (with a CUDA load from
  PyTorch when it is installed and sees the GPU, otherwise idle).

Run on a GPU machine: ``python benchmarks/hardware_check.py [--json out.json]``.
``--sim A100`` runs the same code on simulated GPUs behind a fake NVML (for trying it out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from joules.clock import RealClock
from joules.devices.base import GPU, DeviceSet
from joules.monitoring.monitor import EnergyMonitor


def call_cost_us(fn: Callable[[], object], n: int) -> float:
    """Median cost of one call, µs."""
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e6


def update_period_s(fn: Callable[[], float], seconds: float) -> float | None:
    """Median time between changes of a reading polled back to back (None: never changed)."""
    changes = []
    last = fn()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = fn()
        if value != last:
            changes.append(time.monotonic())
            last = value
    gaps = [b - a for a, b in zip(changes, changes[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


@contextlib.contextmanager
def cuda_load(gpu_index: int, seconds_on: float = 0.3, seconds_off: float = 0.2) -> Iterator[str]:
    """Bursts of matrix multiplications on one GPU, if PyTorch with CUDA is available."""
    try:
        import torch
    except ImportError:
        yield "idle (no torch)"
        return
    if not torch.cuda.is_available():
        yield "idle (torch sees no GPU)"
        return
    stop = threading.Event()

    def work() -> None:
        dev = torch.device("cuda", gpu_index)
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        while not stop.is_set():
            end = time.monotonic() + seconds_on
            while time.monotonic() < end:
                a @ a  # noqa: B018 - load only
            torch.cuda.synchronize(dev)
            stop.wait(seconds_off)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield f"bursts of bf16 matmul ({seconds_on:g} s on, {seconds_off:g} s off)"
    finally:
        stop.set()
        thread.join()


def check_gpu(gpu: GPU, clock: RealClock, quick: bool, simulated: bool = False) -> dict[str, Any]:
    """All checks for one GPU."""
    n = 200 if quick else 2000
    poll_s = 1.0 if quick else 3.0
    out: dict[str, Any] = {"index": gpu.index, "name": gpu.name, "counter": gpu.has_energy_counter()}
    if gpu.has_energy_counter():
        out["energy_call_us"] = call_cost_us(gpu.energy_j, n)
        out["counter_period_s"] = update_period_s(gpu.energy_j, poll_s)
    out["power_call_us"] = call_cost_us(gpu.power_w, n)
    out["average_power_call_us"] = call_cost_us(gpu.average_power_w, n)
    out["power_period_s"] = update_period_s(gpu.power_w, poll_s)
    out["assumed_counter_period_s"] = gpu.energy_counter_period_s()
    out["assumed_power_period_s"] = gpu.power_update_period_s()

    monitor = EnergyMonitor(devices=DeviceSet(gpus=[gpu], clock=clock))
    try:
        time.sleep(2.0)  # the sampler learns the counter's phase
        reads0 = dict(monitor.reads)
        windows = 200 if quick else 2000
        out["window_us"] = call_cost_us(lambda: (monitor.begin_window("w"), monitor.end_window("w")),
                                        windows)
        out["edge_reads_per_window"] = {k: (monitor.reads[k] - reads0[k]) / windows for k in reads0}
        load_ctx = contextlib.nullcontext("simulated bursts") if simulated else cuda_load(gpu.index)
        with load_ctx as load:
            out["load"] = load
            time.sleep(1.0)
            rows = []
            for _ in range(3 if quick else 10):
                t0 = clock.now()
                s0 = monitor.sampler.energy_integral(gpu.index, t0)
                monitor.begin_window("agree")
                time.sleep(1.0)
                m = monitor.end_window("agree")
                sampled = monitor.sampler.energy_integral(gpu.index, clock.now()) - s0
                rows.append((m.gpu[gpu.index].energy_j, sampled, m.gpu[gpu.index].source.value))
        out["windows_1s"] = [
            {"monitor_j": a, "sampled_power_j": b, "source": src,
             "difference_pct": 100 * (b - a) / a if a else None}
            for a, b, src in rows
        ]
    finally:
        monitor.close()
    return out


def main() -> int:
    """Run the checks and print the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim", metavar="SPEC", help="simulated GPUs behind a fake NVML instead")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args()

    from joules.devices.nvidia import discover_nvml

    with contextlib.ExitStack() as stack:
        if args.sim:
            from joules.devices.sim import Periodic, Simulator
            from joules.testing.fake_pynvml import installed

            sim = Simulator.realtime(args.sim)
            sim.set_workload(Periodic([(0.3, 0.9), (0.2, 0.1)]))
            stack.enter_context(installed(sim))
        gpus, problems = discover_nvml()
        for p in problems:
            print(f"problem: {p.device}: {p.message}" + (f" (fix: {p.fix})" if p.fix else ""))
        if not gpus:
            print("no NVIDIA GPU found", file=sys.stderr)
            return 1
        clock = RealClock()
        results = [check_gpu(g, clock, args.quick, simulated=bool(args.sim)) for g in gpus]
    for r in results:
        print(f"GPU {r['index']} {r['name']}: counter={r['counter']}")
        for key in ("energy_call_us", "power_call_us", "average_power_call_us", "window_us"):
            if key in r:
                print(f"  {key:24s} {r[key]:10.1f}")
        for key in ("counter_period_s", "power_period_s"):
            if key in r:
                assumed = r["assumed_" + key]
                seen = "never changed" if r[key] is None else f"{r[key] * 1e3:.1f} ms"
                print(f"  {key:24s} {seen} (joules assumes {assumed})")
        print(f"  edge reads per window    {r['edge_reads_per_window']}")
        print(f"  1 s windows, load: {r['load']}")
        for w in r["windows_1s"]:
            diff = "-" if w["difference_pct"] is None else f"{w['difference_pct']:+.2f} %"
            print(f"    monitor {w['monitor_j']:9.2f} J ({w['source']})  sampled power "
                  f"{w['sampled_power_j']:9.2f} J  {diff}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
