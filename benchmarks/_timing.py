"""Timing of measurement windows shared by the benchmark scripts (no other dependency)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable


def spread_windows(begin: Callable[[str], object], end: Callable[[str], object], n: int,
                   max_pause_s: float) -> list[float]:
    """Seconds spent in ``begin(name)`` + ``end(name)`` for ``n`` windows, each followed by a
    random pause of up to ``max_pause_s``, so that their edges fall at every phase of the
    counters' updates, as in a training loop (back-to-back windows all fall at one phase)."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        begin("w")
        end("w")
        out.append(time.perf_counter() - t0)
        time.sleep(rng.uniform(0.0, max_pause_s))
    return out
