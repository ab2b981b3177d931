"""One training iteration of a pipeline-parallel job as a DAG of computations.

Each pipeline stage runs on its own GPU and executes its forward and backward computations
(one per microbatch) in the order its schedule dictates. A computation depends on the one
before it on the same stage, and on the computation of the same microbatch on the
neighbouring stage: forward ``(s, m)`` needs forward ``(s - 1, m)``'s activations, backward
``(s, m)`` needs backward ``(s + 1, m)``'s gradients, and the last stage's backward needs its
own forward.

Schedules:

* ``1f1b`` (PipeDream-Flush / Megatron): stage ``s`` runs ``S - s - 1`` warm-up forwards,
  then alternates one forward and one backward, then drains the remaining backwards.
* ``gpipe``: every stage runs all forwards, then all backwards (microbatch order).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Literal

SCHEDULES = ("1f1b", "gpipe")
Kind = Literal["forward", "backward"]
KINDS: tuple[Kind, ...] = ("forward", "backward")


@dataclass(frozen=True, order=True)
class Computation:
    """One forward or backward computation of one microbatch on one stage."""

    stage: int
    microbatch: int
    kind: Kind

    @property
    def name(self) -> str:
        """Short name, e.g. ``F3`` for the forward of microbatch 3 (stage implied)."""
        return f"{'F' if self.kind == 'forward' else 'B'}{self.microbatch}"

    def __str__(self) -> str:
        return f"stage {self.stage} {self.kind} {self.microbatch}"


@dataclass(frozen=True)
class PipelineDAG:
    """The computations of one iteration and their dependencies.

    Attributes:
        schedule: Schedule name (one of :data:`SCHEDULES`).
        stages: Number of pipeline stages (one GPU each).
        microbatches: Number of microbatches per iteration.
        nodes: Every computation; a node's id is its index here. Nodes are in a
            topological order.
        edges: ``(u, v)`` pairs of node ids: ``v`` cannot start before ``u`` ends.
        stage_order: For each stage, its node ids in execution order.
    """

    schedule: str
    stages: int
    microbatches: int
    nodes: tuple[Computation, ...]
    edges: tuple[tuple[int, int], ...]
    stage_order: tuple[tuple[int, ...], ...]
    _index: dict[Computation, int] = field(default_factory=dict, repr=False, compare=False)
    _preds: list[tuple[int, ...]] = field(default_factory=list, repr=False, compare=False)
    _succs: list[tuple[int, ...]] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index.update({c: i for i, c in enumerate(self.nodes)})
        preds: list[list[int]] = [[] for _ in self.nodes]
        succs: list[list[int]] = [[] for _ in self.nodes]
        for u, v in self.edges:
            preds[v].append(u)
            succs[u].append(v)
        self._preds.extend(tuple(x) for x in preds)
        self._succs.extend(tuple(x) for x in succs)

    def index(self, computation: Computation) -> int:
        """Node id of ``computation``."""
        return self._index[computation]

    def predecessors(self) -> list[tuple[int, ...]]:
        """For each node id, the ids it depends on (computed once)."""
        return self._preds

    def successors(self) -> list[tuple[int, ...]]:
        """For each node id, the ids that depend on it (computed once)."""
        return self._succs


def stage_sequence(schedule: str, stages: int, microbatches: int, stage: int) -> list[Computation]:
    """The computations stage ``stage`` executes, in order.

    Raises:
        ValueError: Unknown schedule, a count below 1, or ``stage`` not in ``0..stages-1`` (a
            global rank where the pipeline rank is meant, say).
    """
    schedule = _checked(schedule, stages, microbatches)
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage < stages:
        raise ValueError(f"stage must be one of 0..{stages - 1}, got {stage!r}")
    m_count = microbatches
    if schedule == "1f1b":
        warmup = min(stages - stage - 1, m_count)
        seq = [Computation(stage, m, "forward") for m in range(warmup)]
        for i in range(m_count - warmup):
            seq.append(Computation(stage, warmup + i, "forward"))
            seq.append(Computation(stage, i, "backward"))
        seq += [Computation(stage, m, "backward") for m in range(m_count - warmup, m_count)]
        return seq
    if schedule == "gpipe":
        return [Computation(stage, m, "forward") for m in range(m_count)] + [
            Computation(stage, m, "backward") for m in range(m_count)
        ]
    raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def _checked(schedule: str, stages: int, microbatches: int) -> str:
    """The schedule's name, lower-cased, once it and the counts are checked."""
    schedule = schedule.lower()
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1 (got {stages} and {microbatches})")
    return schedule


def build_dag(schedule: str, stages: int, microbatches: int) -> PipelineDAG:
    """Build the DAG of one iteration.

    Args:
        schedule: ``"1f1b"`` or ``"gpipe"``.
        stages: Number of stages, at least 1.
        microbatches: Number of microbatches, at least 1.

    Raises:
        ValueError: Unknown schedule or a count below 1.
    """
    schedule = _checked(schedule, stages, microbatches)
    sequences = [stage_sequence(schedule, stages, microbatches, s) for s in range(stages)]
    deps: dict[Computation, list[Computation]] = {c: [] for seq in sequences for c in seq}
    for seq in sequences:
        for a, b in zip(seq, seq[1:], strict=False):
            deps[b].append(a)
    for s in range(stages):
        for m in range(microbatches):
            if s > 0:
                deps[Computation(s, m, "forward")].append(Computation(s - 1, m, "forward"))
            if s < stages - 1:
                deps[Computation(s, m, "backward")].append(Computation(s + 1, m, "backward"))
            else:
                fwd = Computation(s, m, "forward")
                if fwd not in deps[Computation(s, m, "backward")]:
                    deps[Computation(s, m, "backward")].append(fwd)
    # Topological order (Kahn, ties broken by stage then position) so node ids are stable.
    position = {c: (i, c.stage) for seq in sequences for i, c in enumerate(seq)}
    indegree = {c: len(set(d)) for c, d in deps.items()}
    children: dict[Computation, list[Computation]] = {c: [] for c in deps}
    for c, ds in deps.items():
        for d in set(ds):
            children[d].append(c)
    ready = sorted((c for c, k in indegree.items() if k == 0), key=lambda c: position[c])
    order: list[Computation] = []
    while ready:
        c = ready.pop(0)
        order.append(c)
        for ch in children[c]:
            indegree[ch] -= 1
            if indegree[ch] == 0:
                ready.append(ch)
        ready.sort(key=lambda c: position[c])
    if len(order) != len(deps):  # pragma: no cover - schedules above are acyclic by construction
        raise RuntimeError(f"pipeline schedule {schedule!r} has a dependency cycle")
    index = {c: i for i, c in enumerate(order)}
    edges = sorted({(index[d], index[c]) for c, ds in deps.items() for d in ds})
    return PipelineDAG(
        schedule=schedule,
        stages=stages,
        microbatches=microbatches,
        nodes=tuple(order),
        edges=tuple(edges),
        stage_order=tuple(tuple(index[c] for c in seq) for seq in sequences),
    )
