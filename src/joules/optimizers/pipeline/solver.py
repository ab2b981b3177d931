"""The time-energy frontier of one pipeline iteration.

For every iteration time ``T`` (in whole time units) from the fastest achievable to the
slowest useful one, find a frequency for every computation that minimizes the iteration's
energy while no dependency chain takes longer than ``T``. With blocking power ``p``, a GPU
that is not computing is blocked, so the energy of a plan is::

    sum(energy of each computation) + p * (stages * T - sum(time of each computation))

and minimizing it at a given ``T`` means minimizing the sum of *effective* energies
``energy - p * time`` (:func:`~joules.optimizers.pipeline.profile.pareto_front`). This is the
discrete time-cost trade-off problem, NP-hard on general DAGs. Two methods:

``"exact"``
    Branch and bound over every computation's options (topological order, times rounded
    down to whole units; a partial plan is dropped when a plan found is at least as fast as
    its fastest completion and no costlier than its cheapest). Exact on the rounded
    problem; exponential in the worst case, so for small pipelines. Rounding can tie the
    fastest real plan with a slower, cheaper one, so the all-fastest plan, improved greedily
    on real times, is added.

``"fast"``
    1. The convex relaxation, in microseconds: each computation's options are replaced by
       the lower convex hull of (time, effective energy), neighbouring segments that
       together span at most 4 units, and at most a sixth of the computation's time range,
       merged. It is walked from the relaxed plan of least energy (a linear program; the
       slowest plan without SciPy or blocking power) to the fastest by shortening every
       critical path at least cost per unit, a minimum cut over the critical computations
       (Phillips-Dessouky; a computation crossed backwards is lengthened), each cut applied
       for as many units as it stays optimal (:class:`_Walker` keeps the flow between cuts).
    2. For every iteration time from the fastest to the slowest useful one (where a unit less
       starts to cost more than the blocked energy it saves), every half unit,
       the relaxed plan that fits is rounded down to real options (so the time still holds)
       and improved greedily: while a computation has float for a slower, cheaper option,
       the move saving the most is taken. Each plan is also improved again at the next slower
       time (a second candidate there) and half-way to it (a quarter unit on). All iteration
       times at once, with NumPy. The fastest time is planned once more on real option times
       (rounded down to the microsecond, a plan can miss it by a fraction of one).
    3. From the plan of least energy made, option steps (each one computation one option
       slower or faster, the iteration time free) are taken while one lowers the energy,
       blocked time included: the least-energy plan overall can be slower than any planned.
    4. The frontier is the lower envelope of these plans, evaluated with real times.

``"auto"`` (default) uses ``"exact"`` when the number of option combinations is small and
rounding times to the unit merges no options, and ``"fast"`` otherwise. Plans are reported
with their real (unrounded) times and energies.

:func:`energy_lower_bounds` solves the convex relaxation exactly at given iteration times
(one linear program each): no plan is below it, so it bounds how far any frontier is from
the optimum.
"""

from __future__ import annotations

import bisect
import gc
import math
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from joules.optimizers.pipeline.frontier import Frontier, Plan, option_table, plan_of, timeline
from joules.optimizers.pipeline.profile import Option, PipelineProfile, pareto_front
from joules.optimizers.pipeline.schedule import PipelineDAG

try:  # SciPy's compiled maximum flow is much faster than the pure-Python fallback; its LP skips a walk
    import scipy.sparse as _sp
    import scipy.sparse.csgraph as _cs
    from scipy.optimize import linprog as _linprog

    _csgraph: tuple[object, object] | None = (_sp, _cs)
except ImportError:  # pragma: no cover - exercised where SciPy is absent
    _csgraph = None
    _linprog = None

METHODS = ("auto", "fast", "exact")
EXACT_AUTO_LIMIT = 200_000  # option combinations up to which "auto" solves exactly
PLANS_PER_UNIT = 2  # the fast method plans every half unit of iteration time,
MAX_PLAN_CELLS = 3_000_000  # or coarser, so that planned times x computations stay within this (memory)
HALF_WAY = True  # and improves each plan again half-way to the next slower planned time
SPAN_UNITS = 4  # neighbouring hull segments spanning at most this many units together are merged,
SPAN_PARTS = 6  # and at most 1 / SPAN_PARTS of the computation's time range (at least 6 chords each)
LEAST_ENERGY_STEPS = 10_000  # most rounds of steps from the least-energy plan (each lowers its energy)
LEAST_ENERGY_BATCH = 8  # most steps tried together in a round
LEAST_ENERGY_CELLS = 1 << 20  # candidate plans x computations evaluated at once (memory)
FINE_UNIT_S = 1e-6  # the fast method's internal time unit
MAX_UNIT_S = 3600.0  # the longest unit time accepted (an hour)
_INF = 1 << 62
_N = TypeVar("_N", int, float)  # durations in units, or times


@dataclass
class Problem:
    """The quantized problem: per node, Pareto options as integer durations and effective energies.

    Attributes:
        dag: The pipeline.
        unit_time_s: Time unit, s.
        blocking_power_w: Blocking power, W.
        options: Per node, the real options kept, fastest first.
        durations: Per node, each kept option's duration in units (strictly increasing).
        costs: Per node, each kept option's effective energy in J (strictly decreasing).
        merged: Options left out because they round to the unit of a faster option kept
            (0 when the unit separates every option).
    """

    dag: PipelineDAG
    unit_time_s: float
    blocking_power_w: float
    options: list[list[Option]]
    durations: list[list[int]]
    costs: list[list[float]]
    merged: int = 0
    preds: list[tuple[int, ...]] = field(init=False, repr=False)
    succs: list[tuple[int, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.preds, self.succs = self.dag.predecessors(), self.dag.successors()

    @classmethod
    def build(cls, dag: PipelineDAG, profile: PipelineProfile, blocking_power_w: float,
              unit_time_s: float) -> Problem:
        """Quantize ``profile``'s options for ``dag``.

        Options are first reduced to the time / effective-energy Pareto front, then times are
        rounded down to whole units; of options sharing a unit the fastest is kept (its time is
        the one the unit describes best), and the others are counted in ``merged``: the
        problem is then coarser than the profile (its cheaper, slower options are lost).
        """
        _check_unit_time(unit_time_s)
        if not (blocking_power_w >= 0 and math.isfinite(blocking_power_w)):
            raise ValueError(f"blocking power must be a finite number >= 0 W (got {blocking_power_w})")
        table = option_table(dag, profile)
        cache: dict[tuple[int, str], tuple[list[Option], list[int], list[float]]] = {}
        options, durations, costs = [], [], []
        merged = 0
        for node, c in enumerate(dag.nodes):
            key = (c.stage, c.kind)
            if key not in cache:
                kept: list[Option] = []
                ds: list[int] = []
                cs: list[float] = []
                for o in pareto_front(table[node].values(), blocking_power_w):
                    d = math.floor(o.time_s / unit_time_s + 1e-9)
                    eff = o.energy_j - blocking_power_w * o.time_s
                    if cs and eff >= cs[-1]:
                        continue
                    if ds and d == ds[-1]:  # same unit: keep the faster, whose time the unit describes best
                        merged += 1
                        continue
                    kept.append(o)
                    ds.append(d)
                    cs.append(eff)
                cache[key] = (kept, ds, cs)
            kept, ds, cs = cache[key]
            options.append(kept)
            durations.append(ds)
            costs.append(cs)
        return cls(dag, unit_time_s, blocking_power_w, options, durations, costs, merged)

    def combinations(self) -> float:
        """Number of option combinations (as a float; it can be astronomically large)."""
        return math.prod(float(len(d)) for d in self.durations)

    def makespan(self, durations: Sequence[int]) -> int:
        """Longest path in units with node ``v`` taking ``durations[v]`` units."""
        return round(timeline(self.dag, durations).time_s)

    def plan(self, choice: Sequence[int]) -> Plan:
        """The real plan of ``choice``."""
        return plan_of(self.dag, [self.options[n][k] for n, k in enumerate(choice)], self.blocking_power_w)


# -- convex relaxation (Phillips-Dessouky on the lower convex hulls) ------------------------------

def _hull(ds: Sequence[_N], cs: Sequence[float]) -> tuple[list[_N], list[float]]:
    """Vertices of the lower convex hull of the staircase points (durations ascending)."""
    hx: list[_N] = []
    hy: list[float] = []
    for x, y in zip(ds, cs, strict=True):
        while len(hx) >= 2 and (hy[-1] - hy[-2]) * (x - hx[-1]) >= (y - hy[-1]) * (hx[-1] - hx[-2]):
            hx.pop()
            hy.pop()
        hx.append(x)
        hy.append(y)
    return hx, hy


def _simplify(xs: list[int], ys: list[float], span: int) -> tuple[list[int], list[float]]:
    """Fewer hull vertices: neighbouring segments are merged while together they span at most ``span``.

    The merged chord lies on or above the hull, so the result is still convex; fewer, longer
    segments mean fewer cuts in the relaxation walk.
    """
    kx, ky = [xs[0]], [ys[0]]
    i = 0
    while i < len(xs) - 1:
        j = i + 1
        while j + 1 < len(xs) and xs[j + 1] - xs[i] <= span:
            j += 1
        kx.append(xs[j])
        ky.append(ys[j])
        i = j
    return kx, ky


class _Hull:
    """A computation's convex relaxation: the lower convex hull of its (duration, effective energy)."""

    __slots__ = ("xs", "ys", "slopes")

    def __init__(self, ds: list[int], cs: list[float], span: int = 0) -> None:
        xs, ys = _hull(ds, cs)
        if span > 0 and len(xs) > 2:
            xs, ys = _simplify(xs, ys, span)
        self.xs, self.ys = xs, ys
        # Saving per unit of lengthening on each segment (non-increasing: the hull is convex).
        self.slopes = [(ys[i] - ys[i + 1]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]

    def _segment(self, d: int) -> int:
        """Index of the segment [xs[i], xs[i+1]) holding ``d``."""
        return max(0, bisect.bisect_right(self.xs, d) - 1)

    def slope_down(self, d: int) -> float:
        """Cost (J per unit) of shortening below ``d``; infinite at the fastest."""
        if d <= self.xs[0]:
            return math.inf
        return self.slopes[bisect.bisect_left(self.xs, d) - 1]

    def slope_up(self, d: int) -> float:
        """Saving (J per unit) of lengthening beyond ``d``; 0 at the slowest."""
        if d >= self.xs[-1]:
            return 0.0
        return self.slopes[self._segment(d)]

    def vertex_below(self, d: int) -> int:
        """The largest hull vertex strictly below ``d``."""
        i = bisect.bisect_left(self.xs, d)
        return self.xs[max(i - 1, 0)]

    def vertex_above(self, d: int) -> int:
        """The smallest hull vertex strictly above ``d``."""
        i = bisect.bisect_right(self.xs, d)
        return self.xs[min(i, len(self.xs) - 1)]


class _MaxFlow:
    """A residual network on integer capacities, augmented along shortest paths (Edmonds-Karp)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.head: list[list[int]] = [[] for _ in range(n)]
        self.seen: list[bool] = []
        self.to: list[int] = []
        self.cap: list[int] = []

    def add(self, u: int, v: int, cap: int) -> int:
        self.head[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(cap)
        self.head[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0)
        return len(self.to) - 2

    def augment(self, s: int, t: int) -> int:
        """Push flow along shortest augmenting paths until none is left; the amount pushed."""
        to, cap, head, n = self.to, self.cap, self.head, self.n
        total = 0
        while True:
            parent = [-1] * n
            parent[s] = -2
            q = [s]
            append = q.append
            for u in q:  # breadth first: the list grows while it is walked
                for e in head[u]:
                    if cap[e]:  # capacities are never negative
                        v = to[e]
                        if parent[v] == -1:
                            parent[v] = e
                            append(v)
                if parent[t] != -1:
                    break
            if parent[t] == -1:
                self.seen = [x != -1 for x in parent]  # what s reaches: the source side of a minimum cut
                return total
            f = _INF
            path = []
            v = t
            while v != s:
                e = parent[v]
                path.append(e)
                if cap[e] < f:
                    f = cap[e]
                v = to[e ^ 1]
            for e in path:
                cap[e] -= f
                cap[e ^ 1] += f
            total += f
            if total >= _INF // 2:
                return total

    def reachable(self, s: int) -> list[bool]:
        seen = [False] * self.n
        seen[s] = True
        q = deque([s])
        while q:
            u = q.popleft()
            for e in self.head[u]:
                if self.cap[e] > 0 and not seen[self.to[e]]:
                    seen[self.to[e]] = True
                    q.append(self.to[e])
        return seen


def _repeats(p: Problem, dur: list[int], shorten: list[int], lengthen: list[int], horizon: int,
             most: int) -> int:
    """How many times (at most ``most``) the cut can be applied before another path overtakes.

    Applying the cut ``j`` times changes a path's length by ``j`` times (computations it
    lengthens - those it shortens), ``delta``, while the makespan shrinks by ``j``: the cut
    stays valid while every path's ``length + j * (delta + 1)`` is at most ``horizon``. That
    bound is convex in ``j``, so it is found by Newton steps from ``most``: a longest-path pass
    with the cut applied ``j`` times finds the path that overtakes most, and ``j`` drops to
    where that path would just catch up; a pass with no path over the bound ends it.
    """
    n = len(dur)
    change = [0] * n
    for v in shorten:
        change[v] = -1
    for v in lengthen:
        change[v] = 1
    preds = p.preds
    j = most
    while j > 0:
        end = [0] * n  # longest path ending at v with the cut applied j times
        slope = [0] * n  # its delta
        worst, worst_end, worst_slope = 0, 0, 0
        for v in range(n):
            best, bd = 0, 0
            for u in preds[v]:
                e = end[u]
                if e > best or (e == best and slope[u] > bd):
                    best, bd = e, slope[u]
            cv = change[v]
            best += dur[v] + j * cv
            bd += cv
            end[v], slope[v] = best, bd
            over = best + j - horizon  # length + j * (delta + 1) - horizon
            if over > worst:
                worst, worst_end, worst_slope = over, best, bd
        if worst <= 0:
            return j
        # That path's length without the cut is worst_end - j * worst_slope; it catches up at
        # (horizon - length) // (delta + 1), strictly less than j.
        j = (horizon - (worst_end - j * worst_slope)) // (worst_slope + 1)
    return max(j, 0)


class _Walker:
    """The relaxation walk: repeated least-cost cuts, with the maximum flow kept between cuts.

    A full rebuild finds the critical computations, their flow network and a maximum flow
    (SciPy when installed). Between rebuilds the network is kept: when a shortened computation
    reaches a hull vertex, only the capacity of shortening it further grows, so the previous
    flow stays feasible and a few augmenting paths restore a maximum flow, from which the next
    cut is read (:meth:`applied` moves a computation's flow between its own arcs when its
    capacities change). Each cut is applied until a hull vertex or until a path outside the
    network catches up (:func:`_repeats`); what then became critical is added with zero flow
    (:meth:`refresh`). The kept network may still hold paths that stopped being critical;
    cutting them too is wasteful but never wrong, and the makespan then only shrinks faster
    than tracked. A rebuild happens when a computation's flow
    cannot be kept, or when no finite cut is left in the kept network.
    """

    def __init__(self, p: Problem, hulls: list[_Hull], dur: list[int]) -> None:
        self.p, self.hulls, self.dur = p, hulls, dur
        self.stale = True
        self.refresh_due = False
        self.catching_up = False
        self.rebuilds = 0
        self.refreshes = 0

    def _times(self) -> tuple[list[int], list[int], int]:
        """Earliest starts, latest starts and the makespan."""
        p, dur = self.p, self.dur
        n = len(dur)
        preds, succs = p.preds, p.succs
        es = [0] * n
        ef = [0] * n
        horizon = 0
        for v in range(n):
            best = 0
            for u in preds[v]:
                e = ef[u]
                if e > best:
                    best = e
            es[v] = best
            best += dur[v]
            ef[v] = best
            if best > horizon:
                horizon = best
        ls = [0] * n
        for v in range(n - 1, -1, -1):
            best = horizon
            for w in succs[v]:
                x = ls[w]
                if x < best:
                    best = x
            ls[v] = best - dur[v]
        return es, ls, horizon

    def _add(self, es: list[int], ls: list[int], horizon: int,
             au: list[int], av: list[int], ac: list[float]) -> list[tuple[int, int]]:
        """Arcs for the critical computations and edges not in the network yet.

        Returns:
            ``(node, index of its first arc)`` for each computation added.
        """
        dur, hulls, ids = self.dur, self.hulls, self.ids
        added: list[tuple[int, int]] = []
        inf = math.inf
        crit = [v for v in range(len(dur)) if ls[v] == es[v]]
        for v in crit:
            if ids[v] < 0:
                ids[v] = self.size
                self.size += 2
                self.crit.append(v)
                h = hulls[v]
                down, up = h.slope_down(dur[v]), h.slope_up(dur[v])
                lo = min(up, down)
                a = ids[v]
                added.append((v, len(au)))
                au += (a, a, 0)
                av += (a + 1, 1, a + 1)
                ac += (down - lo, lo, lo)
        for v in crit:
            a = ids[v]
            if es[v] == 0 and (0, v) not in self.links:
                self.links.add((0, v))
                au.append(0)
                av.append(a)
                ac.append(inf)
            end_v = es[v] + dur[v]
            if end_v == horizon and (v, -1) not in self.links:
                self.links.add((v, -1))
                au.append(a + 1)
                av.append(1)
                ac.append(inf)
            for w in self.p.succs[v]:
                if es[w] == end_v and ids[w] >= 0 and ls[w] == end_v and (v, w) not in self.links:
                    self.links.add((v, w))
                    au.append(a + 1)
                    av.append(ids[w])
                    ac.append(inf)
        return added

    def rebuild(self) -> tuple[int, list[int], list[int]] | None:
        """Rebuild the network of critical computations and solve its flow from scratch."""
        self.rebuilds += 1
        es, ls, horizon = self._times()
        self.ids = [-1] * len(self.dur)
        self.size = 2
        self.crit: list[int] = []
        self.links: set[tuple[int, int]] = set()
        au: list[int] = []
        av: list[int] = []
        ac: list[float] = []
        added = self._add(es, ls, horizon, au, av, ac)
        solved = _max_flow(self.size, au, av, ac)
        if solved is None:
            return None  # no finite cut: some critical path is at its fastest everywhere
        self.graph, edge_of, self.scale = solved
        self.arc_edge = {v: (edge_of[i], edge_of[i + 1], edge_of[i + 2]) for v, i in added}
        self.horizon = horizon
        self.stale = self.refresh_due = False
        return self._cut(self.graph.reachable(0))

    def refresh(self) -> tuple[int, list[int], list[int]] | None:
        """Add what became critical to the kept network (zero flow on it), then augment."""
        self.refreshes += 1
        es, ls, horizon = self._times()
        au: list[int] = []
        av: list[int] = []
        ac: list[float] = []
        added = self._add(es, ls, horizon, au, av, ac)
        g, scale = self.graph, self.scale
        while g.n < self.size:
            g.head.append([])
            g.n += 1
        edge_of = []
        for u, v, c in zip(au, av, ac, strict=True):
            edge_of.append(g.add(u, v, _INF if c == math.inf else int(c * scale)))
        for v, i in added:
            self.arc_edge[v] = (edge_of[i], edge_of[i + 1], edge_of[i + 2])
        self.horizon = horizon
        self.refresh_due = False
        if g.augment(0, 1) >= _INF // 2:
            return self.rebuild()
        return self._cut(g.seen)

    def _cut(self, side: list[bool]) -> tuple[int, list[int], list[int]] | None:
        """The cut whose source side is ``side``, and how many units it may be applied."""
        if side[1]:
            return None
        ids, dur, hulls = self.ids, self.dur, self.hulls
        shorten = [v for v in self.crit if side[ids[v]] and not side[ids[v] + 1]]
        lengthen = [v for v in self.crit if side[ids[v] + 1] and not side[ids[v]]]
        if not shorten:
            return None
        k = _INF
        for v in shorten:
            k = min(k, dur[v] - hulls[v].vertex_below(dur[v]))
        for v in lengthen:
            k = min(k, hulls[v].vertex_above(dur[v]) - dur[v])
        # Up to the next hull vertex, unless a path outside the network catches up first (or just
        # then: asked for one unit more, it says whether the path is level at k), which is
        # added to the network once the cut is applied.
        limit = _repeats(self.p, dur, shorten, lengthen, self.horizon, k + 1)
        self.catching_up = limit <= k
        return max(1, min(k, limit)), shorten, lengthen

    def next(self) -> tuple[int, list[int], list[int]] | None:
        """The next cut ``(units, shortened, lengthened)``, or ``None`` at the fastest."""
        if not self.stale and self.refresh_due:
            step = self.refresh()
            if step is not None:
                return step
        elif not self.stale:
            if self.graph.augment(0, 1) >= _INF // 2:
                self.stale = True
            else:
                step = self._cut(self.graph.seen)
                if step is not None:
                    return step
        return self.rebuild()

    def applied(self, units: int, shorten: list[int], lengthen: list[int]) -> None:
        """Record that the cut was applied ``units`` times (durations already changed).

        The changed computations get their new capacities. Their flow is kept where it fits:
        the flow through a computation's three arcs (shorten it, and the two that account for
        lengthening it) may shift between them as long as what enters and leaves it stays the
        same; when no such shift fits, the network is rebuilt.
        """
        self.horizon -= units
        if self.stale:
            return
        if self.catching_up:
            self.refresh_due = True
        g, hulls, dur, scale = self.graph, self.hulls, self.dur, self.scale
        cap = g.cap
        for v in (*shorten, *lengthen):
            h = hulls[v]
            down, up = h.slope_down(dur[v]), h.slope_up(dur[v])
            lo = min(up, down)
            io, it, so = self.arc_edge[v]
            lo_int = int(lo * scale)
            io_int = _INF if down == math.inf else int((down - lo) * scale)
            f_io, f_it, f_so = cap[io ^ 1], cap[it ^ 1], cap[so ^ 1]
            into, out = f_io + f_it, f_io + f_so  # flow entering in(v), leaving out(v): kept
            low = max(0, max(into, out) - lo_int)
            high = min(io_int, into, out)
            if low > high:
                self.stale = True
                return
            f = min(max(f_io, low), high)
            for e, c, flow in ((io, io_int, f), (it, lo_int, into - f), (so, lo_int, out - f)):
                cap[e] = c - flow
                cap[e ^ 1] = flow


def _max_flow(
    n: int, au: list[int], av: list[int], ac: list[float]
) -> tuple[_MaxFlow, list[int], float] | None:
    """A maximum 0-1 flow, as a residual network; ``None`` when every cut is infinite.

    Capacities are scaled to integers so the finite ones sum below 2**30. SciPy's maximum flow
    is used when installed, pure-Python augmenting paths otherwise.

    Returns:
        ``(residual network, edge index of each arc, scale)``.
    """
    # An all-infinite path means no finite cut (checked first, so flows stay below 2**30).
    inf_adj: list[list[int]] = [[] for _ in range(n)]
    for u, v, c in zip(au, av, ac, strict=True):
        if c == math.inf:
            inf_adj[u].append(v)
    seen_inf = [False] * n
    seen_inf[0] = True
    stack = [0]
    while stack:
        for v in inf_adj[stack.pop()]:
            if not seen_inf[v]:
                seen_inf[v] = True
                stack.append(v)
    if seen_inf[1]:
        return None
    c_arr = np.asarray(ac, dtype=np.float64)
    infinite = np.isinf(c_arr)
    finite = float(c_arr[~infinite].sum())
    scale = (1 << 30) / finite if finite > 0 else 1.0
    big = (1 << 31) - 1
    ints = np.where(infinite, big, np.floor(np.where(infinite, 0.0, c_arr) * scale)).astype(np.int64)
    m = len(au)
    caps = np.where(ints == big, _INF, ints)
    if _csgraph is not None:
        sp, cs = _csgraph
        u_arr = np.asarray(au, dtype=np.int32)
        v_arr = np.asarray(av, dtype=np.int32)
        order = np.lexsort((v_arr, u_arr))
        u_s, v_s = u_arr[order], v_arr[order]
        indptr = np.searchsorted(u_s, np.arange(n + 1, dtype=np.int32)).astype(np.int32)
        cap = sp.csr_matrix((ints.astype(np.int32)[order], v_s, indptr), shape=(n, n))
        cap.has_sorted_indices = True
        fm = cs.maximum_flow(cap, 0, 1, method="dinic").flow.tocsr()
        fm.sort_indices()
        rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(fm.indptr))
        keys = rows * n + fm.indices
        want = u_arr.astype(np.int64) * n + v_arr  # original arc order
        pos = np.minimum(np.searchsorted(keys, want), max(len(keys) - 1, 0))
        flows = np.where(keys[pos] == want, fm.data[pos], 0) if len(keys) else np.zeros(m, np.int64)
        flows = np.maximum(flows, 0)
    else:
        flows = np.zeros(m, dtype=np.int64)
    # The residual network in bulk: arc i is edge 2i, its reverse 2i + 1; each node's edges in
    # the order they were added.
    g = _MaxFlow(n)
    ends = np.empty(2 * m, dtype=np.int64)
    ends[0::2], ends[1::2] = au, av
    to = np.empty(2 * m, dtype=np.int64)
    to[0::2], to[1::2] = av, au
    res = np.empty(2 * m, dtype=np.int64)
    res[0::2], res[1::2] = caps - flows, flows
    g.to, g.cap = to.tolist(), res.tolist()
    order_l = np.argsort(ends, kind="stable").tolist()
    bounds = np.concatenate([[0], np.cumsum(np.bincount(ends, minlength=n))]).tolist()
    g.head = [order_l[bounds[i]:bounds[i + 1]] for i in range(n)]
    edge_of = list(range(0, 2 * m, 2))
    if _csgraph is None:
        g.augment(0, 1)
    return g, edge_of, scale


# -- exact branch and bound --------------------------------------------------------------------------

def exact_points(p: Problem) -> list[tuple[int, float, list[int]]]:
    """Every Pareto-optimal ``(makespan units, effective energy, choice)``, by branch and bound."""
    n = len(p.durations)
    min_cost_rest = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        min_cost_rest[i] = min_cost_rest[i + 1] + p.costs[i][-1]
    # Longest path from each node's end to the sink with every node at its fastest.
    tail = [0] * n
    for v in range(n - 1, -1, -1):
        tail[v] = max((p.durations[w][0] + tail[w] for w in p.succs[v]), default=0)
    front: list[tuple[int, float, list[int]]] = []  # sorted by makespan, costs decreasing

    def dominated(ms: int, cost: float) -> bool:
        for m, c, _ in front:
            if m > ms:
                break
            if c <= cost + 1e-12:
                return True
        return False

    choice = [0] * n
    end = [0] * n

    def visit(i: int, cost: float, ms_lb: int, ms: int) -> None:
        if i == n:
            if not dominated(ms, cost):
                front[:] = [f for f in front if not (f[0] >= ms and f[1] >= cost)]
                front.append((ms, cost, list(choice)))
                front.sort(key=lambda f: f[0])
            return
        v = i  # node ids are in topological order
        start = max((end[u] for u in p.preds[v]), default=0)
        ds, cs = p.durations[v], p.costs[v]
        for k in range(len(ds) - 1, -1, -1):  # cheapest first
            e = start + ds[k]
            lb = max(ms_lb, e + tail[v])
            c = cost + cs[k]
            if dominated(lb, c + min_cost_rest[i + 1]):
                continue
            choice[v] = k
            end[v] = e
            visit(i + 1, c, lb, max(ms, e))

    visit(0, 0.0, 0, 0)
    return front


# -- the solver ------------------------------------------------------------------------------------

def _check_unit_time(unit_time_s: float) -> None:
    """Refuse a unit time that is not a number of seconds from ``FINE_UNIT_S`` to ``MAX_UNIT_S``.

    Raises:
        ValueError: ``unit_time_s`` is below 1 µs (the fast method's own unit; the exact
            method would count in more units than it can search), above an hour, or NaN.
    """
    if not FINE_UNIT_S <= unit_time_s <= MAX_UNIT_S:
        raise ValueError(f"unit time must be a number of seconds from {FINE_UNIT_S:g} to {MAX_UNIT_S:g} "
                         f"(got {unit_time_s:g})")


def solve(
    dag: PipelineDAG,
    profile: PipelineProfile,
    blocking_power_w: float,
    unit_time_s: float = 0.001,
    method: str = "auto",
) -> Frontier:
    """The time-energy frontier of one iteration of ``dag``.

    Args:
        dag: The pipeline (:func:`~joules.optimizers.pipeline.schedule.build_dag`).
        profile: Time and energy of each computation at each frequency.
        blocking_power_w: Power of a GPU blocked on communication, W.
        unit_time_s: Resolution of the frontier: the exact method rounds times down to whole
            units, the fast method makes a plan every half unit of iteration time.
        method: ``"auto"``, ``"fast"`` or ``"exact"`` (see the module docs).

    Returns:
        The frontier, fastest plan first. ``meta`` holds the method used and, for ``"fast"``,
        the number of cuts, network rebuilds and refreshes, and iteration times planned.

    Raises:
        PipelineProfileError: The profile lacks a stage or instruction.
        ValueError: Bad unit time, blocking power or method.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    _check_unit_time(unit_time_s)
    # The walk makes many short-lived lists and no reference cycles: collections of the cyclic
    # garbage collector would only pass over the host process's heap (large in a training job).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _solve(dag, profile, blocking_power_w, unit_time_s, method)
    finally:
        if collecting:
            gc.enable()


def _solve(dag: PipelineDAG, profile: PipelineProfile, blocking_power_w: float, unit_time_s: float,
           method: str) -> Frontier:
    """:func:`solve`, its arguments checked."""
    t0 = time.perf_counter()
    meta: dict[str, object] = {}
    fine: Problem | None = None  # options at the fast method's unit (a microsecond)
    p: Problem | None = None  # options rounded to the unit asked for
    if method == "auto":
        # Exact only for few combinations, and where rounding to the unit keeps every option
        # apart (a unit longer than the steps between options would plan on a coarser problem
        # than the profile). The unit can only merge options, so too many on the fine problem
        # settles it without building the rounded one.
        fine = Problem.build(dag, profile, blocking_power_w, FINE_UNIT_S)
        method = "fast"
        if fine.combinations() <= EXACT_AUTO_LIMIT:
            p = Problem.build(dag, profile, blocking_power_w, unit_time_s)
            if p.merged == 0 and p.combinations() == fine.combinations():
                method = "exact"
    if method == "exact":
        if p is None:
            p = Problem.build(dag, profile, blocking_power_w, unit_time_s)
            if p.merged:
                warnings.warn(
                    f"method='exact' at a {unit_time_s:g} s unit: {p.merged} option(s) round to the unit "
                    "of a faster one and are left out, so slower plans lose their energy savings; "
                    "use a smaller unit, or method='auto' or 'fast'", RuntimeWarning, stacklevel=3)
        plans = [p.plan(c) for _, _, c in exact_points(p)]
        # Rounded times can make the fastest real plan tie with a slower, cheaper one, which
        # then drops it: the fastest time is planned on real times too.
        plans += _fastest(fine or Problem.build(dag, profile, blocking_power_w, FINE_UNIT_S))
    if method == "fast":
        if fine is None:
            fine = Problem.build(dag, profile, blocking_power_w, FINE_UNIT_S)
        grid = max(1, round(unit_time_s / FINE_UNIT_S))
        plans, info = _fast(fine, grid, max(1, grid // PLANS_PER_UNIT))
        meta.update(info)
    meta["method"] = method
    table = option_table(dag, profile)
    top = [max(opts.values(), key=lambda o: o.frequency) for opts in table]
    max_freq = plan_of(dag, top, blocking_power_w)
    frontier_plans = _lower_envelope(plans)
    return Frontier(
        dag=dag,
        plans=frontier_plans,
        max_frequency=max_freq,
        blocking_power_w=blocking_power_w,
        unit_time_s=unit_time_s,
        solve_time_s=time.perf_counter() - t0,
        profile_name=profile.name,
        meta=meta,
    )


def _fast(p: Problem, grid: int, every: int) -> tuple[list[Plan], dict[str, object]]:
    """Relaxation walk and rounding on a fine-grained problem.

    Args:
        p: The problem in fine units.
        grid: The time unit asked for, in fine units (hull segments shorter than
            ``SPAN_UNITS`` of it, and shorter than ``1 / SPAN_PARTS`` of a computation's time
            range, are merged).
        every: One plan per ``every`` fine units of iteration time (further apart where that
            would plan more than ``MAX_PLAN_CELLS`` times computations).

    Returns:
        ``(plans, info)``: the plans made (not yet filtered), and statistics.
    """
    n = len(p.durations)
    shared: dict[tuple[int, str], _Hull] = {}
    hulls: list[_Hull] = []
    for v, c in enumerate(p.dag.nodes):
        key = (c.stage, c.kind)  # computations of one stage and kind share their options
        if key not in shared:
            # Long chords split slack between stages by their average slopes: a computation keeps
            # at least SPAN_PARTS of them, however coarse the unit.
            ds = p.durations[v]
            span = min(grid * SPAN_UNITS, max(1, (ds[-1] - ds[0]) // SPAN_PARTS))
            shared[key] = _Hull(ds, p.costs[v], span)
        hulls.append(shared[key])
    t_min = p.makespan([ds[0] for ds in p.durations])
    dur = [h.xs[-1] for h in hulls]
    horizon = p.makespan(dur)
    # Deadlines t_min + m * every, walked from the slowest down; each gets the first relaxed
    # state whose makespan fits it.
    m = (horizon - t_min) // every
    states: list[list[int]] = []
    deadlines: list[int] = []
    cuts = 0
    useful = False
    blocked_per_unit = p.blocking_power_w * p.dag.stages * p.unit_time_s
    left = 0  # units the current cut may still be applied
    total = 0
    if blocked_per_unit > 0:
        # Skip the part of the walk slower than the least-energy relaxed plan: it records nothing.
        start = _useful_start(p, hulls, blocked_per_unit)
        if start is not None:
            dur[:] = start
            horizon = p.makespan(dur)
            useful = True
            m = min(m, (horizon - t_min) // every)
            # The relaxed plan of least energy, at its own iteration time (rarely a planned one).
            states.append(list(dur))
            deadlines.append(horizon)
    if (m + 1) * n > MAX_PLAN_CELLS:
        # A unit far finer than the computations (a microsecond for 100 ms ones) would plan
        # hundreds of thousands of times, each improved as an array of every computation:
        # gigabytes, for a frontier of a few thousand distinct plans. Plan fewer, further apart.
        every = -(-(horizon - t_min) // max(1, MAX_PLAN_CELLS // n - 1))
        m = (horizon - t_min) // every
    walker = _Walker(p, hulls, dur)
    shorten: list[int] = []
    lengthen: list[int] = []
    while m >= 0:
        target = t_min + m * every
        if horizon <= target:
            if useful:
                states.append(list(dur))
                deadlines.append(target)
            m -= 1
            continue
        if left <= 0:
            step = walker.next()
            if step is None:  # cannot shrink further (only rounding noise separates it from t_min)
                states.append(list(dur))
                deadlines.append(target)
                m -= 1
                continue
            left, shorten, lengthen = step
            total = 0
            cuts += 1
            if not useful:
                # While a unit less costs less than the blocked energy it saves, slower plans
                # are dominated (by the relaxation's reckoning): nothing to record yet.
                price = sum(hulls[v].slope_down(dur[v]) for v in shorten)
                price -= sum(hulls[v].slope_up(dur[v]) for v in lengthen)
                useful = price >= blocked_per_unit
        j = min(left, horizon - target)  # stop at the next deadline if it comes first; the cut stays valid
        for v in shorten:
            dur[v] -= j
        for v in lengthen:
            dur[v] += j
        horizon -= j
        left -= j
        total += j
        if left <= 0:
            walker.applied(total, shorten, lengthen)
    batch = _Batch(p)
    relaxed = np.array(states, dtype=np.int64).reshape(len(states), n)
    start = batch.round_down(relaxed)
    limits = np.array(deadlines, dtype=np.int64)
    # Rounding down can overshoot nothing (each duration only shrinks), so every row meets its
    # deadline; the greedy pass then spends what rounding left. Each plan, improved again at the
    # next slower iteration time, is a second candidate there: a greedy pass from a different
    # start (the frontier keeps whichever is better). And half-way to it: a straggler's pace
    # falls anywhere between two planned times, and the float a plan leaves below the next time
    # is often enough for a slower option or two. (One call: such a row starts as soon as its
    # plan is done.)
    r = len(limits)
    later = [limits[:-1], (limits[:-1] + limits[1:]) // 2] if HALF_WAY else [limits[:-1]]
    parent = np.concatenate([np.full(r, -1), *[np.arange(1, r)] * len(later)])
    out = batch.improve(np.vstack([start, np.zeros((len(parent) - r, n), dtype=np.int64)]),
                        np.concatenate([limits, *later]), parent=parent)
    rows, again = out[:r], out[r:]
    again = again[(again != out[parent[r:]]).any(axis=1)]
    # The fastest time once more, on real times, from the relaxed plan that fits it.
    rows = np.vstack([rows, again, batch.fastest(start[-1:])])
    # The least energy overall, with the iteration time free, from the least-energy plan made.
    iteration, total = batch.real(rows)
    k = int(np.argmin(total))
    least = batch.least_energy(rows[k], float(total[k]))
    more = batch.real(least)
    rows = np.vstack([rows, least])
    real = (np.concatenate([iteration, more[0]]), np.concatenate([total, more[1]]))
    return batch.plans(rows, real), {"relaxation_cuts": cuts, "rebuilds": walker.rebuilds,
                               "refreshes": walker.refreshes, "deadlines": len(deadlines)}


def _fastest(p: Problem) -> list[Plan]:
    """The all-fastest plan, improved greedily on real times at its own iteration time."""
    batch = _Batch(p)
    return batch.plans(batch.fastest(np.zeros((0, batch.n), dtype=np.int64)))


def _useful_start(p: Problem, hulls: list[_Hull], blocked_per_unit: float) -> list[int] | None:
    """Durations of the relaxed plan of least energy (effective energy + blocked energy), by LP.

    Where the walk passes it, a unit less starts to cost at least the blocked energy it saves:
    every slower state of the walk is dominated, so the walk can start there. The LP
    (:class:`_RelaxationLP`) weighs the iteration time by the blocked energy per unit.

    Returns:
        The durations (rounded to units, within each hull), or ``None`` without SciPy or when
        the LP fails; the walk then starts from the slowest plan.
    """
    if _linprog is None:
        return None
    scale = 1e-3  # LP time in thousands of units, to keep coefficients near 1
    lp = _RelaxationLP(p.succs, [([x * scale for x in h.xs], h.ys) for h in hulls])
    solved = lp.solve(time_cost=blocked_per_unit / scale)
    if solved is None:
        return None
    durations = solved[0][:len(hulls)]
    return [min(max(round(d / scale), h.xs[0]), h.xs[-1]) for d, h in zip(durations, hulls, strict=True)]


class _RelaxationLP:
    """The convex relaxation of one iteration as a linear program (HiGHS, through SciPy).

    Variables, per computation ``v``: its duration ``d_v`` (within its hull), an epigraph
    variable ``c_v`` above every segment of its hull (its relaxed effective energy) and its
    start ``s_v``; and the iteration time ``T``. Constraints: ``s_v + d_v <= s_w`` for every
    dependency and ``s_v + d_v <= T``. The objective is ``sum(c_v) + time_cost * T``, with
    ``T`` free or bounded above. The matrix is built once for any number of solves.

    Args:
        succs: Successors of each computation.
        hulls: Per computation, the vertices ``(xs, ys)`` of its lower convex hull of
            (time, effective energy), times ascending, in the LP's time unit.
    """

    def __init__(self, succs: Sequence[Sequence[int]],
                 hulls: Sequence[tuple[Sequence[float], Sequence[float]]]) -> None:
        n = self.n = len(hulls)
        d_, c_, s_, t_ = 0, n, 2 * n, 3 * n
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        rhs: list[float] = []
        r = 0
        for v, (xs, ys) in enumerate(hulls):
            if len(xs) == 1:  # one option: c_v >= its energy
                rows.append(r)
                cols.append(c_ + v)
                vals.append(-1.0)
                rhs.append(-ys[0])
                r += 1
            for k in range(len(xs) - 1):  # c_v >= ys[k] + slope * (d_v - xs[k])
                slope = (ys[k + 1] - ys[k]) / (xs[k + 1] - xs[k])
                rows += [r, r]
                cols += [c_ + v, d_ + v]
                vals += [-1.0, slope]
                rhs.append(slope * xs[k] - ys[k])
                r += 1
        for v in range(n):
            for w in succs[v]:  # s_v + d_v <= s_w
                rows += [r, r, r]
                cols += [s_ + v, d_ + v, s_ + w]
                vals += [1.0, 1.0, -1.0]
                rhs.append(0.0)
                r += 1
            rows += [r, r, r]  # s_v + d_v <= T
            cols += [s_ + v, d_ + v, t_]
            vals += [1.0, 1.0, -1.0]
            rhs.append(0.0)
            r += 1
        self.a = _sp.coo_matrix((vals, (rows, cols)), shape=(r, 3 * n + 1)).tocsr()
        self.rhs = np.asarray(rhs)
        self.bounds: list[tuple[float | None, float | None]] = (
            [(xs[0], xs[-1]) for xs, _ in hulls] + [(None, None)] * n + [(0, None)] * n + [(None, None)])

    def solve(self, time_cost: float = 0.0, time_max: float | None = None) -> tuple[np.ndarray, float] | None:
        """The optimal variables ``[d, c, s, T]`` and objective (``None``: no solution).

        Args:
            time_cost: Weight of the iteration time in the objective.
            time_max: The longest iteration time allowed (``None``: any).
        """
        cost = np.zeros(3 * self.n + 1)
        cost[self.n:2 * self.n] = 1.0
        cost[-1] = time_cost
        bounds = self.bounds if time_max is None else [*self.bounds[:-1], (None, time_max)]
        # Dual simplex without presolve: on LPs this small, presolve costs more than it saves.
        res = _linprog(cost, A_ub=self.a, b_ub=self.rhs, bounds=bounds, method="highs-ds",
                       options={"presolve": False})
        return (res.x, float(res.fun)) if res.status == 0 else None


def energy_lower_bounds(dag: PipelineDAG, profile: PipelineProfile, blocking_power_w: float,
                        times_s: Sequence[float]) -> list[float]:
    """A lower bound on the energy of any plan no slower than each of ``times_s``.

    The bound on :meth:`Frontier.energy_at <joules.optimizers.pipeline.frontier.Frontier.energy_at>`:
    the convex relaxation, solved exactly. Every computation may run anywhere on the lower
    convex hull of its options' (time, effective energy), as if it could mix two neighbouring
    frequencies, and the least energy of an iteration no slower than each time, blocked time
    included, is one linear program (with SciPy's HiGHS). No plan that fast uses less energy,
    so a plan is at most as far above the optimum as it is above the bound: a certificate of
    how good a frontier is. The optimum itself can lie above the bound (the options are
    discrete), by a few hundredths of a percent on nearly flat profiles.

    Args:
        dag: The pipeline.
        profile: Time and energy of each computation at each frequency.
        blocking_power_w: Power of a GPU blocked on communication, W.
        times_s: Iteration times, s.

    Returns:
        The bound at each time, J (``math.inf`` below the fastest achievable iteration time).

    Raises:
        ImportError: SciPy is not installed (``pip install joules[pipeline]``).
        PipelineProfileError: The profile lacks a stage or instruction.
        ValueError: Bad blocking power or time.
    """
    if _linprog is None:
        raise ImportError("energy_lower_bounds needs SciPy: pip install 'joules[pipeline]'")
    if not (blocking_power_w >= 0 and math.isfinite(blocking_power_w)):
        raise ValueError(f"blocking power must be a finite number >= 0 W (got {blocking_power_w})")
    times = [float(t) for t in times_s]
    if any(not (t > 0 and math.isfinite(t)) for t in times):
        raise ValueError(f"iteration times must be positive and finite (got {times_s!r})")
    ms = 1e3  # LP time in milliseconds, to keep coefficients near 1
    table = option_table(dag, profile)
    hulls = []
    for opts in table:
        front = pareto_front(opts.values(), blocking_power_w)
        effective = [o.energy_j - blocking_power_w * o.time_s for o in front]
        hulls.append(_hull([o.time_s * ms for o in front], effective))
    lp = _RelaxationLP(dag.successors(), hulls)
    out = []
    for t in times:
        # Plans no slower than t: the iteration time is free up to t, its blocked energy counted
        # (no solution: faster than any plan).
        solved = lp.solve(time_cost=blocking_power_w * dag.stages / ms, time_max=t * ms)
        out.append(math.inf if solved is None else solved[1])
    return out


class _Batch:
    """Many plans of one problem at once (rows), vectorized with numpy.

    Plans come in and go out as rows (plans x nodes). Inside, arrays are nodes x plans with
    the nodes in order of depth (nodes of one depth never depend on each other, and each
    depth is one slice), so a longest-path pass costs a few numpy operations per depth for
    every plan at once. Each node's options live in one flat table, node ``v``'s at
    ``offset[v]`` onward.
    """

    def __init__(self, p: Problem) -> None:
        self.p = p
        n = self.n = len(p.durations)
        depth = [0] * n
        for v in range(n):
            depth[v] = 1 + max((depth[u] for u in p.preds[v]), default=-1)
        levels: dict[int, list[int]] = {}
        for v in range(n):
            levels.setdefault(depth[v], []).append(v)

        def padded(lists: list[tuple[int, ...]]) -> np.ndarray:
            width = max(1, max((len(x) for x in lists), default=1))
            return np.array([[*x, *[n] * (width - len(x))] for x in lists], dtype=np.int64)

        # Nodes in order of depth (``perm[i]`` is the node at position ``i``; ``pos`` the inverse), so
        # that each depth is one slice of a nodes x rows array. Per depth: its slice, and its nodes'
        # predecessors / successors as positions, padded with the dummy position n, one array per
        # place in the list (an elementwise max / min over a few gathered rows beats a reduction).
        self.perm = np.array([v for _, vs in sorted(levels.items()) for v in vs], dtype=np.int64)
        self.pos = np.empty(n, dtype=np.int64)
        self.pos[self.perm] = np.arange(n)
        where = [*self.pos.tolist(), n]
        self.levels = []
        lo = 0
        for _, vs in sorted(levels.items()):
            preds = padded([tuple(where[u] for u in p.preds[v]) for v in vs])
            succs = padded([tuple(where[w] for w in p.succs[v]) for v in vs])
            self.levels.append((lo, lo + len(vs), list(preds.T), list(succs.T)))
            lo += len(vs)
        # Computations sharing their options (one stage and kind, as Problem.build makes them)
        # share one table: the searches below run over far fewer keys.
        group_of: dict[tuple[int, int, int], int] = {}
        group = [group_of.setdefault((id(p.durations[v]), id(p.costs[v]), id(p.options[v])), len(group_of))
                 for v in range(n)]
        first = [0] * len(group_of)
        for v in range(n - 1, -1, -1):
            first[group[v]] = v
        sizes = [len(p.durations[v]) for v in first]
        g_offset = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.offset = g_offset[np.asarray(group, dtype=np.int64)]
        span = self.span = max((ds[-1] for ds in p.durations), default=0) + 2
        # Durations made increasing across groups (group g shifted by g * span) for one searchsorted.
        self.flat_d = np.concatenate([np.asarray(p.durations[v], dtype=np.int64) for v in first])
        self.flat_c = np.concatenate([np.asarray(p.costs[v], dtype=np.float64) for v in first])
        # The real options, for evaluating plans with unrounded times.
        self.flat_t = np.array([o.time_s for v in first for o in p.options[v]], dtype=np.float64)
        self.flat_e = np.array([o.energy_j for v in first for o in p.options[v]], dtype=np.float64)
        self.flat_f = np.array([o.frequency for v in first for o in p.options[v]], dtype=np.int64)
        self.shift = np.asarray(group, dtype=np.int64) * span
        self.count = np.array([len(ds) for ds in p.durations], dtype=np.int64)  # options per node
        self.keys = self.flat_d + np.repeat(np.arange(len(first), dtype=np.int64) * span, sizes)
        # The same for real times, in seconds (plans that must meet a real iteration time).
        real_span = self.real_span = 2.0 * float(self.flat_t.max(initial=0.0)) + 1.0
        self.real_shift = np.asarray(group, dtype=np.float64) * real_span
        self.real_keys = self.flat_t + np.repeat(np.arange(len(first), dtype=np.float64) * real_span, sizes)
        # Per option, how much longer its node's next slower option is (infinite for the slowest):
        # a node whose float is shorter has no move.
        ends = np.cumsum(sizes) - 1
        self.step_d = np.empty(len(self.flat_d), dtype=np.int64)
        self.step_d[:-1] = self.flat_d[1:] - self.flat_d[:-1]
        self.step_d[ends] = _INF
        self.step_t = np.empty(len(self.flat_t), dtype=np.float64)
        self.step_t[:-1] = self.flat_t[1:] - self.flat_t[:-1]
        self.step_t[ends] = np.inf
        # The greedy pass moves less memory on 32-bit durations, where every path fits in them.
        narrow = sum(ds[-1] for ds in p.durations) < 2**31 - 1
        self.pass_d = self.flat_d.astype(np.int32) if narrow else self.flat_d
        self.pass_step = np.minimum(self.step_d, 2**31 - 1).astype(np.int32) if narrow else self.step_d

    def real(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Real iteration time (s) and energy (J) of each option-index row."""
        cols = rows + self.offset
        times = self.flat_t[cols]
        iteration = self.makespan(times)
        blocked = self.p.blocking_power_w * (self.p.dag.stages * iteration - times.sum(axis=1))
        return iteration, self.flat_e[cols].sum(axis=1) + blocked

    def least_energy(self, row: np.ndarray, energy: float) -> np.ndarray:
        """``row`` (real energy ``energy``) improved by option steps, the iteration time free.

        The walk and the greedy pass plan for given iteration times; the plan of least energy
        overall may be a little slower than any of them. From ``row``, every single step (one
        computation one option slower or faster) is evaluated, blocked time included; of those
        that lower the energy, the best of each computation, in order of energy, are applied
        one more at a time (up to ``LEAST_ENERGY_BATCH``) and the best of these combinations is
        kept (at least the best single step), until no step lowers the energy: fewer passes
        over the DAG than one step at a time. Returns one row.
        """
        cur, best = row.copy(), energy
        last = self.count - 1
        chunk = max(1, LEAST_ENERGY_CELLS // self.n)  # candidate rows evaluated at once
        for _ in range(LEAST_ENERGY_STEPS):
            up, down = np.flatnonzero(cur < last), np.flatnonzero(cur > 0)
            node = np.concatenate([up, down])
            delta = np.concatenate([np.ones(up.size, dtype=cur.dtype),
                                    np.full(down.size, -1, dtype=cur.dtype)])
            e = np.empty(node.size)
            for lo in range(0, node.size, chunk):
                m = min(chunk, node.size - lo)
                cand = np.repeat(cur[None, :], m, axis=0)
                cand[np.arange(m), node[lo:lo + m]] += delta[lo:lo + m]
                e[lo:lo + m] = self.real(cand)[1]
            good = np.flatnonzero(e < best - 1e-12 * max(1.0, abs(best)))
            if not good.size:
                break
            good = good[np.argsort(e[good], kind="stable")]
            _, first = np.unique(node[good], return_index=True)  # each computation's best step
            good = good[np.sort(first)][:LEAST_ENERGY_BATCH]
            steps = np.zeros((good.size, self.n), dtype=cur.dtype)
            steps[np.arange(good.size), node[good]] = delta[good]
            if good.size == 1:
                cur, best = cur + steps[0], float(e[good[0]])
                continue
            combos = cur + np.cumsum(steps, axis=0)
            _, e = self.real(combos)
            k = int(np.argmin(e))  # the first is the best single step, which lowers the energy
            cur, best = combos[k], float(e[k])
        return cur[None, :]

    def round_down(self, durations: np.ndarray) -> np.ndarray:
        """Per row and node, the slowest option no longer than the duration (the fastest if none)."""
        limit = np.clip(durations, -1, self.span - 1)
        pos = np.searchsorted(self.keys, limit + self.shift, side="right") - 1
        return np.maximum(pos - self.offset, 0)

    def _ends(self, dur: np.ndarray) -> np.ndarray:
        """Earliest end at every position, positions x rows (``dur`` positions x rows; row n is 0)."""
        ef = np.zeros((self.n + 1, dur.shape[1]), dtype=dur.dtype)
        for lo, hi, preds, _ in self.levels:
            acc = ef[preds[0]]
            for col in preds[1:]:
                np.maximum(acc, ef[col], out=acc)
            np.add(acc, dur[lo:hi], out=ef[lo:hi])
        return ef

    def makespan(self, dur: np.ndarray) -> np.ndarray:
        """Longest path of each row (``dur`` rows x nodes; integer or real durations)."""
        return self._ends(np.ascontiguousarray(dur[:, self.perm].T))[: self.n].max(axis=0)

    def plans(self, rows: np.ndarray, real: tuple[np.ndarray, np.ndarray] | None = None) -> list[Plan]:
        """Real plans (times from the profile, not rounded) of option-index rows, each once.

        ``real``: the rows' :meth:`real` times and energies, where already computed.

        Only rows that may be on the lower envelope are made into plans: in order of iteration
        time, then energy, those using no more energy than every row before them (any other is
        dropped by :func:`_lower_envelope` too, whatever else it is given).
        """
        iteration, total = self.real(rows) if real is None else real
        order = np.lexsort((total, iteration))
        before = np.minimum.accumulate(np.concatenate([[np.inf], total[order]]))[:-1]
        kept = np.sort(order[total[order] <= before])
        rows, iteration, total = rows[kept], iteration[kept], total[kept]
        # Each row once, in lexicographic order (as np.unique(axis=0) gives them, several times faster).
        order = np.lexsort(rows.T[::-1])
        if order.size > 1:
            order = order[np.concatenate([[True], (rows[order[1:]] != rows[order[:-1]]).any(axis=1)])]
        freqs = self.flat_f[rows[order] + self.offset]
        return [
            Plan(tuple(f), float(t), float(e))
            for f, t, e in zip(freqs.tolist(), iteration[order].tolist(), total[order].tolist(), strict=True)
        ]

    def improve(self, choice: np.ndarray, deadline: np.ndarray, real: bool = False,
                parent: np.ndarray | None = None) -> np.ndarray:
        """Greedily move computations to slower, cheaper options while each row's deadline holds.

        Each round computes every node's float and, per row, applies the single move (a node to
        the slowest option its float allows) with the largest saving. Deadlines are in units,
        or with ``real`` in seconds, held by the real option times.

        Args:
            choice: Option indices, rows x nodes.
            deadline: Each row's deadline.
            real: Deadlines in seconds of real option time.
            parent: Per row, ``-1``, or the row whose result is this row's start (its ``choice``
                is then ignored). Such a row starts as soon as its parent is done, in the same
                rounds as the rest: fewer rounds than improving the two sets one after the other.
        """
        # Positions x rows: a node's values for every row lie together, and a depth is a slice.
        # Options as indices into the flat tables.
        out = np.ascontiguousarray((choice + self.offset)[:, self.perm].T)
        rows = np.arange(choice.shape[0])
        parent = np.full(rows.size, -1) if parent is None else np.asarray(parent, dtype=np.int64)
        rows, kids = rows[parent < 0], rows[parent >= 0]
        n = self.n
        table, step = (self.flat_t, self.step_t) if real else (self.pass_d, self.pass_step)
        keys, shift = (self.real_keys, self.real_shift) if real else (self.keys, self.shift)
        shift = shift[self.perm]
        top = self.real_span - 1.0 if real else self.span - 1
        while rows.size:
            at = out[:, rows]
            dur = table[at]
            ef = self._ends(dur)
            ls = np.empty((n + 1, rows.size), dtype=dur.dtype)
            ls[n] = deadline[rows]
            lf = np.empty_like(dur)
            for lo, hi, _, succs in reversed(self.levels):
                acc = lf[lo:hi]
                np.take(ls, succs[0], axis=0, out=acc)
                for col in succs[1:]:
                    np.minimum(acc, ls[col], out=acc)
                np.subtract(acc, dur[lo:hi], out=ls[lo:hi])
            # Only nodes whose float reaches their next slower option can move (flat indices into
            # the positions x rows arrays).
            slack = lf - ef[:n]
            a = rows.size
            fi = np.flatnonzero(slack >= step[at])
            at_pos = fi // a
            # (a float past the slowest option stays within the node's own keys)
            limit = np.minimum(dur.ravel()[fi] + slack.ravel()[fi], top)
            k2 = np.searchsorted(keys, limit + shift[at_pos], side="right") - 1
            # The move of largest saving per row; of equal ones, the lowest node's (in the DAG's order).
            by_node = self.perm[at_pos] * a + (fi - at_pos * a)
            gains = np.zeros(n * a)
            gains[by_node] = self.flat_c[at.ravel()[fi]] - self.flat_c[k2]
            moves = np.zeros(n * a, dtype=np.int64)
            moves[by_node] = k2
            best = gains.reshape(n, a).argmax(axis=0) * a + np.arange(a)
            moving = gains[best] > 0  # a row with no move is done
            out[self.pos[best[moving] // a], rows[moving]] = moves[best[moving]]
            if kids.size and not moving.all():
                moved, kids = self._start_kids(out, rows[~moving], kids, parent)
                rows = np.concatenate([rows[moving], moved])
            else:
                rows = rows[moving]
        return out.T[:, self.pos] - self.offset

    @staticmethod
    def _start_kids(out: np.ndarray, done: np.ndarray, kids: np.ndarray,
                    parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Start the rows waiting on rows ``done``, from their results; (started, still waiting)."""
        finished = np.zeros(out.shape[1], dtype=bool)
        finished[done] = True
        go = finished[parent[kids]]
        started = kids[go]
        out[:, started] = out[:, parent[started]]
        return started, kids[~go]

    def fastest(self, start: np.ndarray) -> np.ndarray:
        """A plan of the real fastest iteration time, improved from ``start`` (one row) on real times.

        Plans improved in units can miss the real fastest time by a fraction of a unit (each
        option's time is rounded down to the unit), so the fastest time is planned again on
        real times: from ``start`` where it is that fast, else from the all-fastest plan.
        """
        fastest = np.zeros((1, self.n), dtype=np.int64)
        t_min = self.makespan(self.flat_t[fastest + self.offset])
        if start.shape[0] and self.makespan(self.flat_t[start[:1] + self.offset])[0] <= t_min[0]:
            fastest = start[:1]
        return self.improve(fastest, t_min, real=True)


def _lower_envelope(plans: list[Plan]) -> list[Plan]:
    """Plans where no other plan is at least as fast and uses less energy, fastest first."""
    out: list[Plan] = []
    for pl in sorted(plans, key=lambda q: (q.time_s, q.energy_j)):
        if not out or pl.energy_j < out[-1].energy_j - 1e-9 * max(1.0, abs(out[-1].energy_j)):
            if out and pl.time_s - out[-1].time_s <= 1e-12:
                out[-1] = pl  # as fast but for rounding, and cheaper
            else:
                out.append(pl)
    return out
