"""benchmarks/hardware_check.py: the opt-in clock-latency check resets what it locks."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from joules.devices.discovery import discover
from joules.devices.nvidia import discover_nvml
from joules.devices.sim import Constant, Simulator
from joules.testing import fake_pynvml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check(load_benchmark):
    return load_benchmark("hardware_check")


@pytest.fixture
def a100():
    sim = Simulator("A100,nocpu")
    sim.set_workload(Constant(1.0))
    with fake_pynvml.installed(sim):
        gpus, _ = discover_nvml({})
        yield sim, gpus[0]


def test_clock_latency_alternates_and_resets(check, a100) -> None:
    sim, gpu = a100
    locks: list[tuple[float, float]] = []
    real_lock = gpu.lock_sm_clock
    gpu.lock_sm_clock = lambda lo, hi: (locks.append((lo, hi)), real_lock(lo, hi))[1]
    out = check.clock_latency(gpu, rounds=6)
    assert (out["high_mhz"], out["low_mhz"]) == (1410.0, 840.0)  # 840 is the clock nearest 60 % of 1410
    assert locks[:6] == [(1410.0, 1410.0), (840.0, 840.0)] * 3
    assert out["never_settled"] == 0 and out["settle_ms_max"] is not None
    assert out["lock_call_us"] > 0 and out["reset_call_us"] > 0
    assert sim.gpus[0].sm_clock_locked() is None  # reset at the end


def test_clock_latency_resets_after_an_error(check, a100) -> None:
    sim, gpu = a100

    def broken() -> float:
        assert sim.gpus[0].sm_clock_locked() == (1410.0, 1410.0)
        raise RuntimeError("NVML went away")

    gpu.sm_clock_mhz = broken
    with pytest.raises(RuntimeError, match="NVML went away"):
        check.clock_latency(gpu, rounds=4)
    assert sim.gpus[0].sm_clock_locked() is None


def test_readonly_guard_refuses_every_nvml_setter_in_a_child_process(tmp_path) -> None:
    """benchmarks/_readonly on PYTHONPATH: NVML setters raise before reaching the driver; reads
    are untouched. Checked with nvidia-ml-py itself, whose functions exist without a GPU."""
    import os
    import subprocess
    import sys

    code = (
        "import pynvml\n"
        "refused = []\n"
        "for name in ('nvmlDeviceSetPowerManagementLimit', 'nvmlDeviceSetGpuLockedClocks',\n"
        "             'nvmlDeviceResetGpuLockedClocks', 'nvmlDeviceSetPersistenceMode'):\n"
        "    try:\n"
        "        getattr(pynvml, name)(None, 1)\n"
        "    except PermissionError as e:\n"
        "        refused.append(name in str(e))\n"
        "print(sum(refused), pynvml.nvmlDeviceGetPowerUsage.__module__)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "benchmarks" / "_readonly"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["4", "pynvml"]


@contextlib.contextmanager
def fake_gpus(sim: Simulator) -> Iterator[None]:
    """A fake NVML over ``sim`` that the script's own monitors discover (discovery is cached per
    process: refreshed inside, and again once the fake is gone)."""
    try:
        with fake_pynvml.installed(sim):
            discover(refresh=True)
            yield
    finally:
        discover(refresh=True)


def test_real_gpu_training_overhead_runs_on_simulated_gpus(load_benchmark, monkeypatch) -> None:
    """benchmarks/real_gpu.py's training check, on a simulated GPU and PyTorch on the CPU."""
    pytest.importorskip("torch")
    real_gpu = load_benchmark("real_gpu")
    monkeypatch.setitem(__import__("sys").modules, "zeus", None)  # Zeus would open the real NVML
    sim = Simulator.realtime("A100,nocpu")
    sim.set_workload(Constant(0.5))
    with fake_gpus(sim):
        out = real_gpu.training(0, steps=2, rounds=1)
    configs = out["configs"]
    assert set(configs) == {"none", "joules", "joules+sync", "joules(read)"}
    assert configs["none"]["overhead_pct"] == 0.0
    assert all(c["median_step_ms"] > 0 and len(c["blocks_ms"]) == 1 for c in configs.values())


def test_real_gpu_lightning_check_runs_on_a_simulated_gpu(load_benchmark) -> None:
    """benchmarks/real_gpu.py's Lightning check: the dry-run search ends, no limit changes."""
    pytest.importorskip("torch")
    if not any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning")):
        pytest.skip("Lightning is not installed")
    real_gpu = load_benchmark("real_gpu")
    sim = Simulator.realtime("H100,nocpu")
    sim.set_workload(Constant(0.8))
    with fake_gpus(sim):
        # (CPU steps of well under a millisecond here, each limit measured over a second's worth
        # of them: epochs enough for three limits however fast the machine)
        out = real_gpu.lightning_dry_run(0, epochs=6)
    assert out["report"]["state"] == "done" and 2 <= len(out["report"]["points"]) <= 3  # adaptive
    assert out["limit_before_w"] == out["limit_after_w"] == 700.0
    assert out["energy_j"] > 0 and out["source"] == "counter"
