"""What the batch-size policy, its server, its client and its simulator all speak.

A *job* recurs: each recurrence is a *trial* that trains with one batch size until the target
metric is reached (or ``max_epochs`` pass, or the trial is stopped early because its cost
already exceeds ``beta`` times the best cost seen). The cost of a trial is
``eta * energy + (1 - eta) * max_power * time`` over the whole trial (energy- and
time-to-accuracy), where ``max_power`` is the job's maximum power (highest power limit times
the number of GPUs).

The policy is pure: its whole state is a JSON-serializable ``dict`` (random generator
included), so the server can keep it in a database row and change it inside a transaction,
and the simulator can keep it in memory; both run the same code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

PolicyState = dict[str, Any]
"""A policy's whole state: JSON-serializable (``json.dumps`` round-trips it exactly)."""


class TrialOutcome(StrEnum):
    """How a trial ended."""

    REACHED = "reached"  # the target metric was reached
    MAX_EPOCHS = "max_epochs"  # max_epochs passed without reaching it
    EARLY_STOPPED = "early_stopped"  # its cost exceeded beta x the best cost so far
    ABORTED = "aborted"  # crashed or cancelled: says nothing about the batch size
    FAILED = "failed"  # the batch size cannot train (out of memory, diverged): pruned


@dataclass(frozen=True)
class PolicyConfig:
    """How a job's batch size is chosen.

    Attributes:
        batch_sizes: Candidate batch sizes (distinct, positive).
        default_batch_size: Where exploration starts; one of ``batch_sizes``.
        eta: Weight of energy in the cost, within [0, 1].
        beta: Early-stopping factor (> 1): a trial whose running cost exceeds ``beta`` times
            the best cost of a trial that reached the target is stopped.
        window_size: Keep only the last this many observations per batch size for the
            posterior (data drift); 0 keeps all.
        prior_mean: Prior mean of the cost; ``None`` for an uninformative prior.
        prior_precision: Prior precision (1 / variance) of the cost mean; 0 is uninformative.
        seed: Seed of the policy's random generator (``None``: from entropy).
        max_epochs: Epochs after which a trial fails (``None``: unknown). ``joules`` uses it
            to choose which direction to explore first.
        variant: ``"joules"`` (default, improvements on) or ``"nsdi23"`` (the original policy).
    """

    batch_sizes: tuple[int, ...]
    default_batch_size: int
    eta: float = 0.5
    beta: float = 2.0
    window_size: int = 0
    prior_mean: float | None = None
    prior_precision: float = 0.0
    seed: int | None = None
    max_epochs: int | None = None
    variant: str = "joules"


@dataclass(frozen=True)
class Decision:
    """The batch size for a new trial, and why.

    Attributes:
        batch_size: The batch size to train with.
        phase: ``"explore"`` (pruning exploration) or ``"exploit"`` (Thompson sampling).
        stop_cost: Stop the trial once its running cost exceeds this (``None``: no bound yet).
    """

    batch_size: int
    phase: str
    stop_cost: float | None = None


@dataclass(frozen=True)
class TrialResult:
    """What one trial found.

    Attributes:
        batch_size: Its batch size.
        outcome: How it ended.
        cost: Its cost (energy- and time-to-accuracy weighted by ``eta``), up to where it ended.
        time_s: Training time, s.
        energy_j: Energy, J.
        epochs: Epochs trained.
    """

    batch_size: int
    outcome: TrialOutcome
    cost: float
    time_s: float = 0.0
    energy_j: float = 0.0
    epochs: int = 0


@dataclass
class PolicySummary:
    """A human- and API-readable view of a policy's state."""

    phase: str
    explored: dict[int, str] = field(default_factory=dict)  # batch size -> "ok" / "failed" / "pending"
    surviving: list[int] = field(default_factory=list)
    posterior: dict[int, dict[str, float]] = field(default_factory=dict)  # bs -> {"mean", "std", "n"}
    best_batch_size: int | None = None
    best_cost: float | None = None


class Policy(ABC):
    """A batch-size policy (pure: every method takes and returns the state)."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    @abstractmethod
    def initial_state(self) -> PolicyState:
        """The state of a job nothing is known about yet."""

    @abstractmethod
    def next_trial(self, state: PolicyState) -> tuple[PolicyState, Decision]:
        """Choose the batch size of a new trial (several may be running at once)."""

    @abstractmethod
    def observe(self, state: PolicyState, result: TrialResult) -> PolicyState:
        """Learn from a trial that ended."""

    @abstractmethod
    def stop_cost(self, state: PolicyState) -> float | None:
        """The running cost above which a trial should stop now (``None``: none yet)."""

    @abstractmethod
    def summary(self, state: PolicyState) -> PolicySummary:
        """A readable view of ``state``."""


def trial_cost(eta: float, max_power_w: float, energy_j: float, time_s: float) -> float:
    """``eta * energy + (1 - eta) * max_power * time``."""
    return eta * energy_j + (1.0 - eta) * max_power_w * time_s
