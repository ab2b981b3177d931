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
from joules.optimizers.power_limit import PowerLimitOptimizer

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Imported on first use: the batch-size client needs httpx, which ``import joules`` does not.
    if name == "BatchSizeOptimizer":
        from joules.optimizers.batch_size.client import BatchSizeOptimizer

        return BatchSizeOptimizer
    raise AttributeError(f"module 'joules' has no attribute {name!r}")


__all__ = [
    "BatchSizeOptimizer", "CPU", "Clock", "DeviceEnergy", "DeviceNotFoundError", "DevicePermissionError",
    "DeviceSet", "EnergyMonitor", "GPU", "InvalidSpecError", "JoulesError", "Measurement",
    "NotSupportedError", "PowerLimitOptimizer", "PowerSampler", "Problem", "RealClock", "Source",
    "VirtualClock", "WindowError", "WindowHandle", "discover",
]
