"""Measurement: the energy monitor, its power sampler, results, logs and multi-process totals."""

from joules.monitoring.measurement import DeviceEnergy, Measurement, Source
from joules.monitoring.monitor import EnergyMonitor, WindowHandle
from joules.monitoring.sampler import CounterTracker, PowerSampler

__all__ = [
    "CounterTracker", "DeviceEnergy", "EnergyMonitor", "Measurement", "PowerSampler", "Source",
    "WindowHandle",
]
