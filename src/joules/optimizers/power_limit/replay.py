"""Replay a search on a recorded profile: what it would choose and what profiling would cost."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from joules.optimizers.power_limit.profile import Profile
from joules.optimizers.power_limit.search import Search


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of profiling a recorded workload with one search.

    Attributes:
        chosen_w: The limit the search chose.
        best_w: The best limit in hindsight (the selector over every limit of the profile).
        profiled_limits_w: Limits profiled, in order.
        overhead_energy_j: Extra energy of profiling, compared with running each profiled
            unit of work at the chosen limit instead.
        overhead_time_s: Extra time, likewise (negative where profiling ran faster).
    """

    chosen_w: float
    best_w: float
    profiled_limits_w: list[float]
    overhead_energy_j: float
    overhead_time_s: float

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return asdict(self)


def replay(profile: Profile, search: Search) -> ReplayResult:
    """Drive ``search`` with the profile's recorded points until it is done."""
    while (limit := search.next_limit()) is not None:
        search.record(profile.at(limit))
    chosen = profile.at(search.chosen())
    best = search.selector.choose(list(profile.points))
    profiled = search.profiled
    return ReplayResult(
        chosen_w=chosen.limit_w,
        best_w=best.limit_w,
        profiled_limits_w=profiled,
        overhead_energy_j=sum(profile.at(x).energy_j - chosen.energy_j for x in profiled),
        overhead_time_s=sum(profile.at(x).time_s - chosen.time_s for x in profiled),
    )
