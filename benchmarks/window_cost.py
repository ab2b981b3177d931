"""Benchmark 1: CPU cost of one measurement window (begin + end), joules vs Zeus.

Both tools read the same simulated A100s through the same fake ``pynvml``
(:mod:`joules.testing.fake_pynvml`) on the real clock. joules uses its real NVML backend
(``joules.devices.nvidia.discover_nvml``) in a ``DeviceSet(gpus=..., cpus=[], clock=RealClock())``;
Zeus is a ``ZeusMonitor`` opening the same fake through its own NVML layer.

Each configuration is timed over many back-to-back windows (``begin_window`` +
``end_window``, nothing in between) in rounds, joules' monitor having run for 2 s first so
that its sampler has learned the counters' update phase (its steady state). Each round
builds a fresh monitor of each tool in turn (order alternating between rounds; only one
monitor alive at a time, so joules' sampler thread never runs while Zeus is timed).
Reported: the median over rounds of each round's median, and the median of the per-round
joules/Zeus ratios (robust to the load of a shared machine drifting between rounds). The
fake's per-call latency (a busy wait in every NVML call) is 0 (pure Python cost) and 20 µs
(about what a real NVML query costs).

"GPU only" rows measure no CPU package in either tool. "+1 CPU pkg" rows add one RAPL
package (package + DRAM zones) read from the same fake powercap tree by both tools
(``joules.devices.rapl.discover_rapl`` and Zeus' ``RAPLCPUs`` with ``RAPL_DIR`` pointed at it).

"H200" rows: one simulated H200, whose energy-counter read blocks 3 ms as on the real board
(``GPUModel.counter_read_s``; ``docs/hardware.md``), windows spread over time (a random pause
of up to 10 ms after each, so that edges fall at every phase of the counter's updates; means
per round instead of medians, since a slow read hits only some windows), joules
as it is and with ``max_edge_read_s=None`` (reading the counter at every edge that needs it).

Run: ``.bench-venv/bin/python benchmarks/window_cost.py [--quick] [--h200-only]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import _harness as H
from _timing import spread_windows
from joules.clock import RealClock
from joules.devices.base import DeviceSet
from joules.devices.rapl import discover_rapl
from joules.devices.sim import Simulator
from joules.monitoring.monitor import EnergyMonitor
from joules.testing.fake_sysfs import FakePowercap

warnings.filterwarnings("ignore", message="The energy consumption of one or more GPUs")


def _sim(n_gpus: int, cpu: bool, model: str = "A100") -> Simulator:
    return Simulator.realtime(f"{model}x{n_gpus}" + ("" if cpu else ",nocpu"))


def calls_per_window(fake: object, begin: object, end: object, n: int = 50) -> float:
    before = sum(fake.fake_calls.values())
    H.timed_windows(begin, end, n)
    return (sum(fake.fake_calls.values()) - before) / n


JOULES_WARMUP_S = 2.0
SPREAD_PAUSE_S = 0.01  # H200 rows: a random pause of up to 10 ms after each window
STUB = -1.0  # "latency" meaning: energy reads replaced by a near-free stub (tool overhead only)


def _install(sim: Simulator, latency: float) -> object:
    fake = H.install_fake(sim, max(0.0, latency), keep_zeus_cpus=True)
    if latency == STUB:
        calls = fake.fake_calls
        mono = time.monotonic

        def nvmlDeviceGetTotalEnergyConsumption(handle: object) -> int:  # noqa: N802
            calls["nvmlDeviceGetTotalEnergyConsumption"] += 1
            return int(mono() * 10.0) * 25_000  # mJ, updated every 100 ms like an A100 counter

        fake.nvmlDeviceGetTotalEnergyConsumption = nvmlDeviceGetTotalEnergyConsumption
    return fake


def run_joules(n_gpus: int, latency: float, cpu: bool, windows: int, tmp: Path, model: str = "A100",
               spread: bool = False, edge_reads: bool = False) -> tuple[list[float], float]:
    """``edge_reads``: read a slow counter at edges anyway (``max_edge_read_s=None``)."""
    sim = _sim(n_gpus, cpu, model)
    _install(sim, latency)
    gpus = H.joules_nvml_gpus()
    assert len(gpus) == n_gpus, gpus
    cpus = []
    if cpu:
        tree = FakePowercap.for_sim(tmp / f"j{time.monotonic_ns()}", sim.cpus)
        cpus, _ = discover_rapl(tree.root, cpuinfo=tree.cpuinfo_path)
        assert len(cpus) == 1
    mon = EnergyMonitor(devices=DeviceSet(gpus=gpus, cpus=cpus, clock=RealClock()),
                        **({"max_edge_read_s": None} if edge_reads else {}))
    timed = partial(spread_windows, max_pause_s=SPREAD_PAUSE_S) if spread else H.timed_windows
    try:
        # Steady state: the sampler learns the counters' update phase in its first 1-2 s.
        time.sleep(JOULES_WARMUP_S)
        H.timed_windows(mon.begin_window, mon.end_window, 200)  # warm-up
        reads0 = mon.reads["counter"] + mon.reads["power"]
        times = timed(mon.begin_window, mon.end_window, windows)
        # NVML calls made by the windows themselves (the monitor counts its edge reads;
        # the sampler's polling is not included).
        reads = mon.reads["counter"] + mon.reads["power"] - reads0
        return times, reads / windows
    finally:
        mon.close()


def run_zeus(n_gpus: int, latency: float, cpu: bool, windows: int, tmp: Path, model: str = "A100",
             spread: bool = False, edge_reads: bool = False) -> tuple[list[float], float]:
    sim = _sim(n_gpus, cpu, model)
    fake = _install(sim, latency)  # Zeus' RAPL CPUs: opened once in main()
    from zeus.monitor import ZeusMonitor

    mon = ZeusMonitor(cpu_indices=None if cpu else [])
    assert len(mon.gpu_indices) == n_gpus and len(mon.cpu_indices) == (1 if cpu else 0)
    assert mon.power_monitor is None  # A100, H200: energy counter, no polling process

    def begin(k: str) -> None:
        mon.begin_window(k, sync_execution=False)

    def end(k: str) -> object:
        return mon.end_window(k, sync_execution=False)

    H.timed_windows(begin, end, 20 if spread else 200)  # warm-up
    times = (spread_windows(begin, end, windows, SPREAD_PAUSE_S) if spread
             else H.timed_windows(begin, end, windows))
    return times, calls_per_window(fake, begin, end, 10 if spread else 50)


def fake_call_us(latency: float) -> float:
    """Median cost of one fake ``nvmlDeviceGetTotalEnergyConsumption`` call."""
    import time as _t

    fake = H.install_fake(_sim(1, False), latency, keep_zeus_cpus=True)
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fn = fake.nvmlDeviceGetTotalEnergyConsumption
    xs = []
    for _ in range(3000):
        t0 = _t.perf_counter()
        fn(h)
        xs.append(_t.perf_counter() - t0)
    return H.median_us(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--h200-only", action="store_true", help="only the rows of the simulated H200")
    args = ap.parse_args()

    rounds, windows = (3, 300) if args.quick else (9, 400)
    H.install_fake(_sim(1, False))
    H.import_zeus()
    results = []
    rows = []
    with tempfile.TemporaryDirectory(prefix="joules-bench-") as d:
        tmp = Path(d)
        # Zeus' RAPL CPUs are opened once: each RAPL file gets a wraparound-tracking process
        # (spawned on first read), started here and left to finish importing before timing.
        import zeus.device.cpu as zcpu

        tree = FakePowercap.for_sim(tmp / "zeus-powercap", _sim(1, True).cpus)
        H.zeus_rapl_view(tree.root, 1, tmp / "zeus-view")
        zcpus = zcpu.get_cpus()
        zcpus.get_total_energy_consumption(0)
        H.wait_children_idle()
        configs = [(lat, cpu, n, "A100", False) for lat in (0.0, 20e-6) for cpu in (False, True)
                   for n in (1, 4, 8)]
        configs += [(STUB, False, n, "A100", False) for n in (1, 4, 8)]
        # The measured H200: a counter read blocks 3 ms. Windows spread over time; joules as
        # it is, and reading the counter at edges anyway.
        configs += [(0.0, False, 1, "H200", False), (0.0, False, 1, "H200", True)]
        if args.h200_only:
            configs = configs[-2:]
        for latency, cpu, n, model, edge_reads in configs:
            spread = model == "H200"
            w = windows if latency <= 0 else max(150, windows // n)
            if spread:
                w = min(w, 150)
            jr: list[float] = []  # per-round medians
            zr: list[float] = []
            ratios: list[float] = []
            for r in range(rounds):
                # Alternate the order every round so slow drifts of the machine cancel out.
                order = ("j", "z") if r % 2 == 0 else ("z", "j")
                got = {}
                for tool in order:
                    run = run_joules if tool == "j" else run_zeus
                    got[tool] = run(n, latency, cpu, w, tmp, model, spread, edge_reads)
                jt, jcalls = got["j"]
                zt, zcalls = got["z"]
                # Spread windows: the mean, since a slow read hits only some of them.
                stat = (lambda xs: statistics.fmean(xs) * 1e6) if spread else H.median_us
                jr.append(stat(jt))
                zr.append(stat(zt))
                ratios.append(jr[-1] / zr[-1])
            jm, zm, ratio = statistics.median(jr), statistics.median(zr), statistics.median(ratios)
            res = {
                "gpus": n, "cpu_pkg": cpu, "latency_us": None if latency == STUB else latency * 1e6,
                "model": model, "spread": spread, "joules_edge_reads": edge_reads,
                "joules_median_us": jm, "zeus_median_us": zm, "ratio_median": ratio,
                "joules_round_medians_us": jr, "zeus_round_medians_us": zr,
                "windows_per_round": w, "rounds": rounds,
                "joules_nvml_calls": jcalls, "zeus_nvml_calls": zcalls,
            }
            results.append(res)
            label = f"{n}x {model}" + (" +1 CPU pkg" if cpu else " GPU only")
            if model == "H200":
                label += ", spread" + (", j reads edges" if edge_reads else "")
            rows.append([
                label,
                "stub" if latency == STUB else f"{latency * 1e6:.0f}",
                f"{jm:.1f}", f"{zm:.1f}", f"{ratio:.2f}",
                f"{min(jr):.1f}-{max(jr):.1f}", f"{min(zr):.1f}-{max(zr):.1f}", f"{jcalls:g} / {zcalls:g}",
            ])
            print(f"  done: {rows[-1]}", file=sys.stderr, flush=True)
        # Stop Zeus' RAPL wraparound processes before their files disappear with the temp dir.
        for zc in zcpus.cpus:
            for rapl_file in (zc.rapl_file, zc.dram):
                tracker = getattr(rapl_file, "_wraparound_tracker", None)
                if tracker is not None:
                    tracker._stop()

    call0, call20 = fake_call_us(0.0), fake_call_us(20e-6)
    H.print_table(
        "Per-window cost, begin_window + end_window (µs, median; fake NVML)",
        ["config", "NVML µs", "joules", "Zeus", "joules/Zeus", "joules range", "Zeus range",
         "NVML calls j/Z"],
        rows,
        note=(
            f"NVML µs = latency added to every fake NVML call; one fake energy-counter read costs "
            f"{call0:.1f} µs at latency 0 (simulator work) and {call20:.1f} µs at 20 µs;\n"
            "'stub' rows replace the energy read by a near-free stub (a counter stepping every 100 ms),\n"
            "leaving each tool's own overhead.\n"
            "H200 rows: every counter read blocks 3 ms (as measured on a real H200); windows spread\n"
            "over time (a random pause of up to 10 ms after each), mean instead of median (a slow read\n"
            "hits only some windows); 'j reads edges': joules with max_edge_read_s=None (reading the\n"
            "counter at every edge that needs it).\n"
            f"NVML calls j/Z = NVML calls per window (joules: edge reads after a {JOULES_WARMUP_S:g} s "
            "warm-up,\nits sampler's polling excluded / Zeus).\n"
            f"joules, Zeus = median over {rounds} rounds of each round's median (range: lowest-highest "
            "round); joules/Zeus = median of the per-round ratios.\n"
            f"{windows} windows per tool and round ({windows} / GPUs at 20 µs, at least 150). {H.machine()}"
        ),
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
