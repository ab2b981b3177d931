"""joules: measure and optimize the energy of deep-learning work.

Measure any span of code::

    from joules import EnergyMonitor

    monitor = EnergyMonitor()
    with monitor.window("epoch") as w:
        train_one_epoch()
    print(w.measurement.total_energy_j)
"""

from joules.clock import Clock, RealClock, VirtualClock
from joules.devices.base import CPU, GPU, DeviceSet, Problem
from joules.devices.discovery import discover
from joules.errors import (
    DeviceNotFoundError,
    DevicePermissionError,
    InvalidSpecError,
    JoulesError,
    NotSupportedError,
    WindowError,
)
from joules.monitoring.measurement import DeviceEnergy, Measurement, Source
from joules.monitoring.monitor import EnergyMonitor, WindowHandle
from joules.monitoring.sampler import PowerSampler

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The optimizers are imported on first use: measuring needs neither them nor httpx.
    if name == "BatchSizeOptimizer":
        from joules.optimizers.batch_size.client import BatchSizeOptimizer

        return BatchSizeOptimizer
    if name == "PowerLimitOptimizer":
        from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer

        return PowerLimitOptimizer
    raise AttributeError(f"module 'joules' has no attribute {name!r}")


__all__ = [
    "BatchSizeOptimizer", "CPU", "Clock", "DeviceEnergy", "DeviceNotFoundError", "DevicePermissionError",
    "DeviceSet", "EnergyMonitor", "GPU", "InvalidSpecError", "JoulesError", "Measurement",
    "NotSupportedError", "PowerLimitOptimizer", "PowerSampler", "Problem", "RealClock", "Source",
    "VirtualClock", "WindowError", "WindowHandle", "discover",
]
