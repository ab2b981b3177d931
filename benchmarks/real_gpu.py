"""joules and Zeus side by side on a real NVIDIA GPU. Read only: nothing is changed on the GPU.

Four checks, each on GPU 0 of the machine (``--gpu`` picks another):

* **Short windows** (``accuracy``): windows of 10, 30, 100 and 300 ms at random phases, with
  the GPU idle and then under a steady load (back-to-back bf16 matrix products). joules and
  Zeus measure the very same spans (their windows are nested: joules begins first and ends
  last; the few microseconds between the edges are negligible). The reference is the GPU's
  average power over 3 s spans read from the energy counter at its own update instants
  (polling it until it changes), before and after each block of windows; a window's
  expected energy is that power times the window's length. Reported per tool: the median
  and 90th percentile of the relative error, the mean (bias), and for joules how often the
  error lies within the uncertainty joules states (plus the reference's drift).
* **Training-step overhead** (``training``): a small transformer trained on random tokens
  (bf16, AdamW; the loss read with ``.item()`` every step, as a logging loop does), timed
  over blocks of steps with no measurement, with one joules window per step, and with one
  Zeus window per step, each without and with a device synchronisation at the window edges
  (``sync="torch"`` / Zeus' ``sync_execution=True``); ``joules(read)`` is joules reading the
  counter at every edge that needs it however slow the read (``max_edge_read_s=None``).
  Blocks alternate between the configurations; reported: the median time per step and the
  overhead against no measurement.
* **Power-limit optimizer, dry run** (``dry-run``): ``PowerLimitOptimizer(dry_run=True)`` on
  the same training loop until its search is done. It sets nothing (it runs every candidate
  at the current limit), so its "choice" only reflects noise; the check is that the whole
  schedule runs on a real GPU and what it costs per step.
* **Lightning** (``lightning``): a ``Trainer`` with ``PowerLimitCallback`` around a dry-run
  optimizer (three candidate limits) on a small MLP, to check the integration on the GPU.

To make sure nothing is changed, run it with ``benchmarks/_readonly`` first on
``PYTHONPATH``: its ``sitecustomize.py`` makes every NVML call that changes a setting raise.

Run on a GPU machine with PyTorch (CUDA) and, for the Zeus columns, ``zeus==0.16.0``:
``PYTHONPATH=benchmarks/_readonly python benchmarks/real_gpu.py [--json F] [--only accuracy,training]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import threading
import time
import warnings
from typing import Any

CHECKS = ("accuracy", "training", "dry-run", "lightning")


# -- the GPU's own counter, read at its update instants ------------------------------------------

def counter_power_w(nvml: Any, handle: Any, seconds: float) -> float:
    """Average power over about ``seconds``, from two counter updates (exact edges)."""

    def next_update() -> tuple[float, int]:
        last = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        while True:
            e = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            if e != last:
                return time.perf_counter(), e
            last = e

    t0, e0 = next_update()
    time.sleep(max(0.0, seconds - 0.15))
    t1, e1 = next_update()
    return (e1 - e0) / 1e3 / (t1 - t0)


def torch_device(gpu: int) -> Any:
    """The CUDA device ``gpu``, or the CPU when CUDA is not available (``--sim`` runs)."""
    import torch

    return torch.device("cuda", gpu) if torch.cuda.is_available() else torch.device("cpu")


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SteadyLoad:
    """Back-to-back bf16 matrix products on one GPU from a thread (torch releases the GIL)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        size = 8192 if device.type == "cuda" else 256
        self.a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for _ in range(8):
                self.a @ self.a  # noqa: B018 - load only
            synchronize(self.device)

    def __enter__(self) -> SteadyLoad:
        self.thread.start()
        time.sleep(3.0)  # clocks and power settle
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def zeus_monitor(gpu: int, approx: bool = False) -> Any | None:
    """A ZeusMonitor on one GPU, or None when Zeus is not installed."""
    try:
        from zeus.monitor import ZeusMonitor
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ZeusMonitor(gpu_indices=[gpu], cpu_indices=[], approx_instant_energy=approx,
                           sync_execution_with="torch")


def accuracy(gpu: int, n: int, durations: list[float]) -> dict[str, Any]:
    """Short windows against the counter's long-span power, idle and under a steady load."""
    import pynvml

    from joules import EnergyMonitor

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    mon = EnergyMonitor(gpu_indices=[gpu], cpu_indices=[])
    zeus = zeus_monitor(gpu)
    zeus_approx = zeus_monitor(gpu, approx=True)
    rng = random.Random(0)
    out: dict[str, Any] = {}
    time.sleep(2.0)  # joules' sampler learns the counter's phase
    try:
        for state in ("idle", "load"):
            load = SteadyLoad(torch_device(gpu)) if state == "load" else contextlib.nullcontext()
            with load:
                rows = []
                ref_before = counter_power_w(pynvml, handle, 3.0)
                for d in durations:
                    recs = []
                    for _ in range(n):
                        time.sleep(rng.uniform(0.0, 0.1))
                        mon.begin_window("w")
                        if zeus:
                            zeus.begin_window("w", sync_execution=False)
                            zeus_approx.begin_window("w", sync_execution=False)
                        time.sleep(d)
                        if zeus:
                            za = zeus_approx.end_window("w", sync_execution=False)
                            z = zeus.end_window("w", sync_execution=False)
                        m = mon.end_window("w")
                        e = m.gpu[gpu]
                        rec = {"joules": (m.elapsed_s, e.energy_j, e.uncertainty_j, e.source.value)}
                        if zeus:
                            rec["zeus"] = (z.time, z.gpu_energy[gpu])
                            rec["zeus_approx"] = (za.time, za.gpu_energy[gpu])
                        recs.append(rec)
                    ref_after = counter_power_w(pynvml, handle, 3.0)
                    p_ref = (ref_before + ref_after) / 2
                    drift = abs(ref_after - ref_before) / 2
                    row: dict[str, Any] = {"duration_s": d, "reference_w": p_ref, "drift_w": drift}
                    for tool in ("joules", "zeus", "zeus_approx"):
                        if tool not in recs[0]:
                            continue
                        errs = [r[tool][1] / (p_ref * r[tool][0]) - 1 for r in recs]
                        row[tool] = {
                            "median_abs_error_pct": 100 * statistics.median(abs(x) for x in errs),
                            "p90_abs_error_pct": 100 * sorted(abs(x) for x in errs)[int(0.9 * len(errs))],
                            "bias_pct": 100 * statistics.fmean(errs),
                            "zero_readings": sum(1 for r in recs if r[tool][1] == 0),
                        }
                    within = sum(1 for r in recs
                                 if abs(r["joules"][1] - p_ref * r["joules"][0])
                                 <= r["joules"][2] + drift * r["joules"][0])
                    row["joules"]["within_stated_uncertainty"] = within / len(recs)
                    row["joules"]["median_uncertainty_pct"] = 100 * statistics.median(
                        r["joules"][2] / (p_ref * r["joules"][0]) for r in recs)
                    row["joules"]["sources"] = sorted({r["joules"][3] for r in recs})
                    rows.append(row)
                    ref_before = ref_after
                out[state] = rows
    finally:
        mon.close()
    return out


# -- training ---------------------------------------------------------------------------------

def make_training(gpu: int, batch: int = 16) -> Any:
    """A training step of a small transformer on random tokens; returns the step function."""
    import torch

    dev = torch_device(gpu)
    torch.manual_seed(0)
    vocab, d, seq = (8192, 512, 256) if dev.type == "cuda" else (512, 64, 32)
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, d),
        torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(d, 8, 4 * d, batch_first=True, dropout=0.0), 6),
        torch.nn.Linear(d, vocab),
    ).to(dev, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, vocab, (batch, seq), device=dev)
    y = torch.randint(0, vocab, (batch, seq), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    return step


def training(gpu: int, steps: int, rounds: int, batch: int = 16) -> dict[str, Any]:
    """Time per step with no measurement, joules windows and Zeus windows (no sync / sync)."""
    from joules import EnergyMonitor

    step = make_training(gpu, batch)
    for _ in range(30):
        step()
    zeus = zeus_monitor(gpu)

    def block(kind: str) -> float:
        mon = None
        if kind.startswith("joules"):
            # A fresh monitor per block (only one joules sampler alive), warmed up untimed.
            mon = EnergyMonitor(gpu_indices=[gpu], cpu_indices=[],
                                sync="torch" if kind.endswith("sync") else None,
                                **({"max_edge_read_s": None} if "read" in kind else {}))
            time.sleep(1.0)
        try:
            t0 = time.perf_counter()
            if kind == "none":
                for _ in range(steps):
                    step()
            elif mon is not None:
                for _ in range(steps):
                    mon.begin_window("s")
                    step()
                    mon.end_window("s")
            else:
                sync = kind.endswith("sync")
                for _ in range(steps):
                    zeus.begin_window("s", sync_execution=sync)
                    step()
                    zeus.end_window("s", sync_execution=sync)
            return (time.perf_counter() - t0) / steps
        finally:
            if mon is not None:
                mon.close()

    kinds = ["none", "joules", "joules+sync", "joules(read)"] + (["zeus", "zeus+sync"] if zeus else [])
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        order = kinds if r % 2 == 0 else kinds[::-1]
        for k in order:
            times[k].append(block(k))
    base = statistics.median(times["none"])
    return {
        "steps_per_block": steps, "rounds": rounds, "batch": batch,
        "configs": {k: {"median_step_ms": 1e3 * statistics.median(v),
                        "overhead_pct": 100 * (statistics.median(v) / base - 1),
                        "overhead_us": 1e6 * (statistics.median(v) - base),
                        "blocks_ms": [1e3 * x for x in v]} for k, v in times.items()},
    }


def dry_run(gpu: int, max_steps: int) -> dict[str, Any]:
    """The power-limit optimizer's whole search in dry-run mode on the training loop."""
    from joules import EnergyMonitor
    from joules.optimizers.power_limit import PowerLimitOptimizer
    from joules.optimizers.power_limit.optimizer import State

    step = make_training(gpu)
    for _ in range(10):
        step()
    mon = EnergyMonitor(gpu_indices=[gpu], cpu_indices=[], sync="torch")
    limit_before = mon.devices.gpus[0].power_limit_w()
    opt = PowerLimitOptimizer(mon, dry_run=True, warmup_steps=10, profile_steps=40)
    t0 = time.perf_counter()
    steps = 0
    try:
        opt.on_train_begin()
        opt.on_epoch_begin()
        while steps < max_steps and opt.state is not State.DONE:
            opt.on_step_begin()
            step()
            opt.on_step_end()
            steps += 1
        opt.on_epoch_end()
        report = opt.report()
        opt.on_train_end()
    finally:
        mon.close()
    elapsed = time.perf_counter() - t0
    return {"steps": steps, "elapsed_s": elapsed, "report": report,
            "limit_before_w": limit_before,
            "limit_after_w": mon.devices.gpus[0].power_limit_w()}


def lightning_dry_run(gpu: int, epochs: int = 3) -> dict[str, Any]:
    """A Lightning ``Trainer`` with ``PowerLimitCallback`` around a dry-run optimizer.

    A small MLP on random data, three candidate limits (the highest and 100 W, 200 W below
    it), 5 warm-up and 20 profiled steps each; steps of a millisecond or two are then measured
    again over enough of them for ten counter periods (some 700), so an epoch has 1,536 steps:
    the search ends within the first two epochs.
    """
    import torch

    try:
        import lightning as pl
    except ImportError:
        import pytorch_lightning as pl  # type: ignore[no-redef]

    from joules import EnergyMonitor
    from joules.integrations.lightning import PowerLimitCallback
    from joules.optimizers.power_limit import PowerLimitOptimizer

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            width = 2048 if torch.cuda.is_available() else 64
            self.net = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(),
                                           torch.nn.Linear(2 * width, width))

        def training_step(self, batch: Any, _i: int) -> Any:
            (x,) = batch
            return ((self.net(x) - x) ** 2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    model = MLP()
    width = model.net[0].in_features
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64 * 1536, width)),
                                         batch_size=64)
    mon = EnergyMonitor(gpu_indices=[gpu], cpu_indices=[])
    g = mon.devices.gpus[0]
    top = g.power_limit_range_w()[1]
    before = g.power_limit_w()
    opt = PowerLimitOptimizer(mon, dry_run=True, warmup_steps=5, profile_steps=20,
                              limits_w=[top, top - 100, top - 200])
    cuda = torch.cuda.is_available()
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[PowerLimitCallback(opt)],
                         accelerator="gpu" if cuda else "cpu", devices=[gpu] if cuda else 1,
                         enable_progress_bar=False, logger=False, enable_checkpointing=False,
                         enable_model_summary=False)
    t0 = time.perf_counter()
    try:
        with mon.window("fit") as w:
            trainer.fit(model, loader)
    finally:
        mon.close()
    m = w.measurement
    assert m is not None
    return {"lightning": pl.__version__, "elapsed_s": time.perf_counter() - t0,
            "energy_j": m.gpu[gpu].energy_j, "source": m.gpu[gpu].source.value,
            "report": opt.report(), "limit_before_w": before, "limit_after_w": g.power_limit_w()}


def main() -> int:
    """Run the checks and print the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated: " + ", ".join(CHECKS))
    ap.add_argument("--windows", type=int, default=30, help="windows per length and load state")
    ap.add_argument("--steps", type=int, default=50, help="training steps per timed block")
    ap.add_argument("--rounds", type=int, default=6, help="timed blocks per configuration")
    ap.add_argument("--batch", type=int, default=16,
                    help="training batch (sequences of 256 tokens): 16 makes a host-bound step of about "
                         "12 ms on an H200, larger ones GPU-bound steps")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    ap.add_argument("--sim", metavar="SPEC",
                    help="simulated GPUs behind a fake NVML and PyTorch on the CPU, no Zeus (to try it out)")
    args = ap.parse_args()
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    for c in only:
        if c not in CHECKS:
            ap.error(f"--only: unknown check {c!r} (choose from {', '.join(CHECKS)})")

    import torch

    results: dict[str, Any] = {}
    if args.sim:
        from joules.devices.sim import Periodic, Simulator
        from joules.testing.fake_pynvml import installed

        sim = Simulator.realtime(args.sim)
        sim.set_workload(Periodic([(0.3, 0.9), (0.2, 0.1)]))
        fake = installed(sim)  # for the whole run
        fake.__enter__()
        sys.modules["zeus"] = None  # type: ignore[assignment]  # Zeus would open the real NVML
        results["gpu"] = f"simulated {args.sim}"
    elif not torch.cuda.is_available():
        print("real_gpu.py needs PyTorch with a CUDA GPU (or --sim SPEC)", file=sys.stderr)
        return 1
    else:
        results["gpu"] = torch.cuda.get_device_name(args.gpu)
    try:
        import zeus
        results["zeus"] = zeus.__version__
    except ImportError:
        results["zeus"] = None
    print(f"GPU {args.gpu}: {results['gpu']}; Zeus {results['zeus'] or 'not installed'}", flush=True)

    if "accuracy" in only:
        results["accuracy"] = acc = accuracy(args.gpu, args.windows, [0.01, 0.03, 0.1, 0.3])
        for state, rows in acc.items():
            print(f"\nShort windows, GPU {state} ({args.windows} windows per length, random phase):")
            print(f"{'length':>7} {'ref W':>7} | {'joules med/p90/bias %':>24} {'in bound':>8} "
                  f"{'±stated':>7} | {'Zeus med/p90/bias %':>22} {'zero':>4} | {'Zeus approx':>22}")
            for r in rows:
                j = r["joules"]
                line = (f"{r['duration_s'] * 1e3:5.0f}ms {r['reference_w']:7.1f} | "
                        f"{j['median_abs_error_pct']:7.2f} {j['p90_abs_error_pct']:7.2f} "
                        f"{j['bias_pct']:+8.2f} {100 * j['within_stated_uncertainty']:7.0f}% "
                        f"{j['median_uncertainty_pct']:6.1f}% | ")
                for tool in ("zeus", "zeus_approx"):
                    if tool in r:
                        z = r[tool]
                        line += (f"{z['median_abs_error_pct']:7.2f} {z['p90_abs_error_pct']:7.2f} "
                                 f"{z['bias_pct']:+7.2f} ")
                        line += f"{z['zero_readings']:4d} | " if tool == "zeus" else ""
                print(line, flush=True)
    if "training" in only:
        results["training"] = tr = training(args.gpu, args.steps, args.rounds, args.batch)
        print(f"\nTraining-step overhead ({tr['steps_per_block']} steps x {tr['rounds']} blocks each):")
        for k, v in tr["configs"].items():
            print(f"  {k:12s} {v['median_step_ms']:8.3f} ms/step  {v['overhead_pct']:+6.2f} %  "
                  f"{v['overhead_us']:+8.1f} us", flush=True)
    if "dry-run" in only:
        results["dry_run"] = dr = dry_run(args.gpu, 3000)
        rep = dr["report"]
        print(f"\nPower-limit optimizer, dry run: {dr['steps']} steps in {dr['elapsed_s']:.1f} s; "
              f"limit before {dr['limit_before_w']:.0f} W, after {dr['limit_after_w']:.0f} W")
        print("  report:", json.dumps(rep, default=str)[:1500], flush=True)
    if "lightning" in only:
        results["lightning"] = lt = lightning_dry_run(args.gpu)
        rep = lt["report"]
        print(f"\nLightning {lt['lightning']}, PowerLimitCallback (dry run): fit {lt['elapsed_s']:.1f} s, "
              f"{lt['energy_j']:.1f} J ({lt['source']}); search {rep['state']}, "
              f"{len(rep['points'])} limits profiled; limit before {lt['limit_before_w']:.0f} W, "
              f"after {lt['limit_after_w']:.0f} W", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
