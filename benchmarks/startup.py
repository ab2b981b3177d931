"""Benchmark 3: monitor start-up on a GPU without an energy counter (simulated P100).

Start-up is the time from constructing the monitor (device discovery included) until the
first ``begin_window`` has returned, i.e. until the monitor can measure. Every trial runs in
a fresh Python process (``--worker``), so no trial benefits from another's imports or
device handles; import time is reported separately and not counted.

* joules: ``discover_nvml()`` on the fake NVML, then
  ``EnergyMonitor(devices=DeviceSet(gpus, cpus=[], clock=RealClock()))``; it measures a
  counter-less GPU by integrating the power its background sampler thread reads.
* Zeus: ``ZeusMonitor(cpu_indices=[])``. On a pre-Volta GPU it starts a ``PowerMonitor``:
  it first infers the power sensor's update period (1000 back-to-back power reads), then
  spawns one polling process per supported power domain and waits for them to be ready.

  - "Zeus" (unmodified): the simulated P100, like the fake models pre-Volta boards, answers
    NOT_SUPPORTED to the ``NVML_FI_DEV_POWER_*`` fields, the only power readings Zeus 0.16
    uses; Zeus starts no poller and ``end_window`` raises ``ValueError``.
  - "Zeus+shim": Zeus with ``get_instant_power_usage`` falling back to
    ``nvmlDeviceGetPowerUsage`` (see ``_harness.zeus_pascal_shim``). Its spawned poller is a
    new interpreter; ``benchmarks/_child/sitecustomize.py`` installs the fake NVML in it.

After start-up each worker sleeps one second with no window open and reports the CPU time
the monitor used meanwhile in the background (joules: this process, i.e. its sampler thread;
Zeus: its polling processes).

Run: ``.bench-venv/bin/python benchmarks/startup.py [--trials N]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SPEC = "P100,nocpu"
# A bursty load (50 ms busy, 50 ms light), so power readings change: Zeus' poller keeps a
# sample only when the reading differs from the previous one.
WORKLOAD = "0.05:1.0,0.05:0.3"


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(tool: str, latency: float) -> dict:
    t_imp = time.perf_counter()
    import _harness as H
    from joules.devices.sim import Simulator

    sim = Simulator.realtime(SPEC)
    sim.set_workload(H.parse_workload(WORKLOAD))
    H.install_fake(sim, latency)
    if tool == "joules":
        from joules.clock import RealClock
        from joules.devices.base import DeviceSet
        from joules.monitoring.monitor import EnergyMonitor
    else:
        H.import_zeus()
        from zeus.monitor import ZeusMonitor

        if tool == "zeus-shim":
            H.zeus_pascal_shim()
            H.child_env(SPEC, latency, shim=True, workload=WORKLOAD)
    import_s = time.perf_counter() - t_imp

    out: dict = {"tool": tool, "latency_us": latency * 1e6, "import_s": import_s}
    out["true_w"] = 30.0 + (250.0 - 30.0) * 0.65  # the P100 model's mean power under WORKLOAD
    t0 = time.perf_counter()
    if tool == "joules":
        gpus = H.joules_nvml_gpus()
        mon = EnergyMonitor(devices=DeviceSet(gpus=gpus, cpus=[], clock=RealClock()))
        mon.begin_window("w")
        out["ready_s"] = time.perf_counter() - t0
        cpu0 = time.process_time()
        time.sleep(1.0)
        out["background_cpu_s"] = time.process_time() - cpu0
        m = mon.end_window("w")
        out["energy_j"] = m.gpu[0].energy_j
        out["elapsed_s"] = m.elapsed_s
        mon.close()
        return out

    mon = ZeusMonitor(cpu_indices=[])
    mon.begin_window("w", sync_execution=False)
    out["ready_s"] = time.perf_counter() - t0
    pm = mon.power_monitor
    procs = list(pm.processes.values()) if pm is not None else []
    out["processes"] = len(procs)
    out["update_period_s"] = pm.update_period if pm is not None else None
    c0 = sum(_proc_cpu_s(p.pid) for p in procs)
    time.sleep(1.0)
    out["background_cpu_s"] = sum(_proc_cpu_s(p.pid) for p in procs) - c0
    try:
        m = mon.end_window("w", sync_execution=False)
        out["energy_j"] = m.gpu_energy[0]
        out["elapsed_s"] = m.time
    except Exception as e:  # noqa: BLE001 - reported
        out["error"] = f"{type(e).__name__}: {e}"
    if pm is not None:
        pm.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", choices=["joules", "zeus", "zeus-shim"])
    ap.add_argument("--latency", type=float, default=0.0)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.latency)))
        return

    import _harness as H

    tools = ["joules", "zeus", "zeus-shim"]
    runs: dict[tuple[str, float], list[dict]] = {}
    for latency in (0.0, 20e-6):
        for trial in range(args.trials):
            for tool in tools:
                r = subprocess.run(
                    [sys.executable, __file__, "--worker", tool, "--latency", repr(latency)],
                    capture_output=True, text=True, timeout=120,
                )
                line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"{tool} worker failed:\n{r.stdout}\n{r.stderr}")
                res = json.loads(line[7:])
                runs.setdefault((tool, latency), []).append(res)
                print(f"  {tool} {latency * 1e6:.0f}us trial {trial}: ready {res['ready_s'] * 1e3:.1f} ms",
                      file=sys.stderr, flush=True)

    names = {"joules": "joules", "zeus": "Zeus", "zeus-shim": "Zeus+shim"}
    rows = []
    summary = []
    for (tool, latency), rs in runs.items():
        ready = statistics.median(r["ready_s"] for r in rs) * 1e3
        imp = statistics.median(r["import_s"] for r in rs)
        bg = statistics.median(r["background_cpu_s"] for r in rs) * 100
        errors = {r["error"] for r in rs if "error" in r}
        if errors:
            measured = "ValueError" if all("ValueError" in e for e in errors) else "error"
        else:
            rel = [r["energy_j"] / (r["true_w"] * r["elapsed_s"]) - 1 for r in rs]
            measured = f"ok ({statistics.median(rel) * 100:+.1f}%)"
        pollers = "thread" if tool == "joules" else str(rs[0]["processes"])
        fastest = min(r["ready_s"] for r in rs) * 1e3
        rows.append([names[tool], f"{latency * 1e6:.0f}", f"{ready:.1f}", f"{fastest:.1f}",
                     f"{imp:.2f}", pollers, f"{bg:.0f}%", measured])
        summary.append({"tool": tool, "latency_us": latency * 1e6, "ready_ms_median": ready,
                        "import_s_median": imp, "background_cpu_pct": bg, "runs": rs})
    H.print_table(
        f"Start-up on a simulated P100 (no energy counter), {args.trials} fresh processes each",
        ["monitor", "NVML µs", "ready ms", "min ms", "import s", "poll procs", "bg CPU", "1 s window"],
        rows,
        note=(
            "ready = construct (incl. device discovery) until the first begin_window returned (median).\n"
            "bg CPU = CPU used by the monitor's background polling during 1 s with a window open.\n"
            "1 s window = its energy vs the model's mean power x elapsed (bursty load), or the error "
            "raised.\n"
            + H.machine()
        ),
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
