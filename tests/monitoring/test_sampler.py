from __future__ import annotations

import csv
import json
import math
import threading
import time
import warnings
from pathlib import Path

import pytest

from joules.clock import RealClock, VirtualClock
from joules.devices.sim import Constant, Periodic, SimCPU, SimGPU, Simulator
from joules.devices.sim.catalog import cpu_model, gpu_model
from joules.monitoring.sampler import CounterTracker, PowerSampler

A100 = gpu_model("A100")
V100 = gpu_model("V100")
P100 = gpu_model("P100")
XEON = cpu_model("XEON8480")


def circular_distance(a: float, b: float, period: float) -> float:
    d = (a - b) % period
    return min(d, period - d)


def arc_center(tracker: CounterTracker) -> float:
    return (tracker._arc_start + tracker._arc_len / 2) % tracker.period


def feed(tracker: CounterTracker, phase: float, t0: float, t1: float, poll: float = 0.029) -> float:
    """Poll a counter that steps at ``phase + k * period`` from t0 to t1; return the last time."""
    period = tracker.period
    t = t0
    while t <= t1:
        tracker.observe(t, float(math.floor((t - phase) / period)))
        t += poll
    return t - poll


# -- CounterTracker ---------------------------------------------------------------------------
def test_tracker_before_and_after_the_first_read() -> None:
    tr = CounterTracker(0.1)
    assert not tr.locked
    assert tr.update_time() is None
    assert tr.update_after(0.0) is None
    # The update that produced the first value seen came within a period before it.
    tr.observe(1.0, 5.0)
    assert tr.update_time() == pytest.approx((0.95, 0.05))
    tr.observe(1.05, 5.0)  # no change: nothing learned
    assert tr.update_time() == pytest.approx((0.95, 0.05))
    assert not tr.locked


def test_tracker_first_change_brackets_the_update() -> None:
    tr = CounterTracker(0.1)
    tr.observe(0.0, 1.0)
    tr.observe(0.029, 1.0)
    tr.observe(0.058, 2.0)  # the update happened in (0.029, 0.058]
    est = tr.update_time()
    assert est is not None
    assert est[0] == pytest.approx(0.0435)
    assert est[1] == pytest.approx(0.0145)
    assert not tr.locked  # 29 ms is more than a quarter period
    # The remembered updates: the first one after a value, with its estimated time.
    assert tr.update_after(1.0) == pytest.approx((0.0435, 2.0))
    assert tr.update_after(2.0) is None  # no later update yet
    assert tr.update_after(0.5) is None  # before anything remembered


def test_tracker_remembers_recent_updates_for_interpolation() -> None:
    tr = CounterTracker(0.1)
    feed(tr, 0.03, 0.0, 3.0)
    # Values are update counts: value v appeared at the update at 0.03 + v * 0.1.
    for v in (20.0, 25.0, 28.0):
        est = tr.update_after(v)
        assert est is not None
        assert est[1] == v + 1
        assert est[0] == pytest.approx(0.03 + (v + 1) * 0.1, abs=0.003)
    assert tr.update_after(29.0) is None
    # The updates within a span, oldest first, with their times narrowed by the learned phase.
    span = tr.updates(2.0, 2.5)
    assert [v for _, _, v in span] == [20.0, 21.0, 22.0, 23.0, 24.0]
    for t, half, v in span:
        assert t == pytest.approx(0.03 + v * 0.1, abs=0.003) and half <= 0.003
    assert tr.updates(5.0, 6.0) == []
    feed(tr, 0.03, 3.029, 3.029 + 0.1 * (CounterTracker.history + 5))
    assert tr.update_after(20.0) is None  # forgotten: only the last updates are kept


@pytest.mark.parametrize("phase", [0.0, 0.011, 0.037, 0.05, 0.074, 0.0999])
def test_tracker_learns_phase_within_a_few_ms_in_two_seconds(phase: float) -> None:
    tr = CounterTracker(0.1)
    last = feed(tr, phase, 0.0, 2.0)
    assert tr.locked
    assert tr._arc_len <= 0.004
    assert circular_distance(arc_center(tr), phase, 0.1) <= 0.003
    est, half = tr.update_time()  # type: ignore[misc]
    true_last_update = phase + math.floor((last - phase) / 0.1) * 0.1
    assert abs(est - true_last_update) <= half + 1e-9
    assert half <= 0.003


def test_tracker_contradiction_restarts_and_relearns() -> None:
    tr = CounterTracker(0.1)
    t = feed(tr, 0.05, 0.0, 2.0)
    assert circular_distance(arc_center(tr), 0.05, 0.1) <= 0.003
    # The counter's timing changes (e.g. a driver reset): the first change that cannot
    # be reconciled with the learned phase restarts the estimate from that observation.
    t2 = t + 0.029
    tr.observe(t2, float(math.floor((t2 - 0.0) / 0.1)) + 1000.0)  # a new, unrelated value
    assert tr._arc_len == pytest.approx(0.029)
    assert not tr.locked
    feed(tr, 0.0, t2 + 0.029, t2 + 2.5)
    assert tr.locked
    assert circular_distance(arc_center(tr), 0.0, 0.1) <= 0.003


def test_tracker_ignores_stale_reads_and_long_gaps() -> None:
    tr = CounterTracker(0.1)
    feed(tr, 0.02, 0.0, 1.0)
    arc = (tr._arc_start, tr._arc_len)
    est = tr.update_time()
    # A read older than the newest one (lost a race) changes nothing.
    tr.observe(0.5, -123.0)
    assert (tr._arc_start, tr._arc_len) == arc and tr.update_time() == est
    # A change seen after a gap longer than the period does not narrow the phase.
    tr.observe(5.0, 1e6)
    assert (tr._arc_start, tr._arc_len) == arc
    lo_hi = tr.update_time()
    assert lo_hi is not None


def test_tracker_learns_from_a_simulated_gpu_through_the_sampler() -> None:
    for index in range(4):
        clock = VirtualClock()
        gpu = SimGPU(A100, clock, index=index, workload=Constant(0.5))
        sampler = PowerSampler([gpu], clock=clock).start()
        tracker = sampler.tracker(index)
        assert tracker is not None and tracker.period == 0.1
        clock.advance(2.0)
        assert tracker.locked
        assert circular_distance(arc_center(tracker), gpu._phase, 0.1) <= 0.003
        sampler.stop()


# -- PowerSampler: configuration and lifecycle ------------------------------------------------
def test_default_interval_follows_the_fastest_sensor() -> None:
    clock = VirtualClock()
    a100, v100, p100 = SimGPU(A100, clock), SimGPU(V100, clock, 1), SimGPU(P100, clock, 2)
    assert PowerSampler([a100], clock=clock).interval_s == pytest.approx(0.029)
    assert PowerSampler([a100, v100], clock=clock).interval_s == pytest.approx(0.0107)  # floor
    assert PowerSampler([p100], clock=clock).interval_s == pytest.approx(0.0107)
    assert PowerSampler([], clock=clock).interval_s == 0.1
    assert PowerSampler([a100], clock=clock, interval_s=0.05).interval_s == 0.05
    with pytest.raises(ValueError, match="positive"):
        PowerSampler([a100], clock=clock, interval_s=0.0)
    assert PowerSampler([p100], clock=clock).tracker(2) is None


def test_start_stop_are_idempotent_and_stop_stops_sampling() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock)
    sampler = PowerSampler([gpu], clock=clock, interval_s=0.1)
    assert not sampler.running and sampler.sample_count(0) == 0
    assert sampler.start() is sampler
    sampler.start()
    assert sampler.running
    assert sampler.sample_count(0) == 1  # the first sample is taken at once
    clock.advance(1.0)
    assert sampler.sample_count(0) == 11
    sampler.stop()
    sampler.stop()
    assert not sampler.running
    clock.advance(1.0)
    assert sampler.sample_count(0) == 11


def test_flaky_reads_are_counted_not_fatal() -> None:
    class Flaky(SimGPU):
        calls = 0

        def power_w(self) -> float:
            Flaky.calls += 1
            if Flaky.calls % 3 == 0:
                raise RuntimeError("NVML hiccup")
            return super().power_w()

    clock = VirtualClock()
    gpu = Flaky(A100, clock, workload=Constant(1.0))
    sampler = PowerSampler([gpu], clock=clock, interval_s=0.1).start()
    clock.advance(3.05)
    assert sampler.errors == 10
    assert sampler.sample_count(0) == 21
    assert sampler.running


# -- integration ------------------------------------------------------------------------------
def test_integral_is_exact_at_constant_power_with_repeated_readings() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Constant(0.5))  # 227.5 W, reading changes every 0.1 s
    sampler = PowerSampler([gpu], clock=clock).start()  # every 29 ms: most readings repeat
    clock.advance(1.0)
    e1 = sampler.energy_integral(0, clock.now())
    clock.advance(10.0)
    e2 = sampler.energy_integral(0, clock.now())
    assert e2 - e1 == pytest.approx(227.5 * 10.0, abs=0.001 * 10.0 + 1e-9)
    # Between samples the latest reading is extrapolated.
    t = clock.now() + 0.0123
    assert sampler.energy_integral(0, t) - e2 == pytest.approx(227.5 * 0.0123, rel=1e-5)
    assert sampler.latest_power(0) == pytest.approx(227.5, abs=0.001)
    assert sampler.power_spread(0) == pytest.approx(0.0, abs=0.002)


def test_integral_tracks_a_slow_square_wave() -> None:
    clock = VirtualClock()
    gpu = SimGPU(V100, clock, workload=Periodic([(1.0, 1.0), (1.0, 0.0)]))
    sampler = PowerSampler([gpu], clock=clock).start()
    clock.advance(2.0)
    e0, t0 = sampler.energy_integral(0, clock.now()), gpu.true_energy_j()
    clock.advance(20.0)
    measured = sampler.energy_integral(0, clock.now()) - e0
    truth = gpu.true_energy_j() - t0
    assert truth == pytest.approx(10 * (290.0 + 40.0))
    assert measured == pytest.approx(truth, rel=0.002)
    clock.advance(0.1)  # just after a step up, recent readings spread widely
    assert sampler.power_spread(0) > 100.0


def test_energy_integral_is_constant_time_and_independent_of_the_ring_buffer() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Constant(1.0))
    sampler = PowerSampler([gpu], clock=clock, capacity=8).start()
    clock.advance(0.5)
    e0 = sampler.energy_integral(0, clock.now())
    clock.advance(200.0)  # thousands of samples through an 8-slot buffer
    assert sampler.sample_count(0) > 6000
    assert sampler.energy_integral(0, clock.now()) - e0 == pytest.approx(400.0 * 200.0, rel=1e-5)
    # Queries read no device and cost the same however long the sampler ran.
    reads = [0]
    original = gpu.power_w

    def counting_power() -> float:
        reads[0] += 1
        return original()

    gpu.power_w = counting_power  # type: ignore[method-assign]
    t0 = time.perf_counter()
    for _ in range(20000):
        sampler.energy_integral(0, clock.now())
    assert time.perf_counter() - t0 < 1.0
    assert reads[0] == 0


def test_first_query_takes_a_sample() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Constant(1.0))
    sampler = PowerSampler([gpu], clock=clock)  # not started
    assert sampler.energy_integral(0, clock.now()) == 0.0
    assert sampler.sample_count(0) == 1
    assert sampler.energy_integral(0, clock.now() + 2.0) == pytest.approx(800.0, abs=0.01)
    assert sampler.latest_power(0) == pytest.approx(400.0, abs=0.001)
    fresh = PowerSampler([SimGPU(A100, clock, 3, workload=Constant(0.0))], clock=clock)
    assert fresh.power_spread(3) == 0.0
    assert fresh.latest_power(3) == pytest.approx(55.0, abs=0.001)


# -- ring buffer and export -------------------------------------------------------------------
def test_ring_buffer_is_bounded_and_timeline_in_order_after_wrap() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Periodic([(0.5, 1.0), (0.5, 0.0)]))
    sampler = PowerSampler([gpu], clock=clock, interval_s=0.01, capacity=100).start()
    clock.advance(0.495)
    times, powers = sampler.timeline(0)
    assert len(times) == 50
    assert times[0] == 0.0 and times[-1] == pytest.approx(0.49)
    clock.advance(10.0)
    count = sampler.sample_count(0)
    assert count == pytest.approx(1050, abs=1)
    times, powers = sampler.timeline(0)
    assert len(times) == len(powers) == 100
    assert sampler._tracks[0].times.shape == (100,)
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] == pytest.approx(clock.now(), abs=0.011)
    assert times[-1] - times[0] == pytest.approx(0.99, abs=1e-6)
    assert set(powers.round(1)) <= {55.0, 400.0}
    # Returned arrays are copies.
    times[:] = 0
    assert sampler.timeline(0)[0][0] > 0


def test_timeline_at_exactly_capacity() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock)
    sampler = PowerSampler([gpu], clock=clock, interval_s=0.1, capacity=10).start()
    clock.advance(0.95)  # 10 samples: 0.0 .. 0.9
    times, _ = sampler.timeline(0)
    assert list(times.round(6)) == [round(0.1 * i, 6) for i in range(10)]
    clock.advance(0.1)  # one more: the oldest goes
    times, _ = sampler.timeline(0)
    assert list(times.round(6)) == [round(0.1 * i, 6) for i in range(1, 11)]


def test_an_export_past_the_ring_says_which_samples_it_left_out(tmp_path: Path) -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock)
    sampler = PowerSampler([gpu], clock=clock, interval_s=0.1, capacity=10).start()
    clock.advance(0.95)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all 10 kept: no warning
        sampler.export(tmp_path / "full.csv")
    clock.advance(0.5)  # 15 samples taken
    left_out = r"GPU 0: the first 5 of 15 samples, before t = 0.5 s, are not kept"
    with pytest.warns(RuntimeWarning, match=left_out):
        out = sampler.export(tmp_path / "ring.csv")
    assert len(out.read_text().splitlines()) == 11


def test_export_csv_and_jsonl(tmp_path: Path) -> None:
    clock = VirtualClock()
    g0 = SimGPU(A100, clock, 0, workload=Constant(1.0))
    g1 = SimGPU(V100, clock, 1, workload=Constant(0.0))
    sampler = PowerSampler([g0, g1], clock=clock, interval_s=0.1).start()
    clock.advance(0.45)
    out = sampler.export(tmp_path / "timeline.csv")
    assert out == tmp_path / "timeline.csv"
    with out.open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["time_s", "device", "power_w"]
    body = rows[1:]
    assert len(body) == 10
    assert [float(r[0]) for r in body] == sorted(float(r[0]) for r in body)
    assert {r[1] for r in body} == {"gpu0", "gpu1"}
    assert all(float(r[2]) == pytest.approx(400.0, abs=0.002) for r in body if r[1] == "gpu0")
    assert all(float(r[2]) == pytest.approx(40.0, abs=0.002) for r in body if r[1] == "gpu1")

    out = sampler.export(str(tmp_path / "timeline.jsonl"))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 10
    assert set(lines[0]) == {"time_s", "device", "power_w"}
    assert [x["time_s"] for x in lines] == sorted(x["time_s"] for x in lines)

    with pytest.raises(ValueError, match=r"\.csv or \.jsonl"):
        sampler.export(tmp_path / "timeline.txt")
    assert not (tmp_path / "timeline.txt").exists()


# -- CPU counters -----------------------------------------------------------------------------
def test_cpu_counters_are_polled_often_enough_to_catch_every_wrap() -> None:
    clock = VirtualClock()
    model = XEON.with_overrides(wrap_j=100.0)  # wraps every ~0.29 s at 350 W
    cpu = SimCPU(model, clock, workload=Constant(1.0))
    gpu = SimGPU(A100, clock, workload=Constant(0.5))
    sampler = PowerSampler([gpu], [cpu], clock=clock).start()
    assert sampler._cpu_period_s <= cpu.max_read_interval_s() / 4 + 1e-12
    p0, d0 = cpu.package_energy_j(), cpu.dram_energy_j()
    t0p, t0d = cpu.true_package_energy_j(), cpu.true_dram_energy_j()
    clock.advance(60.0)  # ~210 package wraps, nobody but the sampler reads the counters
    pkg = cpu.package_energy_j() - p0
    dram = cpu.dram_energy_j() - d0
    assert pkg == pytest.approx(cpu.true_package_energy_j() - t0p, abs=2 * 0.35)
    assert pkg == pytest.approx(350.0 * 60.0, abs=2 * 0.35)
    assert dram == pytest.approx(cpu.true_dram_energy_j() - t0d, abs=2 * 0.045)


def test_cpu_counters_are_read_by_the_clock_while_ticks_are_held_up() -> None:
    """A GPU read that blocks 0.6 s held every tick up: CPU zones read every 17 ticks went
    10 s unread, past their 2 s wrap time, and 12 kJ of wraps vanished in a minute."""
    clock = VirtualClock()
    cpu = SimCPU(XEON.with_overrides(wrap_j=2000.0), clock, workload=Constant(1.0))
    gpu = SimGPU(A100, clock, workload=Constant(0.5))
    real = gpu.power_w

    def blocking_power_w() -> float:
        clock.sleep(0.6)
        return real()

    sampler = PowerSampler([gpu], [cpu], clock=clock).start()
    clock.advance(1.0)
    p0, t0 = cpu.package_energy_j(), cpu.true_package_energy_j()
    gpu.power_w = blocking_power_w  # type: ignore[method-assign]
    clock.advance(60.0)
    gpu.power_w = real  # type: ignore[method-assign]
    clock.advance(1.0)
    assert cpu.package_energy_j() - p0 == pytest.approx(cpu.true_package_energy_j() - t0, abs=1.0)
    sampler.stop()


def test_cpu_only_sampler_polls_counters() -> None:
    clock = VirtualClock()
    cpu = SimCPU(XEON.with_overrides(wrap_j=50.0), clock, workload=Constant(1.0))
    sampler = PowerSampler([], [cpu], clock=clock, interval_s=0.01).start()
    p0 = cpu.package_energy_j()
    clock.advance(10.0)
    assert cpu.package_energy_j() - p0 == pytest.approx(3500.0, abs=0.7)
    sampler.stop()


def test_tracker_uses_read_brackets_so_a_descheduled_read_teaches_nothing_wrong() -> None:
    tr = CounterTracker(0.1)
    feed(tr, 0.0, 0.0, 2.0)  # phase 0 learned: updates at k * 0.1
    before = tr.update_time()
    assert before is not None
    # A read began at 2.005 (value of the 2.0 update) but its thread was descheduled and
    # the read ended at 2.26, after two more updates. Bracketed, it says nothing false.
    value_at_2005 = float(math.floor(2.005 / 0.1 + 1e-9))
    tr.observe(2.26, value_at_2005, t_before=2.005)
    # The next read sees the 2.2 update: it happened in (2.005, 2.27], and the learned phase
    # picks the latest consistent update time, 2.2.
    tr.observe(2.27, value_at_2005 + 2.0, t_before=2.265)
    est, half = tr.update_time()  # type: ignore[misc]
    assert abs(est - 2.2) <= half + 1e-9 and half <= 0.003
    assert tr.locked


def test_tracker_pairs_a_stale_concurrent_read_with_its_own_value() -> None:
    tr = CounterTracker(0.1)
    feed(tr, 0.0, 0.0, 2.0)  # phase 0 learned: updates at k * 0.1, value k
    # Thread A's read begins at 2.095 (value 20, before the 2.1 update) and ends at 2.12;
    # meanwhile thread B read 21 in [2.101, 2.11]. A's value is older than B's.
    value, est, half = tr.observe(2.11, 21.0, t_before=2.101)
    assert value == 21.0 and abs(est - 2.1) <= half + 1e-9
    value, est, half = tr.observe(2.12, 20.0, t_before=2.095)
    # The value returned belongs with the update time returned: the newer value and its update.
    assert value == 21.0 and abs(est - 2.1) <= half + 1e-9 and half <= 0.01
    assert tr.resets == 0


def test_tracker_restarts_when_counter_resets() -> None:
    tr = CounterTracker(0.1)
    feed(tr, 0.0, 0.0, 1.0)
    tr.observe(1.5, 0.0, t_before=1.49)  # later read, lower value: the counter was reset
    assert not tr.locked
    assert tr.update_after(0.0) is None


def test_power_tracker_treats_a_long_unchanged_reading_as_current() -> None:
    tr = CounterTracker(0.1, monotonic=False)
    t = 0.0
    while t < 0.3:
        tr.observe(t, 250.0)
        t += 0.029
    assert tr.current(t) is None  # three periods unchanged: not yet trusted
    while t < 0.8:
        tr.observe(t, 250.0)
        t += 0.029
    last = t - 0.029
    known = tr.current(last + 0.05)
    assert known is not None and known[0] == 250.0
    assert tr.current(last + 0.2) is None  # more than a period after the latest read
    tr.observe(last + 0.01, 300.0)  # a change: no longer steady
    assert tr.current(last + 0.02) is None


def test_tracker_remembers_updates_long_enough_for_long_windows() -> None:
    tr = CounterTracker(0.02)  # a V100's 20 ms counter
    feed(tr, 0.0, 0.0, 6.0, poll=0.0107)
    old_value = float(math.floor(1.0 / 0.02))  # the counter's value 5 s ago
    after = tr.update_after(old_value)
    assert after is not None
    t_next, value = after
    assert value == old_value + 1.0
    assert abs(t_next - 1.02) < 0.003


def test_the_learned_phase_never_drops_the_true_one() -> None:
    # An update seen in an interval that meets the learned arc in two pieces may lie in
    # either: narrowing to the larger one lost the true phase (20 ms counters, uneven polls).
    import random

    rng = random.Random(1)
    lost = 0
    for _ in range(300):
        period = rng.choice([0.02, 0.1])
        step = max(0.0107, 0.29 * period)
        phase = rng.uniform(0, period)
        tracker = CounterTracker(period)
        t = rng.uniform(0, 0.01)
        while t < 3.0:
            tracker.observe(t, float(math.floor((t - phase) / period)))
            start, length = tracker._arc_start, tracker._arc_len
            if length < period and (phase - start) % period > length + 1e-9:
                lost += 1
                break
            t += step * rng.uniform(0.9, 1.6)
    assert lost == 0


def test_starting_from_two_threads_at_once_starts_one_sampler_thread() -> None:
    def sampler_threads() -> int:
        return sum(t.name == "joules-sampler" for t in threading.enumerate())

    before = sampler_threads()
    for _ in range(10):
        sampler = PowerSampler(Simulator.realtime("A100,nocpu").gpus, clock=RealClock())
        barrier = threading.Barrier(2)
        def go(b: threading.Barrier = barrier, s: PowerSampler = sampler) -> None:
            b.wait()
            s.start()

        starters = [threading.Thread(target=go) for _ in range(2)]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        sampler.stop()
    deadline = time.monotonic() + 5.0
    while sampler_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sampler_threads() == before
