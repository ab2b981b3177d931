"""Start-up hook for processes spawned by the benchmarks (Zeus' power-polling processes).

The benchmark scripts put this directory on ``PYTHONPATH`` (see ``_harness.child_env``), so
Python imports this module at start-up in every child process. When
``JOULES_BENCH_FAKE_NVML=<SPEC>`` is set, it installs a fake ``pynvml`` over
``Simulator.realtime(SPEC)`` before anything imports the real nvidia-ml-py (with the call
latency of ``JOULES_BENCH_FAKE_LATENCY_S`` and the workload of ``JOULES_BENCH_WORKLOAD``), and
with ``JOULES_BENCH_ZEUS_SHIM=1`` applies the same Pascal power shim as the parent. Without the
variable it does nothing.
"""

import os
import sys

if os.environ.get("JOULES_BENCH_FAKE_NVML"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _harness
    from joules.devices.sim import Simulator

    _sim = Simulator.realtime(os.environ["JOULES_BENCH_FAKE_NVML"])
    if os.environ.get("JOULES_BENCH_WORKLOAD"):
        _sim.set_workload(_harness.parse_workload(os.environ["JOULES_BENCH_WORKLOAD"]))
    _harness.install_fake(_sim, call_latency_s=float(os.environ.get("JOULES_BENCH_FAKE_LATENCY_S", "0") or 0))
    if os.environ.get("JOULES_BENCH_ZEUS_SHIM") == "1":
        _harness.zeus_pascal_shim()
