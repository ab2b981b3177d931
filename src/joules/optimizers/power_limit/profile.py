"""Time and energy of a workload at each GPU power limit, and loaders for recorded ones."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from joules.errors import JoulesError
from joules.optimizers.csvfile import csv_rows


class ProfileError(JoulesError, ValueError):
    """A profile file is missing, malformed, or does not hold what was asked for."""


@dataclass(frozen=True)
class LimitPoint:
    """Time and energy of one unit of work (a profiling window, an epoch) at one power limit.

    Attributes:
        limit_w: The power limit, W.
        time_s: Time the unit of work took, s.
        energy_j: Energy it took on all GPUs together, J.
    """

    limit_w: float
    time_s: float
    energy_j: float

    @property
    def average_power_w(self) -> float:
        """Average power over the unit of work, W."""
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0


@dataclass(frozen=True)
class Profile:
    """A workload's :class:`LimitPoint` at each power limit, highest limit first."""

    name: str
    points: tuple[LimitPoint, ...]
    gpus: int = 1

    def __post_init__(self) -> None:
        if not self.points:
            raise ProfileError(f"profile {self.name!r} has no power limits")
        limits = [p.limit_w for p in self.points]
        if len(set(limits)) != len(limits):
            raise ProfileError(f"profile {self.name!r} lists a power limit twice")
        for p in self.points:
            if not (p.time_s > 0 and p.energy_j > 0 and math.isfinite(p.time_s + p.energy_j)):
                raise ProfileError(f"profile {self.name!r}: bad time or energy at {p.limit_w:g} W")
        object.__setattr__(self, "points", tuple(sorted(self.points, key=lambda p: -p.limit_w)))

    @property
    def limits_w(self) -> list[float]:
        """The power limits, highest first."""
        return [p.limit_w for p in self.points]

    def at(self, limit_w: float) -> LimitPoint:
        """The point at ``limit_w``.

        Raises:
            ProfileError: The profile has no such limit.
        """
        for p in self.points:
            if p.limit_w == limit_w:
                return p
        have = ", ".join(f"{x:g}" for x in self.limits_w)
        raise ProfileError(f"profile {self.name!r} has no {limit_w:g} W limit (has {have})")


def _require(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"profile file not found: {path}")
    return path


def _rows(path: Path, needed: Iterable[str]) -> list[tuple[int, dict[str, str]]]:
    """``(line in the file, row)`` of each row; names and values stripped of spaces around them."""
    with csv_rows(path, ProfileError) as reader:
        names = [n.strip() for n in reader.fieldnames or []]
        missing = [c for c in needed if c not in names]
        if missing:
            raise ProfileError(f"{path}: missing column(s) {', '.join(missing)}")
        rows = []
        for row in reader:
            if row.get(None):  # type: ignore[call-overload]
                raise ProfileError(f"{path}, line {reader.line_num}: more fields than the header's "
                                   f"{len(names)} ({', '.join(names)})")
            rows.append((reader.line_num, {k.strip(): (v or "").strip() for k, v in row.items()
                                           if k is not None}))
        return rows


def _float(path: Path, line: int, row: dict[str, str], column: str) -> float:
    try:
        return float(row[column])
    except (TypeError, ValueError):
        raise ProfileError(f"{path}, line {line}: {column}={row.get(column)!r} is not a number") from None


def _positive(path: Path, line: int, row: dict[str, str], column: str) -> float:
    value = _float(path, line, row, column)
    if not (value > 0 and math.isfinite(value)):
        raise ProfileError(f"{path}, line {line}: {column}={row[column]!r} is not a positive finite number")
    return value


def load_profile_csv(path: str | Path) -> Profile:
    """Load a recorded power-limit profile: one row per profiling window.

    Columns: ``window_name`` ending in ``_<limit in W>``, ``elapsed_time`` (s) and one
    ``gpuN_energy`` (J) per GPU, each window the same number of steps. Windows repeated at
    one limit are averaged (a point is one window's time and energy, as at every limit).
    """
    path = _require(path)
    rows = _rows(path, ("window_name", "elapsed_time"))
    if not rows:
        raise ProfileError(f"{path}: no rows")
    gpu_cols = [c for c in rows[0][1] if c.startswith("gpu") and c.endswith("_energy")]
    if not gpu_cols:
        raise ProfileError(f"{path}: no gpuN_energy column")
    totals: dict[float, list[float]] = {}  # time, energy, windows
    for line, row in rows:
        name = row["window_name"]
        try:
            limit = float(name.rsplit("_", 1)[-1])
        except ValueError:
            raise ProfileError(f"{path}, line {line}: window name {name!r} does not end in a limit") from None
        if not (math.isfinite(limit) and limit > 0):
            raise ProfileError(f"{path}, line {line}: window name {name!r} ends in {limit:g} W, "
                               f"not a positive power limit")
        energy = sum(_float(path, line, row, c) for c in gpu_cols)
        t = totals.setdefault(limit, [0.0, 0.0, 0])
        t[0] += _float(path, line, row, "elapsed_time")
        t[1] += energy
        t[2] += 1
    points = tuple(LimitPoint(limit, t / n, e / n) for limit, (t, e, n) in totals.items())
    return Profile(path.stem, points, gpus=len(gpu_cols))


_TRACE_COLUMNS = ("dataset", "network", "batch_size", "optimizer", "power_limit", "time_per_epoch",
                  "average_power")


def trace_profiles(path: str | Path) -> list[Profile]:
    """Every profile in a per-power-limit trace (one per workload, batch size and optimizer).

    Columns: ``dataset``, ``network``, ``batch_size``, ``optimizer``, ``power_limit`` (W),
    ``time_per_epoch`` (s), ``average_power`` (W); energy per epoch is their product. Profile
    names are ``dataset/network/batch_size/optimizer``.
    """
    path = _require(path)
    groups: dict[str, list[LimitPoint]] = {}
    seen: dict[tuple[str, float], int] = {}
    for line, row in _rows(path, _TRACE_COLUMNS):
        key = f"{row['dataset']}/{row['network']}/{row['batch_size']}/{row['optimizer']}"
        t, limit, power = (_positive(path, line, row, c)
                           for c in ("time_per_epoch", "power_limit", "average_power"))
        if (key, limit) in seen:
            raise ProfileError(f"{path}, line {line}: power_limit {limit:g} W of {key} is already on "
                               f"line {seen[key, limit]}")
        seen[key, limit] = line
        groups.setdefault(key, []).append(LimitPoint(limit, t, t * power))
    return [Profile(name, tuple(points)) for name, points in groups.items()]


def load_power_trace(
    path: str | Path, workload: str, batch_size: int, optimizer: str | None = None
) -> Profile:
    """One profile of a per-power-limit trace (see :func:`trace_profiles`).

    Args:
        path: The trace CSV.
        workload: ``DATASET/NETWORK``, e.g. ``cifar100/shufflenetv2``.
        batch_size: The batch size.
        optimizer: Needed only where the trace has several for this workload and batch size.

    Raises:
        ProfileError: Nothing matches, or several optimizers match and none was given.
    """
    prefix = f"{workload}/{batch_size}/"
    matches = [p for p in trace_profiles(path) if p.name.startswith(prefix)]
    if optimizer is not None:
        matches = [p for p in matches if p.name == prefix + optimizer]
    if not matches:
        raise ProfileError(f"{path}: no profile for {workload} batch size {batch_size}"
                           + (f" optimizer {optimizer}" if optimizer else ""))
    if len(matches) > 1:
        names = ", ".join(p.name.rsplit("/", 1)[-1] for p in matches)
        raise ProfileError(f"{path}: {workload} batch size {batch_size} has several optimizers "
                           f"({names}); pass one")
    return matches[0]


def profiles_in(paths: Sequence[str | Path]) -> list[Profile]:
    """Load every profile in the given files (profile CSVs and traces alike)."""
    out: list[Profile] = []
    for p in paths:
        path = _require(p)
        with csv_rows(path, ProfileError) as reader:
            header = reader.fieldnames or []
        out.extend(trace_profiles(path) if "power_limit" in header else [load_profile_csv(path)])
    return out
