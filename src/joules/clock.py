"""Clocks: the real monotonic clock and a virtual clock that tests advance by hand.

Everything in joules that needs the time or periodic work (devices, the monitor, the power
sampler) takes a :class:`Clock`. Real hardware uses :class:`RealClock`; simulated hardware
uses a :class:`VirtualClock`, on which periodic tasks run deterministically, in time order,
while the clock is advanced.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    """Handle of a periodic task started with :meth:`Clock.every`."""

    def cancel(self) -> None:
        """Stop the task. Idempotent."""


class Clock(Protocol):
    """Source of time (seconds, monotonic) and of periodic tasks."""

    def now(self) -> float:
        """Current time in seconds."""

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass."""

    def every(self, period: float, callback: Callable[[float], None], name: str = "") -> Timer:
        """Call ``callback(now)`` every ``period`` seconds until the timer is cancelled."""


class _ThreadTimer:
    """A daemon thread calling a function at a fixed period (no drift accumulation)."""

    def __init__(self, period: float, callback: Callable[[float], None], name: str) -> None:
        self._period = period
        self._callback = callback
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name or "joules-timer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self._callback(time.monotonic())
            next_t += self._period
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (slow callback): skip missed ticks, do not burst
                next_t = time.monotonic()
                delay = 0.0
            if self._stop.wait(delay):
                break

    @property
    def alive(self) -> bool:
        """Whether the task still runs: not cancelled, and its thread exists.

        A forked child has none of its parent's threads.
        """
        return not self._stop.is_set() and self._thread.is_alive()

    def cancel(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)


class RealClock:
    """Wall-clock monotonic time; periodic tasks run on daemon threads."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def every(self, period: float, callback: Callable[[float], None], name: str = "") -> Timer:
        if not (math.isfinite(period) and period > 0):
            raise ValueError(f"timer period must be positive and finite, got {period}")
        return _ThreadTimer(period, callback, name)


class _VirtualTimer:
    def __init__(self, clock: VirtualClock, period: float, callback: Callable[[float], None]):
        self.clock = clock
        self.period = period
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualClock:
    """A clock that only moves when told to.

    ``advance(dt)`` moves time forward and fires every periodic task due on the way, in time
    order, with the clock set to each task's due time while it runs. ``sleep`` advances the
    clock, so code written against :class:`Clock` runs unchanged (and instantly) on it.
    A callback that advances the clock past its timer's next ticks gets one catch-up call at
    once and then its period again, as a thread timer that fell behind skips missed ticks.

    Args:
        start: Initial time in seconds.

    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._queue: list[tuple[float, int, _VirtualTimer]] = []
        self._seq = itertools.count()
        self._lock = threading.RLock()

    def now(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def every(self, period: float, callback: Callable[[float], None], name: str = "") -> Timer:
        if not (math.isfinite(period) and period > 0):
            raise ValueError(f"timer period must be positive and finite, got {period}")
        if self._now + period == self._now:  # it would fire at one time forever
            raise ValueError(f"timer period {period} is too short to move the clock from {self._now} s")
        timer = _VirtualTimer(self, period, callback)
        with self._lock:
            # Like the thread timer, the first call happens at once.
            callback(self._now)
            heapq.heappush(self._queue, (self._now + period, next(self._seq), timer))
        return timer

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (>= 0), firing due timers. Returns the new time."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go backwards (advance by {seconds})")
        with self._lock:  # re-entrant: advance_to takes it again
            return self.advance_to(self._now + seconds)

    def advance_to(self, t: float) -> float:
        """Move time forward to ``t``, firing due timers. Returns the new time."""
        with self._lock:
            if t < self._now:
                raise ValueError(f"a clock cannot go backwards (from {self._now} to {t})")
            if not math.isfinite(t):
                raise ValueError(f"a clock cannot move to {t} (NaN or infinity)")
            while self._queue and self._queue[0][0] <= t:
                due, _, timer = heapq.heappop(self._queue)
                if timer.cancelled:
                    continue
                self._now = max(self._now, due)
                timer.callback(self._now)
                if not timer.cancelled:
                    if due + timer.period == due:  # the clock has grown past the period's resolution
                        raise ValueError(f"timer period {timer.period} is too short to move the clock "
                                         f"from {due} s")
                    # Past ticks a slow callback skipped: one catch-up call now, no burst.
                    next_due = max(due + timer.period, self._now)
                    heapq.heappush(self._queue, (next_due, next(self._seq), timer))
            self._now = max(self._now, t)  # a timer's callback may have advanced the clock further
            return self._now
