"""A small, deterministic batch-size policy for tests of the server (not for real use).

It counts what it is told, so that a test can check that no trial was handed out or observed
twice or lost: ``started`` (decisions made), ``observed`` and ``aborted`` (results seen),
and per batch size the costs of the trials that reached the target.
"""

from __future__ import annotations

from joules.optimizers.batch_size.types import (
    Decision,
    Policy,
    PolicyConfig,
    PolicyState,
    PolicySummary,
    TrialOutcome,
    TrialResult,
)


class CountingPolicy(Policy):
    """Try every batch size once, in order, then always the one with the lowest mean cost."""

    def initial_state(self) -> PolicyState:
        return {"started": 0, "observed": 0, "aborted": 0, "costs": {}, "failed": [], "outcomes": {}}

    def next_trial(self, state: PolicyState) -> tuple[PolicyState, Decision]:
        state = {**state, "started": state["started"] + 1}
        sizes = self.config.batch_sizes
        n = state["started"] - 1
        if n < len(sizes):
            return state, Decision(batch_size=sizes[n], phase="explore", stop_cost=self.stop_cost(state))
        return state, Decision(batch_size=self._best(state) or self.config.default_batch_size,
                               phase="exploit", stop_cost=self.stop_cost(state))

    def observe(self, state: PolicyState, result: TrialResult) -> PolicyState:
        outcomes = dict(state["outcomes"])
        outcomes[result.outcome.value] = outcomes.get(result.outcome.value, 0) + 1
        state = {**state, "outcomes": outcomes}
        if result.outcome is TrialOutcome.ABORTED:
            return {**state, "aborted": state["aborted"] + 1}
        state["observed"] = state["observed"] + 1
        key = str(result.batch_size)
        if result.outcome is TrialOutcome.REACHED:
            costs = {k: list(v) for k, v in state["costs"].items()}
            costs.setdefault(key, []).append(result.cost)
            state["costs"] = costs
        elif key not in state["failed"]:
            state["failed"] = [*state["failed"], key]
        return state

    def stop_cost(self, state: PolicyState) -> float | None:
        best = min((c for v in state["costs"].values() for c in v), default=None)
        return None if best is None else self.config.beta * best

    def _best(self, state: PolicyState) -> int | None:
        means = {int(k): sum(v) / len(v) for k, v in state["costs"].items() if v}
        return min(means, key=lambda b: (means[b], b)) if means else None

    def summary(self, state: PolicyState) -> PolicySummary:
        explored = {b: "pending" for b in self.config.batch_sizes}
        for k in state["costs"]:
            explored[int(k)] = "ok"
        for k in state["failed"]:
            explored.setdefault(int(k), "failed")
            if explored[int(k)] == "pending":
                explored[int(k)] = "failed"
        posterior = {}
        for k, v in state["costs"].items():
            mean = sum(v) / len(v)
            std = (sum((c - mean) ** 2 for c in v) / len(v)) ** 0.5
            posterior[int(k)] = {"mean": mean, "std": std, "n": len(v)}
        best = self._best(state)
        return PolicySummary(
            phase="explore" if state["started"] < len(self.config.batch_sizes) else "exploit",
            explored=explored,
            surviving=[b for b in self.config.batch_sizes if explored[b] != "failed"],
            posterior=posterior,
            best_batch_size=best,
            best_cost=None if best is None else posterior[best]["mean"],
        )


def make_counting_policy(config: PolicyConfig) -> Policy:
    """A :class:`CountingPolicy` (the server's ``policy_factory`` signature)."""
    return CountingPolicy(config)


COUNTING_SEED = 2**62
"""Jobs whose seed is at least this get a :class:`CountingPolicy` from :func:`make_test_policy`."""


def make_test_policy(config: PolicyConfig) -> Policy:
    """A :class:`CountingPolicy` for jobs with ``seed >= COUNTING_SEED``, else joules' own policy.

    Lets one test server run both: ``joules serve --policy-factory
    joules.testing.batch_size_policy:make_test_policy``. Falls back to the counting policy
    while ``joules.optimizers.batch_size.policy`` is not there.
    """
    if config.seed is not None and config.seed >= COUNTING_SEED:
        return CountingPolicy(config)
    try:
        from joules.optimizers.batch_size.policy import make_policy
    except ImportError:  # pragma: no cover - only before the policy module exists
        return CountingPolicy(config)
    return make_policy(config)
