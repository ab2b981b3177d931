"""The wire format of the batch-size optimizer server (one place for server and client).

Endpoints (JSON; ``Authorization: Bearer TOKEN`` when the server has a token):

- ``POST /jobs`` (:class:`JobCreate`) -> 201 :class:`JobOut`. Registering a name again with
  the same spec returns the existing job (200); with a different spec, 409.
- ``GET /jobs/{job_id}`` -> :class:`JobState`; ``GET /jobs/{job_id}/trials?offset=0&limit=1000``
  -> list of :class:`TrialOut`, oldest first (at most ``limit``, 1..1000, default 1000, after
  skipping ``offset``). Running trials idle for the job's ``stale_after_s`` are ended as
  ``aborted`` when the job is next read or asked for a trial.
- ``POST /jobs/{job_id}/trials`` (:class:`TrialCreate`, body optional) -> 201 :class:`TrialOut`:
  the batch size of a new trial; with a ``request_id`` already used for this job, that trial
  again (200). ``GET /jobs/{job_id}/trials/{trial_id}`` -> :class:`TrialOut`.
- ``POST /jobs/{job_id}/trials/{trial_id}/epochs`` (:class:`EpochReport`) -> :class:`EpochAnswer`:
  whether to stop. Idempotent per epoch: the same report again gets the same answer; a
  different report for an epoch already reported gets 409.
- ``POST /jobs/{job_id}/trials/{trial_id}/end`` (:class:`TrialEnd`, body optional) ->
  :class:`TrialOut`. Ending a trial that has ended changes nothing and returns it.
- ``GET /healthz``; ``GET /metrics`` (Prometheus).

Invalid requests get 422 (body) or 404/409 with ``{"detail": ...}`` naming the field or
object at fault; 401 without the right token; 503 (with ``Retry-After``) while the database
is unavailable.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,199}$"
PRINTABLE_PATTERN = r"^[^\x00-\x1f\x7f]*$"  # no NUL (PostgreSQL text cannot hold it) nor control characters
MAX_KNOB_LENGTH = 1000  # of a knob's name and of a string value

# Upper bounds of the values the server stores and computes with: a batch size must fit the
# database's 32-bit integer column; the others keep every total, cost and time computed from
# them finite (a trial's cost is at most about 1e24 after 1,000,000 epochs at these bounds).
MAX_BATCH_SIZE = 2**31 - 1
MAX_POWER_W = 1e9  # 1 GW
MAX_EPOCH_TIME_S = 1e9  # about 32 years
MAX_EPOCH_ENERGY_J = 1e18  # 1 GW for about 32 years
MAX_STALE_AFTER_S = 10 * 365 * 86400.0  # 10 years
MAX_PRIOR = 1e100  # of |prior_mean| and of prior_precision


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _not_bool(value: object) -> object:
    if isinstance(value, bool):  # JSON true is not the integer 1
        raise ValueError("must be an integer, not a boolean")
    return value


def _number_not_bool(value: object) -> object:
    if isinstance(value, bool):  # JSON true is not the number 1.0
        raise ValueError("must be a number, not a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_number_not_bool)]
KnobText = Annotated[str, Field(max_length=MAX_KNOB_LENGTH)]


class JobCreate(_Model):
    """A recurring job and how to choose its batch size."""

    name: str = Field(pattern=JOB_NAME_PATTERN, description="Unique name of the recurring job.")
    batch_sizes: list[Annotated[Int, Field(gt=0, le=MAX_BATCH_SIZE)]] = Field(
        min_length=1, max_length=256, json_schema_extra={"uniqueItems": True},
        description="Candidate batch sizes (distinct, positive, at most 2**31 - 1).")
    default_batch_size: Int = Field(gt=0, le=MAX_BATCH_SIZE,
                                    description="Where exploration starts; one of batch_sizes.")
    target_metric: Float = Field(allow_inf_nan=False, description="Validation metric that ends a trial.")
    higher_is_better: bool = Field(True, description="False for metrics like WER.")
    max_epochs: Int = Field(gt=0, le=1_000_000, description="Epochs after which a trial fails.")
    max_power_w: Float = Field(gt=0, le=MAX_POWER_W, allow_inf_nan=False,
                               description="Max power of the job's GPUs, W (at most 1e9).")
    eta: Float = Field(0.5, ge=0.0, le=1.0, description="Weight of energy in the cost.")
    beta: Float = Field(2.0, gt=1.0, le=1000.0, allow_inf_nan=False, description="Early-stop factor.")
    window_size: Int = Field(0, ge=0, le=100_000, description="Observations kept per batch size; 0: all.")
    prior_mean: Float | None = Field(None, ge=-MAX_PRIOR, le=MAX_PRIOR, allow_inf_nan=False)
    prior_precision: Float = Field(0.0, ge=0.0, le=MAX_PRIOR, allow_inf_nan=False)
    seed: Int | None = Field(None, ge=0, lt=2**63)
    policy: Literal["joules", "nsdi23"] = "joules"
    stale_after_s: Float = Field(
        86400.0, ge=1.0, le=MAX_STALE_AFTER_S, allow_inf_nan=False,
        description="A running trial with no epoch report (nor creation) for this long, s, is ended as "
                    "aborted, freeing its batch size for the policy (at most 10 years).")
    knobs: dict[KnobText, KnobText | Annotated[float, Field(allow_inf_nan=False)] | int | bool] = Field(
        default_factory=dict, max_length=64, description="Other settings of the job, kept for reference.")

    @field_validator("batch_sizes")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        # Each item is already known to be positive (Field(gt=0) is checked first).
        if len(set(v)) != len(v):
            raise ValueError("batch_sizes must be distinct")
        return sorted(v)

    @field_validator("default_batch_size")
    @classmethod
    def _default_is_a_candidate(cls, v: int, info: ValidationInfo) -> int:
        # batch_sizes is declared first, so it is in info.data once valid (else its own error is reported).
        batch_sizes = info.data.get("batch_sizes")
        if batch_sizes is not None and v not in batch_sizes:
            raise ValueError(f"default_batch_size {v} is not one of batch_sizes")
        return v


class JobOut(JobCreate):
    """A registered job."""

    job_id: str
    created_at: datetime


class PosteriorOut(_Model):
    """The posterior of one batch size's cost."""

    mean: float
    std: float
    n: int


class JobState(_Model):
    """A job, where its policy stands, and its trial counts."""

    job: JobOut
    phase: str
    explored: dict[int, str]
    surviving: list[int]
    posterior: dict[int, PosteriorOut]
    best_batch_size: int | None
    best_cost: float | None
    trials: dict[str, int] = Field(description="Count of trials per status.")


class TrialCreate(_Model):
    """Ask for a new trial."""

    client: str | None = Field(None, max_length=200, pattern=PRINTABLE_PATTERN,
                               description="Free text: host, run id...")
    request_id: str | None = Field(
        None, min_length=1, max_length=64, pattern=PRINTABLE_PATTERN,
        exclude_if=lambda v: v is None,  # unset: not sent at all
        description="Idempotency key of the client's choosing: a retry with the same key gets the same "
                    "trial back (200) instead of a second one.")


class TrialOut(_Model):
    """A trial and, once ended, its result."""

    trial_id: str
    job_id: str
    batch_size: int
    phase: Literal["explore", "exploit"]
    stop_cost: float | None
    status: Literal["running", "ended"]
    outcome: Literal["reached", "max_epochs", "early_stopped", "aborted", "failed"] | None = None
    epochs: int = 0
    time_s: float = 0.0
    energy_j: float = 0.0
    cost: float = 0.0
    created_at: datetime
    ended_at: datetime | None = None


class EpochReport(_Model):
    """One epoch of a trial: its time, energy, and validation metric after it."""

    epoch: Int = Field(ge=1, le=1_000_000)
    time_s: Float = Field(ge=0.0, le=MAX_EPOCH_TIME_S, allow_inf_nan=False)
    energy_j: Float = Field(ge=0.0, le=MAX_EPOCH_ENERGY_J, allow_inf_nan=False)
    metric: Float = Field(allow_inf_nan=False)


class EpochAnswer(_Model):
    """Whether the trial should stop after this epoch."""

    stop: bool
    reason: Literal["reached", "max_epochs", "early_stopped"] | None = None
    cost: float = Field(description="The trial's cost so far.")
    stop_cost: float | None = None


class TrialEnd(_Model):
    """End a trial: ``completed`` (its epochs tell how), ``aborted`` or ``failed``.

    ``aborted``: crashed or cancelled, which says nothing about the batch size. ``failed``: the
    batch size cannot train (it ran out of memory, or diverged); it is not tried again.
    """

    status: Literal["completed", "aborted", "failed"] = "completed"


def token_problem(token: str) -> str | None:
    """What makes ``token`` unusable as a bearer token, or ``None`` when it is fine."""
    if not token.strip():
        return "is empty"
    if token != token.strip():  # HTTP strips the whitespace around a header's value
        return "starts or ends with whitespace, which no client can send"
    if not (token.isascii() and token.isprintable()):
        return "has characters other than printable ASCII, which clients cannot send in a header"
    return None
