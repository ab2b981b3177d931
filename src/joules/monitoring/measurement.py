"""The result of a measurement window, with the provenance of every number."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Source(StrEnum):
    """How a device's energy for a window was obtained."""

    COUNTER = "counter"
    """Difference of the hardware energy counter, edges corrected with recent power."""
    SAMPLED = "sampled"
    """Integral of power samples taken by the background sampler."""
    ESTIMATE = "estimate"
    """A power reading times the elapsed time (no counter change and too few samples)."""


@dataclass(frozen=True, slots=True)
class DeviceEnergy:
    """Energy of one device (GPU, CPU package or DRAM zone) over a window.

    Attributes:
        energy_j: Best estimate of the energy, J.
        source: How it was obtained.
        uncertainty_j: Bound on the absolute error, J (from counter resolution and update
            period, or from the spacing of power samples).
        corrected: True when the window was shorter than the counter's update period, so
            the counter alone could not resolve it and power samples were used.
        device_id: Stable identity of the device measured (GPU UUID, the physical GPU's for
            a MIG instance; ``<host>/cpu<N>``), used to count each device once in totals and
            when combining measurements across processes.
        host: The host the device is on, in a measurement combined from several hosts
            (``""`` otherwise: the measurement's own ``host``). With ``device_id`` it says
            which device this is when such a measurement is combined again.

    """

    energy_j: float
    source: Source
    uncertainty_j: float = 0.0
    corrected: bool = False
    device_id: str = ""
    host: str = ""

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "energy_j": self.energy_j,
            "source": self.source.value,
            "uncertainty_j": self.uncertainty_j,
            "corrected": self.corrected,
            "device_id": self.device_id,
            **({"host": self.host} if self.host else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> DeviceEnergy:
        """Inverse of :meth:`to_dict`."""
        return cls(
            energy_j=float(d["energy_j"]),  # type: ignore[arg-type]
            source=Source(d["source"]),
            uncertainty_j=float(d.get("uncertainty_j", 0.0)),  # type: ignore[arg-type]
            corrected=bool(d.get("corrected", False)),
            device_id=str(d.get("device_id", "")),
            host=str(d.get("host", "")),
        )


def _totals(zones: dict[int, DeviceEnergy]) -> dict[int, float]:
    return {k: v.energy_j for k, v in zones.items()}


def _distinct(zones: dict[int, DeviceEnergy]) -> list[DeviceEnergy]:
    """Each device once (entries with the same ``device_id``, as MIG instances of one GPU have)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for d in zones.values():
        if d.device_id:
            if (d.host, d.device_id) in seen:
                continue
            seen.add((d.host, d.device_id))
        out.append(d)
    return out


@dataclass(frozen=True, slots=True)
class Measurement:
    """Time and energy of one window.

    Attributes:
        name: Window name.
        start_time: Clock time at which the window began, s.
        elapsed_s: Duration, s.
        gpu: Per-GPU energy, keyed by GPU index (among visible GPUs).
        cpu: Per-CPU-package energy, keyed by package index (empty when not measured).
        dram: Per-package DRAM energy, keyed by package index (empty when not measured).
        host: Host name, used when combining measurements across processes.
        missing: Devices that could not be read at the window's end, left out of every
            total (``gpu1``, ``cpu0``, ``dram0``; in a combined measurement ``<host>/cpu0``
            and ``<host>/<rank>/gpu1``, see :func:`~joules.monitoring.distributed.combine`).
            Only :meth:`EnergyMonitor.end_window
            <joules.monitoring.monitor.EnergyMonitor.end_window>` with ``partial=True`` leaves
            devices out; otherwise this is empty.

    """

    name: str
    start_time: float
    elapsed_s: float
    gpu: dict[int, DeviceEnergy] = field(default_factory=dict)
    cpu: dict[int, DeviceEnergy] = field(default_factory=dict)
    dram: dict[int, DeviceEnergy] = field(default_factory=dict)
    host: str = ""
    missing: tuple[str, ...] = ()

    @property
    def gpu_energy_j(self) -> dict[int, float]:
        """Energy per GPU, J."""
        return _totals(self.gpu)

    @property
    def cpu_energy_j(self) -> dict[int, float]:
        """Energy per CPU package, J."""
        return _totals(self.cpu)

    @property
    def dram_energy_j(self) -> dict[int, float]:
        """DRAM energy per CPU package, J."""
        return _totals(self.dram)

    @property
    def total_energy_j(self) -> float:
        """Energy of every measured device together, J; a device seen twice counts once.

        MIG instances of one GPU each report the whole GPU, under its ``device_id``. (Ids
        are compared within one host: a measurement combined across hosts has each host's
        devices once already, and ids derived from indices may repeat across hosts.)
        """
        return sum(d.energy_j for d in self._devices())

    @property
    def uncertainty_j(self) -> float:
        """Bound on the absolute error of :attr:`total_energy_j`, J."""
        return sum(d.uncertainty_j for d in self._devices())

    def _devices(self) -> list[DeviceEnergy]:
        zones = (self.gpu, self.cpu, self.dram)
        if "," in self.host:  # combined across hosts (host names have no commas)
            return [d for z in zones for d in z.values()]
        return [d for z in zones for d in _distinct(z)]

    @property
    def average_power_w(self) -> float:
        """Average power of all measured devices together, W (0 for an empty window)."""
        return self.total_energy_j / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def sources(self) -> dict[str, str]:
        """How each device's number was obtained, keyed ``gpu0``, ``cpu0``, ``dram0``..."""
        out: dict[str, str] = {}
        for prefix, zones in (("gpu", self.gpu), ("cpu", self.cpu), ("dram", self.dram)):
            for k, d in zones.items():
                out[f"{prefix}{k}"] = d.source.value + ("+corrected" if d.corrected else "")
        return out

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (keys are strings, as JSON requires)."""
        return {
            "name": self.name,
            "start_time": self.start_time,
            "elapsed_s": self.elapsed_s,
            "host": self.host,
            "gpu": {str(k): v.to_dict() for k, v in self.gpu.items()},
            "cpu": {str(k): v.to_dict() for k, v in self.cpu.items()},
            "dram": {str(k): v.to_dict() for k, v in self.dram.items()},
            "total_energy_j": self.total_energy_j,
            "uncertainty_j": self.uncertainty_j,
            **({"missing": list(self.missing)} if self.missing else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Measurement:
        """Inverse of :meth:`to_dict`."""

        def zones(key: str) -> dict[int, DeviceEnergy]:
            raw = d.get(key) or {}
            return {int(k): DeviceEnergy.from_dict(v) for k, v in raw.items()}  # type: ignore[union-attr]

        return cls(
            name=str(d["name"]),
            start_time=float(d["start_time"]),  # type: ignore[arg-type]
            elapsed_s=float(d["elapsed_s"]),  # type: ignore[arg-type]
            gpu=zones("gpu"),
            cpu=zones("cpu"),
            dram=zones("dram"),
            host=str(d.get("host", "")),
            missing=tuple(str(x) for x in d.get("missing") or ()),  # type: ignore[attr-defined]
        )
