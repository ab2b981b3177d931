"""GPU power-limit optimization: profiles, selectors, search strategies and their replay.

The online optimizer that drives these during training is not written yet; the pieces here
are usable on their own to replay recorded profiles (see :func:`replay`).
"""

from joules.optimizers.power_limit.profile import (
    LimitPoint,
    Profile,
    ProfileError,
    load_power_trace,
    load_profile_csv,
    profiles_in,
    trace_profiles,
)
from joules.optimizers.power_limit.replay import ReplayResult, replay
from joules.optimizers.power_limit.search import Adaptive, Search, Sweep
from joules.optimizers.power_limit.selectors import (
    FunctionSelector,
    MaxSlowdown,
    MinCost,
    MinEnergy,
    MinTime,
    Selector,
    parse_selector,
)

__all__ = [
    "Adaptive", "FunctionSelector", "LimitPoint", "MaxSlowdown", "MinCost", "MinEnergy", "MinTime",
    "Profile", "ProfileError", "ReplayResult", "Search", "Selector", "Sweep", "load_power_trace",
    "load_profile_csv", "parse_selector", "profiles_in", "replay", "trace_profiles",
]
