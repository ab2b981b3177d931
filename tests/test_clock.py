from __future__ import annotations

import math
import threading
import time

import pytest

from joules.clock import RealClock, VirtualClock


# -- VirtualClock -----------------------------------------------------------------------------
def test_virtual_clock_starts_where_told_and_only_moves_when_advanced() -> None:
    clock = VirtualClock(start=12.5)
    assert clock.now() == 12.5
    assert clock.now() == 12.5
    assert clock.advance(0.5) == 13.0
    assert clock.now() == 13.0
    assert clock.advance(0.0) == 13.0
    assert clock.advance_to(20.0) == 20.0
    assert clock.now() == 20.0


def test_every_fires_at_once_then_each_period_with_due_time() -> None:
    clock = VirtualClock()
    calls: list[float] = []
    clock.every(0.25, calls.append)
    assert calls == [0.0]  # first call happens immediately
    clock.advance(1.0)
    assert calls == [0.0, 0.25, 0.5, 0.75, 1.0]
    clock.advance(0.1)
    assert calls[-1] == 1.0 and len(calls) == 5
    clock.advance(0.15)
    assert calls[-1] == pytest.approx(1.25) and len(calls) == 6


def test_callbacks_see_the_clock_at_their_due_time() -> None:
    clock = VirtualClock()
    seen: list[tuple[float, float]] = []
    clock.every(0.3, lambda t: seen.append((t, clock.now())))
    clock.advance(1.0)
    assert [a for a, _ in seen] == pytest.approx([0.0, 0.3, 0.6, 0.9])
    assert all(a == b for a, b in seen)
    assert clock.now() == 1.0


def test_timers_fire_in_time_order_across_timers() -> None:
    clock = VirtualClock()
    events: list[tuple[float, str]] = []
    clock.every(0.3, lambda t: events.append((t, "a")))
    clock.every(0.2, lambda t: events.append((t, "b")))
    clock.every(0.5, lambda t: events.append((t, "c")))
    events.clear()
    clock.advance(1.2)
    times = [t for t, _ in events]
    assert times == sorted(times)
    # Each name fires exactly at its own multiples.
    assert [round(t, 9) for t, n in events if n == "a"] == [0.3, 0.6, 0.9, 1.2]
    assert [round(t, 9) for t, n in events if n == "b"] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.2]
    assert [round(t, 9) for t, n in events if n == "c"] == [0.5, 1.0]
    # Equal due times fire in creation order (stable).
    at_06 = [n for t, n in events if abs(t - 0.6) < 1e-9]
    assert at_06 == ["a", "b"]


def test_a_period_too_short_to_move_the_clock_and_nan_are_refused() -> None:
    clock = VirtualClock(start=1.0)
    with pytest.raises(ValueError, match="too short to move the clock"):
        clock.every(1e-17, lambda t: None)  # 1.0 + 1e-17 == 1.0: it would fire forever
    with pytest.raises(ValueError, match="NaN"):
        clock.advance_to(float("nan"))
    assert clock.now() == 1.0


def test_cancel_stops_a_timer_and_is_idempotent() -> None:
    clock = VirtualClock()
    calls: list[float] = []
    timer = clock.every(0.1, calls.append)
    clock.advance(0.35)
    assert len(calls) == 4  # 0, .1, .2, .3
    timer.cancel()
    timer.cancel()
    clock.advance(10.0)
    assert len(calls) == 4
    assert clock.now() == pytest.approx(10.35)


def test_a_timer_can_cancel_itself_and_another_from_its_callback() -> None:
    clock = VirtualClock()
    calls: dict[str, int] = {"a": 0, "b": 0}
    timers = {}

    def a(t: float) -> None:
        calls["a"] += 1
        if calls["a"] == 3:
            timers["a"].cancel()
            timers["b"].cancel()

    def b(t: float) -> None:
        calls["b"] += 1

    timers["a"] = clock.every(0.1, a)
    timers["b"] = clock.every(0.1, b)
    clock.advance(1.0)
    # a: 0, .1, .2 (cancels at the third call); b fired at 0 and .1 and was due at .2 after a.
    assert calls == {"a": 3, "b": 2}


def test_timer_started_later_counts_from_its_start() -> None:
    clock = VirtualClock()
    clock.advance(0.05)
    calls: list[float] = []
    clock.every(0.1, calls.append)
    clock.advance(0.3)
    assert calls == pytest.approx([0.05, 0.15, 0.25, 0.35])


def test_non_positive_period_is_rejected() -> None:
    clock = VirtualClock()
    with pytest.raises(ValueError, match="positive"):
        clock.every(0.0, lambda t: None)
    with pytest.raises(ValueError, match="positive"):
        clock.every(-1.0, lambda t: None)
    with pytest.raises(ValueError, match="positive"):
        RealClock().every(0.0, lambda t: None)


def test_clock_cannot_go_backwards() -> None:
    clock = VirtualClock(start=5.0)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance_to(4.999)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-0.1)
    assert clock.now() == 5.0
    assert clock.advance_to(5.0) == 5.0  # standing still is fine


def test_a_callback_that_advances_the_clock_is_not_undone() -> None:
    clock = VirtualClock()
    seen: list[float] = []

    def tick(now: float) -> None:
        seen.append(now)
        if len(seen) == 2:
            clock.advance(5.0)  # e.g. a simulated workload sleeping inside a sampler tick

    clock.every(1.0, tick)
    clock.advance(2.0)
    assert seen[:2] == [0.0, 1.0] and clock.now() >= 6.0
    before = clock.now()
    clock.advance(0.5)
    assert clock.now() == before + 0.5
    # The ticks the callback skipped (2 to 5) are not fired in a burst at 6 s: one catch-up
    # call, then the period again, as a thread timer does.
    clock.advance(2.0)
    assert seen == [0.0, 1.0, 6.0, 7.0, 8.0]


def test_non_finite_periods_and_times_are_refused() -> None:
    clock = VirtualClock()
    for period in (math.nan, math.inf, 0.0, -1.0):
        with pytest.raises(ValueError, match="positive and finite"):
            clock.every(period, lambda now: None)
        with pytest.raises(ValueError, match="positive and finite"):
            RealClock().every(period, lambda now: None)
    clock.every(0.1, lambda now: None)
    for dt in (math.inf, math.nan):
        with pytest.raises(ValueError):
            clock.advance(dt)
    assert clock.now() == 0.0


def test_advance_from_many_threads_loses_no_time() -> None:
    clock = VirtualClock()
    clock.every(0.001, lambda now: time.sleep(0))  # yields: other threads run mid-advance
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(500):
                clock.advance(0.001)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and clock.now() == pytest.approx(2.0)


def test_sleep_advances_the_virtual_clock_and_fires_timers() -> None:
    clock = VirtualClock()
    calls: list[float] = []
    clock.every(1.0, calls.append)
    t0 = time.monotonic()
    clock.sleep(3600.0)
    assert time.monotonic() - t0 < 1.0  # an hour of virtual time is instant
    assert clock.now() == 3600.0
    assert len(calls) == 3601
    clock.sleep(0.0)
    assert clock.now() == 3600.0


def test_many_timer_ticks_are_fast() -> None:
    clock = VirtualClock()
    n = [0]

    def tick(t: float) -> None:
        n[0] += 1

    clock.every(0.01, tick)
    t0 = time.monotonic()
    clock.advance(1000.0)
    assert n[0] == pytest.approx(100_001, abs=2)
    assert time.monotonic() - t0 < 5.0


# -- RealClock --------------------------------------------------------------------------------
def test_real_clock_now_is_monotonic_and_sleep_sleeps() -> None:
    clock = RealClock()
    a = clock.now()
    clock.sleep(0.02)
    b = clock.now()
    assert b - a >= 0.019
    clock.sleep(0.0)
    clock.sleep(-1.0)  # no error, no wait
    assert clock.now() >= b


def test_real_clock_every_runs_on_a_thread_and_cancels() -> None:
    clock = RealClock()
    calls: list[tuple[float, str]] = []
    got_three = threading.Event()

    def cb(t: float) -> None:
        calls.append((t, threading.current_thread().name))
        if len(calls) >= 3:
            got_three.set()

    timer = clock.every(0.01, cb, name="test-timer")
    assert got_three.wait(5.0)
    timer.cancel()
    n = len(calls)
    time.sleep(0.05)
    assert len(calls) == n  # no calls after cancel returned
    timer.cancel()  # idempotent
    assert all(name == "test-timer" for _, name in calls)
    assert threading.current_thread().name != "test-timer"
    times = [t for t, _ in calls]
    assert times == sorted(times)
    assert not any(th.name == "test-timer" for th in threading.enumerate())


def test_real_clock_timer_can_cancel_itself_from_callback() -> None:
    clock = RealClock()
    done = threading.Event()
    holder: dict[str, object] = {}
    count = [0]
    ready = threading.Event()

    def cb(t: float) -> None:
        ready.wait(5.0)
        count[0] += 1
        if count[0] == 2:
            holder["timer"].cancel()  # type: ignore[attr-defined]
            done.set()

    holder["timer"] = clock.every(0.005, cb, name="self-cancel")
    ready.set()
    assert done.wait(5.0)
    time.sleep(0.03)
    assert count[0] == 2
