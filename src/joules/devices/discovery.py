"""Find the devices this process can use: simulated (``JOULES_SIM``), NVIDIA, AMD, RAPL."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from joules.devices.base import DeviceSet, Problem

SIM_ENV = "JOULES_SIM"
SIM_STATE_ENV = "JOULES_SIM_STATE"

_VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ROCR_VISIBLE_DEVICES",
                    "HIP_VISIBLE_DEVICES")

_cache: dict[str, DeviceSet] = {}
_cache_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child finds its devices again: the parent's may be mid-reading, locks held."""
    global _cache_lock
    _cache_lock = threading.Lock()
    _cache.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def discover(
    sim: str | None = None,
    env: Mapping[str, str] | None = None,
    rapl_root: str = "/sys/class/powercap",
    refresh: bool = False,
) -> DeviceSet:
    """Return the devices of this machine, or simulated ones.

    Simulated hardware is used when ``sim`` is given or ``JOULES_SIM`` is set; it runs on
    the real clock so real programs can be measured on it. When ``JOULES_SIM_STATE`` names a
    file, its GPUs keep their power limits and clock locks there, across processes.
    Otherwise NVIDIA GPUs (NVML), else AMD GPUs (amdsmi), and CPU packages through Linux
    powercap RAPL. Every problem met (missing library, no permission) is listed in
    ``DeviceSet.problems`` with its fix; no exception is raised for missing hardware.

    The result is cached per process (devices are shared by every monitor); pass
    ``refresh=True`` to look again. A forked child starts with an empty cache, so it gets
    its own device objects.

    Raises:
        InvalidSpecError: ``sim``/``JOULES_SIM`` is not a valid SPEC.
    """
    env = os.environ if env is None else env
    spec = sim if sim is not None else env.get(SIM_ENV) or None
    state = env.get(SIM_STATE_ENV) or None
    # The variables that choose the visible GPUs are part of the key: another env, or a
    # changed os.environ, may see other GPUs.
    visible = "|".join(f"{v}={env.get(v)}" for v in _VISIBILITY_VARS)
    key = f"sim:{spec}:{state or ''}" if spec else f"real:{rapl_root}:{visible}"
    with _cache_lock:
        if not refresh and key in _cache:
            return _cache[key]
        devices = _discover_sim(spec, state) if spec else _discover_real(env, rapl_root)
        _cache[key] = devices
        return devices


def _discover_sim(spec: str, state_file: str | None = None) -> DeviceSet:
    from joules.devices.sim import Simulator

    return Simulator.realtime(spec, state_file=state_file).devices()


def _discover_real(env: Mapping[str, str], rapl_root: str) -> DeviceSet:
    from joules.devices.nvidia import discover_nvml
    from joules.devices.rapl import discover_rapl

    problems: list[Problem] = []
    gpus, nvml_problems = discover_nvml(env)
    backend = "nvml" if gpus else ""
    if gpus:
        problems += nvml_problems
    else:
        from joules.devices.amd import discover_amd

        gpus, p = discover_amd(env)
        if gpus:
            # NVML's problems (no NVIDIA driver on an AMD machine) are beside the point.
            backend = "amdsmi"
            problems += p
        else:
            # No GPU at all: NVML's problems, and the AMD one only when its library is present.
            problems += nvml_problems
            problems += [x for x in p if "not installed" not in x.message]
    cpus, p = discover_rapl(rapl_root)
    problems += p
    if cpus:
        backend = f"{backend}+rapl" if backend else "rapl"
    return DeviceSet(gpus=gpus, cpus=cpus, problems=problems, backend=backend or "none")
