"""A training job using the optimizer never leaves GPUs at a lowered limit: real processes.

The simulated GPUs keep their settings in a state file (``JOULES_SIM_STATE``), as real GPUs
keep theirs after a process exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from joules.devices.sim import Simulator

CHILD = textwrap.dedent("""
    import sys, time
    from joules import EnergyMonitor, PowerLimitOptimizer
    from joules.devices.sim import Constant

    mode = sys.argv[1]
    monitor = EnergyMonitor()
    monitor.devices.simulator.set_workload(Constant(1.0))
    opt = PowerLimitOptimizer(monitor, selector="energy", warmup_steps=1, profile_steps=2,
                              limits_w=[400.0, 300.0, 200.0], search="sweep")
    before = [g.power_limit_w() for g in monitor.gpus]
    opt.on_train_begin()
    for step in range(2000):
        opt.on_step_begin()
        time.sleep(0.005)
        opt.on_step_end()
        if any(g.power_limit_w() < min(before) for g in monitor.gpus):
            break
    else:
        sys.exit("the limits were never lowered")
    print("lowered", [g.power_limit_w() for g in monitor.gpus], flush=True)
    sys.stdin.readline()  # the parent has looked at the lowered limits
    if mode == "end":
        opt.on_train_end()
        print("ended", flush=True)
    elif mode == "raise":
        raise RuntimeError("training crashed")
    else:
        while True:
            opt.on_step_begin()
            time.sleep(0.005)
            opt.on_step_end()
""")


def _limits(state: Path) -> list[float]:
    return [g.power_limit_w() for g in Simulator("A100x2", state_file=state).gpus]


@pytest.fixture
def job(tmp_path):
    state = tmp_path / "sim-state.json"
    sim = Simulator("A100x2", state_file=state)
    sim.gpus[0].set_power_limit_w(350.0)  # what the GPUs had: neither the max nor the default
    sim.gpus[1].set_power_limit_w(325.0)
    env = {**os.environ, "JOULES_SIM": "A100x2", "JOULES_SIM_STATE": str(state),
           "JOULES_STATE_DIR": str(tmp_path / "joules-state")}

    def start(mode: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child exits within ~10 s if it never lowers
        assert line.startswith("lowered"), line + proc.stderr.read()
        assert max(_limits(state)) < 325.0  # the child has lowered both GPUs
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        return proc

    return state, env, start


@pytest.mark.parametrize("mode", ["end", "raise"])
def test_normal_end_and_exception_restore(job, mode):
    state, _, start = job
    proc = start(mode)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == (0 if mode == "end" else 1), err
    if mode == "raise":
        assert "training crashed" in err
    assert _limits(state) == [350.0, 325.0]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_restore(job, sig):
    state, _, start = job
    proc = start("loop")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    if sig == signal.SIGTERM:
        assert proc.returncode == -signal.SIGTERM  # the signal still ends the job as before
    else:
        assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert _limits(state) == [350.0, 325.0]


def test_sigkill_is_healed_by_the_next_job(job):
    state, env, start = job
    proc = start("loop")
    proc.kill()
    proc.wait(timeout=30)
    lowered = _limits(state)
    assert max(lowered) < 325.0  # SIGKILL cannot be caught...
    # ...but the next job using joules on those GPUs puts back what the killed one left.
    code = ("from joules import EnergyMonitor, PowerLimitOptimizer\n"
            "m = EnergyMonitor(); PowerLimitOptimizer(m)\n"
            "print([g.power_limit_w() for g in m.gpus])")
    out = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[350.0, 325.0]"
    assert _limits(state) == [350.0, 325.0]
