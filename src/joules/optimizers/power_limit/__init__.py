"""GPU power-limit optimization: the online optimizer, selectors, searches, saved profiles, replay.

:class:`PowerLimitOptimizer` finds the best limit while a job trains; the searches and
selectors it uses can also be replayed on recorded profiles (see :func:`replay`).
"""

from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer, State
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
from joules.optimizers.power_limit.store import ProfileStore

__all__ = [
    "Adaptive", "FunctionSelector", "LimitPoint", "MaxSlowdown", "MinCost", "MinEnergy", "MinTime",
    "PowerLimitOptimizer", "Profile", "ProfileError", "ProfileStore", "ReplayResult", "Search",
    "Selector", "State", "Sweep", "load_power_trace", "load_profile_csv", "parse_selector",
    "profiles_in", "replay", "trace_profiles",
]
