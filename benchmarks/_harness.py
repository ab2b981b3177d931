"""Shared plumbing for the joules-vs-Zeus benchmarks: both tools on the same fake NVML.

How Zeus is hooked up (zeus 0.16, ``pip install zeus`` in ``.bench-venv``):

* ``zeus.device.gpu.nvidia`` does ``import pynvml`` at import time and calls the module's
  functions through that global name. :func:`install_fake` therefore puts a fake ``pynvml``
  (:mod:`joules.testing.fake_pynvml`, over a :class:`~joules.devices.sim.Simulator`) in
  ``sys.modules`` *before* Zeus is first imported, and on later calls re-points
  ``zeus.device.gpu.nvidia.pynvml`` at the new fake (that is what ``installed(patch=...)``
  does) and clears Zeus' device singletons (``zeus.device.gpu._gpus`` and friends) so the
  next ``ZeusMonitor`` opens the new simulated GPUs.
* ``CUDA_VISIBLE_DEVICES`` and the ``ZEUSD_*`` variables are removed from the environment
  (Zeus applies the first and would talk to a daemon with the second).
* Zeus' default ``sync_execution_with="torch"`` raises without torch; every Zeus window is
  opened and closed with ``sync_execution=False`` (joules runs with ``sync=None``): nothing
  to synchronize on simulated GPUs.
* This machine has no ``/sys/class/powercap``, so Zeus finds no RAPL CPU; runs that include
  a CPU package point ``zeus.device.cpu.rapl.RAPL_DIR`` at a fake powercap tree (see
  :func:`zeus_rapl_view`).
* Pascal (P100): Zeus 0.16 reads power only through the ``NVML_FI_DEV_POWER_INSTANT`` /
  ``NVML_FI_DEV_POWER_AVERAGE`` field values, which the simulated P100 does not support
  (NOT_SUPPORTED, as the fake models pre-Volta boards). Zeus then monitors no power domain
  and ``end_window`` raises ``ValueError``. :func:`zeus_pascal_shim` makes
  ``NVIDIAGPU.get_instant_power_usage`` fall back to ``nvmlDeviceGetPowerUsage`` (the
  instant reading on Pascal, what older Zeus releases polled), so Zeus can be measured at
  all; results marked "Zeus+shim" use it.
* Zeus' ``PowerMonitor`` polls in processes started with the ``spawn`` method. A spawned
  child is a fresh interpreter that would import the real nvidia-ml-py. :func:`child_env`
  sets ``PYTHONPATH`` to ``benchmarks/_child`` (whose ``sitecustomize.py`` runs at child
  start-up) and ``JOULES_BENCH_FAKE_NVML=<SPEC>``; the child then installs its own fake
  over ``Simulator.realtime(SPEC)`` (and the shim when ``JOULES_BENCH_ZEUS_SHIM=1``)
  before anything imports ``pynvml``.
* Virtual-clock runs replace Zeus' time source: ``zeus.monitor.energy.time`` and
  ``zeus.monitor.power.time`` become the simulator clock, and the ``PowerMonitor``'s
  ``spawn`` context is replaced by an in-process one (:class:`InProcessContext`) so its
  polling function can be run, unchanged, on the virtual clock.
"""

from __future__ import annotations

import gc
import os
import platform
import queue
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from joules.testing import fake_pynvml

BENCH_DIR = Path(__file__).resolve().parent
CHILD_DIR = BENCH_DIR / "_child"
FAKE_ENV = "JOULES_BENCH_FAKE_NVML"
LATENCY_ENV = "JOULES_BENCH_FAKE_LATENCY_S"
SHIM_ENV = "JOULES_BENCH_ZEUS_SHIM"
WORKLOAD_ENV = "JOULES_BENCH_WORKLOAD"

for _var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ZEUSD_SOCK_PATH", "ZEUSD_HOST_PORT"):
    os.environ.pop(_var, None)


# -- fake NVML -------------------------------------------------------------------------------

def install_fake(
    sim: object, call_latency_s: float = 0.0, *, keep_zeus_cpus: bool = False
) -> types.ModuleType:
    """Make a fake ``pynvml`` over ``sim`` the one every tool sees; reset Zeus' singletons."""
    mod = fake_pynvml.make_module(sim, call_latency_s=call_latency_s)
    sys.modules["pynvml"] = mod
    znv = sys.modules.get("zeus.device.gpu.nvidia")
    if znv is not None:
        znv.pynvml = mod  # what fake_pynvml.installed(patch=["zeus.device.gpu.nvidia"]) does
    reset_zeus_singletons(keep_cpus=keep_zeus_cpus)
    return mod


def reset_zeus_singletons(keep_cpus: bool = False) -> None:
    """Forget the GPUs/CPUs/SoC Zeus opened, so the next monitor opens the current fake."""
    names = [("zeus.device.gpu", "_gpus"), ("zeus.device.soc", "_soc")]
    if not keep_cpus:
        names.append(("zeus.device.cpu", "_cpus"))
    for name, attr in names:
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, attr):
            old = getattr(mod, attr)
            setattr(mod, attr, None)
            if old is not None and name == "zeus.device.gpu":
                # NVIDIAGPUs.__del__ calls nvmlShutdown on whatever fake is current; keep
                # it from running later against a newer fake.
                type(old).__del__ = lambda self: None  # type: ignore[method-assign]


def import_zeus() -> types.ModuleType:
    """Import ``zeus.monitor`` (a fake ``pynvml`` must be installed first)."""
    if "pynvml" not in sys.modules or not getattr(sys.modules["pynvml"], "__joules_fake__", False):
        raise RuntimeError("install a fake pynvml before importing zeus")
    import zeus.monitor  # noqa: F401

    return sys.modules["zeus.monitor"]


def zeus_version() -> str:
    try:
        from importlib.metadata import version

        return version("zeus")
    except Exception:  # noqa: BLE001
        return "?"


_SHIMMED = False


def zeus_pascal_shim() -> None:
    """Let Zeus read power on GPUs without the POWER_INSTANT field (see module docs)."""
    global _SHIMMED
    if _SHIMMED:
        return
    import zeus.device.gpu.common as gc_
    import zeus.device.gpu.nvidia as znv

    original = znv.NVIDIAGPU.get_instant_power_usage

    def get_instant_power_usage(self: Any) -> int:
        try:
            return original(self)
        except gc_.ZeusGPUNotSupportedError:
            try:
                return znv.pynvml.nvmlDeviceGetPowerUsage(self.handle)
            except znv.pynvml.NVMLError as e:
                cls = znv.NVIDIAGPU._exception_map.get(e.value, gc_.ZeusGPUUnknownError)
                raise cls(str(e)) from e

    znv.NVIDIAGPU.get_instant_power_usage = get_instant_power_usage
    _SHIMMED = True


def parse_workload(text: str) -> object:
    """``"0.05:1.0,0.05:0.3"`` -> ``Periodic([(0.05, 1.0), (0.05, 0.3)])``; ``"0.4"`` -> ``Constant(0.4)``."""
    from joules.devices.sim import Constant, Periodic

    if ":" not in text:
        return Constant(float(text))
    return Periodic([(float(d), float(u)) for d, u in (p.split(":") for p in text.split(","))])


def child_env(spec: str, call_latency_s: float = 0.0, shim: bool = False, workload: str = "") -> None:
    """Make processes spawned from now on install a fake NVML over ``Simulator.realtime(spec)``.

    ``workload`` (see :func:`parse_workload`) is set on the child's simulated GPUs.
    """
    paths = [str(CHILD_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    os.environ[FAKE_ENV] = spec
    os.environ[LATENCY_ENV] = repr(call_latency_s)
    if shim:
        os.environ[SHIM_ENV] = "1"
    else:
        os.environ.pop(SHIM_ENV, None)
    if workload:
        os.environ[WORKLOAD_ENV] = workload
    else:
        os.environ.pop(WORKLOAD_ENV, None)


def joules_nvml_gpus() -> list:
    """joules' real NVML backend on whatever ``pynvml`` is installed (the fake)."""
    from joules.devices.nvidia import discover_nvml

    gpus, _problems = discover_nvml(env={})
    return gpus


# -- Zeus on a virtual clock -----------------------------------------------------------------

def zeus_use_clock(now: Callable[[], float], power_time: Callable[[], float] | None = None) -> None:
    """Point Zeus' ``time()`` (monitor and power monitor) at a virtual clock."""
    import zeus.monitor.energy as zen
    import zeus.monitor.power as zpo

    zen.time = now
    zpo.time = power_time or now


class _DeferredProcess:
    """Stands in for a spawned polling process: records its work, runs nothing by itself."""

    started: list[_DeferredProcess] = []

    def __init__(self, target: Callable[..., None], kwargs: dict[str, Any], **_: Any) -> None:
        self.target = target
        self.kwargs = kwargs

    def start(self) -> None:
        self.kwargs["ready_event"].set()
        _DeferredProcess.started.append(self)

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        return None

    terminate = kill = join


class InProcessContext:
    """A ``multiprocessing`` context whose processes run in this process when told to."""

    Queue = queue.Queue
    Event = threading.Event
    Process = _DeferredProcess


def zeus_inprocess_power_monitor() -> list[_DeferredProcess]:
    """Make Zeus' ``PowerMonitor`` start no process; returns the list its pollers go to."""
    import zeus.monitor.power as zpo

    zpo.mp = types.SimpleNamespace(get_context=lambda method=None: InProcessContext)
    _DeferredProcess.started.clear()
    return _DeferredProcess.started


# -- RAPL for both ----------------------------------------------------------------------------

def zeus_rapl_view(powercap_root: Path, packages: int, view_dir: Path) -> Path:
    """A directory shaped like ``/sys/class/powercap/intel-rapl`` (package links only) for Zeus."""
    view = view_dir / "intel-rapl"
    view.mkdir(parents=True, exist_ok=True)
    for p in range(packages):
        link = view / f"intel-rapl:{p}"
        if not link.exists():
            link.symlink_to(powercap_root / f"intel-rapl:{p}")
    import zeus.device.cpu.rapl as zr

    zr.RAPL_DIR = str(view)
    zr.rapl_is_available.cache_clear()
    return view


def wait_children_idle(timeout_s: float = 30.0, quiet_s: float = 0.5) -> None:
    """Wait until child processes of this one stop using CPU (done starting up)."""
    import multiprocessing as mp

    def cpu_ticks() -> int:
        total = 0
        for p in mp.active_children():
            try:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                pass
        return total

    deadline = time.monotonic() + timeout_s
    last = cpu_ticks()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = cpu_ticks()
        if now == last:
            return
        last = now


# -- measurement helpers ----------------------------------------------------------------------

def timed_windows(begin: Callable[[str], Any], end: Callable[[str], Any], n: int) -> list[float]:
    """Seconds spent in ``begin(name)`` + ``end(name)`` for ``n`` back-to-back windows."""
    out = [0.0] * n
    pc = time.perf_counter
    for i in range(n):
        t0 = pc()
        begin("w")
        end("w")
        out[i] = pc() - t0
    return out


def median_us(xs: Iterable[float]) -> float:
    return statistics.median(xs) * 1e6


def quantile_us(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e6


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"zeus {zeus_version()}; GPUs simulated behind joules.testing.fake_pynvml"
    )


def deep_sizeof(obj: object, seen: set[int] | None = None) -> int:
    """Bytes held by ``obj`` and everything it references (numpy arrays by ``nbytes``)."""
    seen = set() if seen is None else seen
    stack = [obj]
    total = 0
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, skip):
            continue
        seen.add(id(o))
        nbytes = getattr(o, "nbytes", None)
        if isinstance(nbytes, int) and type(o).__module__ == "numpy":
            total += sys.getsizeof(o)
            continue
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)) or type(o).__name__ == "deque":
            stack.extend(o)
        if hasattr(o, "__dict__"):
            stack.append(o.__dict__)
        for slot in getattr(type(o), "__slots__", ()):
            if hasattr(o, slot):
                stack.append(getattr(o, slot))
    return total


def collect() -> None:
    gc.collect()


def print_table(title: str, columns: list[str], rows: list[list[str]], note: str = "") -> None:
    """A rich table if rich is installed, else plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print(f"\n{title}")
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
        if note:
            print(note)
        return
    table = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    console = Console(width=max(120, sum(len(c) + 6 for c in columns) + 20))
    console.print(table)
    if note:
        console.print(note)
