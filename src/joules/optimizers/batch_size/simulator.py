"""Replay a recurring job on the NSDI'23 traces with a batch-size policy.

Each recurrence of the job must reach the target metric. It asks the policy for a batch
size, trains with it, and reports the result; a trial that fails (stopped early, or out of
epochs) is followed by another trial in the same recurrence, as the job still has to reach
the target (up to 20 trials per recurrence). A trial replays one recorded seed run of its
batch size, drawn at random: it reaches the target in that run's epoch if that is within
``max_epochs``.

**Power limits.** Each batch size runs at the power limit joules' power-limit optimizer
chooses for it, with the ``cost:eta`` selector (:class:`MinCost`) and the adaptive search
(:class:`Adaptive`), replayed (:func:`replay`) on the batch size's per-epoch profile from
the power trace. The optimizer saves the profile, so only the first trial of a batch size
profiles; later ones start at the chosen limit. Profiling happens during the first epoch:
each limit the search profiles takes ``1/L`` of that epoch (``L``: the number of limits in
the trace, so profiling every limit takes exactly one epoch, the model of the NSDI'23
simulator) and the rest of the epoch runs at the chosen limit. The first epoch therefore
costs the chosen limit's epoch plus ``1/L`` of the profiling overhead that :func:`replay`
reports (the extra energy and time of the profiled limits over the chosen one).

**Early stopping.** A trial ends after an epoch when one more epoch at the chosen limit
would take its running cost over the policy's ``stop_cost`` (``stop_before=False``: after
the first epoch whose running cost is over it), and after ``max_epochs``. The server takes
the epoch just reported as the next one's cost, which after a first epoch that profiled
limits is dearer than the chosen limit's epoch: it can stop such a trial an epoch earlier.

**Baselines** (expected values, over the seed runs): the default configuration (default
batch size at the highest power limit) and the best configuration in hindsight (the batch
size and power limit of least expected cost), each used for every recurrence. A recurrence
of a configuration whose runs fail with probability ``f`` costs its successful runs' mean
plus ``f / (1 - f)`` failed runs of ``max_epochs`` epochs (the retries).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from joules.errors import JoulesError
from joules.optimizers.batch_size.policy import make_policy
from joules.optimizers.batch_size.traces import JobTrace
from joules.optimizers.batch_size.types import Policy, PolicyConfig, TrialOutcome, TrialResult, trial_cost
from joules.optimizers.power_limit import Adaptive, LimitPoint, MinCost, replay

MAX_TRIALS_PER_RECURRENCE = 20


class SimulationError(JoulesError, RuntimeError):
    """The simulated job cannot go on (e.g. it never reaches its target)."""


@dataclass(frozen=True)
class SimulatedTrial:
    """One trial of the simulation."""

    recurrence: int
    batch_size: int
    phase: str
    power_limit_w: float
    profiled: bool
    outcome: TrialOutcome
    epochs: int
    time_s: float
    energy_j: float
    cost: float


@dataclass(frozen=True)
class Expected:
    """Expected energy, time and cost of one recurrence of a fixed configuration."""

    batch_size: int
    power_limit_w: float
    energy_j: float
    time_s: float
    cost: float


@dataclass
class SimulationResult:
    """Totals over the recurrences, with the baselines' (see :meth:`to_dict`)."""

    energy_j: float
    time_s: float
    cost: float
    default: Expected
    oracle: Expected
    recurrences: int
    trials: list[SimulatedTrial] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The totals, JSON-ready.

        Keys: ``energy_j``, ``time_s``, ``cost``, the ``default_*`` and ``oracle_*`` ones
        (expected value per recurrence times the recurrences), and ``recurrences``.
        """
        n = self.recurrences
        return {
            "energy_j": self.energy_j,
            "time_s": self.time_s,
            "default_energy_j": self.default.energy_j * n,
            "default_time_s": self.default.time_s * n,
            "oracle_energy_j": self.oracle.energy_j * n,
            "oracle_time_s": self.oracle.time_s * n,
            "cost": self.cost,
            "default_cost": self.default.cost * n,
            "oracle_cost": self.oracle.cost * n,
            "recurrences": n,
        }


def expected(job: JobTrace, batch_size: int, limit_w: float, eta: float) -> Expected | None:
    """Expected cost of one recurrence at a fixed configuration (``None``: it never reaches the target)."""
    runs = job.runs[batch_size]
    good = [e for e in runs if job.reaches(e)]
    if not good:
        return None
    failing = 1.0 - len(good) / len(runs)
    epochs = sum(good) / len(good) + failing / (1.0 - failing) * job.spec.max_epochs  # type: ignore[arg-type]
    p = job.profiles[batch_size].at(limit_w)
    energy, time = epochs * p.energy_j, epochs * p.time_s
    return Expected(batch_size, limit_w, energy, time, trial_cost(eta, job.max_power_w, energy, time))


def default_config(job: JobTrace, eta: float) -> Expected:
    """The default batch size at the highest power limit."""
    b = job.spec.default_batch_size
    e = expected(job, b, job.profiles[b].limits_w[0], eta)
    if e is None:
        raise SimulationError(f"{job.spec.workload} on {job.gpu}: the default batch size {b} never "
                              f"reaches {job.spec.target_metric:g} within {job.spec.max_epochs} epochs")
    return e


def oracle_config(job: JobTrace, eta: float) -> Expected:
    """The batch size and power limit of least expected cost."""
    options = [e for b in job.batch_sizes for w in job.profiles[b].limits_w
               if (e := expected(job, b, w, eta)) is not None]
    return min(options, key=lambda e: (e.cost, e.batch_size, -e.power_limit_w))


@dataclass(frozen=True)
class _Limit:
    point: LimitPoint  # one epoch at the chosen limit
    first_extra_time_s: float  # extra time and energy of the first epoch (profiling)
    first_extra_energy_j: float


def choose_limit(job: JobTrace, batch_size: int, eta: float) -> tuple[float, float, float]:
    """The power limit joules' optimizer picks for ``batch_size``, and its profiling overhead.

    Returns:
        ``(limit_w, extra_time_s, extra_energy_j)``: the chosen limit, and the extra time and
        energy of the first epoch of the batch size (its profiling, see the module docstring).
    """
    profile = job.profiles[batch_size]
    r = replay(profile, Adaptive(profile.limits_w, MinCost(eta, profile.gpus), profile.gpus))
    share = 1.0 / len(profile.limits_w)
    return r.chosen_w, share * r.overhead_time_s, share * r.overhead_energy_j


def simulate(
    job: JobTrace,
    *,
    policy: str = "joules",
    recurrences: int | None = None,
    seed: int = 0,
    eta: float = 0.5,
    beta: float = 2.0,
    window_size: int = 0,
    progress: Callable[[int, int], None] | None = None,
    factory: Callable[[PolicyConfig], Policy] = make_policy,
    stop_before: bool = True,
) -> SimulationResult:
    """Replay ``recurrences`` recurrences of ``job`` with the policy ``policy``.

    Args:
        job: The job, from :func:`~joules.optimizers.batch_size.traces.load_job`.
        policy: ``"joules"`` or ``"nsdi23"``.
        recurrences: How many times the job recurs (default: 2 x batch sizes x power limits).
        seed: Seeds the policy and the draw of seed runs: the same seed, the same result.
        eta: Weight of energy in the cost.
        beta: Early-stopping factor.
        window_size: The policy's window (0: all observations).
        progress: Called with (recurrences done, recurrences) after each recurrence.
        factory: Makes the policy from its configuration (e.g. a tuned subclass, for ablations).
        stop_before: Stop a trial before the epoch that would take it over the stop cost (as
            the NSDI'23 simulator and ``joules serve`` do); ``False``: after the first epoch
            that did.

    Raises:
        SimulationError: A recurrence failed 20 trials, or the default never reaches the target.
        ValueError: A bad argument.
    """
    n = job.default_recurrences() if recurrences is None else recurrences
    if n < 1:
        raise ValueError(f"recurrences must be at least 1, got {n}")
    default = default_config(job, eta)
    oracle = oracle_config(job, eta)
    pol = factory(PolicyConfig(
        batch_sizes=job.batch_sizes, default_batch_size=job.spec.default_batch_size, eta=eta, beta=beta,
        window_size=window_size, seed=seed, max_epochs=job.spec.max_epochs, variant=policy,
    ))
    state = pol.initial_state()
    rng = np.random.default_rng([seed, 0x5EED])
    limits: dict[int, _Limit] = {}
    trials: list[SimulatedTrial] = []
    for rec in range(n):
        for _ in range(MAX_TRIALS_PER_RECURRENCE):
            state, decision = pol.next_trial(state)
            b = decision.batch_size
            profiled = b not in limits
            if profiled:
                w, extra_t, extra_e = choose_limit(job, b, eta)
                limits[b] = _Limit(job.profiles[b].at(w), extra_t, extra_e)
            trial = _run(job, b, limits[b], profiled, decision.stop_cost, eta, rng, rec, decision.phase,
                         stop_before)
            trials.append(trial)
            state = pol.observe(state, TrialResult(b, trial.outcome, trial.cost, trial.time_s,
                                                   trial.energy_j, trial.epochs))
            if trial.outcome == TrialOutcome.REACHED:
                break
        else:
            raise SimulationError(f"{job.spec.workload} on {job.gpu}: recurrence {rec + 1} did not "
                                  f"reach the target in {MAX_TRIALS_PER_RECURRENCE} trials")
        if progress is not None:
            progress(rec + 1, n)
    energy = sum(t.energy_j for t in trials)
    time = sum(t.time_s for t in trials)
    return SimulationResult(energy, time, trial_cost(eta, job.max_power_w, energy, time), default, oracle,
                            n, trials)


def _run(job: JobTrace, b: int, limit: _Limit, profiled: bool, stop_cost: float | None, eta: float,
         rng: np.random.Generator, rec: int, phase: str, stop_before: bool) -> SimulatedTrial:
    runs = job.runs[b]
    target = runs[int(rng.integers(len(runs)))]
    reach_at = target if job.reaches(target) else None
    time = energy = 0.0
    p = limit.point
    outcome = TrialOutcome.MAX_EPOCHS
    epoch = 0
    # Stopping before an epoch that would cross the bound needs its cost: the chosen limit's.
    next_epoch = trial_cost(eta, job.max_power_w, p.energy_j, p.time_s) if stop_before else 0.0
    for epoch in range(1, job.spec.max_epochs + 1):
        time += p.time_s
        energy += p.energy_j
        if epoch == 1 and profiled:
            time += limit.first_extra_time_s
            energy += limit.first_extra_energy_j
        if epoch == reach_at:
            outcome = TrialOutcome.REACHED
            break
        if epoch == job.spec.max_epochs:
            break
        if stop_cost is not None and trial_cost(eta, job.max_power_w, energy, time) + next_epoch > stop_cost:
            outcome = TrialOutcome.EARLY_STOPPED
            break
    cost = trial_cost(eta, job.max_power_w, energy, time)
    if math.isnan(cost):
        raise SimulationError(f"{job.spec.workload}: bad profile for batch size {b}")
    return SimulatedTrial(rec, b, phase, p.limit_w, profiled, outcome, epoch, time, energy, cost)
