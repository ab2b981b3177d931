#!/usr/bin/env python3
"""Find the most energy-efficient GPU power limit while training, in a plain PyTorch loop.

:class:`~joules.optimizers.power_limit.optimizer.PowerLimitOptimizer` tries power limits on
the GPUs during the first steps of training, measuring the time and energy of each step at
each limit, then keeps the best one for the rest of training and puts back the limits the
GPUs had before when training ends (or fails).

By default this runs on a *simulated* A100 on a virtual clock, so it needs no GPU: the tiny
model trains for real on the CPU, and after each real optimizer step the simulated GPU is
advanced by the time that step's work would take at its current power limit::

    python examples/power_limit_pytorch.py                  # simulated A100
    python examples/power_limit_pytorch.py --sim H100x2 --selector slowdown:1.1
    python examples/power_limit_pytorch.py --sim none       # real GPUs (root needed to change limits)

On real hardware, build the monitor with ``EnergyMonitor(sync="torch")`` and delete every
line marked ``# sim``: the steps' real GPU work is then what gets measured.
"""

from __future__ import annotations

import argparse
import sys

import torch

from joules.devices.sim import Constant, Simulator
from joules.monitoring.monitor import EnergyMonitor
from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer

# What one training step costs on the simulated GPU: 0.2 s of work at full speed, 80% of it
# compute-bound (slows down with the power limit) and 20% memory-bound (does not).
SIM_STEP_WORK_S = 0.2
SIM_COMPUTE_FRACTION = 0.8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sim", default="A100", help="simulated hardware SPEC (e.g. A100, H100x2), or 'none' "
                                                 "for the real GPUs (default: A100)")
    p.add_argument("--epochs", type=int, default=10, help="training epochs (default: 10)")
    p.add_argument("--steps", type=int, default=50, help="training steps per epoch (default: 50)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--selector", default="energy",
                   help="what 'best' means: time, energy, cost:ETA or slowdown:FACTOR (default: energy)")
    p.add_argument("--warmup-steps", type=int, default=5, help="unmeasured steps after each limit change")
    p.add_argument("--profile-steps", type=int, default=20, help="measured steps per limit")
    p.add_argument("--dry-run", action="store_true", help="measure and choose, but never change a GPU")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train the tiny model with the power-limit optimizer; print what it found."""
    args = parse_args(argv)
    torch.manual_seed(0)
    on_gpu = args.sim == "none" and torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")

    # A tiny regression model on random data: steps per epoch = args.steps.
    x = torch.randn(args.steps * args.batch_size, 32)
    y = x @ torch.randn(32, 1) + 0.1 * torch.randn(len(x), 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size,
                                         shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)

    if args.sim == "none":
        monitor = EnergyMonitor(sync="torch")  # the real GPUs
        sim = None
        if not monitor.gpus:
            print("no GPU found to optimize: run with --sim SPEC to simulate some (see `joules info`)",
                  file=sys.stderr)
            return 1
    else:
        sim = Simulator(args.sim)  # sim: simulated GPUs on a virtual clock
        sim.set_workload(Constant(1.0), cpus=False)  # sim: busy GPUs while training
        monitor = EnergyMonitor(devices=sim.devices())  # sim: on real GPUs, EnergyMonitor(sync="torch")

    optimizer = PowerLimitOptimizer(monitor, selector=args.selector, warmup_steps=args.warmup_steps,
                                    profile_steps=args.profile_steps, dry_run=args.dry_run)
    before = [g.power_limit_w() for g in optimizer.gpus]
    loss = torch.tensor(float("nan"))
    # `with optimizer:` puts the GPUs' previous limits back when the block ends, however it ends.
    with monitor, optimizer:
        for epoch in range(args.epochs):
            optimizer.on_epoch_begin()
            model.train()
            for xb, yb in loader:
                optimizer.on_step_begin()
                xb, yb = xb.to(device), yb.to(device)
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                sgd.zero_grad()
                loss.backward()
                sgd.step()
                if sim is not None:  # sim: the step's GPU work, at the current power limit
                    sim.run(SIM_STEP_WORK_S, SIM_COMPUTE_FRACTION)  # sim
                optimizer.on_step_end()
            optimizer.on_epoch_end()  # pauses a profile in progress: evaluation is not a training step
            print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f}, optimizer {optimizer.state}, "
                  f"limit {optimizer.current_limit_w} W", flush=True)
    after = [g.power_limit_w() for g in optimizer.gpus]

    print()
    if optimizer.chosen_limit_w is None:
        print(f"no limit chosen yet (state {optimizer.state}): train longer or use fewer --profile-steps")
    else:
        print(f"chosen power limit: {optimizer.chosen_limit_w:g} W ({optimizer.selector})")
    print(f"{'limit (W)':>10} {'time/step (s)':>14} {'energy/step (J)':>16}")
    for limit, point in sorted(optimizer.points.items(), reverse=True):
        mark = "  <- chosen" if limit == optimizer.chosen_limit_w else ""
        print(f"{limit:>10g} {point.time_s:>14.4f} {point.energy_j:>16.2f}{mark}")
    print(f"power limits before: {before} W, after training: {after} W")
    return 0


if __name__ == "__main__":
    sys.exit(main())
