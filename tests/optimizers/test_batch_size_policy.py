"""Batch-size policies: pruning exploration, Thompson sampling, state keeping, concurrency."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from joules.optimizers.batch_size.policy import JoulesPolicy, NSDI23Policy, make_policy
from joules.optimizers.batch_size.types import Policy, PolicyConfig, PolicyState, TrialOutcome, TrialResult

R, M, E, A = TrialOutcome.REACHED, TrialOutcome.MAX_EPOCHS, TrialOutcome.EARLY_STOPPED, TrialOutcome.ABORTED

# A synthetic job: 8, 16 and 256 never reach the target; 32 is the cheapest.
COSTS = {8: None, 16: None, 32: 10.0, 64: 11.0, 128: 15.0, 256: None}


def config(variant: str, **kw: object) -> PolicyConfig:
    args: dict[str, object] = {"batch_sizes": (8, 16, 32, 64, 128, 256), "default_batch_size": 64,
                               "seed": 7, "variant": variant}
    args.update(kw)
    return PolicyConfig(**args)  # type: ignore[arg-type]


def result(bs: int, costs: dict[int, float | None] = COSTS, epochs: int = 10) -> TrialResult:
    cost = costs[bs]
    if cost is None:
        return TrialResult(bs, M, 50.0, epochs=100)
    return TrialResult(bs, R, cost, epochs=epochs)


def drive(policy: Policy, trials: int, costs: dict[int, float | None] = COSTS,
          epochs: dict[int, int] | None = None) -> tuple[list[tuple[int, str]], PolicyState]:
    """Run ``trials`` trials one after another: the (batch size, phase) handed out, and the state."""
    state = policy.initial_state()
    seen = []
    for _ in range(trials):
        state, d = policy.next_trial(state)
        seen.append((d.batch_size, d.phase))
        state = policy.observe(state, result(d.batch_size, costs, epochs[d.batch_size] if epochs else 10))
    return seen, state


def run(variant: str, trials: int, **kw: object) -> tuple[list[tuple[int, str]], PolicyState]:
    return drive(make_policy(config(variant, **kw)), trials)


def test_make_policy_and_bad_configs() -> None:
    assert isinstance(make_policy(config("nsdi23")), NSDI23Policy)
    assert isinstance(make_policy(config("joules")), JoulesPolicy)
    assert isinstance(make_policy(PolicyConfig((32, 64), 64)), JoulesPolicy)  # the default variant
    for kw, match in [({"variant": "zeus"}, "unknown policy variant"),
                      ({"default_batch_size": 48}, "not one of batch_sizes"),
                      ({"default_batch_size": np.int64(64)}, "default_batch_size must be an integer"),
                      ({"batch_sizes": (32, np.int64(64))}, "batch_sizes must be positive integers"),
                      ({"batch_sizes": (32, 32, 64)}, "distinct"),
                      ({"batch_sizes": ()}, "empty"),
                      ({"eta": 1.5}, "eta"), ({"beta": 1.0}, "beta"), ({"window_size": -1}, "window_size"),
                      ({"window_size": 1.5}, "window_size must be an integer"),
                      ({"max_epochs": 0}, "max_epochs")]:
        with pytest.raises(ValueError, match=match):
            make_policy(config(kw.pop("variant", "nsdi23"), **kw))  # type: ignore[arg-type]


def test_nsdi23_explores_down_then_up_in_two_rounds_and_prunes_failures() -> None:
    seen, state = run("nsdi23", 9)
    # Round 1 from the default: down until 16 fails, then up until 256 fails.
    # Round 2 over the survivors (32, 64, 128), from the cheapest (32): down, then up.
    assert seen == [(64, "explore"), (32, "explore"), (16, "explore"), (128, "explore"), (256, "explore"),
                    (32, "explore"), (64, "explore"), (128, "explore"), (32, "exploit")]
    s = make_policy(config("nsdi23")).summary(state)
    assert s.phase == "exploit" and s.surviving == [32, 64, 128]
    assert s.explored == {16: "failed", 32: "ok", 64: "ok", 128: "ok", 256: "failed"}  # 8 never tried
    assert s.best_batch_size == 32 and s.best_cost == 10.0
    # Equal costs: the posterior is certain (the original's known-variance model).
    assert s.posterior[32] == {"mean": 10.0, "std": 0.0, "n": 3}


def test_joules_explores_once_and_stops_a_direction_at_a_costly_batch_size() -> None:
    assert make_policy(config("joules")).summary(make_policy(config("joules")).initial_state()).surviving == [
        8, 16, 32, 64, 128, 256]
    seen, state = run("joules", 6)
    # One pass: down until 16 fails; up to 128, which costs more than 1.15 x 32's cost: the
    # direction stops there (256 is never tried). Then Thompson sampling.
    assert [b for b, _ in seen[:4]] == [64, 32, 16, 128]
    assert [p for _, p in seen] == ["explore"] * 4 + ["exploit"] * 2
    costly = {8: 2.0, 16: 2.0, 32: 30.0, 64: 10.0, 128: 9.0, 256: 20.0}
    policy = make_policy(config("joules"))
    seen, state = drive(policy, 5, costly)
    # 32 costs 3x the best: the downward direction stops there (16 and 8 are never tried,
    # though cheap), 32 stays a candidate; upwards 256 costs > 1.15 x 128's: stop there.
    assert [b for b, _ in seen[:4]] == [64, 32, 128, 256]
    assert policy.summary(state).explored == {32: "ok", 64: "ok", 128: "ok", 256: "ok"}
    assert policy.summary(state).surviving == [32, 64, 128, 256]
    # A default far costlier than a smaller batch size: the upward direction is not started.
    costly = {8: None, 16: 30.0, 32: 10.0, 64: 30.0, 128: 1.0, 256: 1.0}
    order, _ = drive(policy, 6, costly)
    assert order[:3] == [(64, "explore"), (32, "explore"), (16, "explore")]
    assert all(p == "exploit" and b in (16, 32, 64) for b, p in order[3:])


def test_joules_goes_on_exploring_past_a_default_that_failed() -> None:
    # The default (the largest here) ran out of epochs once: the other batch sizes must still
    # be tried, not the failed default handed out again and again.
    policy = make_policy(PolicyConfig(batch_sizes=(32, 64, 128, 256), default_batch_size=256, seed=1,
                                      max_epochs=10, variant="joules"))
    state, chosen = policy.initial_state(), []
    for _ in range(8):
        state, d = policy.next_trial(state)
        chosen.append(d.batch_size)
        failed = d.batch_size == 256
        state = policy.observe(state, TrialResult(
            d.batch_size, TrialOutcome.MAX_EPOCHS if failed else TrialOutcome.REACHED,
            cost=100.0 if failed else 30.0 + d.batch_size / 32, epochs=10 if failed else 5))
    assert chosen[:4] == [256, 128, 64, 32] and 256 not in chosen[1:]
    summary = policy.summary(state)
    assert summary.phase == "exploit" and summary.surviving == [32, 64, 128]


def test_joules_ends_a_direction_before_a_candidate_the_rising_trend_predicts_costly() -> None:
    # Downwards the cost rises on two steps (64: 10, 32: 10.5, 16: 11.2): the trend, linear in
    # log batch size, predicts 11.2^2 / 10.5 = 11.9 for 8, above 1.15 x 10; 8 is never tried,
    # though 16 itself is within the bound. Upwards the cost fell before rising (32 -> 64 ->
    # 128): no trend, so 256 is tried (and fails).
    costs = {8: 14.0, 16: 11.2, 32: 10.5, 64: 10.0, 128: 10.5, 256: None}

    def order(policy: JoulesPolicy) -> list[int]:
        return [b for b, _ in drive(policy, 7, costs)[0]]

    assert order(JoulesPolicy(config("joules")))[:5] == [64, 32, 16, 128, 256]
    assert 8 not in order(JoulesPolicy(config("joules")))
    no_trend = type("NoTrend", (JoulesPolicy,), {"extrapolate": False})(config("joules"))
    assert order(no_trend)[:6] == [64, 32, 16, 8, 128, 256]


def test_joules_explores_upwards_first_and_to_the_end_when_the_default_needed_few_epochs() -> None:
    # The default (64) needs 10 of 100 epochs: room above it. Upwards first and to the end,
    # though 128 costs more than 1.15 x 64's (it needed an unlucky 20 epochs); then downwards
    # from the default, whose cost is now more than 1.15 x the best's (256): not started.
    costs = {8: 9.0, 16: 9.0, 32: 9.0, 64: 10.0, 128: 13.0, 256: 4.0}
    epochs = {8: 10, 16: 10, 32: 10, 64: 10, 128: 20, 256: 10}

    def order(**kw: object) -> list[tuple[int, str]]:
        return drive(make_policy(config("joules", **kw)), 5, costs, epochs)[0]

    up_first = [(64, "explore"), (128, "explore"), (256, "explore"), (256, "exploit"), (256, "exploit")]
    assert order(max_epochs=100) == up_first
    # Unknown max epochs, or a default that needed more than a third of them: downwards first,
    # and the cost of 128 ends the upward direction.
    for kw in ({}, {"max_epochs": 25}):
        assert [b for b, _ in order(**kw)[:5]] == [64, 32, 16, 8, 128]


def noisy_job(bs: int, rng: np.random.Generator) -> TrialResult:
    """Cost per epoch falls with the batch size, epochs rise: 64 is the cheapest (17.6)."""
    per_epoch = {16: 4.0, 32: 2.5, 64: 1.6, 128: 1.0, 256: 0.7}[bs]
    epochs = {16: 10, 32: 10, 64: 11, 128: 20, 256: 40}[bs] + int(rng.integers(-2, 3))
    return TrialResult(bs, R, per_epoch * epochs * float(rng.normal(1.0, 0.03)), epochs=epochs)


@pytest.mark.parametrize("variant", ["nsdi23", "joules"])
def test_thompson_sampling_converges_to_the_cheapest_batch_size(variant: str) -> None:
    policy = make_policy(PolicyConfig((16, 32, 64, 128, 256), 128, seed=3, variant=variant))
    state = policy.initial_state()
    rng = np.random.default_rng(0)
    chosen = []
    for _ in range(150):
        state, d = policy.next_trial(state)
        chosen.append(d.batch_size)
        state = policy.observe(state, noisy_job(d.batch_size, rng))
    late = Counter(chosen[-50:])
    assert late[64] >= 45, late
    s = policy.summary(state)
    assert s.phase == "exploit"
    assert min(s.posterior, key=lambda b: s.posterior[b]["mean"]) == 64
    assert abs(s.posterior[64]["mean"] - 17.6) < 1.0


def close_job(bs: int, rng: np.random.Generator) -> TrialResult:
    """Two batch sizes 4 % apart per epoch, with noisy epochs (4 or 5): 64 is the cheaper."""
    epochs = 5 if rng.random() < 0.3 else 4
    return TrialResult(bs, R, {64: 1.0, 128: 1.04}[bs] * epochs, epochs=epochs)


def test_joules_temperature_below_one_explores_less_among_close_batch_sizes() -> None:
    def worse_picks(temperature: float) -> int:
        cls = type("Tempered", (JoulesPolicy,), {"temperature": temperature})
        picks = 0
        for seed in range(10):
            policy = cls(PolicyConfig((64, 128), 64, seed=seed))
            state = policy.initial_state()
            rng = np.random.default_rng(seed)
            for _ in range(60):
                state, d = policy.next_trial(state)
                picks += d.phase == "exploit" and d.batch_size == 128
                state = policy.observe(state, close_job(d.batch_size, rng))
        return picks

    assert JoulesPolicy.temperature == 0.25
    plain, tempered = worse_picks(1.0), worse_picks(0.5)
    assert tempered < 0.8 * plain, (tempered, plain)


@pytest.mark.parametrize("variant", ["nsdi23", "joules"])
def test_same_seed_same_decisions_and_state_json_round_trip_mid_run(variant: str) -> None:
    policy = make_policy(PolicyConfig((16, 32, 64, 128, 256), 128, seed=11, variant=variant))

    def drive(state: PolicyState, n: int, seed: int) -> tuple[list[int], PolicyState]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            state, d = policy.next_trial(state)
            out.append(d.batch_size)
            state = policy.observe(state, noisy_job(d.batch_size, rng))
        return out, state

    first, mid = drive(policy.initial_state(), 30, 1)
    assert drive(policy.initial_state(), 30, 1)[0] == first  # deterministic
    text = json.dumps(mid)
    restored = json.loads(text)
    assert restored == mid and json.dumps(restored) == text  # exact round trip, no NaN or inf
    rest_a, end_a = drive(mid, 40, 2)
    rest_b, end_b = drive(restored, 40, 2)
    assert rest_a == rest_b and end_a == end_b
    assert len(set(rest_a)) >= 1 and policy.summary(end_a).phase == "exploit"
    # Another seed explores the same way but samples differently.
    other = make_policy(PolicyConfig((16, 32, 64, 128, 256), 128, seed=12, variant=variant))
    s_other = other.initial_state()
    assert s_other["rng"] != policy.initial_state()["rng"]
    # The call does not change the state it was given.
    snapshot = json.dumps(mid)
    policy.next_trial(mid)
    policy.observe(mid, TrialResult(64, R, 17.0, epochs=11))
    assert json.dumps(mid) == snapshot


def test_state_of_another_variant_is_refused() -> None:
    state = make_policy(config("joules")).initial_state()
    with pytest.raises(ValueError, match="nsdi23"):
        make_policy(config("nsdi23")).next_trial(state)


@pytest.mark.parametrize("variant", ["nsdi23", "joules"])
def test_sliding_window_keeps_the_last_observations(variant: str) -> None:
    policy = make_policy(PolicyConfig((32, 64), 64, seed=1, window_size=3, variant=variant))
    state = policy.initial_state()
    costs = {32: 50.0, 64: 10.0}
    for _ in range(8):  # explore both, then settle on 64
        state, d = policy.next_trial(state)
        state = policy.observe(state, TrialResult(d.batch_size, R, costs[d.batch_size], epochs=10))
    s = policy.summary(state)
    assert all(p["n"] <= 3 for p in s.posterior.values())
    # Data drift: 64 becomes expensive; within a few recurrences the window forgets.
    costs = {32: 50.0, 64: 100.0}
    picks = []
    for _ in range(25):
        state, d = policy.next_trial(state)
        picks.append(d.batch_size)
        state = policy.observe(state, TrialResult(d.batch_size, R, costs[d.batch_size], epochs=10))
    assert picks[-5:] == [32] * 5
    assert policy.summary(state).posterior[64]["n"] == 3
    if variant == "nsdi23":
        assert policy.summary(state).posterior[64]["mean"] == 100.0  # the last 3 costs only


@pytest.mark.parametrize("variant", ["joules", "nsdi23"])
def test_with_a_window_the_stop_bound_follows_costs_that_drift_up(variant: str) -> None:
    # Every epoch costs 2.5x after the data grew: a bound of beta x the old best would stop
    # every trial for ever; the windows' bound lets trials reach the target again.
    policy = make_policy(PolicyConfig(batch_sizes=(32, 64, 128), default_batch_size=64, seed=1,
                                      window_size=3, beta=2.0, max_epochs=20, variant=variant))
    per_epoch = {32: 1.2, 64: 1.0, 128: 1.1}

    def trial(state: PolicyState, factor: float) -> tuple[PolicyState, TrialOutcome]:
        state, d = policy.next_trial(state)
        bound, cost = d.stop_cost, 0.0
        for epoch in range(1, 21):  # stopped before an epoch that would cross the bound
            cost += per_epoch[d.batch_size] * factor
            if epoch == 10:
                outcome = TrialOutcome.REACHED
                break
            if bound is not None and cost + per_epoch[d.batch_size] * factor > bound:
                outcome = TrialOutcome.EARLY_STOPPED
                break
        return policy.observe(state, TrialResult(d.batch_size, outcome, cost, epochs=epoch)), outcome

    state = policy.initial_state()
    for _ in range(10):
        state, _ = trial(state, 1.0)
    assert policy.stop_cost(state) == pytest.approx(20.0)
    outcomes = []
    for _ in range(30):
        state, outcome = trial(state, 2.5)
        outcomes.append(outcome)
    assert outcomes[:3] == [TrialOutcome.EARLY_STOPPED] * 3
    assert outcomes[-10:] == [TrialOutcome.REACHED] * 10
    assert policy.stop_cost(state) == pytest.approx(50.0)


def test_nsdi23_window_posterior_is_the_windows_mean() -> None:
    policy = make_policy(PolicyConfig((32, 64), 64, seed=1, window_size=2, variant="nsdi23"))
    state = policy.initial_state()
    for cost in (10.0, 20.0, 30.0, 40.0):
        state, _ = policy.next_trial(state)
        state = policy.observe(state, TrialResult(64, R, cost))
    post = policy.summary(state).posterior[64]
    assert post["n"] == 2 and post["mean"] == 35.0 and post["std"] == pytest.approx(5.0 / np.sqrt(2))


def test_nsdi23_concurrent_trials() -> None:
    policy = make_policy(config("nsdi23"))
    state = policy.initial_state()
    state, a = policy.next_trial(state)
    state, b = policy.next_trial(state)  # 64 in flight: the down direction waits; up is free
    state, c = policy.next_trial(state)  # nothing free, nothing reached yet: the round's start
    assert (a.batch_size, b.batch_size, c.batch_size) == (64, 128, 64)
    assert state["in_flight"] == [64, 128, 64]
    state = policy.observe(state, result(128))  # 128 reached: up goes on to 256
    state, d = policy.next_trial(state)
    assert d.batch_size == 256
    state = policy.observe(state, result(64))  # the first result for 64 decides its step
    state, e = policy.next_trial(state)
    assert e.batch_size == 32 and e.phase == "explore"
    state = policy.observe(state, result(64))  # the second 64 trial: learned, not a step
    state, f = policy.next_trial(state)  # 32 and 256 in flight: best guess, the cheapest so far
    assert f.batch_size == 64 and f.stop_cost == 2.0 * 11.0
    assert sorted(state["in_flight"]) == [32, 64, 256]
    assert [h[0] for h in state["history"]] == [128, 64, 64]


def test_joules_concurrent_trials_use_thompson_sampling_when_nothing_is_free() -> None:
    policy = make_policy(config("joules"))
    state = policy.initial_state()
    picks = []
    for _ in range(3):
        state, d = policy.next_trial(state)
        picks.append((d.batch_size, d.phase))
    assert picks == [(64, "explore"), (128, "explore"), (64, "explore")]
    costs = {**COSTS, 128: 12.5}  # within 1.15 x 64's cost: the upward direction goes on
    state = policy.observe(state, result(64, costs))
    state = policy.observe(state, result(128, costs))
    state, d = policy.next_trial(state)
    assert d.batch_size == 32  # downwards first
    state, d = policy.next_trial(state)
    assert d.batch_size == 256  # then upwards
    state, d = policy.next_trial(state)  # 32 and 256 in flight: a draw among 64 and 128
    assert d.phase == "exploit" and d.batch_size in (64, 128)
    state = policy.observe(state, result(256, costs))  # failed: pruned
    state = policy.observe(state, result(32, costs))
    s = policy.summary(state)
    assert s.explored == {32: "ok", 64: "ok", 128: "ok", 256: "failed"}
    assert s.phase == "explore" and s.surviving == [8, 16, 32, 64, 128]  # 16 and 8 are still ahead


@pytest.mark.parametrize("variant", ["nsdi23", "joules"])
def test_early_stopping_threshold_is_beta_times_the_best_reached_cost(variant: str) -> None:
    policy = make_policy(config(variant, beta=3.0))
    state = policy.initial_state()
    assert policy.stop_cost(state) is None
    state, d = policy.next_trial(state)
    assert d.stop_cost is None
    state = policy.observe(state, TrialResult(64, R, 12.0, epochs=10))
    assert policy.stop_cost(state) == 36.0
    state, d = policy.next_trial(state)
    assert d.stop_cost == 36.0
    state = policy.observe(state, TrialResult(d.batch_size, E, 5.0, epochs=1))  # not a reached cost
    assert policy.stop_cost(state) == 36.0
    state, d = policy.next_trial(state)
    state = policy.observe(state, TrialResult(d.batch_size, R, 10.0, epochs=10))
    assert policy.stop_cost(state) == 30.0
    assert policy.summary(state).best_cost == 10.0


@pytest.mark.parametrize("variant", ["nsdi23", "joules"])
def test_aborted_trials_teach_nothing_and_free_their_slot(variant: str) -> None:
    policy = make_policy(config(variant))
    state = policy.initial_state()
    state, d = policy.next_trial(state)
    assert d.batch_size == 64
    state = policy.observe(state, TrialResult(64, A, 3.0))
    assert state["history"] == [] and state["in_flight"] == []
    state, d = policy.next_trial(state)
    assert d.batch_size == 64  # handed out again
    state, d2 = policy.next_trial(state)  # 128 (up)
    state, d3 = policy.next_trial(state)  # 64 again (nothing free)
    assert (d2.batch_size, d3.batch_size) == (128, 64)
    state = policy.observe(state, TrialResult(64, A, 0.0))
    assert 64 in state["in_flight"] and policy.summary(state).explored.get(64) == "pending"
    state = policy.observe(state, TrialResult(64, A, 0.0))
    assert 64 not in state["in_flight"] and 64 not in policy.summary(state).explored
    state, d = policy.next_trial(state)
    assert d.batch_size == 64


def test_nsdi23_second_round_abort_keeps_the_first_rounds_verdict() -> None:
    policy = make_policy(PolicyConfig((16, 32, 64), 32, seed=0, variant="nsdi23"))
    state = policy.initial_state()
    costs = {16: 90.0, 32: 100.0, 64: 120.0}
    while state["explore"]["round"] == 1:
        state, d = policy.next_trial(state)
        state = policy.observe(state, TrialResult(d.batch_size, R, costs[d.batch_size], epochs=3))
    assert policy.summary(state).explored == {16: "ok", 32: "ok", 64: "ok"}
    state, d = policy.next_trial(state)  # round 2 starts from the cheapest
    assert d.batch_size == 16 and policy.summary(state).explored[16] == "pending"
    state = policy.observe(state, TrialResult(16, A, 0.0))
    assert policy.summary(state).explored == {16: "ok", 32: "ok", 64: "ok"}
    state, d = policy.next_trial(state)
    assert d.batch_size == 16  # handed out again


def test_observe_rejects_unknown_batch_sizes_and_bad_costs() -> None:
    policy = make_policy(config("joules"))
    state = policy.initial_state()
    with pytest.raises(ValueError, match="not one of"):
        policy.observe(state, TrialResult(48, R, 1.0))
    with pytest.raises(ValueError, match="finite"):
        policy.observe(state, TrialResult(64, R, float("nan")))
    with pytest.raises(ValueError, match="trial epochs must be a finite number, got nan"):
        policy.observe(state, TrialResult(64, R, 1.0, epochs=float("nan")))  # type: ignore[arg-type]


def test_a_numpy_batch_size_keeps_the_state_json_serializable() -> None:
    import json

    policy = make_policy(config("joules"))
    state = policy.observe(policy.initial_state(), TrialResult(np.int64(64), R, 1.0, epochs=np.int64(3)))
    again = json.loads(json.dumps(state))
    assert again["history"] == [[64, R.value, 1.0, 3]]


@pytest.mark.parametrize("variant", ["nsdi23", "joules"])
def test_a_strong_prior_moves_the_posterior(variant: str) -> None:
    cfg = dict(batch_sizes=(32, 64), default_batch_size=64, seed=1, variant=variant)
    flat = make_policy(PolicyConfig(**cfg))  # type: ignore[arg-type]
    strong = make_policy(PolicyConfig(**cfg, prior_mean=100.0, prior_precision=1.0))  # type: ignore[arg-type]
    for policy in (flat, strong):
        state = policy.initial_state()
        for cost in (10.0, 12.0, 11.0, 13.0):
            state, _ = policy.next_trial(state)
            state = policy.observe(state, TrialResult(64, R, cost, epochs=10))
        post = policy.summary(state).posterior[64]
        if policy is flat:
            assert post["mean"] == pytest.approx(11.5, rel=0.02)
        else:
            assert post["mean"] > 20.0


@pytest.mark.parametrize("variant", ["joules", "nsdi23"])
def test_a_batch_size_that_fails_is_never_handed_out_again(variant: str) -> None:
    """A batch size that runs out of memory, ended as aborted (all a client could say), was
    handed out in every recurrence; failed, it is pruned, also after it once reached the target."""
    policy = make_policy(config(variant))
    _, state = drive(policy, 30)
    assert policy.summary(state).explored[128] == "ok"
    # 128 cannot run any more (a larger model, say): a client's trial of it fails.
    state = policy.observe(state, TrialResult(128, TrialOutcome.FAILED, 0.0, epochs=0))
    assert policy.summary(state).explored[128] == "failed" and 128 not in policy.summary(state).surviving
    seen = []
    for _ in range(200):
        state, d = policy.next_trial(state)
        seen.append(d.batch_size)
        state = policy.observe(state, result(d.batch_size))
    assert 128 not in seen and set(seen) <= {32, 64}
    json.dumps(state)  # still a JSON state
    # Failed before it ever ran: pruned like a batch size that cannot reach the target.
    state = policy.initial_state()
    state, d = policy.next_trial(state)
    state = policy.observe(state, TrialResult(d.batch_size, TrialOutcome.FAILED, 0.0, epochs=0))
    handed = []
    for _ in range(30):
        state, e = policy.next_trial(state)
        handed.append(e.batch_size)
        state = policy.observe(state, result(e.batch_size))
    assert d.batch_size not in handed


@pytest.mark.parametrize("variant", ["joules", "nsdi23"])
def test_no_fallback_hands_out_a_batch_size_that_failed(variant: str) -> None:
    """With nothing that reached the target, both policies fell back to the default (or the
    round's start, or the best batch size so far) even where it had failed: every recurrence
    got the batch size that crashed, and concurrent trials got it while others explored."""
    policy = make_policy(config(variant, batch_sizes=(16, 32, 64), default_batch_size=32))
    outcomes = {32: TrialOutcome.FAILED, 64: TrialOutcome.FAILED, 16: M}
    state = policy.initial_state()
    handed = []
    for _ in range(8):  # one trial at a time
        state, d = policy.next_trial(state)
        handed.append(d.batch_size)
        state = policy.observe(state, TrialResult(d.batch_size, outcomes[d.batch_size], 50.0, epochs=3))
    assert handed.count(32) == 1 and handed.count(64) == 1 and handed[-4:] == [16] * 4
    # Concurrent trials: the default fails while the others are in flight.
    state = policy.initial_state()
    state, first = policy.next_trial(state)
    assert first.batch_size == 32
    state = policy.observe(state, TrialResult(32, TrialOutcome.FAILED, 0.0, epochs=0))
    extra = []
    for _ in range(5):
        state, d = policy.next_trial(state)
        extra.append(d.batch_size)
    assert 32 not in extra
    # The best batch size so far fails: it is no longer the best, nor the stop cost's ground.
    _, state = drive(make_policy(config(variant)), 30)
    assert policy_best(variant, state) == 32
    state = make_policy(config(variant)).observe(state, TrialResult(32, TrialOutcome.FAILED, 0.0, epochs=0))
    summary = make_policy(config(variant)).summary(state)
    assert summary.best_batch_size == 64 and make_policy(config(variant)).stop_cost(state) == 2 * 11.0


def policy_best(variant: str, state: PolicyState) -> int | None:
    return make_policy(config(variant)).summary(state).best_batch_size
