from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from _fork import held_in_thread, needs_fork, run_in_forked_child

from joules.clock import RealClock, VirtualClock
from joules.devices.base import WrappingCounter
from joules.devices.sim import (
    CPU_MODELS,
    GPU_MODELS,
    Constant,
    Idle,
    Periodic,
    SimCPU,
    SimGPU,
    Simulator,
    Trace,
    parse_spec,
)
from joules.devices.sim.catalog import cpu_model, gpu_model
from joules.errors import DevicePermissionError, InvalidSpecError, NotSupportedError

A100 = gpu_model("A100")
V100 = gpu_model("V100")
P100 = gpu_model("P100")
XEON = cpu_model("XEON8480")
EPYC = cpu_model("EPYC7763")


def a100_power(u: float) -> float:
    return 55.0 + u * (400.0 - 55.0)


# -- parse_spec / Simulator -------------------------------------------------------------------
def test_parse_single_gpu_adds_default_cpu() -> None:
    gpus, cpus = parse_spec("A100")
    assert [g.name for g in gpus] == ["NVIDIA A100-SXM4-40GB"]
    assert [c.name for c in cpus] == ["Intel Xeon Platinum 8480+"]


def test_parse_counts_and_lists() -> None:
    gpus, cpus = parse_spec("H100x4")
    assert [g.name for g in gpus] == ["NVIDIA H100 80GB HBM3"] * 4
    assert len(cpus) == 1
    gpus, cpus = parse_spec("V100,A40")
    assert [g.arch for g in gpus] == ["volta", "ampere"]
    assert [g.name for g in gpus] == ["Tesla V100-SXM2-32GB", "NVIDIA A40"]
    gpus, cpus = parse_spec("A100x2,EPYC7763x2")
    assert len(gpus) == 2 and [c.name for c in cpus] == ["AMD EPYC 7763"] * 2
    gpus, cpus = parse_spec(" a100X2 , xeon6248 ")  # case and spaces do not matter
    assert len(gpus) == 2 and [c.name for c in cpus] == ["Intel Xeon Gold 6248"]


def test_parse_nocpu_and_cpu_only() -> None:
    assert parse_spec("nocpu") == ([], [])
    gpus, cpus = parse_spec("H200,NOCPU")
    assert [g.name for g in gpus] == ["NVIDIA H200"] and cpus == []
    gpus, cpus = parse_spec("XEON8480x2")
    assert gpus == [] and len(cpus) == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("B200", "unknown model 'B200'"),
        ("A100x0", "bad count"),
        ("A100x65", "bad count"),
        ("A100-2", "bad SPEC item 'A100-2'"),
        ("A100,,V100", "bad SPEC item ''"),
        ("2xA100", "bad SPEC item"),
        ("XEON8480,nocpu", "'nocpu' at once"),
    ],
)
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message.replace("(", r"\(")) as info:
        parse_spec(spec)
    assert isinstance(info.value, ValueError)


def test_unknown_model_message_lists_known_models() -> None:
    with pytest.raises(InvalidSpecError) as info:
        parse_spec("A100,T4")
    text = str(info.value)
    for key in [*GPU_MODELS, *CPU_MODELS, "nocpu"]:
        assert key in text
    with pytest.raises(InvalidSpecError, match="known"):
        gpu_model("T4")
    with pytest.raises(InvalidSpecError, match="known"):
        cpu_model("i9")


def test_simulator_builds_devices_with_indices_and_distinct_phases() -> None:
    sim = Simulator("A100x3,EPYC7763x2")
    assert isinstance(sim.clock, VirtualClock)
    assert [g.index for g in sim.gpus] == [0, 1, 2]
    assert [c.index for c in sim.cpus] == [0, 1]
    assert len({g.uuid for g in sim.gpus}) == 3
    ds = sim.devices()
    assert ds.clock is sim.clock and ds.simulator is sim
    assert ds.backend == "sim:A100x3,EPYC7763x2"
    assert ds.gpus == sim.gpus and ds.cpus == sim.cpus
    # The counters of different GPUs update at different times.
    sim.set_workload(Constant(1.0))
    first_change = []
    for g in sim.gpus:
        start = g.energy_j()
        t0 = sim.clock.now()
        k = 0
        while g.energy_j() == start:
            k += 1
            sim.clock.advance_to(t0 + k * 0.001)
        first_change.append(round(sim.clock.now() % 0.1, 3))
    assert len(set(first_change)) == 3


def test_simulator_workload_advance_and_truth() -> None:
    sim = Simulator("A100x2,nocpu")
    sim.set_workload(Constant(1.0))
    sim.advance(2.0)
    assert sim.true_gpu_energy_j() == pytest.approx({0: 800.0, 1: 800.0})
    sim.set_workload(Constant(0.0), gpus=False)  # only CPUs: none here, GPUs unchanged
    sim.advance(1.0)
    assert sim.true_gpu_energy_j()[0] == pytest.approx(1200.0)


def test_realtime_simulator_cannot_be_advanced() -> None:
    sim = Simulator.realtime("A100")
    assert isinstance(sim.clock, RealClock)
    with pytest.raises(TypeError, match="VirtualClock"):
        sim.advance(1.0)


# -- SimGPU: energy counter -------------------------------------------------------------------
def test_energy_counter_updates_every_period_in_millijoules_at_its_phase() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, index=1, workload=Constant(0.3))  # 158.5 W
    power = a100_power(0.3)
    phase = 0.37 * A100.counter_period_s
    assert gpu.energy_counter_period_s() == 0.1
    assert gpu.energy_j() == 2000.0  # the default offset for index 1
    prev = gpu.energy_j()
    changes: list[tuple[float, float]] = []
    for k in range(1, 1001):
        clock.advance_to(k / 1000)
        value = gpu.energy_j()
        assert value >= prev
        if value != prev:
            changes.append((clock.now(), value))
        prev = value
    assert len(changes) == 10  # updates at 0.037, 0.137, ..., 0.937
    for i, (t, value) in enumerate(changes):
        update = phase + i * 0.1
        assert update - 1e-9 <= t <= update + 0.0015
        assert value * 1000 == pytest.approx(round(value * 1000), abs=1e-6)  # whole mJ
        truth = power * update
        assert truth - 0.001 - 1e-9 <= value - 2000.0 <= truth + 1e-9
    # Between updates the counter is stale: it lags the truth by up to one period of energy.
    clock.advance_to(1.036)
    assert gpu.energy_j() - 2000.0 == pytest.approx(power * 0.937, abs=0.001)
    assert gpu.true_energy_j() == pytest.approx(power * 1.036)


def test_counter_offset_and_sub_millijoule_energy_is_not_seen() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, index=0, workload=Constant(0.0), counter_offset_j=0.0)
    assert gpu.energy_j() == 0.0
    clock.advance(0.1)
    assert gpu.energy_j() == pytest.approx(5.5)  # 55 W for 0.1 s
    # 1 mJ steps: 55 W * 0.2 s = 11 J exactly; floor never overshoots the truth.
    clock.advance(0.1)
    assert gpu.energy_j() <= gpu.true_energy_j() + 1e-9


def test_gpu_without_counter() -> None:
    clock = VirtualClock()
    gpu = SimGPU(P100, clock)
    assert not gpu.has_energy_counter()
    assert gpu.energy_counter_period_s() is None
    with pytest.raises(NotSupportedError, match="no energy counter"):
        gpu.energy_j()
    problems = gpu.problems()
    assert len(problems) == 1 and "power sampling" in problems[0].message
    assert SimGPU(A100, clock).problems() == []
    info = gpu.describe()
    assert info["energy_counter"] is False and info["name"] == "Tesla P100-PCIE-16GB"


# -- SimGPU: power sensors --------------------------------------------------------------------
def test_a100_averaged_power_is_a_one_second_average_and_instant_is_part_time() -> None:
    clock = VirtualClock()
    # 50 ms busy, 50 ms idle: the instant sensor only sees the last 25 ms of each 100 ms.
    gpu = SimGPU(A100, clock, workload=Periodic([(0.05, 1.0), (0.05, 0.0)]))
    assert gpu.power_update_period_s() == 0.1
    clock.advance(3.0)
    mean = (400.0 + 55.0) / 2
    assert gpu.average_power_w() == pytest.approx(mean, abs=0.002)
    assert gpu.power_w() == pytest.approx(55.0, abs=0.002)  # sampled only the idle half
    # Mid-period, readings hold the last update.
    clock.advance(0.06)
    assert gpu.power_w() == pytest.approx(55.0, abs=0.002)
    assert gpu.true_power_w() == pytest.approx(55.0)
    clock.advance(0.05)  # 3.11: busy phase, reading from the 3.1 update (idle tail)
    assert gpu.true_power_w() == pytest.approx(400.0)
    assert gpu.power_w() == pytest.approx(55.0, abs=0.002)


def test_a100_instant_power_sees_busy_tail_when_phases_shift() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Periodic([(0.05, 0.0), (0.05, 1.0)]))
    clock.advance(2.0)
    assert gpu.power_w() == pytest.approx(400.0, abs=0.002)
    assert gpu.average_power_w() == pytest.approx(227.5, abs=0.002)


def test_averaged_power_lags_a_step() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Constant(0.0))
    clock.advance(5.0)
    gpu.set_workload(Constant(1.0))
    clock.advance(0.5)
    # Instant reading already at full power; the 1 s average is half way there.
    assert gpu.power_w() == pytest.approx(400.0, abs=0.002)
    assert gpu.average_power_w() == pytest.approx((55.0 + 400.0) / 2, abs=0.002)
    clock.advance(1.0)
    assert gpu.average_power_w() == pytest.approx(400.0, abs=0.002)


def test_v100_power_is_instant_full_period() -> None:
    clock = VirtualClock()
    gpu = SimGPU(V100, clock, workload=Periodic([(0.01, 1.0), (0.01, 0.0)]))
    assert gpu.power_update_period_s() == 0.02
    clock.advance(1.0)
    # The whole 20 ms period is averaged, and there is no separate 1 s average.
    assert gpu.power_w() == pytest.approx((290.0 + 40.0) / 2, abs=0.002)
    assert gpu.average_power_w() == gpu.power_w()


def test_power_readings_are_in_milliwatts() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Constant(1 / 3))
    clock.advance(2.0)
    for reading in (gpu.power_w(), gpu.average_power_w()):
        assert reading * 1000 == pytest.approx(round(reading * 1000), abs=1e-6)
        assert reading == pytest.approx(a100_power(1 / 3), abs=0.0011)


# -- SimGPU: control --------------------------------------------------------------------------
def test_power_limit_caps_power_and_slows_the_gpu() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Constant(1.0))
    assert gpu.power_limit_w() == 400.0 == gpu.default_power_limit_w()
    assert gpu.power_limit_range_w() == (100.0, 400.0)
    assert gpu.relative_speed() == pytest.approx(1.0)
    assert gpu.sm_clock_mhz() == 1410
    clock.advance(1.0)
    gpu.set_power_limit_w(200)
    assert gpu.power_limit_w() == 200.0
    assert gpu.true_power_w() == pytest.approx(200.0)
    # 200 W leaves 42 % of the dynamic power: below the voltage floor (0.8 of the clock, 51 %
    # of the power), so the clock falls linearly with power from there.
    speed = ((200.0 - 55.0) / 345.0) / 0.8**2
    assert gpu.relative_speed() == pytest.approx(speed)
    assert gpu.sm_clock_mhz() == round(1410 * speed)
    # Half utilization needs 227.5 W at full clock: capped too, but less slowed.
    assert gpu.relative_speed(0.5) == pytest.approx(((200.0 - 55.0) / (0.5 * 345.0)) ** (1 / 3))
    # A light load fits under the cap at full speed.
    assert gpu.relative_speed(0.2) == pytest.approx(1.0)
    assert gpu.relative_speed(0.0) == pytest.approx(1.0)
    clock.advance(2.0)
    assert gpu.true_energy_j() == pytest.approx(400.0 + 2 * 200.0)
    gpu.reset_power_limit()
    assert gpu.power_limit_w() == 400.0
    clock.advance(1.0)
    assert gpu.true_energy_j() == pytest.approx(1200.0)
    assert gpu.average_power_w() == pytest.approx(400.0, abs=0.002)


def test_power_limit_out_of_range() -> None:
    gpu = SimGPU(A100, VirtualClock())
    for bad in (99.9, 400.1, 0.0, -5.0):
        with pytest.raises(ValueError, match=r"outside the allowed range \[100, 400\] W"):
            gpu.set_power_limit_w(bad)
    assert gpu.power_limit_w() == 400.0
    gpu.set_power_limit_w(100.0)  # the bounds themselves are fine
    gpu.set_power_limit_w(400.0)


def test_no_control_permission() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Constant(1.0), allow_control=False)
    with pytest.raises(DevicePermissionError, match="power limit"):
        gpu.set_power_limit_w(200.0)
    with pytest.raises(DevicePermissionError, match="SM clocks"):
        gpu.lock_sm_clock(210, 1000)
    with pytest.raises(DevicePermissionError, match="SM clocks"):
        gpu.reset_sm_clock()
    with pytest.raises(DevicePermissionError, match="memory clocks"):
        gpu.lock_memory_clock(1215, 1215)
    with pytest.raises(DevicePermissionError):
        gpu.reset_memory_clock()
    with pytest.raises(DevicePermissionError):
        gpu.reset_power_limit()
    # Nothing changed.
    assert gpu.power_limit_w() == 400.0 and gpu.sm_clock_locked() is None
    assert gpu.true_power_w() == pytest.approx(400.0)


def test_sm_clock_lock_lowers_power_and_speed() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Constant(1.0))
    clocks = gpu.supported_sm_clocks_mhz()
    assert clocks[0] == 1410 and clocks[-1] == 210 and len(clocks) == 81
    assert all(a - b == 15 for a, b in zip(clocks, clocks[1:], strict=False))
    gpu.lock_sm_clock(210, 705)
    assert gpu.sm_clock_locked() == (210.0, 705.0)
    assert gpu.true_power_w() == pytest.approx(55.0 + 345.0 * 0.5 * 0.8**2)  # below the voltage floor
    assert gpu.relative_speed() == pytest.approx(0.5)
    assert gpu.sm_clock_mhz() == 705
    clock.advance(1.0)
    assert gpu.true_energy_j() == pytest.approx(55.0 + 345.0 * 0.5 * 0.8**2)
    gpu.set_workload(Idle(0.0))
    assert gpu.sm_clock_mhz() == 210  # idle sits at the lower end of the lock
    gpu.reset_sm_clock()
    assert gpu.sm_clock_locked() is None
    assert gpu.sm_clock_mhz() == A100.min_sm_mhz
    gpu.set_workload(Constant(1.0))
    assert gpu.sm_clock_mhz() == 1410
    assert gpu.true_power_w() == pytest.approx(400.0)
    with pytest.raises(ValueError, match="outside"):
        gpu.lock_sm_clock(100, 705)
    with pytest.raises(ValueError, match="outside"):
        gpu.lock_sm_clock(800, 705)
    with pytest.raises(ValueError, match="outside"):
        gpu.lock_sm_clock(210, 2000)


def test_memory_clock_lock() -> None:
    gpu = SimGPU(A100, VirtualClock())
    assert gpu.memory_clock_mhz() == 1215.0
    gpu.lock_memory_clock(800, 1000)
    assert gpu.memory_clock_mhz() == 1000.0
    gpu.reset_memory_clock()
    assert gpu.memory_clock_mhz() == 1215.0
    for lo, hi in ((5000, -3), (800, 99999), (float("nan"), 1000), (1000, 800)):
        with pytest.raises(ValueError, match="memory clock range"):
            gpu.lock_memory_clock(lo, hi)
    assert gpu.memory_clock_mhz() == 1215.0


def test_temperature_follows_power_and_describe() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Constant(0.0))
    idle_temp = gpu.temperature_c()
    gpu.set_workload(Constant(1.0))
    assert gpu.temperature_c() > idle_temp
    info = gpu.describe()
    assert info["power_limit_range_w"] == (100.0, 400.0)
    assert info["energy_counter_period_s"] == 0.1 and info["vendor"] == "nvidia"


def test_model_overrides() -> None:
    model = A100.with_overrides(counter_period_s=0.05, idle_w=60.0)
    assert model.counter_period_s == 0.05 and model.idle_w == 60.0 and A100.idle_w == 55.0
    clock = VirtualClock()
    gpu = SimGPU(model, clock)
    clock.advance(1.0)
    assert gpu.true_energy_j() == pytest.approx(60.0)


# -- workloads --------------------------------------------------------------------------------
def test_periodic_energy_is_exact_over_cycles() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Periodic([(0.2, 1.0), (0.3, 0.0)]))
    per_cycle = 0.2 * 400.0 + 0.3 * 55.0  # 96.5 J
    clock.advance(0.5)
    assert gpu.true_energy_j() == pytest.approx(per_cycle, rel=1e-12)
    clock.advance(0.1)  # 0.1 s into the busy phase
    assert gpu.true_energy_j() == pytest.approx(per_cycle + 40.0, rel=1e-12)
    clock.advance_to(50.0)
    assert gpu.true_energy_j() == pytest.approx(100 * per_cycle, rel=1e-9)


@pytest.mark.parametrize("duration", [0.0, -1.0, float("nan"), float("inf")])
def test_periodic_phases_must_be_positive_and_finite(duration: float) -> None:
    with pytest.raises(ValueError, match="positive and finite"):
        Periodic([(duration, 0.5), (1.0, 0.1)])


def test_periodic_utilization_and_pieces() -> None:
    w = Periodic([(0.03, 1.0), (0.07, 0.25)])
    assert w.period == pytest.approx(0.1)
    assert w.utilization(0.0) == 1.0
    assert w.utilization(0.05) == 0.25
    assert w.utilization(1.2345) == 0.25
    # Spans starting at whole cycles (where t / period may round either way) integrate right.
    for n in range(1, 400):
        t = n / 10
        busy = sum((b - a) * (u == 1.0) for a, b, u in w.pieces(t, t + 0.05))
        assert busy == pytest.approx(0.03, abs=1e-9), t
        assert w.utilization(t + 1e-9) == 1.0, t
        assert w.utilization(t + 0.031) == 0.25, t
    pieces = list(w.pieces(0.02, 0.25))
    assert pieces[0] == pytest.approx((0.02, 0.03, 1.0))
    assert [p[2] for p in pieces] == [1.0, 0.25, 1.0, 0.25, 1.0, 0.25]
    assert pieces[-1][1] == 0.25
    total = sum((b - a) * u for a, b, u in w.pieces(0.0, 10.0))
    assert total == pytest.approx(100 * (0.03 + 0.07 * 0.25))


def test_periodic_energy_exact_from_arbitrary_float_times() -> None:
    # Integrals over many adjacent spans add up exactly, even at cycle boundaries.
    w = Periodic([(0.03, 1.0), (0.07, 0.0)])
    edges = [k * 0.1 for k in range(0, 101)] + [k * 0.029 for k in range(0, 345)]
    edges = sorted(set(edges))
    total = sum(
        (b - a) * u for t0, t1 in zip(edges, edges[1:], strict=False) for a, b, u in w.pieces(t0, t1)
    )
    assert total == pytest.approx(edges[-1] // 0.1 * 0.03 + min(0.03, edges[-1] % 0.1), abs=1e-9)


def test_workload_validation() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Constant(1.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Constant(-0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Constant(math.nan)
    with pytest.raises(ValueError, match="at least one phase"):
        Periodic([])
    with pytest.raises(ValueError, match="positive"):
        Periodic([(0.1, 1.0), (0.0, 0.0)])
    with pytest.raises(ValueError, match="as many times"):
        Trace([0.0, 1.0], [0.5])
    with pytest.raises(ValueError, match="at least one"):
        Trace([], [])
    with pytest.raises(ValueError, match="strictly increasing"):
        Trace([0.0, 1.0, 1.0], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Trace([0.0, 1.0], [0.1, 2.0])


def test_trace_holds_last_value_and_loops() -> None:
    clock = VirtualClock()
    trace = Trace([10.0, 11.0, 13.0], [0.2, 1.0, 0.0])  # times are relative to the first
    assert trace.times == [0.0, 1.0, 3.0]
    assert trace.duration == 5.0
    assert [trace.utilization(t) for t in (0.5, 1.0, 2.9, 3.0, 100.0)] == [0.2, 1.0, 1.0, 0.0, 0.0]
    gpu = SimGPU(A100, clock, workload=trace)
    clock.advance(6.0)
    assert gpu.true_energy_j() == pytest.approx(a100_power(0.2) + 2 * 400.0 + 3 * 55.0)

    looped = Trace([0.0, 1.0, 3.0], [0.2, 1.0, 0.0], loop=True)
    assert [looped.utilization(t) for t in (5.5, 6.5, 8.5, 10.0)] == [0.2, 1.0, 0.0, 0.2]
    clock2 = VirtualClock()
    gpu2 = SimGPU(A100, clock2, workload=looped)
    clock2.advance(10.0)
    per_loop = a100_power(0.2) + 2 * 400.0 + 2 * 55.0
    assert gpu2.true_energy_j() == pytest.approx(2 * per_loop)


def test_trace_from_power_csv(tmp_path: Path) -> None:
    path = tmp_path / "power.csv"
    path.write_text("time,power\n0.0,55\n0.5,400\n1.5,227.5\n2.0,500\n2.5,10\n")
    trace = Trace.from_power_csv(path, idle_w=55.0, peak_w=400.0)
    assert trace.times == [0.0, 0.5, 1.5, 2.0, 2.5]
    assert trace.utils == pytest.approx([0.0, 1.0, 0.5, 1.0, 0.0])  # clamped to [0, 1]
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=trace)
    clock.advance(3.0)
    expected = 0.5 * 55 + 1.0 * 400 + 0.5 * 227.5 + 0.5 * 400 + 0.5 * 55
    assert gpu.true_energy_j() == pytest.approx(expected)
    looped = Trace.from_power_csv(str(path), idle_w=55.0, peak_w=400.0, loop=True)
    assert looped.loop and looped.duration == 3.0


def test_trace_from_power_csv_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    with pytest.raises(FileNotFoundError, match="power trace not found"):
        Trace.from_power_csv(missing, idle_w=55.0, peak_w=400.0)
    bad = tmp_path / "bad.csv"
    bad.write_text("t,watts\n0,100\n")
    with pytest.raises(ValueError, match="'time' and 'power'"):
        Trace.from_power_csv(bad, idle_w=55.0, peak_w=400.0)
    bad.write_text("time,power\n0,abc\n")
    with pytest.raises(ValueError, match="numeric"):
        Trace.from_power_csv(bad, idle_w=55.0, peak_w=400.0)


def test_workload_change_mid_run_is_exact() -> None:
    clock = VirtualClock()
    gpu = SimGPU(A100, clock)
    clock.advance(1.0)
    gpu.set_workload(Periodic([(0.1, 1.0), (0.1, 0.0)]))
    clock.advance(1.05)  # 5 cycles and half a busy phase
    expected = 55.0 + 5 * (0.1 * 400 + 0.1 * 55) + 0.05 * 400
    assert gpu.true_energy_j() == pytest.approx(expected)
    for _ in range(20):  # many epochs: old ones are dropped, the energy stays right
        gpu.set_power_limit_w(300.0)
        clock.advance(0.5)
        gpu.set_power_limit_w(400.0)
        clock.advance(0.5)
    assert len(gpu._epochs) < 20
    assert gpu.true_energy_j() > expected


# -- SimCPU -----------------------------------------------------------------------------------
def test_cpu_package_and_dram_energy() -> None:
    clock = VirtualClock()
    cpu = SimCPU(XEON, clock, workload=Constant(1.0))
    assert cpu.has_dram() and cpu.vendor == "intel"
    p0, d0 = cpu.package_energy_j(), cpu.dram_energy_j()
    clock.advance(10.0)
    assert cpu.true_package_energy_j() == pytest.approx(3500.0)
    assert cpu.true_dram_energy_j() == pytest.approx(450.0)
    # Counters: 1 ms updates and 61 uJ units.
    assert cpu.package_energy_j() - p0 == pytest.approx(3500.0, abs=0.35 + 2 * 61e-6)
    assert cpu.dram_energy_j() - d0 == pytest.approx(450.0, abs=0.045 + 2 * 61e-6)
    assert cpu.max_read_interval_s() == pytest.approx(XEON.wrap_j / (350.0 + 45.0))
    info = cpu.describe()
    assert info["dram"] is True and info["name"] == "Intel Xeon Platinum 8480+"


def test_amd_cpu_has_no_dram() -> None:
    clock = VirtualClock()
    cpu = SimCPU(EPYC, clock)
    assert not cpu.has_dram() and cpu.vendor == "amd"
    with pytest.raises(NotSupportedError, match="no DRAM"):
        cpu.dram_energy_j()
    with pytest.raises(NotSupportedError, match="no DRAM"):
        cpu.true_dram_energy_j()
    clock.advance(1.0)
    assert cpu.true_package_energy_j() == pytest.approx(90.0)
    assert cpu.max_read_interval_s() == pytest.approx(EPYC.wrap_j / 280.0)


def test_cpu_counters_wrap_and_wrapping_counter_keeps_them_exact() -> None:
    clock = VirtualClock()
    model = XEON.with_overrides(wrap_j=100.0)  # wraps about every 0.25 s at full load
    cpu = SimCPU(model, clock, workload=Constant(1.0))
    assert cpu.max_read_interval_s() == pytest.approx(100.0 / 395.0)
    start = cpu.package_energy_j()
    raws = [cpu.raw_package_units()]
    wraps = 0
    for _ in range(500):  # 10 s, read every 20 ms (well within a wrap)
        clock.advance(0.02)
        raw = cpu.raw_package_units()
        if raw < raws[-1]:
            wraps += 1
        raws.append(raw)
        cpu.package_energy_j()
    assert wraps >= 30  # 3500 J / 100 J
    assert max(raws) < int(100.0 / model.energy_unit_j)
    assert cpu.package_energy_j() - start == pytest.approx(cpu.true_package_energy_j(), abs=0.36)


def test_cpu_counter_read_too_rarely_loses_wraps() -> None:
    clock = VirtualClock()
    model = XEON.with_overrides(wrap_j=100.0)
    cpu = SimCPU(model, clock, workload=Constant(1.0))
    start = cpu.package_energy_j()
    clock.advance(1.0)  # 350 J: several wraps between two reads
    seen = cpu.package_energy_j() - start
    assert seen < 300.0  # whole wraps lost
    lost = 350.0 - seen
    assert lost / model.wrap_j == pytest.approx(round(lost / model.wrap_j), abs=0.01)


def test_wrapping_counter() -> None:
    with pytest.raises(ValueError, match="positive"):
        WrappingCounter(0)
    c = WrappingCounter(1000)
    assert c.update(900) == 900
    assert c.update(950) == 950
    assert c.update(10) == 1010
    assert c.update(10) == 1010
    assert c.update(999) == 1999
    assert c.update(0) == 2000


def test_cpu_workload_change() -> None:
    clock = VirtualClock()
    cpu = SimCPU(XEON, clock)
    clock.advance(2.0)
    cpu.set_workload(Periodic([(0.5, 1.0), (0.5, 0.0)]))
    clock.advance(3.0)
    assert cpu.true_package_energy_j() == pytest.approx(2 * 95 + 3 * (0.5 * 350 + 0.5 * 95))
    assert cpu.true_dram_energy_j() == pytest.approx(2 * 12 + 3 * (0.5 * 45 + 0.5 * 12))


# -- speed ------------------------------------------------------------------------------------
def test_an_hour_of_virtual_time_is_fast() -> None:
    sim = Simulator("A100,V100")
    # Query cost grows with the number of workload pieces in the ~1 s sensors look back.
    work = Periodic([(0.3, 1.0), (0.7, 0.2)])
    sim.set_workload(work)
    clock = sim.clock
    assert isinstance(clock, VirtualClock)
    g0, g1 = sim.gpus
    cpu = sim.cpus[0]
    cpu_start = cpu.package_energy_j()
    t_start = time.monotonic()
    readings = 0

    def poll(now: float) -> None:
        nonlocal readings
        g0.energy_j()
        g0.power_w()
        g0.average_power_w()
        g1.energy_j()
        cpu.package_energy_j()
        readings += 1

    timer = clock.every(0.1, poll)
    clock.advance(3600.0)
    timer.cancel()
    elapsed = time.monotonic() - t_start
    assert readings == pytest.approx(36_001, abs=2)
    assert elapsed < 15.0
    mean_a100 = 0.3 * 400.0 + 0.7 * a100_power(0.2)
    assert g0.true_energy_j() == pytest.approx(3600.0 * mean_a100, rel=1e-6)
    assert g0.energy_j() - 1000.0 == pytest.approx(g0.true_energy_j(), abs=mean_a100 * 0.1 + 0.001)
    mean_cpu = 95.0 + (0.3 + 0.7 * 0.2) * (350.0 - 95.0)
    assert cpu.true_package_energy_j() == pytest.approx(3600.0 * mean_cpu, rel=1e-6)
    assert cpu.package_energy_j() - cpu_start == pytest.approx(3600.0 * mean_cpu, abs=1.0)


def test_run_takes_longer_under_a_lower_power_limit():
    from joules.devices.sim import Constant, Simulator

    sim = Simulator("A100x2")
    sim.set_workload(Constant(1.0))
    assert sim.run(1.0) == pytest.approx(1.0)
    sim.gpus[1].set_power_limit_w(200.0)  # the slowest GPU sets the pace
    slow = sim.step_time_s(1.0)
    assert slow == pytest.approx(1.0 / sim.gpus[1].relative_speed())
    assert 1.1 < slow < 2.0
    half = sim.step_time_s(1.0, compute_fraction=0.5)
    assert half == pytest.approx(0.5 + 0.5 * slow)
    # Per GPU: only the limited one is slow.
    assert sim.gpus[1].step_time_s(1.0) == pytest.approx(slow)
    assert sim.gpus[0].step_time_s(1.0) == pytest.approx(1.0)
    assert sim.gpus[1].step_time_s(1.0, compute_fraction=0.0) == 1.0
    t0 = sim.clock.now()
    assert sim.run(2.0) == pytest.approx(2 * slow)
    assert sim.clock.now() - t0 == pytest.approx(2 * slow)
    with pytest.raises(ValueError, match="compute_fraction"):
        sim.step_time_s(1.0, compute_fraction=1.5)


@needs_fork
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads running
def test_forked_child_discovers_its_own_devices() -> None:
    from joules.devices import discovery

    parent = discovery.discover(sim="A100,nocpu", refresh=True)
    assert discovery.discover(sim="A100,nocpu") is parent  # cached in this process
    # another thread is discovering (the cache lock held) when the process forks
    release = held_in_thread(discovery._cache_lock)

    def child() -> str:
        devices = discovery.discover(sim="A100,nocpu")
        return f"{devices is parent} {len(devices.gpus)}"

    try:
        out = run_in_forked_child(child)
    finally:
        release.set()
    assert out is not None, "the child hung on the discovery cache lock"
    assert out == "False 1"  # new device objects, not the parent's (whose locks may be held)


@needs_fork
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads running
def test_forked_child_reads_simulated_devices_whose_locks_the_parent_held() -> None:
    sim = Simulator("A100,XEON8480")
    gpu, cpu = sim.gpus[0], sim.cpus[0]
    releases = [held_in_thread(gpu._lock), held_in_thread(cpu._lock)]  # a sampler mid-read
    try:
        out = run_in_forked_child(lambda: (gpu.power_w() > 0, cpu.package_energy_j() > 0))
    finally:
        for r in releases:
            r.set()
    assert out == "(True, True)", "the child hung on a simulated device's lock"


def test_sensor_values_are_latched_at_their_update_ticks() -> None:
    """A counter or power value read again before its next update is the one read first, even
    where recomputing it would now differ (a moved integral checkpoint can shift it by float
    noise, which at a whole-mJ value flips the last mJ: the monitor took that for an update
    between two real ones)."""
    clock = VirtualClock()
    gpu = SimGPU(A100, clock, workload=Periodic([(0.37, 0.9), (0.21, 0.3)]))
    exact = gpu._energy_at
    held = changed = 0
    last: tuple[int, tuple[float, float, float]] | None = None
    for i in range(300):
        clock.advance(0.0317)
        tick = math.floor(clock.now() / 0.1)  # both sensors update every 100 ms, phase 0
        first = (gpu.energy_j(), gpu.power_w(), gpu.average_power_w())
        gpu._energy_at = lambda t, i=i: exact(t) + 0.0015 * (i % 2)  # type: ignore[method-assign]
        clock.advance(0.0001)
        again = (gpu.energy_j(), gpu.power_w(), gpu.average_power_w())
        gpu._energy_at = exact  # type: ignore[method-assign]
        if math.floor(clock.now() / 0.1) == tick:
            assert again == first
            held += 1
        if last is not None and last[0] != tick:
            changed += first != last[1]  # a new tick: new values
        last = (tick, first)
    assert held > 200 and changed > 80  # about one tick in three iterations
