"""Which power limits to profile: the full sweep, or an adaptive search that profiles fewer.

Both are driven the same way, by the online optimizer or by a replay of recorded profiles:
``next_limit()`` says which limit to profile next (``None`` when done), ``record(point)``
reports its measurement, and ``chosen()`` gives the selected limit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from joules.optimizers.power_limit.profile import LimitPoint
from joules.optimizers.power_limit.selectors import Selector


class Search(ABC):
    """A profiling plan over ``limits`` (any order; only these are ever proposed)."""

    def __init__(self, limits: Sequence[float], selector: Selector) -> None:
        if not limits:
            raise ValueError("no power limit to search")
        self.limits = sorted({float(x) for x in limits}, reverse=True)
        self.selector = selector
        self.points: dict[float, LimitPoint] = {}

    @abstractmethod
    def next_limit(self) -> float | None:
        """The next limit to profile, or ``None`` when the search is over."""

    def record(self, point: LimitPoint) -> None:
        """Report the measurement of a proposed limit."""
        if point.limit_w not in self.limits:
            raise ValueError(f"{point.limit_w:g} W was not a limit of this search")
        self.points[point.limit_w] = point

    def chosen(self) -> float:
        """The selected limit among those profiled."""
        return self.selector.choose(list(self.points.values())).limit_w

    @property
    def profiled(self) -> list[float]:
        """Limits profiled so far, in order."""
        return list(self.points)


class Sweep(Search):
    """Every limit, from the highest down."""

    def next_limit(self) -> float | None:
        for limit in self.limits:
            if limit not in self.points:
                return limit
        return None


class Adaptive(Search):
    """Profiles from the highest limit down and stops once the selector's cost has risen.

    Time grows and power falls as the limit drops, so every selector's cost is, up to noise,
    first falling then rising along the way down (or monotone). The search stops after
    ``patience`` consecutive limits worse than the best so far. Limits well below the
    optimum, the slowest and most expensive to profile, are never tried.

    Args:
        limits: Allowed limits.
        selector: What "best" means.
        patience: Consecutive worse limits that end the search.
    """

    def __init__(self, limits: Sequence[float], selector: Selector, patience: int = 2) -> None:
        super().__init__(limits, selector)
        if patience < 1:
            raise ValueError(f"patience must be at least 1, got {patience}")
        self.patience = patience

    def next_limit(self) -> float | None:
        done = [x for x in self.limits if x in self.points]
        remaining = [x for x in self.limits if x not in self.points]
        if not remaining:
            return None
        if done:
            reference = self.points[self.limits[0]] if self.limits[0] in self.points else None
            if reference is not None:
                costs = [self.selector.cost(self.points[x], reference) for x in done]
                best = min(range(len(costs)), key=lambda i: (costs[i], i))
                if len(costs) - 1 - best >= self.patience:
                    return None
        return remaining[0]
