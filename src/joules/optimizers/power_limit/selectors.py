"""What "optimal" means: selectors that pick a power limit from profiled points."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from joules.errors import JoulesError
from joules.optimizers.power_limit.profile import LimitPoint


class Selector(ABC):
    """Scores profiled points; the lowest cost wins (ties: the higher, faster limit)."""

    name: str = "selector"

    @abstractmethod
    def cost(self, point: LimitPoint, reference: LimitPoint) -> float:
        """Cost of running at ``point``; ``reference`` is the point at the highest limit."""

    def choose(self, points: Sequence[LimitPoint]) -> LimitPoint:
        """The best of ``points`` (which include the highest limit, the reference)."""
        if not points:
            raise ValueError("no profiled power limit to choose from")
        reference = max(points, key=lambda p: p.limit_w)
        return min(points, key=lambda p: (self.cost(p, reference), -p.limit_w))

    def __repr__(self) -> str:
        return self.name


class MinTime(Selector):
    """The fastest limit."""

    name = "time"

    def cost(self, point: LimitPoint, reference: LimitPoint) -> float:
        return point.time_s


class MinEnergy(Selector):
    """The limit that spends the least energy."""

    name = "energy"

    def cost(self, point: LimitPoint, reference: LimitPoint) -> float:
        return point.energy_j


class MinCost(Selector):
    """Minimizes ``eta * energy + (1 - eta) * max_power * time``.

    ``max_power`` is the highest limit (times the GPU count when given), so that time is
    priced as if the GPUs drew full power while they run: ``eta = 1`` is pure energy,
    ``eta = 0`` pure time.
    """

    def __init__(self, eta: float, gpus: int = 1) -> None:
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta must be within [0, 1], got {eta:g}")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
        self.eta = eta
        self.gpus = gpus
        self.name = f"cost:{eta:g}"

    def cost(self, point: LimitPoint, reference: LimitPoint) -> float:
        max_power = reference.limit_w * self.gpus
        return self.eta * point.energy_j + (1.0 - self.eta) * max_power * point.time_s


class MaxSlowdown(Selector):
    """The least energy among limits at most ``factor`` times slower than the highest limit."""

    def __init__(self, factor: float) -> None:
        if not factor >= 1.0:
            raise ValueError(f"slowdown factor must be at least 1, got {factor:g}")
        self.factor = factor
        self.name = f"slowdown:{factor:g}"

    def cost(self, point: LimitPoint, reference: LimitPoint) -> float:
        if point.time_s > self.factor * reference.time_s:
            return math.inf
        return point.energy_j


class FunctionSelector(Selector):
    """A user-defined cost: ``fn(point, reference) -> float``."""

    def __init__(self, fn: Callable[[LimitPoint, LimitPoint], float], name: str = "custom") -> None:
        self.fn = fn
        self.name = name

    def cost(self, point: LimitPoint, reference: LimitPoint) -> float:
        return self.fn(point, reference)


def parse_selector(spec: str, gpus: int = 1) -> Selector:
    """``time``, ``energy``, ``cost:ETA`` or ``slowdown:FACTOR``.

    Raises:
        JoulesError: The spec is none of these.
    """
    kind, _, arg = spec.partition(":")
    try:
        if kind == "time" and not arg:
            return MinTime()
        if kind == "energy" and not arg:
            return MinEnergy()
        if kind == "cost" and arg:
            return MinCost(float(arg), gpus)
        if kind == "slowdown" and arg:
            return MaxSlowdown(float(arg))
    except ValueError as e:
        raise JoulesError(f"bad selector {spec!r}: {e}") from None
    raise JoulesError(f"bad selector {spec!r} (expected time, energy, cost:ETA or slowdown:FACTOR)")
