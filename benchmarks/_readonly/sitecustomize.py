"""Make every NVML call that changes a GPU setting raise, in this process and its children.

Put this folder first on ``PYTHONPATH`` when running checks on a GPU whose settings must not
change (a shared or borrowed machine): ``PYTHONPATH=benchmarks/_readonly python ...``. Any
attempt to set a power limit, lock or reset a clock, or change persistence, compute or
application-clock settings then fails with ``PermissionError`` naming the call, before it
reaches the driver. Reads are untouched.
"""

from __future__ import annotations

_SETTERS = (
    "nvmlDeviceSetPowerManagementLimit", "nvmlDeviceSetPowerManagementLimit_v2",
    "nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetMemoryLockedClocks", "nvmlDeviceResetMemoryLockedClocks",
    "nvmlDeviceSetApplicationsClocks", "nvmlDeviceResetApplicationsClocks",
    "nvmlDeviceSetPersistenceMode", "nvmlDeviceSetComputeMode", "nvmlDeviceSetGpuOperationMode",
    "nvmlDeviceSetClockOffsets",
    "nvmlDeviceSetAutoBoostedClocksEnabled", "nvmlDeviceSetDefaultAutoBoostedClocksEnabled",
)


def _refuse(name: str):  # noqa: ANN202
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise PermissionError(f"{name} refused: this run is read only (benchmarks/_readonly)")

    return refuse


try:
    import pynvml
except ImportError:  # no NVML bindings: nothing to guard
    pynvml = None
if pynvml is not None:
    for _name in _SETTERS:
        if hasattr(pynvml, _name):
            setattr(pynvml, _name, _refuse(_name))
