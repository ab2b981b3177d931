"""Workload models for simulated devices.

A workload says how busy a device is over time: a piecewise-constant utilization in
[0, 1]. The device turns utilization into power according to its model, power limit and
clock, so ground-truth energy is an exact sum over the pieces.
"""

from __future__ import annotations

import bisect
import csv
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path


class Workload(ABC):
    """Utilization over time, piecewise constant. Time is relative to the workload's start."""

    @abstractmethod
    def pieces(self, t0: float, t1: float) -> Iterator[tuple[float, float, float]]:
        """Yield ``(start, end, utilization)`` pieces covering ``[t0, t1]`` in order."""

    def utilization(self, t: float) -> float:
        """Utilization at time ``t``."""
        for _, _, u in self.pieces(t, t):
            return u
        return 0.0


def _check_util(u: float) -> float:
    if not 0.0 <= u <= 1.0 or math.isnan(u):
        raise ValueError(f"utilization must be within [0, 1], got {u}")
    return float(u)


class Constant(Workload):
    """The same utilization forever (``Constant(0)`` is idle)."""

    def __init__(self, utilization: float) -> None:
        self.u = _check_util(utilization)

    def pieces(self, t0: float, t1: float) -> Iterator[tuple[float, float, float]]:
        yield (t0, t1, self.u)


Idle = Constant  # readability: ``Idle(0.0)``


class Periodic(Workload):
    """A repeating pattern of ``(duration_s, utilization)`` phases, e.g. a bursty step loop."""

    def __init__(self, phases: Sequence[tuple[float, float]]) -> None:
        if not phases:
            raise ValueError("a periodic workload needs at least one phase")
        self.phases = [(float(d), _check_util(u)) for d, u in phases]
        if any(not (0 < d < math.inf) for d, _ in self.phases):  # (NaN too)
            raise ValueError("phase durations must be positive and finite")
        self.period = sum(d for d, _ in self.phases)
        self._starts = [0.0]
        for d, _ in self.phases[:-1]:
            self._starts.append(self._starts[-1] + d)

    def pieces(self, t0: float, t1: float) -> Iterator[tuple[float, float, float]]:
        cycle = math.floor(t0 / self.period)
        base = cycle * self.period
        # max: t0 / period may round up to a whole cycle when t0 lies a hair before it.
        i = max(0, bisect.bisect_right(self._starts, t0 - base) - 1)
        t = t0
        while True:
            d, u = self.phases[i]
            end = base + self._starts[i] + d
            yield (t, min(end, t1), u)
            if end >= t1:
                return
            t = end
            i += 1
            if i == len(self.phases):
                i = 0
                base += self.period


class Trace(Workload):
    """Utilization from a recorded trace: ``times[i]`` starts a piece at ``utils[i]``.

    Before the first time the first value holds; after the last, the last one (or the
    trace repeats when ``loop`` is true).
    """

    def __init__(self, times: Sequence[float], utils: Sequence[float], loop: bool = False):
        if len(times) != len(utils) or not times:
            raise ValueError("a trace needs as many times as utilizations, and at least one")
        if any(b <= a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError("trace times must be strictly increasing")
        self.times = [float(t) - float(times[0]) for t in times]
        self.utils = [_check_util(u) for u in utils]
        self.loop = loop
        self.duration = self.times[-1] + (self.times[-1] - self.times[-2] if len(times) > 1 else 1)

    @classmethod
    def from_power_csv(
        cls, path: str | Path, idle_w: float, peak_w: float, loop: bool = False
    ) -> Trace:
        """Build a trace from a CSV with ``time`` (s) and ``power`` (W) columns.

        Power is mapped to utilization linearly between ``idle_w`` and ``peak_w``.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"power trace not found: {path}")
        times: list[float] = []
        utils: list[float] = []
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                try:
                    t, p = float(row["time"]), float(row["power"])
                except (KeyError, ValueError) as e:
                    raise ValueError(f"{path}: need numeric 'time' and 'power' columns") from e
                times.append(t)
                utils.append(min(1.0, max(0.0, (p - idle_w) / (peak_w - idle_w))))
        return cls(times, utils, loop=loop)

    def pieces(self, t0: float, t1: float) -> Iterator[tuple[float, float, float]]:
        offset = 0.0
        if self.loop:
            offset = math.floor(t0 / self.duration) * self.duration
        t = t0
        while True:
            local = t - offset
            i = max(0, bisect.bisect_right(self.times, local) - 1)
            if i + 1 < len(self.times):
                end = offset + self.times[i + 1]
            elif self.loop:
                end = offset + self.duration
            else:
                end = math.inf
            yield (t, min(end, t1), self.utils[i])
            if end >= t1:
                return
            t = end
            if self.loop and i + 1 >= len(self.times):
                offset += self.duration
