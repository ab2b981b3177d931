"""Time and energy of each pipeline computation at each GPU frequency.

A profile is a CSV file with the header ``stage,instruction,frequency,time,energy``: for
each stage, each instruction (``forward`` or ``backward``) and each SM frequency (MHz), the
time (s) and the GPU energy (J) of one computation of one microbatch. Frequencies are
rounded to the nearest whole MHz; rows of one stage and instruction at the same frequency
(measured more than once) are averaged. :func:`synthetic_profile` makes GPU-like profiles for tests, demos and
benchmarks.
"""

from __future__ import annotations

import csv
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from joules.errors import JoulesError
from joules.optimizers.csvfile import csv_rows
from joules.optimizers.pipeline.schedule import KINDS

COLUMNS = ("stage", "instruction", "frequency", "time", "energy")


class PipelineProfileError(JoulesError, ValueError):
    """A pipeline profile is missing, malformed, or lacks a stage or instruction."""


@dataclass(frozen=True, order=True)
class Option:
    """Running one computation at one SM frequency.

    Attributes:
        frequency: SM clock, MHz.
        time_s: Time the computation takes, s.
        energy_j: GPU energy it takes, J.
    """

    frequency: int
    time_s: float
    energy_j: float


def pareto_front(options: Iterable[Option], blocking_power_w: float = 0.0) -> list[Option]:
    """The options no other option beats in both time and effective energy, fastest first.

    Effective energy is ``energy - blocking_power_w * time``: the GPU would otherwise spend
    that time blocked at ``blocking_power_w``. Among options with equal time and energy the
    higher frequency is dropped.
    """
    ranked = sorted(options, key=lambda o: (o.time_s, o.energy_j - blocking_power_w * o.time_s, o.frequency))
    front: list[Option] = []
    best = math.inf
    for o in ranked:
        eff = o.energy_j - blocking_power_w * o.time_s
        if eff < best - 1e-12 * max(1.0, abs(best) if math.isfinite(best) else 1.0):
            front.append(o)
            best = eff
    return front


@dataclass(frozen=True)
class PipelineProfile:
    """Options of every (stage, instruction).

    Attributes:
        options: ``{(stage, instruction): [Option, ...]}``, each list sorted by frequency.
        name: Where it came from (a file name, or a description).
    """

    options: dict[tuple[int, str], tuple[Option, ...]]
    name: str = "profile"

    @property
    def stages(self) -> int:
        """Number of stages the profile covers (stages are numbered from 0)."""
        return 1 + max(s for s, _ in self.options)

    def of(self, stage: int, instruction: str) -> tuple[Option, ...]:
        """The options of ``instruction`` on ``stage``.

        Raises:
            PipelineProfileError: The profile has none.
        """
        try:
            return self.options[(stage, instruction)]
        except KeyError:
            raise PipelineProfileError(
                f"profile {self.name!r} has no {instruction} rows for stage {stage}"
            ) from None

    def check_covers(self, stages: int) -> None:
        """Raise :class:`PipelineProfileError` unless stages ``0..stages-1`` all have both instructions."""
        missing = [f"stage {s} {k}" for s in range(stages) for k in KINDS if (s, k) not in self.options]
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise PipelineProfileError(
                f"profile {self.name!r} does not cover {stages} stages: no rows for {shown}"
            )

    def frequencies(self) -> list[int]:
        """Every frequency appearing in the profile, ascending."""
        return sorted({o.frequency for opts in self.options.values() for o in opts})

    @classmethod
    def from_rows(
        cls, rows: Iterable[tuple[int, str, float, float, float]], name: str = "profile"
    ) -> PipelineProfile:
        """Build from ``(stage, instruction, frequency, time_s, energy_j)`` rows.

        Frequencies are rounded to the nearest whole MHz; rows of one stage and instruction at
        the same (rounded) frequency are repeated measurements, averaged.

        Raises:
            PipelineProfileError: No rows, or a bad row (the message names it and the value):
                the checks :meth:`from_csv` makes of a file's rows.
        """
        sums: dict[tuple[int, str, int], list[float]] = {}
        for stage, instruction, frequency, time_s, energy_j in rows:
            problem = _row_problem(stage, instruction, frequency, time_s, energy_j)
            if problem is not None:
                field, why = problem
                value = {"stage": stage, "instruction": instruction, "frequency": frequency,
                         "time": time_s, "energy": energy_j}[field]
                row = f"({stage!r}, {instruction!r}, {frequency!r}, {time_s!r}, {energy_j!r})"
                raise PipelineProfileError(f"profile {name!r}, row {row}: {field} {value!r} {why}")
            acc = sums.setdefault((stage, instruction, int(round(frequency))), [0.0, 0.0, 0.0])
            acc[0] += time_s
            acc[1] += energy_j
            acc[2] += 1
        if not sums:
            raise PipelineProfileError(f"profile {name!r} has no rows")
        grouped: dict[tuple[int, str], list[Option]] = {}
        for (stage, instruction, frequency), (t, e, n) in sums.items():
            option = Option(frequency, float(t / n), float(e / n))  # plain numbers, even from numpy
            grouped.setdefault((stage, instruction), []).append(option)
        return cls({k: tuple(sorted(v)) for k, v in sorted(grouped.items())}, name=name)

    @classmethod
    def merge(cls, profiles: Sequence[PipelineProfile], name: str | None = None) -> PipelineProfile:
        """One profile from several, e.g. the one each rank measured of its own stage.

        Raises:
            PipelineProfileError: No profile, or two of them have rows for one stage and
                instruction (the message names both).
        """
        if not profiles:
            raise PipelineProfileError("no profiles to merge")
        options: dict[tuple[int, str], tuple[Option, ...]] = {}
        owner: dict[tuple[int, str], str] = {}
        for prof in profiles:
            for key, opts in prof.options.items():
                if key in options:
                    raise PipelineProfileError(f"profiles {owner[key]!r} and {prof.name!r} both have "
                                               f"{key[1]} rows for stage {key[0]}")
                options[key] = opts
                owner[key] = prof.name
        return cls(dict(sorted(options.items())), name=name or "+".join(p.name for p in profiles))

    @classmethod
    def from_csv(cls, path: str | Path) -> PipelineProfile:
        """Read a ``stage,instruction,frequency,time,energy`` CSV file.

        Frequencies are rounded to the nearest whole MHz, and rows at the same one averaged
        (see :meth:`from_rows`); blank lines are skipped.

        Raises:
            PipelineProfileError: The file is missing, a column is missing, or a row is bad
                (the message names the field and the row's line in the file).
        """
        path = Path(path)
        if not path.is_file():
            raise PipelineProfileError(f"pipeline profile not found: {path}")
        rows: list[tuple[int, str, int, float, float]] = []
        with csv_rows(path, PipelineProfileError) as reader:
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise PipelineProfileError(
                    f"{path}: missing column(s) {', '.join(missing)}; expected header {','.join(COLUMNS)}"
                )
            for raw in reader:
                extra = raw.get(None)  # type: ignore[call-overload]
                if extra:
                    raise PipelineProfileError(
                        f"{path}, line {reader.line_num}: {len(header) + len(extra)} fields where the "
                        f"header has {len(header)} ({', '.join(header)}); a comma inside a number?"
                    )
                row = {k.strip(): (v or "").strip() for k, v in raw.items() if k is not None}
                # The file's own line number (blank lines are skipped, yet counted).
                rows.append(_parse_row(path, reader.line_num, row))
        return cls.from_rows(rows, name=path.name)

    def to_csv(self, path: str | Path) -> None:
        """Write the profile as a CSV file :meth:`from_csv` reads back."""
        with Path(path).open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            for (stage, instruction), opts in self.options.items():
                for o in opts:
                    w.writerow([stage, instruction, o.frequency, repr(o.time_s), repr(o.energy_j)])


def _parse_row(path: Path, line: int, row: dict[str, str]) -> tuple[int, str, int, float, float]:
    def bad(field: str, why: str) -> PipelineProfileError:
        return PipelineProfileError(f"{path}, line {line}: {field} {row.get(field)!r} {why}")

    try:
        stage = int(row["stage"])
    except ValueError:
        raise bad("stage", "is not an integer") from None
    instruction = row["instruction"].lower()
    values = {}
    for field in ("frequency", "time", "energy"):
        try:
            values[field] = float(row[field])
        except ValueError:
            raise bad(field, "is not a number") from None
    problem = _row_problem(stage, instruction, values["frequency"], values["time"], values["energy"])
    if problem is not None:
        raise bad(*problem)
    # The nearest whole MHz (as StageProfiler records it): 1409.9999 is 1410, 1410.9 is 1411.
    return stage, instruction, int(round(values["frequency"])), values["time"], values["energy"]


def _row_problem(stage: object, instruction: object, frequency: float, time_s: float,
                 energy_j: float) -> tuple[str, str] | None:
    """What is wrong with a profile row, as ``(field, why)``; ``None`` when nothing is."""
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral):
        return "stage", "is not an integer"
    if stage < 0:
        return "stage", "is negative"
    if instruction not in KINDS:
        return "instruction", f"is not one of {', '.join(KINDS)}"
    if not isinstance(frequency, numbers.Real) or not math.isfinite(frequency):
        return "frequency", "is not a finite number"
    if round(frequency) <= 0:
        return "frequency", "must be positive"
    if round(frequency) > MAX_FREQUENCY_MHZ:
        return "frequency", f"is beyond {MAX_FREQUENCY_MHZ} (MHz are expected)"
    for field, v in (("time", time_s), ("energy", energy_j)):
        if not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
            return field, "must be a positive finite number"
        if v > _MAX_VALUE[field]:
            return field, f"is beyond {_MAX_VALUE[field]:g} (seconds and joules are expected)"
    return None


MAX_FREQUENCY_MHZ = 100_000  # far above any GPU's clock: a frequency in Hz or kHz is refused
# Far above any one computation (a day; a petajoule), low enough that sums stay finite.
_MAX_VALUE = {"time": 86_400.0, "energy": 1e15}


# -- synthetic profiles --------------------------------------------------------------------

@dataclass(frozen=True)
class GPUCurve:
    """A GPU-like frequency curve for :func:`synthetic_profile`.

    Attributes:
        name: Label.
        min_mhz, max_mhz, step_mhz: The SM clocks offered.
        static_w: Power drawn at any clock while computing (leakage, memory, fans), W.
        dynamic_w: Extra power at the highest clock, W; it scales with frequency times
            voltage squared, the voltage following the clock down to ``voltage_floor``
            (as a fraction of the highest clock) and staying there below it.
        voltage_floor: See ``dynamic_w``.
        compute_fraction: Share of a computation's time that scales with the clock.
        blocking_w: Power while blocked on communication, W.
    """

    name: str
    min_mhz: int
    max_mhz: int
    step_mhz: int
    static_w: float
    dynamic_w: float
    voltage_floor: float
    compute_fraction: float
    blocking_w: float

    def clocks(self, lowest_mhz: int | None = None) -> list[int]:
        """Offered clocks from ``lowest_mhz`` (default ``min_mhz``) to ``max_mhz``."""
        lo = self.min_mhz if lowest_mhz is None else max(self.min_mhz, lowest_mhz)
        return [f for f in range(self.max_mhz, lo - 1, -self.step_mhz)][::-1]

    def time_energy(self, base_time_s: float, frequency: int) -> tuple[float, float]:
        """Time and energy of a computation taking ``base_time_s`` at the highest clock."""
        x = frequency / self.max_mhz
        t = base_time_s * ((1.0 - self.compute_fraction) + self.compute_fraction / x)
        v = max(x, self.voltage_floor)
        busy = self.compute_fraction / x / ((1.0 - self.compute_fraction) + self.compute_fraction / x)
        p = self.static_w + self.dynamic_w * x * v * v * (0.35 + 0.65 * busy)
        return t, p * t


CURVES: dict[str, GPUCurve] = {
    # Loosely shaped after public specs and DVFS measurements of each GPU class.
    "a100": GPUCurve("a100", 210, 1410, 15, 95.0, 300.0, 0.72, 0.85, 85.0),
    "h100": GPUCurve("h100", 345, 1980, 15, 130.0, 520.0, 0.65, 0.80, 110.0),
    "v100": GPUCurve("v100", 135, 1530, 15, 60.0, 220.0, 0.78, 0.90, 55.0),
    "a40": GPUCurve("a40", 210, 1740, 15, 70.0, 230.0, 0.75, 0.70, 65.0),
}


def synthetic_profile(
    stages: int,
    gpu: str = "a100",
    *,
    forward_time_s: float = 0.030,
    backward_ratio: float = 2.0,
    imbalance: float = 0.15,
    lowest_mhz: int | None = 900,
    noise: float = 0.0,
    seed: int = 0,
) -> PipelineProfile:
    """A GPU-like profile for ``stages`` stages.

    Each stage's forward takes about ``forward_time_s`` at the highest clock, each stage
    differing by up to ``imbalance`` (a stage's share of layers never splits evenly), and
    backward takes ``backward_ratio`` times as long. ``noise`` multiplies every time and
    energy by log-normal noise (as measurements have; relative standard deviation about
    ``noise`` when small, and never a value of 0 or below).

    Args:
        stages: Number of stages.
        gpu: A key of :data:`CURVES`.
        forward_time_s: Mean forward time at the highest clock, s.
        backward_ratio: Backward time over forward time.
        imbalance: Relative spread of stage times.
        lowest_mhz: Lowest clock profiled (lower clocks are rarely worth it).
        noise: Standard deviation of the log of the measurement noise (about the relative one).
        seed: Random seed.
    """
    try:
        curve = CURVES[gpu.lower()]
    except KeyError:
        raise PipelineProfileError(f"unknown GPU curve {gpu!r}; choose one of {', '.join(CURVES)}") from None
    rng = np.random.default_rng(seed)
    rows: list[tuple[int, str, int, float, float]] = []
    for s in range(stages):
        scale = 1.0 + imbalance * float(rng.uniform(-1.0, 1.0))
        for kind, ratio in (("forward", 1.0), ("backward", backward_ratio)):
            base = forward_time_s * scale * ratio * (1.0 + 0.03 * float(rng.standard_normal()))
            for f in curve.clocks(lowest_mhz):
                t, e = curve.time_energy(base, f)
                if noise > 0:  # log-normal: relative noise that keeps times and energies positive
                    t *= math.exp(noise * float(rng.standard_normal()))
                    e *= math.exp(noise * float(rng.standard_normal()))
                rows.append((s, kind, f, t, e))
    return PipelineProfile.from_rows(rows, name=f"synthetic-{curve.name}-{stages}stages-seed{seed}")


def blocking_power_w(gpu: str) -> float:
    """The blocking power of a synthetic GPU curve, W."""
    try:
        return CURVES[gpu.lower()].blocking_w
    except KeyError:
        raise PipelineProfileError(f"unknown GPU curve {gpu!r}; choose one of {', '.join(CURVES)}") from None

