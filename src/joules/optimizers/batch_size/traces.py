"""The NSDI'23 training and power traces, and the recurring jobs they describe.

Two CSV files describe a job on one GPU model (see ``../shared/data/README.md``):

- ``summary_train.csv``: for each (workload, batch size, seed run, metric threshold), the
  epoch at which the validation metric first reached that threshold (``nan`` or empty:
  never). Columns ``dataset``, ``network``, ``batch_size``, ``optimizer``, ``run``,
  ``target_metric``, ``target_epoch`` (``learning_rate`` is not used).
- ``summary_power_{gpu}.csv``: for each (workload, batch size, optimizer, power limit), the
  time of one epoch and the average GPU power during it. Read with
  :func:`joules.optimizers.power_limit.trace_profiles`: one :class:`Profile` per batch size,
  whose points are the energy and time of one epoch at each limit.

A job is a workload with a target metric, a maximum number of epochs and a default batch
size; :data:`JOBS` holds the six of the paper. :func:`load_job` joins both traces for one
job on one GPU: the candidate batch sizes are those both traces have (for the optimizer the
training trace used), and each one's seed runs say in which epoch the target is reached.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from joules.optimizers.csvfile import csv_rows
from joules.optimizers.power_limit.profile import Profile, ProfileError, trace_profiles


class TraceError(ProfileError):
    """A trace file is missing or malformed, or does not hold the job asked for."""


@dataclass(frozen=True)
class JobSpec:
    """A recurring training job of the traces.

    Attributes:
        dataset: Dataset name as in the traces, e.g. ``cifar100``.
        network: Model name as in the traces, e.g. ``shufflenetv2``.
        target_metric: The validation metric a recurrence must reach.
        max_epochs: Epochs after which a trial that has not reached the target fails.
        default_batch_size: The batch size the job's owner would use (exploration starts here).
        higher_is_better: ``False`` for metrics like word error rate (informative only: the
            trace already says in which epoch the target is reached).
    """

    dataset: str
    network: str
    target_metric: float
    max_epochs: int
    default_batch_size: int
    higher_is_better: bool = True

    @property
    def workload(self) -> str:
        """``DATASET/NETWORK``."""
        return f"{self.dataset}/{self.network}"


JOBS: dict[str, JobSpec] = {
    j.workload: j
    for j in (
        JobSpec("cifar100", "shufflenetv2", 0.6, 100, 1024),
        JobSpec("imagenet", "resnet50", 0.65, 100, 256),
        JobSpec("squad", "bert_base_uncased", 84.0, 6, 32),
        JobSpec("librispeech", "deepspeech2", 40.0, 16, 192, higher_is_better=False),
        JobSpec("movielens-1m", "ncf", 0.41, 100, 1024),
        JobSpec("sentiment140", "bert_base_uncased", 0.84, 10, 128),
    )
}
"""The jobs of the NSDI'23 evaluation, by workload (target, max epochs, default batch size)."""


@dataclass(frozen=True)
class JobTrace:
    """One job on one GPU model, as the traces record it.

    Attributes:
        spec: The job (its default batch size already one of ``batch_sizes``).
        gpu: GPU model of the power trace, e.g. ``v100``.
        optimizer: The training optimizer the traces recorded for this workload.
        batch_sizes: Candidate batch sizes, ascending: those both traces have.
        runs: For each batch size, the epoch at which each recorded seed run reached the
            target (``None``: never), in run order. Epochs beyond ``max_epochs`` are kept as
            recorded; such a run fails.
        profiles: For each batch size, the energy and time of one epoch at each power limit.
        max_power_w: The highest power limit of the GPU's power trace (the cost's max power).
    """

    spec: JobSpec
    gpu: str
    optimizer: str
    batch_sizes: tuple[int, ...]
    runs: Mapping[int, tuple[int | None, ...]]
    profiles: Mapping[int, Profile]
    max_power_w: float

    @property
    def power_limits_w(self) -> list[float]:
        """Every power limit some batch size's profile has, highest first."""
        return sorted({w for p in self.profiles.values() for w in p.limits_w}, reverse=True)

    def reaches(self, epoch: int | None) -> bool:
        """Whether a run that reaches the target at ``epoch`` does so within ``max_epochs``."""
        return epoch is not None and epoch <= self.spec.max_epochs

    def default_recurrences(self) -> int:
        """The paper's number of recurrences: 2 x batch sizes x power limits."""
        return 2 * len(self.batch_sizes) * len(self.power_limits_w)


_TRAIN_COLUMNS = ("dataset", "network", "batch_size", "optimizer", "run", "target_metric", "target_epoch")


def _number(path: Path, line: int, column: str, text: str | None) -> float:
    try:
        return float(text if text is not None else "")
    except ValueError:
        raise TraceError(f"{path}, line {line}: {column}={text!r} is not a number") from None


def _integer(path: Path, line: int, column: str, text: str | None) -> int:
    value = _number(path, line, column, text)
    if not (math.isfinite(value) and value == int(value)):
        raise TraceError(f"{path}, line {line}: {column}={text!r} is not an integer")
    return int(value)


def same_metric(a: float, b: float) -> bool:
    """Whether two metric thresholds are the same one (``0.6`` and ``0.6000000000000001`` are)."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@dataclass(frozen=True)
class TrainTrace:
    """What the training trace says about one workload and target metric.

    Attributes:
        optimizer: The training optimizer recorded.
        runs: For each batch size, the epoch at which each seed run first reached the
            target (``None``: never), in run order.
    """

    optimizer: str
    runs: Mapping[int, tuple[int | None, ...]]


def load_train_trace(path: str | Path, workload: str, target_metric: float) -> TrainTrace:
    """The seed runs of ``workload`` (``DATASET/NETWORK``) for one target metric.

    The threshold is matched up to float rounding. A workload recorded with several
    optimizers is refused (the NSDI'23 traces have one per workload).

    Raises:
        TraceError: The file is missing, lacks a column, has a malformed value or a
            duplicated (batch size, run), or holds no row for this workload and target.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"training trace not found: {path}")
    dataset, _, network = workload.partition("/")
    runs: dict[int, dict[int, int | None]] = {}
    optimizers: set[str] = set()
    targets: set[float] = set()
    seen_workload = False
    with csv_rows(path, TraceError) as reader:
        missing = [c for c in _TRAIN_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}")
        for row in reader:
            line = reader.line_num  # the file's own line, blank lines counted
            if row["dataset"] != dataset or row["network"] != network:
                continue
            seen_workload = True
            target = _number(path, line, "target_metric", row["target_metric"])
            targets.add(target)
            if not same_metric(target, target_metric):
                continue
            bs = _integer(path, line, "batch_size", row["batch_size"])
            run = _integer(path, line, "run", row["run"])
            text = (row["target_epoch"] or "").strip()
            epoch_f = _number(path, line, "target_epoch", text) if text else math.nan
            if math.isnan(epoch_f):
                epoch: int | None = None
            elif epoch_f < 0 or math.isinf(epoch_f):
                raise TraceError(f"{path}, line {line}: target_epoch={text!r} is not an epoch")
            else:
                epoch = math.ceil(epoch_f)
                if epoch == 0:  # epochs count from 1: the target is checked after each epoch
                    raise TraceError(f"{path}, line {line}: target_epoch={text!r}: epochs count "
                                     f"from 1 (the target is reached after some epoch)")
            if bs <= 0:
                raise TraceError(f"{path}, line {line}: batch_size={row['batch_size']!r} is not positive")
            if run in runs.setdefault(bs, {}):
                raise TraceError(f"{path}, line {line}: batch size {bs} run {run} listed twice "
                                 f"for target {target_metric:g}")
            runs[bs][run] = epoch
            optimizers.add(row["optimizer"])
    if not seen_workload:
        raise TraceError(f"{path}: no rows for workload {workload}")
    if not runs:
        have = ", ".join(f"{t:g}" for t in sorted(targets))
        raise TraceError(f"{path}: {workload} has no target_metric {target_metric:g} (has {have})")
    if len(optimizers) > 1:
        raise TraceError(f"{path}: {workload} was recorded with several optimizers "
                         f"({', '.join(sorted(optimizers))})")
    return TrainTrace(
        optimizer=optimizers.pop(),
        runs={bs: tuple(r[k] for k in sorted(r)) for bs, r in sorted(runs.items())},
    )


def load_power_profiles(path: str | Path, workload: str, optimizer: str) -> dict[int, Profile]:
    """The per-epoch power-limit profile of each batch size of ``workload`` with ``optimizer``.

    Raises:
        TraceError: The file is missing or malformed, or has no row for them.
    """
    return _power_profiles(Path(path), workload, optimizer)[0]


def _power_profiles(path: Path, workload: str, optimizer: str) -> tuple[dict[int, Profile], float]:
    """:func:`load_power_profiles`, and the highest power limit of the whole file, W."""
    if not path.is_file():
        raise TraceError(f"power trace not found: {path}")
    try:
        profiles = trace_profiles(path)
    except ProfileError as e:
        raise TraceError(str(e)) from None
    out: dict[int, Profile] = {}
    for p in profiles:
        parts = p.name.split("/")
        if len(parts) != 4:
            raise TraceError(f"{path}, line {_line_of(path, p.name)}: dataset, network, batch_size and "
                             f"optimizer must not contain '/' (row {p.name!r})")
        dataset, network, bs, opt = parts
        if f"{dataset}/{network}" == workload and opt == optimizer:
            try:
                out[int(bs)] = p
            except ValueError:
                raise TraceError(f"{path}: batch_size={bs!r} is not an integer") from None
    if not out:
        raise TraceError(f"{path}: no rows for workload {workload} with optimizer {optimizer}")
    return dict(sorted(out.items())), max(p.limits_w[0] for p in profiles)


def _line_of(path: Path, name: str) -> int | str:
    """The line of the first row of a power trace in profile ``name`` (``"?"`` if none is)."""
    with path.open(newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            if f"{row['dataset']}/{row['network']}/{row['batch_size']}/{row['optimizer']}" == name:
                return line
    return "?"


def known_gpus(traces_dir: str | Path) -> list[str]:
    """The GPU models with a ``summary_power_{gpu}.csv`` in ``traces_dir``."""
    return sorted(p.stem.removeprefix("summary_power_") for p in Path(traces_dir).glob("summary_power_*.csv"))


def load_job(traces_dir: str | Path, gpu: str, workload: str | JobSpec) -> JobTrace:
    """Join the training trace and ``gpu``'s power trace for one job.

    Args:
        traces_dir: Directory with ``summary_train.csv`` and ``summary_power_{gpu}.csv``.
        gpu: GPU model, e.g. ``v100`` or ``a40``, in any case (the trace's name is kept).
        workload: ``DATASET/NETWORK`` of one of :data:`JOBS`, or a :class:`JobSpec`.

    The candidate batch sizes are those with seed runs in the training trace and a profile
    in the power trace. The default batch size becomes the largest candidate not above the
    job's default (the smallest candidate if none is).

    Raises:
        TraceError: Unknown workload, missing directory or file, malformed file, or no batch
            size in both traces.
    """
    traces_dir = Path(traces_dir)
    if isinstance(workload, JobSpec):
        spec = workload
    elif workload in JOBS:
        spec = JOBS[workload]
    else:
        raise TraceError(f"unknown workload {workload!r} (known: {', '.join(JOBS)})")
    if not traces_dir.is_dir():
        if traces_dir.exists():
            raise TraceError(f"not a trace directory: {traces_dir} is a file, not a directory")
        raise TraceError(f"trace directory not found: {traces_dir}")
    power_path = traces_dir / f"summary_power_{gpu}.csv"
    if not power_path.is_file():
        have = known_gpus(traces_dir)
        same = [g for g in have if g.lower() == gpu.lower()]  # V100 is the trace's v100
        if len(same) != 1:
            raise TraceError(f"power trace not found: {power_path} (GPUs with a trace: "
                             f"{', '.join(have) or 'none'})")
        gpu = same[0]
        power_path = traces_dir / f"summary_power_{gpu}.csv"
    train = load_train_trace(traces_dir / "summary_train.csv", spec.workload, spec.target_metric)
    profiles, max_power_w = _power_profiles(power_path, spec.workload, train.optimizer)
    batch_sizes = tuple(sorted(set(train.runs) & set(profiles)))
    if not batch_sizes:
        raise TraceError(f"{spec.workload}: no batch size is in both {traces_dir / 'summary_train.csv'} "
                         f"and {power_path}")
    not_above = [b for b in batch_sizes if b <= spec.default_batch_size]
    default = max(not_above) if not_above else batch_sizes[0]
    return JobTrace(
        spec=replace(spec, default_batch_size=default),
        gpu=gpu,
        optimizer=train.optimizer,
        batch_sizes=batch_sizes,
        runs={b: train.runs[b] for b in batch_sizes},
        profiles={b: profiles[b] for b in batch_sizes},
        max_power_w=max_power_w,
    )
