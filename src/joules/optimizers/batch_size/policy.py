"""Batch-size policies for recurring jobs: pruning exploration, then Thompson sampling.

``make_policy(config)`` returns the policy of ``config.variant``:

- ``"nsdi23"`` (:class:`NSDI23Policy`): the policy of the Zeus paper (NSDI'23), as its
  authors' code implements it.
- ``"joules"`` (:class:`JoulesPolicy`, the default): the same skeleton with the changes that
  measurably lower the cost on the paper's traces (``docs/batch-size.md``).

Both are pure: every method takes the state (a JSON-serializable ``dict``) and returns a new
one; nothing else is kept between calls. The random generator (numpy's PCG64) is part of
the state, so a job that is saved, reloaded and continued makes the same decisions as one
that never stopped.

**Pruning exploration.** A direction explores candidates one by one away from its start
(downwards: the start itself, then smaller batch sizes in decreasing order; upwards: larger
ones in increasing order) until a trial fails to reach the target, stopped early or out of
epochs. A batch size that failed is pruned: never tried again. ``nsdi23`` runs two rounds
of both directions: the first from the default batch size over every candidate, the second
over those that reached the target in the first, from the cheapest of them. Thompson
sampling then chooses among those that reached the target in the second round.
``joules`` runs one pass from the default, and a direction also stops after a batch size
that reached the target at an estimated cost more than ``1 + margin`` times the best one's
(it stays a candidate; the ones beyond it are not tried; the upward direction is not even
started when the default itself is that costly). A direction also ends before a candidate
whose cost, extrapolated linearly in log batch size from the estimates of the two batch sizes
before it, exceeds that bound, when the estimates rose on the last two steps towards it.
The pass goes downwards first, except when the default's trial reached the target within a
third of ``max_epochs`` (where the job gives it): larger batch sizes, which usually need
more epochs, then have room, and the pass goes upwards first and to the end (or to a
failure), not stopped by those rules.
Thompson sampling then chooses among every batch size that reached the target.

**Early stopping** (both). A trial should stop once its running cost exceeds ``beta`` times
the least cost of a trial that reached the target (:meth:`Policy.stop_cost`; ``None`` until
one has). ``Decision.stop_cost`` is that bound when the trial was handed out.

**Concurrent trials.** ``next_trial`` may be called again before earlier trials were
observed. Exploration hands out the next free candidate of the downward direction, else of
the upward one; a direction waits while its trial is in flight, since whether that trial
reaches the target decides whether the direction goes on. When no candidate is free,
``nsdi23`` hands out its best guess (the cheapest batch size that reached the target so far,
or the round's start while none has) and ``joules`` draws by Thompson sampling among the
batch sizes that reached the target (the default while none has). Such a trial is not an
exploration step, but its result is learned from like any other; the first result
observed for a candidate whose exploration trial is in flight decides that step, whichever
trial it came from. During Thompson sampling every call draws anew. An aborted trial
teaches nothing and frees its slot: a candidate whose only trial in flight was aborted is
handed out again.

**Observations.** ``observe`` matches a result to a trial in flight by batch size. A result
for a batch size never handed out is learned from too (``joules`` also takes it as that
batch size's exploration step).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from joules.optimizers.batch_size.types import (
    Decision,
    Policy,
    PolicyConfig,
    PolicyState,
    PolicySummary,
    TrialOutcome,
    TrialResult,
)

STATE_VERSION = 1
VARIANTS = ("joules", "nsdi23")

_OK = "ok"
_FAILED = "failed"
_PENDING = "pending"


def make_policy(config: PolicyConfig) -> Policy:
    """The policy ``config.variant`` names.

    Raises:
        ValueError: Unknown variant, or a bad configuration (named in the message).
    """
    if config.variant == "nsdi23":
        return NSDI23Policy(config)
    if config.variant == "joules":
        return JoulesPolicy(config)
    raise ValueError(f"unknown policy variant {config.variant!r} (expected {' or '.join(VARIANTS)})")


def _check_config(config: PolicyConfig) -> None:
    bs = config.batch_sizes
    if not bs:
        raise ValueError("batch_sizes is empty")
    if any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in bs):
        raise ValueError(f"batch_sizes must be positive integers, got {list(bs)}")
    if len(set(bs)) != len(bs):
        raise ValueError(f"batch_sizes must be distinct, got {list(bs)}")
    d = config.default_batch_size
    if not isinstance(d, int) or isinstance(d, bool):  # (a numpy integer would end up in the JSON state)
        raise ValueError(f"default_batch_size must be an integer, got {d!r}")
    if d not in bs:
        raise ValueError(f"default_batch_size {d} is not one of batch_sizes")
    if not 0.0 <= config.eta <= 1.0:
        raise ValueError(f"eta must be within [0, 1], got {config.eta:g}")
    if not (config.beta > 1.0 and math.isfinite(config.beta)):
        raise ValueError(f"beta must be a finite number above 1, got {config.beta:g}")
    if not isinstance(config.window_size, int) or config.window_size < 0:
        raise ValueError(f"window_size must be an integer >= 0, got {config.window_size!r}")
    if config.prior_precision < 0 or not math.isfinite(config.prior_precision):
        raise ValueError(f"prior_precision must be finite and not negative, got {config.prior_precision:g}")
    if config.prior_mean is not None and not math.isfinite(config.prior_mean):
        raise ValueError(f"prior_mean must be finite, got {config.prior_mean:g}")
    if config.max_epochs is not None and (not isinstance(config.max_epochs, int) or config.max_epochs < 1):
        raise ValueError(f"max_epochs must be a positive integer, got {config.max_epochs!r}")


# -- the random generator, kept in the state ---------------------------------------------------

def _rng_state(rng: np.random.Generator) -> dict[str, Any]:
    s = rng.bit_generator.state
    # 128-bit integers as hex strings: a JSON column that reads numbers as doubles keeps them.
    return {"state": hex(s["state"]["state"]), "inc": hex(s["state"]["inc"]),
            "has_uint32": int(s["has_uint32"]), "uinteger": int(s["uinteger"])}


def _rng(saved: dict[str, Any]) -> np.random.Generator:
    bg = np.random.PCG64()
    bg.state = {"bit_generator": "PCG64",
                "state": {"state": int(saved["state"], 16), "inc": int(saved["inc"], 16)},
                "has_uint32": saved["has_uint32"], "uinteger": saved["uinteger"]}
    return np.random.Generator(bg)


class _BasePolicy(Policy):
    """State keeping, in-flight trials, early stopping; subclasses choose and learn."""

    def __init__(self, config: PolicyConfig) -> None:
        _check_config(config)
        super().__init__(config)
        self.batch_sizes = sorted(config.batch_sizes)

    # -- state ---------------------------------------------------------------------------------

    def initial_state(self) -> PolicyState:
        rng = np.random.Generator(np.random.PCG64(self.config.seed))
        return {
            "version": STATE_VERSION,
            "variant": self.config.variant,
            "rng": _rng_state(rng),
            "history": [],  # [batch size, outcome, cost, epochs] of every observed trial, oldest first
            "in_flight": [],  # batch sizes handed out and not yet observed
            "unusable": [],  # batch sizes whose trial failed: they cannot train (never handed out)
            **self._initial(),
        }

    def _initial(self) -> dict[str, Any]:
        return {}

    def _checked(self, state: PolicyState) -> PolicyState:
        if state.get("version") != STATE_VERSION or state.get("variant") != self.config.variant:
            raise ValueError(f"state is not a version-{STATE_VERSION} {self.config.variant!r} policy state")
        # A copy, so that the caller's state is left as it was. The history's rows are never
        # changed once appended: a copy of its list will do (copying them all made every call
        # as slow as the history is long, and a run of N trials N-squared slow).
        out = copy.deepcopy({k: v for k, v in state.items() if k != "history"})
        if "history" in state:
            out["history"] = list(state["history"])
        return out

    def _best(self, state: PolicyState) -> tuple[int, float] | None:
        """The cheapest trial that reached the target: (batch size, cost).

        With a sliding window, among each batch size's last ``window_size`` trials: after the
        costs drift up, a bound from older, cheaper trials would stop every trial for ever.
        """
        best: tuple[int, float] | None = None
        w = self.config.window_size
        seen: dict[int, int] = {}
        unusable = set(state.get("unusable", ()))  # (one that cannot train any more is not the best)
        for b, outcome, cost, _ in reversed(state["history"]):
            seen[b] = seen.get(b, 0) + 1
            if (w and seen[b] > w) or b in unusable:
                continue
            if outcome == TrialOutcome.REACHED and (best is None or cost < best[1]):
                best = (b, cost)
        return best

    def _fallback(self, state: PolicyState) -> int:
        """The batch size to hand out when the policy has none: the default, unless it cannot train.

        Then the one nearest to it (in log batch size) that can, if any.
        """
        default = self.config.default_batch_size
        unusable = set(state.get("unusable", ()))
        usable = [b for b in self.batch_sizes if b not in unusable]
        if default not in unusable or not usable:
            return default
        return min(usable, key=lambda b: (abs(math.log(b / default)), b))

    def _window(self, state: PolicyState, bs: int) -> list[float]:
        """The last ``window_size`` costs of ``bs`` (all of them for 0), oldest first."""
        costs = [c for b, _, c, _ in state["history"] if b == bs]
        w = self.config.window_size
        return costs[-w:] if w else costs

    # -- the Policy interface ------------------------------------------------------------------

    def next_trial(self, state: PolicyState) -> tuple[PolicyState, Decision]:
        state = self._checked(state)
        rng = _rng(state["rng"])
        bs, phase = self._choose(state, rng)
        state["rng"] = _rng_state(rng)
        state["in_flight"].append(bs)
        return state, Decision(batch_size=bs, phase=phase, stop_cost=self.stop_cost(state))

    def observe(self, state: PolicyState, result: TrialResult) -> PolicyState:
        state = self._checked(state)
        bs = result.batch_size
        if bs not in self.batch_sizes:
            raise ValueError(f"batch size {bs} is not one of the job's {self.batch_sizes}")
        bs = int(bs)  # a NumPy integer would make the state unserializable
        outcome = TrialOutcome(result.outcome)
        if bs in state["in_flight"]:
            state["in_flight"].remove(bs)
        if outcome == TrialOutcome.ABORTED:
            self._aborted(state, bs)
            return state
        if outcome == TrialOutcome.FAILED:  # (its cost says nothing about a whole run: not kept)
            unusable = state.setdefault("unusable", [])
            if bs not in unusable:
                unusable.append(bs)
            self._failed(state, bs)
            return state
        if not (math.isfinite(result.cost) and result.cost >= 0):
            raise ValueError(f"trial cost must be finite and not negative, got {result.cost!r}")
        if not math.isfinite(result.epochs):
            raise ValueError(f"trial epochs must be a finite number, got {result.epochs!r}")
        state["history"].append([bs, outcome.value, float(result.cost), max(0, int(result.epochs))])
        self._learn(state, bs, outcome, float(result.cost))
        return state

    def stop_cost(self, state: PolicyState) -> float | None:
        best = self._best(state)
        return None if best is None else self.config.beta * best[1]

    def summary(self, state: PolicyState) -> PolicySummary:
        state = self._checked(state)
        phase, explored, surviving = self._view(state)
        best = self._best(state)
        return PolicySummary(
            phase=phase,
            explored={int(b): s for b, s in sorted(explored.items(), key=lambda kv: int(kv[0]))},
            surviving=surviving,
            posterior=self._posterior(state, surviving),
            best_batch_size=best[0] if best else None,
            best_cost=best[1] if best else None,
        )

    # -- what the variants define --------------------------------------------------------------

    def _choose(self, state: PolicyState, rng: np.random.Generator) -> tuple[int, str]:
        """The next trial's batch size and phase (``state`` may be changed)."""
        raise NotImplementedError

    def _learn(self, state: PolicyState, bs: int, outcome: TrialOutcome, cost: float) -> None:
        """Take in a result (already in the history)."""

    def _aborted(self, state: PolicyState, bs: int) -> None:
        """Free what an aborted trial of ``bs`` held (already out of ``in_flight``)."""

    def _failed(self, state: PolicyState, bs: int) -> None:
        """Prune ``bs``, which cannot train (already out of ``in_flight``)."""
        raise NotImplementedError

    def _view(self, state: PolicyState) -> tuple[str, dict[str, str], list[int]]:
        """Phase, exploration status per batch size, surviving batch sizes."""
        raise NotImplementedError

    def _posterior(self, state: PolicyState, arms: list[int]) -> dict[int, dict[str, float]]:
        raise NotImplementedError


def _free_in(order: list[int], status: dict[str, str]) -> int | None:
    """The next candidate of one exploration direction (``order`` goes away from the start).

    Candidates that reached the target are passed; a failed one ends the direction and one in
    flight blocks it (whether it reaches the target decides whether the direction goes on).
    """
    for b in order:
        s = status.get(str(b))
        if s == _OK:
            continue
        return b if s is None else None
    return None


class NSDI23Policy(_BasePolicy):
    """The Zeus paper's policy: two pruning rounds, then Gaussian Thompson sampling.

    Each surviving batch size's cost is modelled as Gaussian with a known variance, set to
    the variance of its observed costs (every observation in the window, whatever the trial's
    outcome: an early-stopped or failed trial's cost counts as a sample). Its mean has a
    Gaussian posterior: the optional prior (``prior_mean``, ``prior_precision``) updated with
    the window's costs. A batch size with fewer than two costs in its window is tried first
    (at random among such); one whose costs are all equal is certain (its mean is its cost).
    Otherwise one mean is sampled per batch size, and the lowest wins.
    """

    rounds = 2

    def _initial(self) -> dict[str, Any]:
        return {
            "explore": self._round(1, self.batch_sizes, self.config.default_batch_size),
            "explored": {},  # batch size (str) -> latest exploration status
            "surviving": None,  # batch sizes Thompson sampling chooses among, once exploration ends
        }

    @staticmethod
    def _round(number: int, candidates: list[int], start: int) -> dict[str, Any]:
        # status: batch size (str) -> ok/failed/pending; costs: batch size (str) -> cost of its step
        return {"round": number, "candidates": sorted(candidates), "start": start, "status": {}, "costs": {}}

    @staticmethod
    def _directions(rnd: dict[str, Any]) -> tuple[list[int], list[int]]:
        start = rnd["start"]
        down = sorted((b for b in rnd["candidates"] if b <= start), reverse=True)
        up = sorted(b for b in rnd["candidates"] if b > start)
        return down, up

    @staticmethod
    def _over(order: list[int], status: dict[str, str]) -> bool:
        """Whether a direction is over: a candidate failed, or every one reached the target."""
        for b in order:
            s = status.get(str(b))
            if s == _FAILED:
                return True
            if s != _OK:
                return False
        return True

    def _advance(self, state: PolicyState) -> None:
        """End finished rounds (and exploration) until one has something to do."""
        while (rnd := state["explore"]) is not None:
            status = rnd["status"]
            if not all(self._over(order, status) for order in self._directions(rnd)):
                return
            good = [b for b in rnd["candidates"] if status.get(str(b)) == _OK]
            if good and rnd["round"] < self.rounds:
                costs = rnd["costs"]
                start = min(good, key=lambda b: (costs[str(b)], b))
                state["explore"] = self._round(rnd["round"] + 1, good, start)
                continue
            state["explore"] = None
            if not good:  # every candidate of the round failed: keep the cheapest that ever reached it
                best = self._best(state)
                good = [best[0] if best else self._fallback(state)]
            state["surviving"] = good

    def _choose(self, state: PolicyState, rng: np.random.Generator) -> tuple[int, str]:
        self._advance(state)
        rnd = state["explore"]
        if rnd is None:
            return self._sample(state, rng), "exploit"
        for order in self._directions(rnd):
            free = _free_in(order, rnd["status"])
            if free is not None:
                rnd["status"][str(free)] = _PENDING
                state["explored"][str(free)] = _PENDING
                return free, "explore"
        best = self._best(state)
        if best is not None:
            return best[0], "explore"
        start = rnd["start"]
        return (start if start not in state.get("unusable", ()) else self._fallback(state)), "explore"

    def _learn(self, state: PolicyState, bs: int, outcome: TrialOutcome, cost: float) -> None:
        rnd = state["explore"]
        key = str(bs)
        if rnd is not None and rnd["status"].get(key) == _PENDING:
            ok = outcome == TrialOutcome.REACHED
            rnd["status"][key] = state["explored"][key] = _OK if ok else _FAILED
            if ok:
                rnd["costs"][key] = cost
        self._advance(state)

    def _failed(self, state: PolicyState, bs: int) -> None:
        rnd = state["explore"]
        key = str(bs)
        state["explored"][key] = _FAILED
        if rnd is not None:
            rnd["status"][key] = _FAILED
            rnd["costs"].pop(key, None)
        surviving = state["surviving"]
        if surviving and bs in surviving:
            surviving.remove(bs)
            if not surviving:  # every one failed: as when none reached the target
                surviving.append(self._fallback(state))
        self._advance(state)

    def _aborted(self, state: PolicyState, bs: int) -> None:
        rnd = state["explore"]
        key = str(bs)
        if rnd is not None and rnd["status"].get(key) == _PENDING and bs not in state["in_flight"]:
            del rnd["status"][key]
            if rnd["round"] > 1:  # a later round's candidates all reached the target in the first
                state["explored"][key] = _OK
            else:
                state["explored"].pop(key, None)

    def _view(self, state: PolicyState) -> tuple[str, dict[str, str], list[int]]:
        rnd = state["explore"]
        if rnd is None:
            return "exploit", state["explored"], list(state["surviving"])
        return "explore", state["explored"], [b for b in rnd["candidates"]
                                               if rnd["status"].get(str(b)) != _FAILED]

    # -- Gaussian Thompson sampling --------------------------------------------------------------

    def _stats(self, state: PolicyState, bs: int) -> tuple[float, float, int]:
        """Posterior mean, standard deviation (``inf``: unknown, 0: certain) and count."""
        costs = np.array(self._window(state, bs))
        n = len(costs)
        prior_prec = self.config.prior_precision if self.config.prior_mean is not None else 0.0
        prior_mean = self.config.prior_mean or 0.0
        if n == 0:
            return (prior_mean, 1.0 / math.sqrt(prior_prec), 0) if prior_prec > 0 else (math.nan, math.inf, 0)
        var = float(np.var(costs))
        if n < 2 or var == 0.0:
            return float(costs.mean()), 0.0, n
        prec = 1.0 / var
        post_prec = prior_prec + n * prec
        post_mean = (prior_prec * prior_mean + prec * float(costs.sum())) / post_prec
        return post_mean, 1.0 / math.sqrt(post_prec), n

    def _sample(self, state: PolicyState, rng: np.random.Generator) -> int:
        arms = state["surviving"]
        cold = [b for b in arms if len(self._window(state, b)) < 2]
        if cold:
            return int(cold[int(rng.integers(len(cold)))])
        samples = {}
        for b in arms:
            mean, std, _ = self._stats(state, b)
            samples[b] = mean if std == 0.0 else float(rng.normal(mean, std))
        return min(arms, key=lambda b: (samples[b], b))

    def _posterior(self, state: PolicyState, arms: list[int]) -> dict[int, dict[str, float]]:
        out = {}
        for b in arms:
            mean, std, n = self._stats(state, b)
            if n:
                out[b] = {"mean": mean, "std": std, "n": n}
        return out


@dataclass
class _Fit:
    """joules' cost model fitted to the observations, on the log scale.

    A trial's log cost is its batch size's log cost per epoch plus its log epochs. The cost
    per epoch is nearly deterministic (it is measured over every epoch of every trial); the
    epochs to reach the target vary from run to run. Each batch size's mean log epochs has a
    normal prior shared by all batch sizes (their common mean and spread, estimated from the
    batch sizes explored: empirical Bayes), and the run-to-run variance of log epochs is
    shared too (a scaled inverse chi-square posterior pooled over every batch size).
    """

    log_epoch_cost: dict[int, float]  # each batch size's mean log cost per epoch
    mean_log_epochs: dict[int, float]  # each batch size's observed mean of log epochs
    n: dict[int, int]  # observations of each batch size
    noise_dof: float  # the run-to-run variance of log epochs: scaled inverse chi-square
    noise_scale: float
    spread: float  # variance of the batch sizes' mean log epochs around their common mean
    common: float  # that common mean

    def posterior(self, b: int, noise: float, prior: tuple[float, float] | None) -> tuple[float, float]:
        """Mean and variance of batch size ``b``'s mean log cost, given the noise variance."""
        prec = self.n[b] / noise + 1.0 / self.spread
        num = self.n[b] / noise * self.mean_log_epochs[b] + self.common / self.spread
        if prior is not None:  # the user's prior on the mean cost (log scale)
            mean, p = prior
            num += p * (mean - self.log_epoch_cost[b])
            prec += p
        return self.log_epoch_cost[b] + num / prec, 1.0 / prec


class JoulesPolicy(_BasePolicy):
    """joules' policy: one pruning pass that also stops at costly batch sizes, then Thompson sampling.

    Thompson sampling uses a cost model shared across batch sizes (:class:`_Fit`). See the
    module docstring and ``docs/batch-size.md``. The class attributes were chosen on the NSDI'23
    traces (``benchmarks/recurring.py --ablation`` shows what each part is worth):

    Attributes:
        margin: A direction of the pruning pass goes on past a batch size that reached the
            target only while its estimated cost is within ``1 + margin`` of the best one's.
        extrapolate: A direction also ends before a candidate whose log cost, extrapolated
            linearly in log batch size from the estimates of the two batch sizes before it,
            exceeds the same bound; only where the estimates rose on the last two steps.
        per_epoch: Model the cost as cost per epoch x epochs, the epochs shared across batch
            sizes (``False``: model the log cost itself, with a shared run-to-run variance only).
        noise_prior: Prior run-to-run standard deviation of log epochs (or log cost) ...
        noise_prior_weight: ... worth this many observations.
        spread_prior: Prior standard deviation of the batch sizes' mean log epochs ...
        spread_prior_weight: ... worth this many batch sizes.
        temperature: Thompson sampling draws each batch size's mean log cost with this
            times its posterior variance (1: plain Thompson sampling). Below 1, it explores
            less among batch sizes whose estimates are close.
        up_first_fraction: The pass goes upwards first when the default's trial reached the
            target within this fraction of ``max_epochs`` (0: never).
        up_first_to_end: That upward direction goes on to the end (or a failure), not ended
            by the estimated costs (``False``: ended like any direction).
    """

    margin = 0.15
    per_epoch = True
    noise_prior = 0.1
    noise_prior_weight = 2.0
    spread_prior = 0.1
    spread_prior_weight = 1.0
    extrapolate = True
    temperature = 0.25
    up_first_fraction = 1 / 3
    up_first_to_end = True

    def _initial(self) -> dict[str, Any]:
        return {"status": {}}  # batch size (str) -> ok/failed/pending; absent: not explored

    def _arms(self, state: PolicyState) -> list[int]:
        return [b for b in self.batch_sizes if state["status"].get(str(b)) == _OK]

    def _fit(self, state: PolicyState, arms: list[int]) -> _Fit:
        epoch_cost: dict[int, float] = {}
        mean_log_epochs: dict[int, float] = {}
        n: dict[int, int] = {}
        ss = 0.0
        dof = 0
        w = self.config.window_size
        for b in arms:
            obs = [(c, e) for x, _, c, e in state["history"] if x == b]
            obs = obs[-w:] if w else obs
            if self.per_epoch:
                # A trial reported without its epochs counts as one epoch.
                y = np.log([max(e, 1) for _, e in obs])
                epoch_cost[b] = float(np.mean([math.log(max(c, 1e-300) / max(e, 1)) for c, e in obs]))
            else:
                y = np.log([max(c, 1e-300) for c, _ in obs])
                epoch_cost[b] = 0.0
            mean_log_epochs[b] = float(y.mean())
            n[b] = len(y)
            ss += float(((y - y.mean()) ** 2).sum())
            dof += len(y) - 1
        nu = self.noise_prior_weight + dof
        scale = (self.noise_prior_weight * self.noise_prior**2 + ss) / nu
        means = np.array([mean_log_epochs[b] for b in arms])
        k = len(arms)
        if not self.per_epoch:  # no shrinkage of log costs across batch sizes
            return _Fit(epoch_cost, mean_log_epochs, n, nu, scale, math.inf, 0.0)
        between = 0.0
        if k >= 2:
            between = max(0.0, float(means.var(ddof=1)) - scale * float(np.mean([1 / n[b] for b in arms])))
        w0 = self.spread_prior_weight
        spread = (w0 * self.spread_prior**2 + (k - 1) * between) / (w0 + k - 1)
        return _Fit(epoch_cost, mean_log_epochs, n, nu, scale, max(spread, 1e-12), float(means.mean()))

    def _prior(self) -> tuple[float, float] | None:
        cfg = self.config
        if cfg.prior_mean is not None and cfg.prior_mean > 0 and cfg.prior_precision > 0:
            # The prior on the mean cost, moved to the log scale (delta method).
            return math.log(cfg.prior_mean), cfg.prior_precision * cfg.prior_mean**2
        return None

    def _pass(self, state: PolicyState) -> tuple[int | None, set[int]]:
        """The next candidate of the pruning pass if one is free, and those it may still try."""
        status = state["status"]
        arms = self._arms(state)
        if arms:
            fit = self._fit(state, arms)
            prior = self._prior()
            est = {b: fit.posterior(b, fit.noise_scale, prior)[0] for b in arms}
            bound = min(est.values()) + math.log1p(self.margin)
        start = self.config.default_batch_size
        down = [b for b in reversed(self.batch_sizes) if b <= start]
        up = [start, *(b for b in self.batch_sizes if b > start)]
        free: int | None = None
        ahead: set[int] = set()
        directions = [(down, 0, True), (up, 1, True)]
        if self._up_first(state):  # upwards first (by default to the end, or a failure)
            directions = [(up, 1, not self.up_first_to_end), (down, 0, True)]
        for order, first, judged in directions:
            for i in range(first, len(order)):
                b = order[i]
                s = status.get(str(b))
                if s == _OK:
                    continue
                if s is None:
                    prev = order[i - 1] if i and judged else None
                    if not (prev is None or status.get(str(prev)) != _OK or est[prev] <= bound):
                        break  # past a batch size that costs too much: the direction ends
                    if (self.extrapolate and prev is not None and status.get(str(prev)) == _OK
                            and self._predicted(prev, b, est, status) > bound):
                        break  # the trend of the estimates predicts a costly batch size: it ends
                    if free is None:
                        free = b
                elif s == _FAILED:
                    if i == 0:  # the default: where both directions start, it ends neither
                        continue
                    break
                for c in order[i:]:  # what the direction may still try (up to a failure)
                    if status.get(str(c)) == _FAILED:
                        break
                    if status.get(str(c)) is None:
                        ahead.add(c)
                break
        return free, ahead

    def _up_first(self, state: PolicyState) -> bool:
        """Whether the default's trial left room for larger batch sizes: explore upwards first.

        Larger batch sizes usually need more epochs to reach the target. A default that needed
        most of ``max_epochs`` leaves little room above it, so the pass goes downwards first (as
        the original); one that reached the target within ``up_first_fraction`` of them goes
        upwards first. Decided on the default's first trial that reached the target.
        """
        max_epochs = self.config.max_epochs
        if max_epochs is None or self.up_first_fraction <= 0:
            return False
        start = self.config.default_batch_size
        for b, outcome, _, epochs in state["history"]:
            if b == start and outcome == TrialOutcome.REACHED:
                return 0 < epochs <= self.up_first_fraction * max_epochs
        return False

    def _predicted(self, prev: int, b: int, est: dict[int, float], status: dict[str, str]) -> float:
        """``b``'s log cost extrapolated from the trend of the two steps before it (``-inf``: none).

        ``b`` lies beyond ``prev``; ``p1`` and ``p2`` are the next batch sizes behind ``prev``
        (possibly on the other side of the default). The trend counts only where the estimates
        rose on both steps, ``p2 -> p1 -> prev`` (one rise can be one unlucky trial's doing),
        and is linear in log batch size through ``p1`` and ``prev``.
        """
        bs = self.batch_sizes
        i = bs.index(prev)
        back = -1 if b > prev else 1
        if not 0 <= i + 2 * back < len(bs):
            return -math.inf
        p1, p2 = bs[i + back], bs[i + 2 * back]
        if any(status.get(str(c)) != _OK or c not in est for c in (prev, p1, p2)):
            return -math.inf
        if not est[prev] > est[p1] > est[p2]:
            return -math.inf
        slope = (est[prev] - est[p1]) / (math.log(prev) - math.log(p1))
        return est[prev] + slope * (math.log(b) - math.log(prev))

    def _free(self, state: PolicyState) -> int | None:
        return self._pass(state)[0]

    def _choose(self, state: PolicyState, rng: np.random.Generator) -> tuple[int, str]:
        free = self._free(state)
        if free is not None:
            state["status"][str(free)] = _PENDING
            return free, "explore"
        arms = self._arms(state)
        if not arms:  # nothing reached the target yet: the default (whose trial may be in flight)
            return self._fallback(state), "explore"
        fit = self._fit(state, arms)
        noise = fit.noise_dof * fit.noise_scale / float(rng.chisquare(fit.noise_dof))
        prior = self._prior()
        samples = {}
        for b in arms:
            m, v = fit.posterior(b, noise, prior)
            samples[b] = float(rng.normal(m, math.sqrt(v * self.temperature)))
        return min(arms, key=lambda b: (samples[b], b)), "exploit"

    def _learn(self, state: PolicyState, bs: int, outcome: TrialOutcome, cost: float) -> None:
        key = str(bs)
        if state["status"].get(key) in (None, _PENDING):
            state["status"][key] = _OK if outcome == TrialOutcome.REACHED else _FAILED

    def _aborted(self, state: PolicyState, bs: int) -> None:
        key = str(bs)
        if state["status"].get(key) == _PENDING and bs not in state["in_flight"]:
            del state["status"][key]

    def _failed(self, state: PolicyState, bs: int) -> None:
        state["status"][str(bs)] = _FAILED  # (also one that reached the target before)

    def _view(self, state: PolicyState) -> tuple[str, dict[str, str], list[int]]:
        status = state["status"]
        free, ahead = self._pass(state)
        exploring = free is not None or _PENDING in status.values()
        return ("explore" if exploring else "exploit"), dict(status), [
            b for b in self.batch_sizes if status.get(str(b)) in (_OK, _PENDING) or b in ahead]

    def _posterior(self, state: PolicyState, arms: list[int]) -> dict[int, dict[str, float]]:
        arms = [b for b in arms if state["status"].get(str(b)) == _OK]
        if not arms:
            return {}
        fit = self._fit(state, arms)
        prior = self._prior()
        out = {}
        for b in arms:
            m, v = fit.posterior(b, fit.noise_scale, prior)
            mean = math.exp(m + v / 2 + fit.noise_scale / 2)
            out[b] = {"mean": mean, "std": mean * math.sqrt(math.expm1(v)), "n": fit.n[b]}
        return out
