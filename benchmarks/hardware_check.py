"""Check joules' measurement paths on the GPUs of this machine. Read only unless asked.

For every visible NVIDIA GPU it reports

* the cost of one NVML call for each reading joules uses (energy counter, instant power,
  averaged power), and of the energy counter read as a field value instead (whether it agrees
  with the call, and costs less);
* how often the energy counter and the power reading actually change (the update periods
  joules' sampler relies on), found by polling them back to back;
* the cost of one ``begin_window`` + ``end_window`` once the sampler has learned the
  counter's phase (median, mean and 99th percentile over windows spread over time), and how
  many NVML reads the windows needed;
* how the counter and the sampled power agree over 1 s windows (with a CUDA load from
  PyTorch when it is installed and sees the GPU, otherwise idle).

With ``--clock-latency`` (the one check that changes a setting, so it must be asked for) it
also locks each GPU's SM clock in turn to its highest clock and to about 60 % of it, under the
same load, and reports what the pipeline frequency controller pays per computation: the
cost of the lock call, how long until the SM clock reads the new value, and the cost of the
reset. Locks go through :class:`~joules.devices.restore.RestoreGuard`, so the clock is reset
at the end, on an exception and on SIGTERM or Ctrl-C. It needs root (or the permission to
set clocks), and is not for a GPU whose clocks others rely on.

Run on a GPU machine: ``python benchmarks/hardware_check.py [--clock-latency] [--json out.json]``.
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

from _timing import spread_windows
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


def clock_latency(gpu: GPU, rounds: int, settle_timeout_s: float = 1.0) -> dict[str, Any]:
    """Lock the SM clock alternately high and low ``rounds`` times; reset it at the end.

    Returns:
        The clocks used, median lock and reset call costs (µs), and the median and largest time
        from a lock call until the SM clock reads within one clock step of it (ms; ``None``
        for a lock whose clock never read so within ``settle_timeout_s``).
    """
    from joules.devices.restore import RestoreGuard

    clocks = sorted(gpu.supported_sm_clocks_mhz())
    high = clocks[-1]
    low = min(clocks, key=lambda f: abs(f - 0.6 * high))
    step = min((b - a for a, b in zip(clocks, clocks[1:], strict=False) if b > a), default=1.0)
    lock_us: list[float] = []
    settle_ms: list[float | None] = []
    reset_us: list[float] = []
    guard = RestoreGuard([gpu])
    try:
        for i in range(rounds):
            target = low if i % 2 else high
            t0 = time.perf_counter()
            guard.lock_sm_clock(gpu, target, target)
            t1 = time.perf_counter()
            lock_us.append((t1 - t0) * 1e6)
            settled = None
            while time.perf_counter() - t1 < settle_timeout_s:
                if abs(gpu.sm_clock_mhz() - target) <= step:
                    settled = (time.perf_counter() - t0) * 1e3
                    break
            settle_ms.append(settled)
        for _ in range(min(rounds, 10)):
            t0 = time.perf_counter()
            gpu.reset_sm_clock()
            reset_us.append((time.perf_counter() - t0) * 1e6)
            guard.lock_sm_clock(gpu, high, high)
    finally:
        guard.restore()
    seen = [x for x in settle_ms if x is not None]
    return {
        "high_mhz": high, "low_mhz": low, "rounds": rounds,
        "lock_call_us": statistics.median(lock_us),
        "reset_call_us": statistics.median(reset_us) if reset_us else None,
        "settle_ms_median": statistics.median(seen) if seen else None,
        "settle_ms_max": max(seen) if seen else None,
        "never_settled": len(settle_ms) - len(seen),
    }


def energy_field_reader(gpu: GPU) -> Callable[[], int] | None:
    """A reader of the ``NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` field (mJ), where NVML has it."""
    nvml, handle = getattr(gpu, "_nvml", None), getattr(gpu, "_handle", None)
    if nvml is None or handle is None:
        return None
    from joules.devices.nvidia import _field_reader

    return _field_reader(nvml, handle, int(getattr(nvml, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 83)), 0)


def check_gpu(gpu: GPU, clock: RealClock, quick: bool, simulated: bool = False,
              clocks: bool = False) -> dict[str, Any]:
    """All checks for one GPU."""
    n = 200 if quick else 2000
    poll_s = 1.0 if quick else 3.0
    out: dict[str, Any] = {"index": gpu.index, "name": gpu.name, "counter": gpu.has_energy_counter()}
    if gpu.has_energy_counter():
        out["energy_call_us"] = call_cost_us(gpu.energy_j, n)
        out["counter_period_s"] = update_period_s(gpu.energy_j, poll_s)
        field = energy_field_reader(gpu)
        if field is not None:
            # The same counter as a field value: no cheaper path on the boards seen so far.
            out["energy_field_call_us"] = call_cost_us(field, n)
            reads = [(gpu.energy_j(), field() / 1e3, gpu.energy_j()) for _ in range(20)]
            out["energy_field_agrees"] = sum(a <= b <= c for a, b, c in reads) / len(reads)
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
        # Windows spread over time (a random pause of up to 2 ms after each), so that their
        # edges fall at every phase of the counter's updates, as in a training loop.
        costs = sorted(spread_windows(monitor.begin_window, monitor.end_window, windows, 0.002))
        out["window_us"] = statistics.median(costs) * 1e6
        out["window_mean_us"] = statistics.fmean(costs) * 1e6
        out["window_p99_us"] = costs[int(0.99 * len(costs))] * 1e6
        out["edge_reads_per_window"] = {k: (monitor.reads[k] - reads0[k]) / windows for k in reads0}
        read_cost = monitor.sampler.counter_read_cost_s(gpu.index)
        out["counter_read_cost_us"] = None if read_cost is None else read_cost * 1e6
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
            if clocks:
                out["clock_latency"] = clock_latency(gpu, 10 if quick else 40)
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
    ap.add_argument("--clock-latency", action="store_true",
                    help="also lock and reset each GPU's SM clock to time it (changes a setting; "
                         "it is reset at the end)")
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
        results = [check_gpu(g, clock, args.quick, simulated=bool(args.sim), clocks=args.clock_latency)
                   for g in gpus]
    for r in results:
        print(f"GPU {r['index']} {r['name']}: counter={r['counter']}")
        for key in ("energy_call_us", "energy_field_call_us", "power_call_us", "average_power_call_us",
                    "window_us", "window_mean_us", "window_p99_us"):
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
        if "clock_latency" in r:
            c = r["clock_latency"]
            settle = ("never" if c["settle_ms_median"] is None
                      else f"{c['settle_ms_median']:.2f} ms median, {c['settle_ms_max']:.2f} ms max")
            print(f"  SM clock {c['high_mhz']:.0f} <-> {c['low_mhz']:.0f} MHz x {c['rounds']}: lock call "
                  f"{c['lock_call_us']:.0f} us, reads the new clock after {settle} "
                  f"({c['never_settled']} never), reset call "
                  + ("-" if c["reset_call_us"] is None else f"{c['reset_call_us']:.0f} us"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
