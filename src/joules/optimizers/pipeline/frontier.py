"""Frequency plans, their evaluation, and the time-energy frontier they form.

A :class:`Plan` gives every computation of one iteration an SM frequency. Its iteration time
is the longest path through the DAG with each computation's profiled time, and its energy is
the computations' energy plus every GPU's blocked time (the iteration time minus the time it
computes) at the blocking power. A :class:`Frontier` is the list of plans where no faster plan
uses less energy, fastest first.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from joules.errors import JoulesError
from joules.optimizers.pipeline.profile import Option, PipelineProfile
from joules.optimizers.pipeline.schedule import PipelineDAG, build_dag

FORMAT_VERSION = 1


class PlanError(JoulesError, ValueError):
    """A plan or frontier file is malformed, or a plan does not fit its pipeline."""


@dataclass(frozen=True)
class Plan:
    """One frequency per computation, with its iteration time and energy.

    Attributes:
        frequencies: SM frequency (MHz) of each DAG node, by node id.
        time_s: Iteration time, s.
        energy_j: Energy of the iteration on all stages' GPUs, blocking included, J.
    """

    frequencies: tuple[int, ...]
    time_s: float
    energy_j: float

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly form."""
        return {"time_s": self.time_s, "energy_j": self.energy_j, "frequencies": list(self.frequencies)}


@dataclass
class Timeline:
    """Start and end time of every computation of a plan (as early as dependencies allow)."""

    start_s: list[float]
    end_s: list[float]

    @property
    def time_s(self) -> float:
        """Iteration time: when the last computation ends."""
        return max(self.end_s, default=0.0)


def option_table(dag: PipelineDAG, profile: PipelineProfile) -> list[dict[int, Option]]:
    """For each node id, its profiled options by frequency."""
    profile.check_covers(dag.stages)
    return [{o.frequency: o for o in profile.of(c.stage, c.kind)} for c in dag.nodes]


def timeline(dag: PipelineDAG, durations: Sequence[float]) -> Timeline:
    """Earliest start and end of every node given its duration."""
    preds = dag.predecessors()
    start = [0.0] * len(dag.nodes)
    end = [0.0] * len(dag.nodes)
    for v in range(len(dag.nodes)):  # nodes are in topological order
        s = max((end[u] for u in preds[v]), default=0.0)
        start[v] = s
        end[v] = s + durations[v]
    return Timeline(start, end)


def evaluate(
    dag: PipelineDAG, profile: PipelineProfile, frequencies: Sequence[int], blocking_power_w: float
) -> Plan:
    """The :class:`Plan` of running each node at ``frequencies[node]``.

    Raises:
        PlanError: Wrong length, or a frequency the profile lacks for that computation.
    """
    return plan_of(dag, chosen_options(dag, profile, frequencies), blocking_power_w)


def chosen_options(dag: PipelineDAG, profile: PipelineProfile, frequencies: Sequence[int]) -> list[Option]:
    """The profiled option of each node at ``frequencies[node]``.

    Raises:
        PipelineProfileError: The profile does not cover the pipeline's stages.
        PlanError: Wrong length, or a frequency the profile lacks for that computation.
    """
    table = option_table(dag, profile)
    if len(frequencies) != len(dag.nodes):
        raise PlanError(f"plan has {len(frequencies)} frequencies for {len(dag.nodes)} computations")
    chosen: list[Option] = []
    for node, (opts, f) in enumerate(zip(table, frequencies, strict=True)):
        if f not in opts:
            raise PlanError(f"profile {profile.name!r} has no {f} MHz option for {dag.nodes[node]}")
        chosen.append(opts[f])
    return chosen


def plan_of(dag: PipelineDAG, chosen: Sequence[Option], blocking_power_w: float) -> Plan:
    """The :class:`Plan` of running each node with option ``chosen[node]``."""
    tl = timeline(dag, [o.time_s for o in chosen])
    t = tl.time_s
    busy = sum(o.time_s for o in chosen)
    energy = sum(o.energy_j for o in chosen) + blocking_power_w * (dag.stages * t - busy)
    return Plan(tuple(o.frequency for o in chosen), t, energy)


def stage_instructions(dag: PipelineDAG, frequencies: Sequence[int]) -> list[list[dict[str, object]]]:
    """Each stage's instructions, in order, for the per-computation ``frequencies``.

    Raises:
        PlanError: ``frequencies`` does not have one entry per computation.
    """
    if len(frequencies) != len(dag.nodes):
        raise PlanError(f"plan has {len(frequencies)} frequencies for {len(dag.nodes)} computations")
    return [
        [{"computation": dag.nodes[n].kind, "microbatch": dag.nodes[n].microbatch,
          "frequency": int(frequencies[n])} for n in order]
        for order in dag.stage_order
    ]


def _positive(data: dict[str, object], key: str, zero: bool = False) -> float:
    """``data[key]`` as a finite number above 0 (or at least 0 with ``zero``), else PlanError."""
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero):
        need = "at least 0" if zero else "above 0"
        raise PlanError(f"malformed frontier: {key} is {value!r}, not a finite number {need}")
    return float(value)


@dataclass
class Frontier:
    """The time-energy frontier of one iteration.

    Attributes:
        dag: The pipeline.
        plans: Plans fastest first; each slower plan uses strictly less energy.
        max_frequency: The plan running everything at the highest profiled frequency.
        blocking_power_w: Power of a GPU blocked on communication, W.
        unit_time_s: Time unit the solver worked in, s.
        solve_time_s: Wall time the solver took, s.
        profile_name: Name of the profile planned from.
    """

    dag: PipelineDAG
    plans: list[Plan]
    max_frequency: Plan
    blocking_power_w: float
    unit_time_s: float
    solve_time_s: float = 0.0
    profile_name: str = ""
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def fastest(self) -> Plan:
        """The plan with the shortest iteration time (least energy among those)."""
        return self.plans[0]

    @property
    def min_time_s(self) -> float:
        """The shortest iteration time, s."""
        return self.plans[0].time_s

    def plan_for_time(self, time_s: float) -> Plan:
        """Straggler lookup: the least-energy plan whose iteration time is at most ``time_s``.

        When every pipeline must wait for a straggler taking ``time_s`` per iteration, this is
        the plan to run. Below the fastest time, the fastest plan.

        Raises:
            ValueError: ``time_s`` is not a number (NaN).
        """
        if math.isnan(time_s):
            raise ValueError("plan_for_time needs an iteration time, got NaN")
        # Plans go fastest first: the last one no slower than time_s.
        i = bisect.bisect_right(self.plans, time_s * (1 + 1e-12), key=lambda p: p.time_s)
        return self.plans[max(0, i - 1)]

    def energy_at(self, time_s: float) -> float:
        """Energy of :meth:`plan_for_time`, J."""
        return self.plan_for_time(time_s).energy_j

    def rank_plan(self, plan: Plan, stage: int) -> list[dict[str, object]]:
        """What stage ``stage``'s GPU runs, in order: ``{"computation", "microbatch", "frequency"}``."""
        if not 0 <= stage < self.dag.stages:
            raise PlanError(f"stage {stage} out of range (the pipeline has {self.dag.stages})")
        return stage_instructions(self.dag, plan.frequencies)[stage]

    def summary(self) -> dict[str, object]:
        """The CLI's ``--json`` summary."""
        return {
            "points": [{"time_s": p.time_s, "energy_j": p.energy_j} for p in self.plans],
            "min_time_s": self.min_time_s,
            "energy_at_min_time_j": self.fastest.energy_j,
            "max_frequency_energy_j": self.max_frequency.energy_j,
            "solve_time_s": self.solve_time_s,
        }

    def to_dict(self) -> dict[str, object]:
        """Everything, JSON-friendly (see :meth:`from_dict`)."""
        return {
            "version": FORMAT_VERSION,
            "schedule": self.dag.schedule,
            "stages": self.dag.stages,
            "microbatches": self.dag.microbatches,
            "blocking_power_w": self.blocking_power_w,
            "unit_time_s": self.unit_time_s,
            "solve_time_s": self.solve_time_s,
            "profile": self.profile_name,
            "meta": self.meta,
            "max_frequency": self.max_frequency.to_dict(),
            "plans": [p.to_dict() for p in self.plans],
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Frontier:
        """Inverse of :meth:`to_dict`.

        Raises:
            PlanError: A key is missing or does not fit the pipeline.
        """
        try:
            if data.get("version") != FORMAT_VERSION:
                raise PlanError(f"unsupported frontier format version {data.get('version')!r}")
            stages, microbatches = data["stages"], data["microbatches"]
            for name, value in (("stages", stages), ("microbatches", microbatches)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise PlanError(f"malformed frontier: {name} is {value!r}, not a positive integer")
            top = data["max_frequency"]
            if not isinstance(top, dict) or len(top["frequencies"]) != 2 * stages * microbatches:
                # (before the DAG is built: a huge count in a small file would take forever)
                raise PlanError(f"malformed frontier: max_frequency does not have {2 * stages * microbatches}"
                                f" frequencies for {stages} stages x {microbatches} microbatches")
            dag = build_dag(str(data["schedule"]), stages, microbatches)

            def plan(d: object) -> Plan:
                if not isinstance(d, dict):
                    raise PlanError(f"malformed frontier: a plan is {type(d).__name__}, not an object")
                freqs = tuple(d["frequencies"])
                if len(freqs) != len(dag.nodes):
                    raise PlanError(f"a plan has {len(freqs)} frequencies for {len(dag.nodes)} computations")
                bad = [f for f in freqs if isinstance(f, bool) or not isinstance(f, int) or f <= 0]
                if bad:
                    raise PlanError(f"malformed frontier: frequency {bad[0]!r} is not a positive integer")
                time_s, energy_j = _positive(d, "time_s"), _positive(d, "energy_j")
                return Plan(freqs, time_s, energy_j)

            plans = [plan(p) for p in data["plans"]]  # type: ignore[attr-defined]
            if not plans:
                raise PlanError("the frontier has no plans")
            for i in range(1, len(plans)):
                if not (plans[i].time_s > plans[i - 1].time_s and plans[i].energy_j < plans[i - 1].energy_j):
                    raise PlanError(f"malformed frontier: plan {i} is not slower and cheaper than "
                                    f"plan {i - 1} (plans go fastest first, energy decreasing)")
            return cls(
                dag=dag,
                plans=plans,
                max_frequency=plan(data["max_frequency"]),
                blocking_power_w=_positive(data, "blocking_power_w", zero=True),
                unit_time_s=_positive(data, "unit_time_s"),
                solve_time_s=float(data.get("solve_time_s", 0.0)),  # type: ignore[arg-type]
                profile_name=str(data.get("profile", "")),
                meta=dict(data.get("meta") or {}),  # type: ignore[call-overload]
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"malformed frontier: {type(e).__name__}: {e}") from None

    def save(self, directory: str | Path) -> Path:
        """Write ``frontier.json`` and, for the fastest plan, ``rank{stage}.json`` per stage.

        Rank files of an earlier plan with more stages are removed, so that none is left that
        belongs to another pipeline.

        Returns:
            The path of ``frontier.json``.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "frontier.json"
        path.write_text(json.dumps(self.to_dict()))
        for old in directory.glob("rank*.json"):
            tail = old.stem[len("rank"):]
            if tail.isdigit() and int(tail) >= self.dag.stages:
                old.unlink()
        for stage in range(self.dag.stages):
            (directory / f"rank{stage}.json").write_text(
                json.dumps({"stage": stage, "stages": self.dag.stages, "schedule": self.dag.schedule,
                            "microbatches": self.dag.microbatches, "time_s": self.fastest.time_s,
                            "energy_j": self.fastest.energy_j,
                            "instructions": self.rank_plan(self.fastest, stage)}, indent=1)
            )
        return path

    @classmethod
    def load(cls, path: str | Path) -> Frontier:
        """Read a ``frontier.json`` (or the directory holding one).

        Raises:
            PlanError: Missing or malformed file.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "frontier.json"
        if not path.is_file():
            raise PlanError(f"frontier file not found: {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise PlanError(f"cannot read the frontier {path}: {e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise PlanError(f"{path}: not JSON ({type(e).__name__}: {e})") from None
        if not isinstance(data, dict):
            raise PlanError(f"{path}: expected a JSON object")
        return cls.from_dict(data)
