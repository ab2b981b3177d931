"""Which power limits to profile: the full sweep, or an adaptive search that profiles fewer.

Both are driven the same way, by the online optimizer or by a replay of recorded profiles:
``next_limit()`` says which limit to profile next (``None`` when done), ``record(point)``
reports its measurement, and ``chosen()`` gives the selected limit.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

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
    """Profiles only the limits that could still be the selector's choice, judged against noise.

    A limit changes nothing until it is below the power the GPUs draw anyway: above that (a
    *no-op* limit) time and energy are those of the highest limit, up to noise. Below it (a
    *binding* limit) time rises, convexly, and power falls as the limit drops, so every
    selector's cost is, up to noise, unimodal along the limits: falling, then rising (or
    monotone). The search exploits both:

    1. Profile the highest limit, the reference. Limits at or above its average power per GPU
       are presumed no-ops; the others bind.
    2. Descend the binding limits one at a time from the highest (skipping the presumed
       no-ops above it) while the next one could still beat the best cost measured so far:
       its optimistic estimate takes time at least the last measured one plus the last
       secant's slope (time is convex in the limit) and power falling in proportion to the
       limit (a lower limit only uses more of itself), both lowered by the noise margin.
       Stop as well once a binding limit below the best one costs more than the best even
       lowered by the margin: the cost being unimodal, nothing further down can win.
    3. Profile the presumed no-op limits (highest first) only while the reference's cost,
       lowered by the margin, is not above the best: they are then ties with it that noise
       may decide, as it would in a full sweep. Otherwise (typically for energy, once a
       binding limit clearly saves some) skip them. A presumed no-op limit whose power comes
       out clearly (beyond the margin) below the reference's shows power peaks above the
       average: it and every limit below it bind after all.
    4. Binding limits left out between profiled ones (by step 3, or points recorded
       beforehand) are profiled when they could win: time at least the next higher profiled
       limit's, power at least the chord between its neighbours (power is concave in the
       limit), both lowered by the margin.

    The noise margin is learned from measurements that the model says should agree:
    ``noise_gain`` times the largest disagreement among them (time spread among the presumed
    no-op limits, which should all run like the highest; time falling or power rising from
    one profiled limit to the next lower one), and at least ``min_margin``. Measurement noise
    and model error alike widen it: noisy or unusual workloads profile more, clean ones less.
    Every decision is taken again on each call, so a limit ruled out early comes back if the
    margin grows.

    Limits far below the optimum, the slowest and most expensive to profile, are never
    tried, nor the high limits a cost dominated by energy cannot choose. Only limits of
    ``limits`` are proposed. The selector's cost is assumed not to fall when time or energy
    rise (true of every built-in selector); for other costs use :class:`Sweep`.

    Args:
        limits: Allowed limits.
        selector: What "best" means.
        gpus: GPUs the measured energy is summed over, each under the limit. Default: the
            selector's ``gpus`` if it has one (:class:`MinCost`), else 1. Too few only makes
            the search profile more; too many can skip limits that matter.
        min_margin: Smallest relative noise margin.
        noise_gain: Margin per unit of observed relative noise.
    """

    max_margin = 0.5

    def __init__(self, limits: Sequence[float], selector: Selector, gpus: int | None = None,
                 min_margin: float = 0.04, noise_gain: float = 2.0) -> None:
        super().__init__(limits, selector)
        gpus = getattr(selector, "gpus", 1) if gpus is None else gpus
        if not (isinstance(gpus, int) and gpus >= 1):
            raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
        if not 0.0 <= min_margin < self.max_margin:
            raise ValueError(f"min_margin must be within [0, {self.max_margin:g}), got {min_margin:g}")
        if noise_gain < 0:
            raise ValueError(f"noise_gain must not be negative, got {noise_gain:g}")
        self.gpus = gpus
        self.min_margin = min_margin
        self.noise_gain = noise_gain
        self.busiest_w: float | None = None
        """The highest average power of one GPU at the highest limit, where the caller measured
        it (the online optimizer does): the presumed no-op limits start there, rather than at
        the mean over GPUs, which a GPU that draws less (an idle one) lowers."""

    @property
    def reference(self) -> LimitPoint | None:
        """The point at the highest limit, once profiled."""
        return self.points.get(self.limits[0])

    @property
    def draw_w(self) -> float:
        """Power per GPU at the highest limit: limits at or above it presumably do nothing.

        :attr:`busiest_w` where set, else the mean over the GPUs.
        """
        ref = self.reference
        if ref is None:
            return math.inf
        return self.busiest_w if self.busiest_w is not None else ref.average_power_w / self.gpus

    def noise(self) -> float:
        """Largest relative disagreement among measurements that should agree (0 if none)."""
        points = [self.points[x] for x in sorted(self.points, reverse=True)]
        seen = [0.0]
        times = [p.time_s for p in points if p.limit_w >= self.draw_w]
        if times:
            seen.append(max(times) / min(times) - 1.0)
        for hi, lo in zip(points, points[1:], strict=False):
            seen.append(1.0 - lo.time_s / hi.time_s)
            seen.append(lo.average_power_w / hi.average_power_w - 1.0)
        return max(seen)

    @property
    def margin(self) -> float:
        """The relative noise margin the search currently allows."""
        return min(self.max_margin, max(self.min_margin, self.noise_gain * self.noise()))

    def _binds(self, margin: float) -> Callable[[float], bool]:
        """Whether a limit binds.

        It does below the reference's draw, and at or below any limit that drew clearly less
        power than the reference.
        """
        ref = self.reference
        assert ref is not None
        clearly_less = [x for x, p in self.points.items()
                        if p.average_power_w < ref.average_power_w * (1.0 - margin)]
        top_binding = max(clearly_less, default=-math.inf)
        draw = self.draw_w
        return lambda x: x < draw or x <= top_binding

    def _cost(self, limit_w: float, time_s: float, energy_j: float, margin: float = 0.0) -> float:
        ref = self.reference
        assert ref is not None
        keep = 1.0 - margin
        return self.selector.cost(LimitPoint(limit_w, time_s * keep, energy_j * keep), ref)

    def _bound(self, limit_w: float, margin: float) -> float:
        """Optimistic cost of an unprofiled binding limit (steps 2 and 4 of the class docstring)."""
        profiled = sorted(self.points)
        higher = [x for x in profiled if x > limit_w]
        lower = [x for x in profiled if x < limit_w]
        a = self.points[higher[0]]
        time = a.time_s
        if lower:
            b = self.points[lower[-1]]
            frac = (limit_w - b.limit_w) / (a.limit_w - b.limit_w)
            power = b.average_power_w + frac * (a.average_power_w - b.average_power_w)
        else:
            power = a.average_power_w * limit_w / a.limit_w
            if len(higher) >= 2:
                h = self.points[higher[1]]
                slope = (a.time_s - h.time_s) / (h.limit_w - a.limit_w)
                time += max(0.0, slope) * (a.limit_w - limit_w)
        return self._cost(limit_w, time, power * time, margin)

    def next_limit(self) -> float | None:
        top = self.limits[0]
        ref = self.reference
        if ref is None:
            return top
        margin = self.margin
        binds = self._binds(margin)
        costs = {x: self._cost(x, p.time_s, p.energy_j) for x, p in self.points.items()}
        best_w = min(costs, key=lambda x: (costs[x], -x))
        best = costs[best_w]
        # The cost is unimodal: below a binding limit clearly worse than a higher best one,
        # nothing can win.
        floor_w = max((x for x, p in self.points.items()
                       if x < best_w and binds(x)
                       and self._cost(x, p.time_s, p.energy_j, margin) > best), default=-math.inf)
        lowest = min(self.points)
        open_binding = [x for x in self.limits if x > floor_w and binds(x) and x not in self.points]
        gaps = [x for x in open_binding if x > lowest]
        bounds = {x: self._bound(x, margin) for x in gaps}
        hopeful = [x for x in gaps if bounds[x] <= best]
        if hopeful:
            return min(hopeful, key=lambda x: (bounds[x], -x))
        below = [x for x in open_binding if x < lowest]
        if below and self._bound(below[0], margin) <= best:
            return below[0]
        noop = [x for x in self.limits if not binds(x) and x not in self.points]
        if noop and self._cost(top, ref.time_s, ref.energy_j, margin) <= best:
            return noop[0]
        return None
