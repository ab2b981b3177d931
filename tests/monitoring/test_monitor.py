from __future__ import annotations

import csv
import json
import os
import random
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from joules.clock import VirtualClock
from joules.devices.base import DeviceSet
from joules.devices.sim import Constant, Periodic, SimCPU, SimGPU, Simulator, Workload
from joules.devices.sim.catalog import cpu_model, gpu_model
from joules.errors import DeviceNotFoundError, WindowError
from joules.monitoring.measurement import DeviceEnergy, Measurement, Source
from joules.monitoring.monitor import EnergyMonitor
from joules.monitoring.sync import make_sync

A100 = gpu_model("A100")
XEON = cpu_model("XEON8480")


def setup(spec: str, workload: Workload | None = None, warm: float = 2.0, **kwargs: object):
    sim = Simulator(spec)
    if workload is not None:
        sim.set_workload(workload)
    mon = EnergyMonitor(devices=sim.devices(), **kwargs)  # type: ignore[arg-type]
    sim.advance(warm)
    return sim, mon


class Truth:
    """Ground-truth energy of every simulated device since creation, at one instant."""

    def __init__(self, sim: Simulator) -> None:
        self.gpu = {g.index: g.true_energy_j() for g in sim.gpus}
        self.cpu = {c.index: c.true_package_energy_j() for c in sim.cpus}
        self.dram = {c.index: c.true_dram_energy_j() for c in sim.cpus if c.has_dram()}

    def since(self, earlier: Truth) -> dict[str, dict[int, float]]:
        return {
            kind: {k: getattr(self, kind)[k] - getattr(earlier, kind)[k] for k in getattr(self, kind)}
            for kind in ("gpu", "cpu", "dram")
        }


def zones(m: Measurement) -> dict[str, dict[int, DeviceEnergy]]:
    return {"gpu": m.gpu, "cpu": m.cpu, "dram": m.dram}


def measure_span(sim: Simulator, mon: EnergyMonitor, name: str, seconds: float):
    before = Truth(sim)
    mon.begin_window(name)
    sim.advance(seconds)
    m = mon.end_window(name)
    return m, Truth(sim).since(before)


def assert_bounded(d: DeviceEnergy, true: float, ceiling: float, what: object = None) -> None:
    """The stated uncertainty covers the error, and is no wider than ``ceiling``.

    A bound many times too wide would cover any error: each test gives the most its case
    warrants (a fraction of one update period's energy at a steady load, the whole power
    range over a window nothing resolves).
    """
    assert abs(d.energy_j - true) <= d.uncertainty_j + 1e-9, (what, d, true)
    assert 0.0 <= d.uncertainty_j <= ceiling, (what, d.uncertainty_j, ceiling)


def steady_ceiling(gpu: SimGPU, share: float = 0.1) -> float:
    """At a steady load: ``share`` of one update period's (counter, else sampling) energy at peak power."""
    period = gpu.model.counter_period_s if gpu.model.energy_counter else gpu.model.power_period_s
    return share * gpu.model.peak_w * period + 0.002


def whole_range(gpu: SimGPU, seconds: float) -> float:
    """The widest bound a window of ``seconds`` can warrant: the GPU's whole power range over it."""
    return gpu.power_limit_range_w()[1] * seconds * 1.01 + 0.002


# -- accuracy against ground truth ------------------------------------------------------------
def test_steady_windows_are_accurate_and_within_uncertainty() -> None:
    sim, mon = setup("A100x2,V100,H100,XEON8480x2", Constant(0.7))
    rng = random.Random(7)
    for i in range(12):
        sim.advance(rng.uniform(0.0, 0.3))
        m, truth = measure_span(sim, mon, f"w{i}", rng.uniform(2.0, 6.0))
        assert set(m.gpu) == {0, 1, 2, 3} and set(m.cpu) == {0, 1} and set(m.dram) == {0, 1}
        for kind, measured in zones(m).items():
            for k, d in measured.items():
                true = truth[kind][k]
                assert d.source is Source.COUNTER and not d.corrected
                assert abs(d.energy_j - true) / true < 1e-3, (kind, k)
                if kind == "gpu":
                    ceiling = steady_ceiling(sim.gpus[k])
                else:  # one RAPL update (1 ms) at the zone's highest power, per edge
                    model = sim.cpus[k].model
                    ceiling = 2 * 0.001 * (model.tdp_w if kind == "cpu" else model.dram_peak_w) * 1.01
                assert_bounded(d, true, ceiling, (kind, k))
        assert m.total_energy_j == pytest.approx(sum(sum(v.values()) for v in truth.values()), rel=1e-3)
    mon.close()


def test_steady_gpu_counter_edges_are_good_to_a_millisecond() -> None:
    sim, mon = setup("A100,H100,nocpu", Constant(0.5))
    for length in (0.35, 1.0, 3.7):
        m, truth = measure_span(sim, mon, "w", length)
        for k, d in m.gpu.items():
            power = sim.gpus[k].true_power_w()
            assert abs(d.energy_j - truth["gpu"][k]) <= power * 0.001
            assert_bounded(d, truth["gpu"][k], steady_ceiling(sim.gpus[k]), (length, k))


def test_bursty_windows_beat_the_naive_counter_difference() -> None:
    sim, mon = setup("A100x2,H100,nocpu", Periodic([(0.25, 1.0), (0.15, 0.0), (0.33, 0.5)]), warm=3.0)
    rng = random.Random(3)
    errors: list[float] = []
    naive_errors: list[float] = []
    for i in range(60):
        sim.advance(rng.uniform(0.0, 0.3))
        c0 = {g.index: g.energy_j() for g in sim.gpus}
        m, truth = measure_span(sim, mon, f"b{i}", rng.uniform(0.3, 2.0))
        for g in sim.gpus:
            true = truth["gpu"][g.index]
            err = abs(m.gpu[g.index].energy_j - true)
            naive = abs(g.energy_j() - c0[g.index] - true)
            # Each edge is off by at most one counter period at the worst power swing.
            swing = g.model.peak_w - g.model.idle_w
            assert err <= 2 * g.model.counter_period_s * swing + 1.0
            assert 0.0 <= m.gpu[g.index].uncertainty_j <= 2 * g.model.counter_period_s * g.model.peak_w
            errors.append(err / true)
            naive_errors.append(naive / true)
    mean, naive_mean = sum(errors) / len(errors), sum(naive_errors) / len(naive_errors)
    assert mean < 0.05
    assert mean < 0.6 * naive_mean


def test_short_windows_are_corrected_not_zero() -> None:
    sim, mon = setup("A100,V100,nocpu", Constant(0.5))
    rng = random.Random(11)
    sources = set()
    for i in range(30):
        sim.advance(rng.uniform(0.0, 0.2))
        length = rng.uniform(0.002, 0.09)  # shorter than the A100's 100 ms counter period
        m, truth = measure_span(sim, mon, f"s{i}", length)
        a100 = m.gpu[0]
        assert a100.energy_j > 0.0
        assert a100.corrected
        # Between two counter updates the counter cannot resolve the window: power x time.
        moved = a100.source is Source.COUNTER
        assert a100.source is (Source.COUNTER if moved else Source.ESTIMATE)
        assert a100.energy_j == pytest.approx(truth["gpu"][0], rel=5e-3)
        assert_bounded(a100, truth["gpu"][0], whole_range(sim.gpus[0], m.elapsed_s), i)
        assert m.sources["gpu0"] == ("counter+corrected" if moved else "estimate+corrected")
        sources.add(a100.source)
        v100 = m.gpu[1]  # 20 ms counter
        assert v100.corrected == (m.elapsed_s < 0.02 or v100.source is Source.ESTIMATE)
        assert v100.energy_j == pytest.approx(truth["gpu"][1], rel=5e-3)
    assert sources == {Source.COUNTER, Source.ESTIMATE}  # both paths were exercised


def test_short_window_right_after_start() -> None:
    sim = Simulator("A100,nocpu")
    sim.set_workload(Constant(1.0))
    sim.advance(2.0)
    mon = EnergyMonitor(devices=sim.devices())  # knows nothing yet of the counter's timing
    m, truth = measure_span(sim, mon, "cold", 0.03)
    d = m.gpu[0]
    assert d.corrected
    assert d.energy_j > 0.0
    assert_bounded(d, truth["gpu"][0], whole_range(sim.gpus[0], m.elapsed_s))


def test_gpu_without_counter_is_sampled() -> None:
    sim, mon = setup("P100,A100,nocpu", Constant(0.6))
    m, truth = measure_span(sim, mon, "long", 3.0)
    p100 = m.gpu[0]
    assert p100.source is Source.SAMPLED and not p100.corrected
    assert p100.energy_j == pytest.approx(truth["gpu"][0], rel=1e-4)
    assert_bounded(p100, truth["gpu"][0], steady_ceiling(sim.gpus[0]))
    assert m.gpu[1].source is Source.COUNTER
    assert m.sources == {"gpu0": "sampled", "gpu1": "counter"}
    # Shorter than the sampling interval: a reading times the elapsed time.
    interval = mon.sampler.interval_s
    sim.advance(interval / 3)
    m, truth = measure_span(sim, mon, "short", interval / 2)
    p100 = m.gpu[0]
    assert p100.source is Source.ESTIMATE and p100.corrected
    assert m.sources["gpu0"] == "estimate+corrected"
    assert p100.energy_j == pytest.approx(truth["gpu"][0], rel=1e-4)
    assert_bounded(p100, truth["gpu"][0], whole_range(sim.gpus[0], m.elapsed_s))


def test_sampled_gpu_windows_within_uncertainty_at_any_length() -> None:
    sim, mon = setup("P100,nocpu", Constant(0.7))
    rng = random.Random(5)
    for i in range(40):
        sim.advance(rng.uniform(0.0, 0.3))
        m, truth = measure_span(sim, mon, f"p{i}", rng.uniform(0.002, 1.0))
        d = m.gpu[0]
        steady = d.source is Source.SAMPLED
        ceiling = steady_ceiling(sim.gpus[0]) if steady else whole_range(sim.gpus[0], m.elapsed_s)
        assert_bounded(d, truth["gpu"][0], ceiling, i)


def test_sampled_gpu_tracks_slow_changes() -> None:
    sim, mon = setup("P100,nocpu", Periodic([(1.0, 1.0), (1.0, 0.0)]))
    m, truth = measure_span(sim, mon, "w", 10.0)
    assert m.gpu[0].energy_j == pytest.approx(truth["gpu"][0], rel=0.01)


def test_rapl_wraps_during_a_long_window_are_exact() -> None:
    clock = VirtualClock()
    cpu = SimCPU(XEON.with_overrides(wrap_j=200.0), clock, workload=Constant(1.0))
    gpu = SimGPU(A100, clock, workload=Constant(0.5))
    devices = DeviceSet(gpus=[gpu], cpus=[cpu], clock=clock, backend="test")
    mon = EnergyMonitor(devices=devices)
    clock.advance(1.0)
    p0, d0 = cpu.true_package_energy_j(), cpu.true_dram_energy_j()
    mon.begin_window("long")
    clock.advance(120.0)  # 42 kJ: about 210 wraps of the package counter
    m = mon.end_window("long")
    true_pkg = cpu.true_package_energy_j() - p0
    true_dram = cpu.true_dram_energy_j() - d0
    assert true_pkg == pytest.approx(350.0 * 120.0)
    assert m.cpu[0].energy_j == pytest.approx(true_pkg, rel=1e-5)
    assert abs(m.cpu[0].energy_j - true_pkg) <= m.cpu[0].uncertainty_j <= 2 * 0.001 * XEON.tdp_w * 1.01
    assert m.dram[0].energy_j == pytest.approx(true_dram, rel=1e-5)
    assert m.gpu[0].energy_j == pytest.approx(227.5 * 120.0, rel=1e-4)


# -- windows ----------------------------------------------------------------------------------
def test_nested_and_overlapping_windows() -> None:
    sim, mon = setup("A100,XEON8480", Constant(0.5))
    t0 = Truth(sim)
    mon.begin_window("outer")
    sim.advance(1.0)
    t1 = Truth(sim)
    mon.begin_window("inner")
    mon.begin_window("a")
    sim.advance(2.0)
    t2 = Truth(sim)
    inner = mon.end_window("inner")
    mon.begin_window("b")
    assert sorted(mon.open_windows) == ["a", "b", "outer"]
    sim.advance(1.5)
    t3 = Truth(sim)
    a = mon.end_window("a")
    sim.advance(0.5)
    t4 = Truth(sim)
    outer = mon.end_window("outer")
    b = mon.end_window("b")
    assert mon.open_windows == []
    for m, (start, end) in ((outer, (t0, t4)), (inner, (t1, t2)), (a, (t1, t3)), (b, (t2, t4))):
        truth = end.since(start)
        for kind, measured in zones(m).items():
            for k, d in measured.items():
                assert d.energy_j == pytest.approx(truth[kind][k], rel=2e-3), (m.name, kind)
    assert [outer.elapsed_s, inner.elapsed_s, a.elapsed_s, b.elapsed_s] == pytest.approx([5.0, 2.0, 3.5, 2.0])
    assert inner.start_time - outer.start_time == pytest.approx(1.0)
    assert inner.total_energy_j < a.total_energy_j < outer.total_energy_j
    assert mon.last["inner"] is inner and mon.last["outer"] is outer


def test_adjacent_windows_add_up() -> None:
    sim, mon = setup("A100,nocpu", Constant(0.8))
    mon.begin_window("whole")
    parts = []
    for i in range(5):
        mon.begin_window(f"p{i}")
        sim.advance(0.77)
        parts.append(mon.end_window(f"p{i}"))
    whole = mon.end_window("whole")
    assert sum(p.gpu[0].energy_j for p in parts) == pytest.approx(whole.gpu[0].energy_j, rel=1e-3)
    assert sum(p.elapsed_s for p in parts) == pytest.approx(whole.elapsed_s)


def test_window_errors() -> None:
    sim, mon = setup("A100,nocpu", Constant(0.5), warm=0.1)
    mon.begin_window("x")
    with pytest.raises(WindowError, match="'x' is already open"):
        mon.begin_window("x")
    assert mon.open_windows == ["x"]
    mon.end_window("x")
    with pytest.raises(WindowError, match="no open window named 'x'"):
        mon.end_window("x")
    with pytest.raises(WindowError, match="no open window named 'never'"):
        mon.end_window("never")
    with pytest.raises(WindowError, match="no open window"):
        mon.cancel_window("never")
    assert isinstance(WindowError("x"), Exception)


def test_cancel_window() -> None:
    sim, mon = setup("A100,nocpu", Constant(0.5), warm=0.1)
    mon.begin_window("c")
    sim.advance(1.0)
    mon.cancel_window("c")
    assert mon.open_windows == [] and "c" not in mon.last
    with pytest.raises(WindowError):
        mon.end_window("c")
    mon.begin_window("c")  # the name is free again
    sim.advance(1.0)
    m = mon.end_window("c")
    assert m.elapsed_s == pytest.approx(1.0)


def test_restart_window() -> None:
    sim, mon = setup("A100,nocpu", Constant(0.5))
    mon.begin_window("r")
    sim.advance(1.0)
    mon.restart_window("r")
    sim.advance(2.0)
    m = mon.end_window("r")
    assert m.elapsed_s == pytest.approx(2.0)
    assert m.gpu[0].energy_j == pytest.approx(227.5 * 2.0, rel=1e-4)
    mon.restart_window("fresh")  # not open: simply opens it
    assert mon.open_windows == ["fresh"]


def test_window_context_manager() -> None:
    sim, mon = setup("A100,XEON8480", Constant(0.5))
    with mon.window("block") as w:
        assert w.name == "block" and w.measurement is None
        assert mon.open_windows == ["block"]
        sim.advance(1.5)
    assert mon.open_windows == []
    assert w.measurement is not None
    assert w.measurement is mon.last["block"]
    assert w.measurement.elapsed_s == pytest.approx(1.5)
    assert w.measurement.gpu[0].energy_j == pytest.approx(227.5 * 1.5, rel=1e-3)
    # The same name may be open several times at once through the context manager.
    with mon.window("same") as o, mon.window("same") as i:
        sim.advance(0.5)
    assert o.measurement is not None and i.measurement is not None
    # and alongside a begin/end window of that name.
    mon.begin_window("block")
    with mon.window("block"):
        sim.advance(0.1)
    mon.end_window("block")


def test_window_context_manager_cancels_on_exception() -> None:
    sim, mon = setup("A100,nocpu", Constant(0.5))
    with pytest.raises(KeyError, match="boom"):
        with mon.window("failing") as w:
            sim.advance(1.0)
            raise KeyError("boom")
    assert w.measurement is None
    assert mon.open_windows == []
    assert "failing" not in mon.last


def test_measure_decorator() -> None:
    sim, mon = setup("A100,nocpu", Constant(0.5))

    @mon.measure()
    def step(seconds: float, *, scale: int = 1) -> int:
        """Docstring kept."""
        sim.advance(seconds)
        return 42 * scale

    @mon.measure("named")
    def other() -> None:
        sim.advance(0.25)

    assert step(0.5, scale=2) == 84
    assert step.__doc__ == "Docstring kept." and step.__name__ == "step"
    key = "test_measure_decorator.<locals>.step"
    m = mon.last[key]
    assert m.name == key and m.elapsed_s == pytest.approx(0.5)
    assert m.gpu[0].energy_j == pytest.approx(227.5 * 0.5, rel=1e-3)
    other()
    assert mon.last["named"].elapsed_s == pytest.approx(0.25)

    @mon.measure("fails")
    def bad() -> None:
        raise RuntimeError("nope")

    with pytest.raises(RuntimeError, match="nope"):
        bad()
    assert "fails" not in mon.last and mon.open_windows == []


def test_measure_decorator_concurrent_calls_on_real_clock() -> None:
    sim = Simulator.realtime("A100,nocpu")
    sim.set_workload(Constant(0.5))  # 227.5 W
    with EnergyMonitor(devices=sim.devices()) as mon:
        results: list[Measurement] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        @mon.measure("work")
        def work(i: int) -> int:
            time.sleep(0.02)
            return i

        def run(i: int) -> None:
            try:
                for _ in range(3):
                    assert work(i) == i
                    with lock:
                        results.append(mon.last["work"])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        time.sleep(0.25)  # let the power sensor catch up with the workload set at start
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(results) == 24 and all(m.name == "work" for m in results)
        assert mon.open_windows == []
        assert all(m.elapsed_s >= 0.019 and m.gpu[0].energy_j >= 0.0 for m in results)
        ratios = sorted(m.gpu[0].energy_j / (227.5 * m.elapsed_s) for m in results)
        assert 0.5 < ratios[len(ratios) // 2] < 2.0  # the median window is about right
    assert not mon.sampler.running


def test_many_threads_open_and_close_windows() -> None:
    sim, mon = setup("A100x2,XEON8480", Constant(0.5))
    n = 12
    start = threading.Barrier(n + 1)
    stop = threading.Barrier(n + 1)
    out: dict[str, Measurement] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            mon.begin_window(f"t{i}")
            with mon.window("shared") as w:
                start.wait()
                stop.wait()
            m = mon.end_window(f"t{i}")
            with lock:
                out[f"t{i}"] = m
                out[f"shared{i}"] = w.measurement  # type: ignore[assignment]
            # Then a burst of zero-length windows from every thread at once.
            for j in range(50):
                mon.begin_window(f"t{i}-{j}")
                with mon.window("burst"):
                    pass
                mon.end_window(f"t{i}-{j}")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    before = Truth(sim)
    sim.advance(1.0)
    truth = Truth(sim).since(before)
    stop.wait()
    for t in threads:
        t.join()
    assert errors == []
    assert mon.open_windows == []
    assert len(out) == 2 * n
    for m in out.values():
        assert m.elapsed_s == pytest.approx(1.0)
        for kind, measured in zones(m).items():
            for k, d in measured.items():
                assert d.energy_j == pytest.approx(truth[kind][k], rel=1e-3)


# -- device selection -------------------------------------------------------------------------
def test_gpu_and_cpu_selection() -> None:
    sim, mon = setup("A100x4,XEON8480x2", Constant(0.5), gpu_indices=[1, 3], cpu_indices=[1])
    assert [g.index for g in mon.gpus] == [1, 3] and [c.index for c in mon.cpus] == [1]
    m, truth = measure_span(sim, mon, "sel", 1.0)
    assert set(m.gpu) == {1, 3} and set(m.cpu) == {1} and set(m.dram) == {1}
    assert m.gpu[3].energy_j == pytest.approx(truth["gpu"][3], rel=1e-4)
    assert m.gpu[1].device_id == sim.gpus[1].uuid
    assert m.cpu[1].device_id.endswith("/cpu1") and m.dram[1].device_id.endswith("/dram1")


def test_no_cpus() -> None:
    sim, mon = setup("A100,XEON8480", Constant(0.5), cpu_indices=[])
    m, _ = measure_span(sim, mon, "gpu-only", 1.0)
    assert m.cpu == {} and m.dram == {}
    assert m.total_energy_j == pytest.approx(m.gpu[0].energy_j)
    assert mon.sampler.cpus == []


def test_bad_indices() -> None:
    sim = Simulator("A100x4,XEON8480")
    with pytest.raises(DeviceNotFoundError, match=r"GPU index 7 not found \(available: 0, 1, 2, 3\)"):
        EnergyMonitor(devices=sim.devices(), gpu_indices=[0, 7])
    with pytest.raises(DeviceNotFoundError, match=r"CPU index 2 not found \(available: 0\)"):
        EnergyMonitor(devices=sim.devices(), cpu_indices=[2])
    with pytest.raises(DeviceNotFoundError, match="available: none"):
        EnergyMonitor(devices=Simulator("nocpu").devices(), gpu_indices=[0])


def test_amd_cpu_without_dram() -> None:
    sim, mon = setup("A100,EPYC7763", Constant(0.5))
    m, truth = measure_span(sim, mon, "w", 2.0)
    assert m.dram == {}
    assert m.cpu[0].energy_j == pytest.approx(truth["cpu"][0], rel=1e-3)


# -- logging ----------------------------------------------------------------------------------
def test_log_jsonl_appends_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "windows.jsonl"
    sim, mon = setup("A100,XEON8480", Constant(0.5), log=path)
    m1, _ = measure_span(sim, mon, "one", 1.0)
    m2, _ = measure_span(sim, mon, "two", 0.05)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert Measurement.from_dict(json.loads(lines[0])) == m1
    assert Measurement.from_dict(json.loads(lines[1])) == m2
    mon.close()
    mon.close()  # idempotent
    mon2 = EnergyMonitor(devices=sim.devices(), log=str(path))
    m3, _ = measure_span(sim, mon2, "three", 1.0)
    mon2.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert json.loads(lines[2])["name"] == "three"
    assert Measurement.from_dict(json.loads(lines[2])) == m3


def test_log_csv_header_once_and_reopen_appends(tmp_path: Path) -> None:
    path = tmp_path / "windows.csv"
    sim, mon = setup("A100x2,XEON8480", Constant(0.5), log=path)
    m1, _ = measure_span(sim, mon, "one", 1.0)
    m2, _ = measure_span(sim, mon, "two", 0.05)
    mon.close()
    with EnergyMonitor(devices=sim.devices(), log=path) as mon2:
        measure_span(sim, mon2, "three", 1.0)
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    assert header[:6] == ["name", "host", "start_time", "elapsed_s", "total_energy_j", "uncertainty_j"]
    assert "gpu0_energy_j" in header and "gpu1_source" in header and "dram0_energy_j" in header
    assert [r[0] for r in rows[1:]] == ["one", "two", "three"]
    assert sum(r == header for r in rows) == 1
    by_name = {r[0]: dict(zip(header, r, strict=True)) for r in rows[1:]}
    assert float(by_name["one"]["gpu0_energy_j"]) == pytest.approx(m1.gpu[0].energy_j)
    assert float(by_name["one"]["total_energy_j"]) == pytest.approx(m1.total_energy_j)
    assert by_name["two"]["gpu0_source"] == m2.sources["gpu0"]
    assert by_name["two"]["gpu0_source"].endswith("+corrected")
    assert by_name["one"]["cpu0_source"] == "counter"
    assert float(by_name["two"]["elapsed_s"]) == pytest.approx(m2.elapsed_s)


def test_log_bad_suffix(tmp_path: Path) -> None:
    sim = Simulator("A100")
    with pytest.raises(ValueError, match=r"\.jsonl or \.csv"):
        EnergyMonitor(devices=sim.devices(), log=tmp_path / "windows.txt")


# -- measurement ------------------------------------------------------------------------------
def test_measurement_round_trip_and_properties() -> None:
    m = Measurement(
        name="step",
        start_time=12.5,
        elapsed_s=2.0,
        gpu={
            0: DeviceEnergy(100.0, Source.COUNTER, 0.5, False, "GPU-a"),
            3: DeviceEnergy(20.0, Source.COUNTER, 0.1, True, "GPU-b"),
        },
        cpu={0: DeviceEnergy(50.0, Source.COUNTER, 0.05, False, "h/cpu0")},
        dram={0: DeviceEnergy(10.0, Source.COUNTER, 0.01, False, "h/dram0")},
        host="h",
    )
    assert m.total_energy_j == pytest.approx(180.0)
    assert m.uncertainty_j == pytest.approx(0.66)
    assert m.average_power_w == pytest.approx(90.0)
    assert m.gpu_energy_j == {0: 100.0, 3: 20.0}
    assert m.cpu_energy_j == {0: 50.0} and m.dram_energy_j == {0: 10.0}
    assert m.sources == {
        "gpu0": "counter", "gpu3": "counter+corrected", "cpu0": "counter", "dram0": "counter"
    }
    d = m.to_dict()
    assert d["gpu"]["3"]["corrected"] is True  # type: ignore[index]
    assert d["total_energy_j"] == pytest.approx(180.0)
    back = Measurement.from_dict(json.loads(json.dumps(d)))
    assert back == m
    assert back.gpu[3].source is Source.COUNTER
    sampled = DeviceEnergy(1.0, Source.SAMPLED)
    assert DeviceEnergy.from_dict(sampled.to_dict()) == sampled
    assert DeviceEnergy.from_dict({"energy_j": 2, "source": "estimate"}) == DeviceEnergy(2.0, Source.ESTIMATE)
    empty = Measurement("e", 0.0, 0.0)
    assert empty.average_power_w == 0.0 and empty.total_energy_j == 0.0 and empty.sources == {}
    assert Measurement.from_dict(empty.to_dict()) == empty


def test_monitor_measurement_round_trips() -> None:
    sim, mon = setup("A100,P100,XEON8480", Constant(0.5))
    m, _ = measure_span(sim, mon, "w", 1.0)
    assert Measurement.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert m.average_power_w == pytest.approx(m.total_energy_j / m.elapsed_s)
    assert m.host and all(v.device_id for z in zones(m).values() for v in z.values())


# -- sync -------------------------------------------------------------------------------------
def test_sync_torch_without_torch_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    sim, mon = setup("A100,nocpu", Constant(0.5), sync="torch")
    m, _ = measure_span(sim, mon, "w", 1.0)
    assert m.gpu[0].energy_j > 0
    assert "torch" not in sys.modules
    for name in ("jax", "cupy"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        fn = make_sync(name, [0])  # type: ignore[arg-type]
        assert fn is not None
        fn()
        assert name not in sys.modules


def test_sync_callable_is_called_at_both_edges() -> None:
    calls: list[float] = []
    sim = Simulator("A100,nocpu")
    mon = EnergyMonitor(devices=sim.devices(), sync=lambda: calls.append(sim.clock.now()))
    assert calls == []
    mon.begin_window("w")
    sim.advance(1.0)
    mon.end_window("w")
    assert calls == [0.0, 1.0]
    with mon.window("ctx"):
        pass
    assert len(calls) == 4
    mon.begin_window("c")
    mon.cancel_window("c")  # cancelling does not synchronize
    assert len(calls) == 5


def test_sync_failure_at_begin_releases_the_name() -> None:
    sim = Simulator("A100,nocpu")
    fail = [True]

    def sync() -> None:
        if fail[0]:
            raise RuntimeError("device lost")

    mon = EnergyMonitor(devices=sim.devices(), sync=sync)
    with pytest.raises(RuntimeError, match="device lost"):
        mon.begin_window("w")
    assert mon.open_windows == []
    fail[0] = False
    mon.begin_window("w")
    mon.end_window("w")


def test_bad_sync_value() -> None:
    sim = Simulator("A100")
    with pytest.raises(ValueError, match="sync must be"):
        EnergyMonitor(devices=sim.devices(), sync="tensorflow")  # type: ignore[arg-type]
    assert make_sync(None, [0]) is None


def test_sync_torch_synchronizes_each_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    state = {"initialized": False}
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: state["initialized"],
        device_count=lambda: 2,
        synchronize=synced.append,
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    fn = make_sync("torch", [0, 1, 3])
    assert fn is not None
    fn()
    assert synced == []  # CUDA never initialized: no work can be queued
    state["initialized"] = True
    fn()
    assert synced == [0, 1]  # index 3 is not a device here


def test_sync_jax_and_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[object] = []

    class Arr:
        def block_until_ready(self) -> None:
            events.append("ready")

    jax = types.SimpleNamespace(
        effects_barrier=lambda: events.append("barrier"),
        local_devices=lambda: ["d0", "d1"],
        device_put=lambda x, d: events.append(("put", d)) or Arr(),
    )
    monkeypatch.setitem(sys.modules, "jax", jax)
    make_sync("jax", [0])()  # type: ignore[misc]
    assert events == ["barrier", ("put", "d0"), "ready", ("put", "d1"), "ready"]

    events.clear()

    class Device:
        def __init__(self, i: int) -> None:
            self.i = i

        def __enter__(self) -> None:
            events.append(("enter", self.i))

        def __exit__(self, *exc: object) -> None:
            events.append(("exit", self.i))

    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            Device=Device, runtime=types.SimpleNamespace(deviceSynchronize=lambda: events.append("sync"))
        )
    )
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    make_sync("cupy", [0, 2])()  # type: ignore[misc]
    assert events == [("enter", 0), "sync", ("exit", 0), ("enter", 2), "sync", ("exit", 2)]


# -- lifecycle --------------------------------------------------------------------------------
def test_close_stops_the_sampler() -> None:
    sim = Simulator("A100")
    with EnergyMonitor(devices=sim.devices()) as mon:
        assert mon.sampler.running
        sim.advance(1.0)
        n = mon.sampler.sample_count(0)
        assert n > 30
    assert not mon.sampler.running
    sim.advance(1.0)
    assert mon.sampler.sample_count(0) == n


# -- edge reads skipped when the counter phase proves them unchanged --------------------------
def _slow_counter(sim: Simulator, seconds: float) -> dict[str, int]:
    """Make every energy-counter read of ``sim``'s GPUs cost ``seconds`` of wall-clock time."""
    calls = {"n": 0}
    for g in sim.gpus:
        real = g.energy_j

        def slow(real=real) -> float:
            calls["n"] += 1
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
            return real()

        g.energy_j = slow  # type: ignore[method-assign]
    return calls


def _paired_windows(sim: Simulator, monitors: dict[str, EnergyMonitor], calls: dict[str, int],
                    edge_reads: dict[str, int], n: int, seed: int, length: Callable[[random.Random], float]):
    """``n`` windows at random offsets, measured by every monitor at once; counts each monitor's
    edge reads. Yields ``(ground truth, {monitor name: measurement})`` per window."""
    rng = random.Random(seed)
    for i in range(n):
        sim.advance(rng.uniform(0.0, 0.3))
        before = Truth(sim)
        for name, mon in monitors.items():
            k = calls["n"]
            mon.begin_window(f"w{i}")
            edge_reads[name] += calls["n"] - k
        sim.advance(length(rng))
        truth = Truth(sim).since(before)
        results = {}
        for name, mon in monitors.items():
            k = calls["n"]
            results[name] = mon.end_window(f"w{i}")
            edge_reads[name] += calls["n"] - k
        yield truth, results


def test_skipped_edge_reads_save_calls_and_give_the_same_energy() -> None:
    sim = Simulator("A100x2,nocpu")
    sim.set_workload(Periodic([(0.13, 1.0), (0.05, 0.2), (0.21, 0.7)]))
    calls = _slow_counter(sim, 0.0)  # counts the reads
    monitors = {"skip": EnergyMonitor(devices=sim.devices()),
                "read": EnergyMonitor(devices=sim.devices(), skip_reads=False)}
    sim.advance(2.0)
    edge_reads = {"skip": 0, "read": 0}
    for truth, results in _paired_windows(sim, monitors, calls, edge_reads, 60, 5,
                                          lambda rng: rng.uniform(0.15, 1.5)):
        for g in sim.gpus:
            a, b = results["skip"].gpu[g.index].energy_j, results["read"].gpu[g.index].energy_j
            assert a == pytest.approx(b, rel=0.01, abs=0.5)
            assert abs(a - truth["gpu"][g.index]) <= 2 * 0.1 * (400 - 55) + 1.0  # as when reading
    assert edge_reads["read"] == 60 * 2 * 2  # one read per GPU per edge
    assert edge_reads["skip"] < 0.5 * edge_reads["read"]


def test_sampler_reads_the_counter_about_twice_per_update() -> None:
    sim = Simulator("A100,nocpu")
    sim.set_workload(Periodic([(0.13, 1.0), (0.21, 0.4)]))
    calls = _slow_counter(sim, 0.0)
    mon = EnergyMonitor(devices=sim.devices())
    sim.advance(2.0)
    n = calls["n"]
    sim.advance(10.0)  # 100 counter updates, 345 sampler ticks
    reads = calls["n"] - n
    assert 100 <= reads <= 230  # the tick before each update and the one after, not every tick
    assert mon.sampler._tracks[0].tracker.locked
    mon.close()


def test_slow_counter_is_extrapolated_at_edges_within_the_stated_uncertainty() -> None:
    sim = Simulator("A100,H100,nocpu")
    sim.set_workload(Periodic([(0.13, 1.0), (0.05, 0.2), (0.21, 0.7)]))
    calls = _slow_counter(sim, 0.001)  # 1 ms a read, as on some NVML drivers (3 ms on an H200)
    slow = EnergyMonitor(devices=sim.devices())  # extrapolates: reads cost more than 0.5 ms
    read = EnergyMonitor(devices=sim.devices(), max_edge_read_s=None)
    sim.advance(2.0)
    assert slow.sampler.counter_read_cost_s(0) >= 0.001
    edge_reads = {"slow": 0, "read": 0}
    errors: dict[str, list[float]] = {"slow": [], "read": []}
    beyond = {"slow": 0, "read": 0}  # errors larger than the stated uncertainty
    monitors = {"slow": slow, "read": read}
    for truth, results in _paired_windows(
        sim, monitors, calls, edge_reads, 80, 4,
        lambda rng: rng.choice([rng.uniform(0.005, 0.09), rng.uniform(0.1, 1.5)]),
    ):
        for name, m in results.items():
            for g in sim.gpus:
                d = m.gpu[g.index]
                err = abs(d.energy_j - truth["gpu"][g.index])
                beyond[name] += err > d.uncertainty_j + 1e-6
                errors[name].append(err / truth["gpu"][g.index])
    assert edge_reads["slow"] == 0  # never waited for a slow read once the phase was known
    assert slow.reads["counter_extrapolated"] > 0.1 * 80 * 2 * 2
    assert edge_reads["read"] == read.reads["counter"] > 0
    # As accurate as reading at every edge (half the windows are shorter than a counter
    # period, under a load that swings every 50-210 ms: both err by several percent there).
    mean = {k: sum(v) / len(v) for k, v in errors.items()}
    assert mean["slow"] < 1.1 * mean["read"]
    assert beyond["slow"] <= max(2, beyond["read"])
    slow.close()
    read.close()


def test_simulated_h200_counter_read_blocks_3_ms_and_windows_do_not_wait_for_it() -> None:
    """The simulated H200 reads its counter as slowly as the real one (real clock only)."""
    sim = Simulator.realtime("H200,nocpu")
    sim.set_workload(Constant(0.6))
    gpu = sim.gpus[0]
    t0 = time.perf_counter()
    gpu.energy_j()
    assert time.perf_counter() - t0 >= 0.003
    mon = EnergyMonitor(devices=sim.devices())
    try:
        deadline = time.monotonic() + 5.0
        while not mon._trackers[0].locked and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mon.sampler.counter_read_cost_s(0) >= 0.003
        reads0 = mon.reads["counter"]
        costs = []
        for i in range(40):
            time.sleep(0.011)  # edges at every phase of the 100 ms updates
            t0 = time.perf_counter()
            mon.begin_window(f"w{i}")
            mon.end_window(f"w{i}")
            costs.append(time.perf_counter() - t0)
        assert mon.reads["counter"] == reads0  # no edge waited for a 3 ms read
        assert mon.reads["counter_extrapolated"] > 0
        assert sorted(costs)[-5] < 0.003
    finally:
        mon.close()
    virtual = Simulator("H200,nocpu")  # a virtual clock's reads cost no real time
    t0 = time.perf_counter()
    for _ in range(100):
        virtual.gpus[0].energy_j()
    assert time.perf_counter() - t0 < 0.1


def test_slow_counter_whose_period_drifts_is_still_measured_within_the_uncertainty() -> None:
    """A counter updating every 101 ms where 100 ms is assumed (a drift 300 times a real H200's):
    the learned phase slides, observations contradict it, and it is learned again; edges
    extrapolate only while it holds."""
    clock = VirtualClock()
    gpu = SimGPU(A100.with_overrides(counter_period_s=0.101), clock,
                 workload=Periodic([(0.13, 1.0), (0.21, 0.4)]))
    gpu.energy_counter_period_s = lambda: 0.1  # type: ignore[method-assign]
    sim = types.SimpleNamespace(gpus=[gpu], cpus=[], advance=clock.advance)
    calls = _slow_counter(sim, 0.0006)  # type: ignore[arg-type]
    mon = EnergyMonitor(devices=DeviceSet(gpus=[gpu], cpus=[], clock=clock))
    clock.advance(2.0)
    beyond = 0
    for truth, results in _paired_windows(sim, {"m": mon}, calls, {"m": 0}, 300, 1,  # type: ignore[arg-type]
                                          lambda rng: rng.uniform(0.05, 0.6)):
        d = results["m"].gpu[0]
        beyond += abs(d.energy_j - truth["gpu"][0]) > d.uncertainty_j + 1e-9
    assert beyond <= 2
    assert mon.reads["counter_extrapolated"] > 100
    mon.close()


def test_slow_counter_is_read_at_edges_before_the_phase_is_known() -> None:
    sim = Simulator("A100,nocpu")
    sim.set_workload(Constant(0.6))
    calls = _slow_counter(sim, 0.001)
    mon = EnergyMonitor(devices=sim.devices())
    n = calls["n"]
    m, truth = measure_span(sim, mon, "early", 0.05)  # phase not learned yet: read
    assert calls["n"] > n and mon.reads["counter_extrapolated"] == 0
    assert abs(m.gpu[0].energy_j - truth["gpu"][0]) <= m.gpu[0].uncertainty_j
    with pytest.raises(ValueError, match="max_edge_read_s"):
        EnergyMonitor(devices=sim.devices(), max_edge_read_s=-1.0)
    mon.close()


def test_windows_stay_within_uncertainty_with_a_second_monitor_reading_the_same_gpus() -> None:
    """At a constant load every counter tick is a whole number of mJ; a simulated counter that
    recomputed a tick's value later could read 1 mJ off, which the monitor took for an update
    between two real ones and mis-anchored a begin edge by 38 ms of power (11 J)."""
    sim = Simulator("A100,H100,nocpu")
    sim.set_workload(Periodic([(1.0, 0.7)]))
    other = EnergyMonitor(devices=sim.devices())
    mon = EnergyMonitor(devices=sim.devices())
    sim.advance(2.0)
    rng = random.Random(1)
    for i in range(30):
        sim.advance(rng.uniform(0.0, 0.3))
        before = Truth(sim)
        other.begin_window(f"w{i}")
        mon.begin_window(f"w{i}")
        sim.advance(rng.choice([rng.uniform(0.005, 0.09), rng.uniform(0.1, 1.5)]))
        truth = Truth(sim).since(before)
        other.end_window(f"w{i}")
        m = mon.end_window(f"w{i}")
        for g in sim.gpus:
            err = abs(m.gpu[g.index].energy_j - truth["gpu"][g.index])
            assert err <= m.gpu[g.index].uncertainty_j + 1e-9, (i, g.index, err)
    other.close()
    mon.close()


def test_skip_needs_a_locked_phase() -> None:
    sim = Simulator("A100,nocpu")
    mon = EnergyMonitor(devices=sim.devices())
    tracker = mon.sampler.tracker(0)
    assert tracker is not None and not tracker.locked
    assert tracker.current(sim.clock.now()) is None  # nothing learned yet: read the counter
    sim.advance(2.0)
    assert tracker.locked


# -- GPUs without a counter: sensor phase and short windows ----------------------------------
def test_sampled_gpu_bursty_windows_use_the_sensor_phase() -> None:
    sim, mon = setup("P100,nocpu", Periodic([(0.13, 1.0), (0.05, 0.2), (0.21, 0.7)]), warm=3.0)
    sensor = mon.sampler._tracks[0].sensor
    assert sensor is not None and sensor.locked  # the 20 ms power updates were learned
    rng = random.Random(3)
    for length, bound in ((0.05, 0.10), (0.33, 0.025), (1.07, 0.01)):
        errors = []
        for i in range(60):
            sim.advance(rng.uniform(0.0, 0.5))
            m, truth = measure_span(sim, mon, f"p{i}", length)
            assert m.gpu[0].source is Source.SAMPLED
            errors.append(abs(m.gpu[0].energy_j - truth["gpu"][0]) / truth["gpu"][0])
        assert sum(errors) / len(errors) < bound, length


def test_sampled_gpu_window_too_short_for_samples_reads_power_once() -> None:
    sim, mon = setup("P100,nocpu", Constant(0.6))
    m, truth = measure_span(sim, mon, "tiny", 0.004)
    assert m.gpu[0].source is Source.ESTIMATE and m.gpu[0].corrected
    assert m.gpu[0].energy_j == pytest.approx(truth["gpu"][0], rel=1e-3)


def test_short_windows_reuse_the_samplers_power_reading_when_current() -> None:
    sim, mon = setup("A100,nocpu", Periodic([(0.13, 1.0), (0.21, 0.4)]), warm=2.0)
    rng = random.Random(2)
    n = 100
    for i in range(n):
        sim.advance(rng.uniform(0.0, 0.2))
        m, truth = measure_span(sim, mon, f"s{i}", 0.001)
        assert m.gpu[0].energy_j > 0
    # A power read is needed only when the sensor may have refreshed since the sampler read it.
    assert 0 < mon.reads["power"] < 0.6 * n
    assert mon.reads["counter_skipped"] > mon.reads["counter"]


# -- devices and failures the common paths do not cover ----------------------------------------
def test_counter_of_unknown_update_period_is_measured() -> None:
    """GPUs not yet characterized (e.g. Ada) have a counter but no known period: still measured."""
    from joules.devices.nvidia import discover_nvml
    from joules.testing import fake_pynvml

    clock = VirtualClock()
    model = A100.with_overrides(arch="ada", name="NVIDIA L40S")
    sim = SimGPU(model, clock, index=0, workload=Periodic([(0.3, 0.9), (0.2, 0.2)]))
    with fake_pynvml.installed([sim]):
        gpus, _ = discover_nvml({})
        assert gpus[0].has_energy_counter() and gpus[0].energy_counter_period_s() is None
        mon = EnergyMonitor(devices=DeviceSet(gpus=gpus, cpus=[], clock=clock))
        clock.advance(2.0)
        rng = random.Random(3)
        for _ in range(30):
            clock.advance(rng.uniform(0.0, 0.3))
            e0 = sim.true_energy_j()
            mon.begin_window("w")
            clock.advance(rng.uniform(0.2, 2.0))
            m = mon.end_window("w")
            true = sim.true_energy_j() - e0
            assert m.gpu[0].source == Source.COUNTER
            assert abs(m.gpu[0].energy_j - true) <= m.gpu[0].uncertainty_j
        assert mon.reads["counter_skipped"] == 0  # no phase is learned, so no read is skipped
        mon.close()


def test_short_windows_on_a_counter_of_unknown_period_are_flagged_corrected() -> None:
    from joules.devices.nvidia import discover_nvml
    from joules.testing import fake_pynvml

    clock = VirtualClock()
    sim = SimGPU(gpu_model("A100").with_overrides(arch="ada", name="NVIDIA L40S"), clock, 0, Constant(0.7))
    with fake_pynvml.installed([sim]):
        gpus, _ = discover_nvml({})
        mon = EnergyMonitor(devices=DeviceSet(gpus=gpus, cpus=[], clock=clock))
        clock.advance(2.0)
        for dt in (0.002, 0.01, 0.03):
            clock.advance_to((int(clock.now() * 10) + 1) / 10 - dt / 2)  # around the next update
            e0 = sim.true_energy_j()
            mon.begin_window("w")
            clock.advance(dt)
            d = mon.end_window("w").gpu[0]
            assert d.source == Source.COUNTER and d.corrected  # shorter than the period may be
            assert abs(d.energy_j - (sim.true_energy_j() - e0)) <= d.uncertainty_j
        mon.close()


def test_a_load_in_step_with_the_power_sensor_widens_the_bound() -> None:
    # The A100's power reading averages the last quarter of each 100 ms period. A load with a
    # 100 ms cycle shows it the same part of every cycle: the readings never vary, and are
    # biased. The counter's own rate over its period disagrees, and the edges' bound says so.
    sim = Simulator("A100,nocpu")
    sim.set_workload(Periodic([(0.03, 1.0), (0.07, 0.0)]))
    mon = EnergyMonitor(devices=sim.devices())
    sim.advance(5.0)
    assert mon.sampler.power_spread(0) < 0.01  # W: the readings barely vary
    rng = random.Random(2)
    outside = 0
    for _ in range(100):
        sim.advance(rng.uniform(0, 0.1))
        m, truth = measure_span(sim, mon, "w", rng.uniform(0.12, 0.6))
        d = m.gpu[0]
        error = abs(d.energy_j - truth["gpu"][0])
        assert d.source == Source.COUNTER and error <= 4 * d.uncertainty_j
        outside += error > d.uncertainty_j
    assert outside <= 20  # (9 at the time of writing; with the readings' spread alone, every window was, far)
    mon.close()


def test_amd_counter_without_a_known_period_is_measured() -> None:
    from joules.devices.amd import discover_amd
    from joules.testing.fake_amdsmi import MI300X, installed

    clock = VirtualClock()
    sim = SimGPU(MI300X, clock, index=0, workload=Constant(0.5))
    with installed([sim]):
        gpus, _ = discover_amd({}, clock=clock)
        mon = EnergyMonitor(devices=DeviceSet(gpus=gpus, cpus=[], clock=clock))
        clock.advance(1.0)
        e0 = sim.true_energy_j()
        mon.begin_window("w")
        clock.advance(2.0)
        m = mon.end_window("w")
        assert m.gpu[0].source == Source.COUNTER
        assert m.gpu[0].energy_j == pytest.approx(sim.true_energy_j() - e0, abs=m.gpu[0].uncertainty_j)
        mon.close()


def test_counter_reset_inside_a_window_falls_back_to_power_samples() -> None:
    sim, mon = setup("A100,nocpu", Constant(0.5))
    g = sim.gpus[0]
    e0 = g.true_energy_j()
    mon.begin_window("w")
    sim.advance(2.0)
    g._offset_j -= g.energy_j()  # the driver reloads: the counter starts again near 0
    sim.advance(3.0)
    m = mon.end_window("w")
    true = g.true_energy_j() - e0
    assert m.gpu[0].source == Source.SAMPLED
    assert true > 1000 and abs(m.gpu[0].energy_j - true) <= m.gpu[0].uncertainty_j
    # The next window is measured from the counter again.
    m2, truth = measure_span(sim, mon, "after", 1.0)
    assert m2.gpu[0].source == Source.COUNTER
    assert m2.gpu[0].energy_j == pytest.approx(truth["gpu"][0], rel=1e-3)


def test_mig_instances_of_one_gpu_are_counted_once() -> None:
    from joules.testing import fake_pynvml

    sim = Simulator("A100,nocpu")
    sim.set_workload(Constant(0.5))
    with fake_pynvml.installed(sim, mig={0: 2}) as nv:
        # (A process enumerates one MIG device; a monitor can still be given several.)
        gpus = fake_pynvml.mig_gpus(nv)
        assert len(gpus) == 2
        mon = EnergyMonitor(devices=DeviceSet(gpus=gpus, cpus=[], clock=sim.clock))
        sim.advance(2.0)
        e0 = sim.gpus[0].true_energy_j()
        mon.begin_window("w")
        sim.advance(5.0)
        m = mon.end_window("w")
        true = sim.gpus[0].true_energy_j() - e0
        # Each instance reports the whole GPU, under the physical GPU's identity...
        assert m.gpu[0].device_id == m.gpu[1].device_id == gpus[0].gpu_uuid
        assert m.gpu[0].energy_j == pytest.approx(true, rel=1e-3)
        # ...and the GPU counts once in the total.
        assert m.total_energy_j == pytest.approx(true, rel=1e-3)
        assert m.uncertainty_j == pytest.approx(m.gpu[0].uncertainty_j)
        mon.close()


def test_mig_instances_used_from_two_pods_count_once_with_the_nodes_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pods on one node (each its own host name), each with a MIG instance of one GPU: the
    job total counted the GPU twice. JOULES_HOST names the machine the devices are on."""
    from joules.monitoring.distributed import combine
    from joules.testing import fake_pynvml

    sim = Simulator("A100,nocpu")
    sim.set_workload(Constant(0.5))
    with fake_pynvml.installed(sim, mig={0: 2}) as nv:
        gpus = fake_pynvml.mig_gpus(nv)
        totals = {}
        for node in (None, "node-7"):
            monitors = []
            for pod, gpu in zip(("pod-a", "pod-b"), gpus, strict=True):
                monkeypatch.setattr("socket.gethostname", lambda pod=pod: pod)
                if node is None:
                    monkeypatch.delenv("JOULES_HOST", raising=False)
                else:
                    monkeypatch.setenv("JOULES_HOST", node)
                monitors.append(EnergyMonitor(devices=DeviceSet(gpus=[gpu], cpus=[], clock=sim.clock)))
            sim.advance(2.0)
            e0 = sim.gpus[0].true_energy_j()
            for mon in monitors:
                mon.begin_window("w")
            sim.advance(5.0)
            totals[node] = combine([mon.end_window("w") for mon in monitors]).total_energy_j
            true = sim.gpus[0].true_energy_j() - e0
            for mon in monitors:
                mon.close()
        assert totals[None] == pytest.approx(2 * true, rel=1e-3)  # two host names: counted twice
        assert totals["node-7"] == pytest.approx(true, rel=1e-3)


@pytest.mark.parametrize(("spec", "read", "length_s"), [
    ("A100,nocpu", "energy_j", 1.0),  # the end edge's counter read
    ("A100,nocpu", "power_w", 0.004),  # a window too short for the counter reads the power
    ("P100,nocpu", "power_w", 0.004),  # ... or too short for the samples
])
def test_a_failed_end_edge_leaves_the_window_open(spec: str, read: str, length_s: float) -> None:
    sim, mon = setup(spec, Constant(0.5), skip_reads=False)
    g = sim.gpus[0]
    e0 = g.true_energy_j()
    mon.begin_window("w")
    sim.advance(length_s)
    setattr(g, read, lambda: (_ for _ in ()).throw(RuntimeError("NVML: GPU is lost")))
    with pytest.raises(RuntimeError, match="GPU is lost"):
        mon.end_window("w")
    assert mon.open_windows == ["w"]
    delattr(g, read)
    m = mon.end_window("w")
    assert m.gpu[0].energy_j == pytest.approx(g.true_energy_j() - e0, rel=1e-2)
    assert mon.open_windows == []


def test_power_reads_that_fail_for_a_gpu_without_a_counter_fail_the_edge() -> None:
    # The sampler keeps going past failed reads; the edge must not extrapolate its last good
    # reading, many seconds old, into a "sampled" result with a tiny bound.
    sim, mon = setup("P100,nocpu", Constant(0.0))
    g = sim.gpus[0]
    mon.begin_window("w")
    sim.advance(1.0)
    g.power_w = lambda: (_ for _ in ()).throw(RuntimeError("NVML_ERROR_UNKNOWN"))  # type: ignore[method-assign]
    sim.set_workload(Constant(1.0))
    sim.advance(9.0)
    assert mon.sampler.errors > 100
    with pytest.raises(RuntimeError, match="NVML_ERROR_UNKNOWN"):
        mon.end_window("w")
    assert mon.open_windows == ["w"]
    mon.cancel_window("w")


def test_block_windows_cannot_be_cancelled_or_restarted_by_name() -> None:
    sim, mon = setup("A100,nocpu", Constant(0.5))
    with mon.window("epoch") as w:
        assert mon.open_windows == ["epoch"]
        for op in (mon.cancel_window, mon.restart_window, mon.end_window):
            with pytest.raises(WindowError, match="open as a `with monitor.window"):
                op("epoch")
        assert mon.open_windows == ["epoch"]
        sim.advance(1.0)
    assert w.measurement is not None and w.measurement.elapsed_s == pytest.approx(1.0)
    with pytest.raises(WindowError, match="no open window named 'epoch'"):
        mon.cancel_window("epoch")


def test_log_csv_refuses_a_file_written_for_other_devices(tmp_path: Path) -> None:
    path = tmp_path / "windows.csv"
    sim = Simulator("A100x2,nocpu")
    sim.set_workload(Constant(0.5))
    with EnergyMonitor([0], devices=sim.devices(), log=path) as mon:
        measure_span(sim, mon, "one", 1.0)
    before = path.read_text()
    with pytest.raises(ValueError, match=r"for other devices \(it lacks gpu1_energy_j, gpu1_source\)"):
        EnergyMonitor([0, 1], devices=sim.devices(), log=path)
    assert path.read_text() == before
    with EnergyMonitor([0], devices=sim.devices(), log=path) as mon:  # the same devices append
        measure_span(sim, mon, "two", 1.0)
    assert [r[0] for r in csv.reader(path.open(newline=""))] == ["name", "one", "two"]

    # Columns in another order are the same devices: each cell goes under its own column.
    both = tmp_path / "both.csv"
    with EnergyMonitor([0, 1], devices=sim.devices(), log=both) as mon:
        measure_span(sim, mon, "ab", 1.0)
    with EnergyMonitor([1, 0], devices=sim.devices(), log=both) as mon:
        m, _ = measure_span(sim, mon, "ba", 0.5)
    rows = list(csv.DictReader(both.open(newline="")))
    assert [r["name"] for r in rows] == ["ab", "ba"]
    assert float(rows[1]["gpu1_energy_j"]) == pytest.approx(m.gpu[1].energy_j)


def test_log_written_after_close_is_appended_and_closed(tmp_path: Path) -> None:
    path = tmp_path / "windows.jsonl"
    sim, mon = setup("A100,nocpu", Constant(0.5), log=path)
    m = measure_span(sim, mon, "early", 0.5)[0]
    mon.begin_window("late")
    sim.advance(0.5)
    mon.close()
    with pytest.raises(WindowError, match="closed"):  # close() discards open windows
        mon.end_window("late")
    assert mon._log is not None
    mon._log.write(m)  # a window ending while the monitor closes: appended, file closed again
    assert mon._log._fd is None  # nothing left open
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert Measurement.from_dict(json.loads(lines[-1])) == m


def test_sampled_gpu_begin_edge_revision_keeps_to_the_sensor_period() -> None:
    """A P100 reading changes only every sensor period: a change just after a begin edge must
    not be applied to the whole time since the previous change."""
    sim, mon = setup("P100,nocpu", Periodic([(0.37, 0.9), (0.23, 0.1)]))
    rng = random.Random(1)
    worst = 0.0
    for _ in range(300):
        sim.advance(rng.uniform(0, 0.2))
        e0 = sim.gpus[0].true_energy_j()
        mon.begin_window("w")
        sim.advance(rng.choice([rng.uniform(0.05, 0.5), rng.uniform(0.5, 3)]))
        m = mon.end_window("w")
        worst = max(worst, abs(m.gpu[0].energy_j - (sim.gpus[0].true_energy_j() - e0)))
    assert worst < 5.0  # up to 30 J when the first reading after the edge covered it all


def test_an_edge_read_racing_the_sampler_keeps_value_and_update_time_together() -> None:
    """A counter read that returns the value before an update, while the sampler (another
    thread) reads the value after it, is a stale read: the edge takes the newer value, which
    belongs with the update time the tracker reports (40 J too much on a 400 W GPU before)."""
    sim = Simulator("A100,nocpu")
    sim.set_workload(Constant(1.0))
    mon = EnergyMonitor(devices=sim.devices(), skip_reads=False)
    sim.advance(2.03)
    gpu = sim.gpus[0]
    real = gpu.energy_j
    armed = {"on": False}

    def racing() -> float:
        if not armed["on"]:
            return real()
        armed["on"] = False
        value = real()  # the edge's read returns the value before the next update...
        sim.advance(0.11)  # ...but is descheduled past that update,
        mon.sampler._tick(sim.clock.now())  # while the sampler reads the newer value
        return value

    gpu.energy_j = racing  # type: ignore[method-assign]
    armed["on"] = True
    mon.begin_window("w")
    before = gpu.true_energy_j()  # the edge is the end of its read
    sim.advance(1.0)
    m = mon.end_window("w")
    truth = gpu.true_energy_j() - before
    assert truth == pytest.approx(400.0, rel=0.01)
    assert m.gpu[0].energy_j == pytest.approx(truth, abs=2.0)


@pytest.mark.parametrize(("spec", "length"),
                         [("H100x2,nocpu", 0.05), ("A100,nocpu", 0.05), ("P100,nocpu", 0.005)])
def test_a_short_window_at_a_load_change_no_reading_saw_is_within_its_uncertainty(
        spec: str, length: float) -> None:
    """A window shorter than the counter period (or the samples) that starts with a load no
    sensor has reported yet is extrapolated from idle readings: its uncertainty is the worst
    case, from 0 W to the highest power limit, and covers the truth."""
    for start in (0.0, 0.013, 0.041, 0.077):
        sim = Simulator(spec)
        mon = EnergyMonitor(devices=sim.devices())
        sim.advance(2.0 + start)  # idle so far
        sim.set_workload(Periodic([(0.3, 1.0), (0.1, 0.2)]))
        before = Truth(sim)
        mon.begin_window("burst")
        sim.advance(length)
        m = mon.end_window("burst")
        truth = Truth(sim).since(before)["gpu"]
        for k, d in m.gpu.items():
            assert d.corrected
            assert abs(d.energy_j - truth[k]) <= d.uncertainty_j, (start, k, d, truth[k])
            limit = sim.gpus[k].power_limit_range_w()[1]
            assert d.uncertainty_j <= limit * length * 1.01  # never more than the whole range
    mon.close()


# -- windows open at close, generators and coroutines, concurrent begin, failed end edges ---------
def test_close_discards_open_windows_and_refuses_new_ones() -> None:
    sim, mon = setup("A100,XEON8480", Constant(1.0))
    mon.begin_window("long")
    with pytest.raises(WindowError, match="monitor was closed"):
        with mon.window("block"):
            sim.advance(1.0)
            mon.close()
    assert mon.open_windows == []
    sim.advance(800.0)  # the sampler no longer keeps the counters current
    with pytest.raises(WindowError, match="monitor was closed"):
        mon.end_window("long")
    with pytest.raises(WindowError, match="monitor was closed"):
        mon.cancel_window("long")
    with pytest.raises(WindowError, match="closed"):
        mon.begin_window("new")
    with pytest.raises(WindowError, match="closed"):
        mon.restart_window("long")


def test_measure_spans_generators_and_coroutines() -> None:
    import asyncio
    import inspect

    sim, mon = setup("A100,nocpu", Constant(0.5))

    @mon.measure("gen")
    def gen(n: int):
        for i in range(n):
            sim.advance(1.0)
            yield i

    @mon.measure("coro")
    async def coro() -> int:
        sim.advance(1.0)
        await asyncio.sleep(0)
        return 7

    @mon.measure("agen")
    async def agen():
        for i in range(2):
            sim.advance(1.0)
            yield i

    assert inspect.isgeneratorfunction(gen)
    assert inspect.iscoroutinefunction(coro)
    assert inspect.isasyncgenfunction(agen)

    before = Truth(sim)
    assert list(gen(3)) == [0, 1, 2]
    m, true = mon.last["gen"], Truth(sim).since(before)
    assert m.elapsed_s == pytest.approx(3.0)
    assert abs(m.gpu[0].energy_j - true["gpu"][0]) <= m.gpu[0].uncertainty_j

    it = gen(5)  # closed early: the window ends with it
    assert next(it) == 0 and next(it) == 1
    it.close()
    assert mon.last["gen"].elapsed_s == pytest.approx(2.0)
    assert mon.open_windows == []

    it = gen(5)  # an exception inside cancels the window
    next(it)
    with pytest.raises(KeyError):
        it.throw(KeyError("x"))
    assert mon.open_windows == [] and mon.last["gen"].elapsed_s == pytest.approx(2.0)

    before = Truth(sim)
    assert asyncio.run(coro()) == 7
    m, true = mon.last["coro"], Truth(sim).since(before)
    assert m.elapsed_s == pytest.approx(1.0)
    assert abs(m.gpu[0].energy_j - true["gpu"][0]) <= m.gpu[0].uncertainty_j

    async def consume() -> list[int]:
        return [i async for i in agen()]

    assert asyncio.run(consume()) == [0, 1]
    assert mon.last["agen"].elapsed_s == pytest.approx(2.0)
    assert mon.open_windows == []


def test_end_or_cancel_while_begin_edge_is_taken() -> None:
    entered, release = threading.Event(), threading.Event()
    hold = [False]

    def sync() -> None:
        if hold[0]:
            entered.set()
            assert release.wait(10)

    sim, mon = setup("A100,XEON8480", Constant(0.5), sync=sync)
    errors: list[BaseException] = []

    def begin() -> None:
        try:
            mon.begin_window("x")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    for op in ("end", "cancel"):
        entered.clear()
        release.clear()
        hold[0] = True
        t = threading.Thread(target=begin)
        t.start()
        assert entered.wait(10)
        hold[0] = False
        if op == "end":
            with pytest.raises(WindowError, match="still beginning"):
                mon.end_window("x")
        else:
            mon.cancel_window("x")
        release.set()
        t.join(10)
        assert errors == []
        if op == "end":
            assert mon.open_windows == ["x"]
            sim.advance(0.5)
            assert mon.end_window("x").elapsed_s == pytest.approx(0.5)
        else:
            assert mon.open_windows == []  # the cancelled window does not come back
    mon.close()


def test_counter_reset_in_window_longer_than_sample_buffer() -> None:
    sim, mon = setup("A100,nocpu", Constant(1.0))
    g = sim.gpus[0]
    assert mon.sampler.interval_s * mon.sampler.capacity < 3600
    e0 = g.true_energy_j()
    mon.begin_window("w")
    sim.advance(1800.0)
    sim.set_workload(Constant(0.0))
    sim.advance(1800.0)
    g._offset_j -= g.energy_j()  # driver reload: the counter restarts
    sim.advance(60.0)
    d = mon.end_window("w").gpu[0]
    assert d.source is Source.SAMPLED
    assert abs(d.energy_j - (g.true_energy_j() - e0)) <= d.uncertainty_j


def test_failed_end_edge_of_block_or_measured_call_removes_window() -> None:
    fail = [False]

    def sync() -> None:
        if fail[0]:
            fail[0] = False
            raise RuntimeError("device error at end edge")

    sim, mon = setup("A100,nocpu", Constant(0.5), sync=sync)

    @mon.measure("step")
    def step() -> None:
        sim.advance(0.5)
        fail[0] = True

    with pytest.raises(RuntimeError):
        step()
    assert mon.open_windows == []
    with pytest.raises(RuntimeError):
        with mon.window("block"):
            fail[0] = True
    assert mon.open_windows == []
    mon.begin_window("named")  # a named window stays open to be ended again
    fail[0] = True
    with pytest.raises(RuntimeError):
        mon.end_window("named")
    assert mon.open_windows == ["named"]
    sim.advance(0.1)
    assert mon.end_window("named").elapsed_s == pytest.approx(0.1)


def test_cpu_bound_covers_windows_without_a_rapl_update() -> None:
    sim, mon = setup("XEON8480", Constant(1.0), warm=1.0)
    c = sim.cpus[0]
    rng = random.Random(0)
    for _ in range(200):
        sim.advance(rng.uniform(0, 0.01))
        length = rng.uniform(0.0001, 0.003)
        e0, d0 = c.true_package_energy_j(), c.true_dram_energy_j()
        mon.begin_window("w")
        sim.advance(length)
        m = mon.end_window("w")
        # Two edges of at most one RAPL update (1 ms) each at the zone's highest power (the
        # package's 350 W; DRAM reports none: its measured rate, 45 W at full load), or the
        # window's own rate where an update inside it makes that higher.
        for d, true, peak_w in ((m.cpu[0], c.true_package_energy_j() - e0, 350.0),
                                (m.dram[0], c.true_dram_energy_j() - d0, 45.0)):
            assert 0 < d.uncertainty_j <= 0.002 * max(peak_w, d.energy_j / m.elapsed_s) * 1.01
            assert abs(d.energy_j - true) <= d.uncertainty_j + 1e-12


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_samples_again() -> None:
    """A monitor made before a fork (DDP's fork strategies, notebooks) measures as well in the child.

    A P100 has no energy counter: its energy comes from the sampler, whose thread a forked
    child does not inherit; the child's first window starts one.
    """
    import multiprocessing

    mon = EnergyMonitor(sim="P100")  # real clock
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()

    def window() -> tuple[str, float, bool]:
        mon.begin_window("w")
        time.sleep(0.4)
        m = mon.end_window("w")
        return m.sources["gpu0"], m.gpu[0].uncertainty_j, mon.sampler.running

    try:
        parent = window()
        child = ctx.Process(target=lambda: out.put(window()))
        child.start()
        got = out.get(timeout=30)
        child.join(timeout=30)
    finally:
        mon.close()
    assert parent[0] == "sampled" and parent[2]
    assert got[0] == "sampled" and got[2], got
    assert got[1] < 5.0, got  # was the worst case (0 W to the highest limit): about 100 J


def test_a_csv_log_begun_for_other_devices_by_another_monitor_keeps_the_window(tmp_path: Path) -> None:
    # Both made while the file is empty (ranks starting together): the second to write cannot.
    sim = Simulator("A100x2,nocpu")
    path = tmp_path / "windows.csv"
    a = EnergyMonitor(devices=sim.devices(), log=path)
    b = EnergyMonitor(devices=sim.devices(), gpu_indices=[0], log=path)
    try:
        a.begin_window("x")
        b.begin_window("y")
        sim.advance(0.5)
        a.end_window("x")
        with pytest.warns(RuntimeWarning, match="not written to the window log.*other devices"):
            m = b.end_window("y")
        assert m.gpu[0].energy_j > 0 and b.last["y"] is m
    finally:
        a.close()
        b.close()


def test_sampled_bounds_cover_bursty_windows_but_for_unseen_changes() -> None:
    # A P100 (no counter) under bursty loads: the end edge extrapolates a reading up to one
    # sensor period old, which the bound now includes. What is left out of it is a change no
    # reading has seen yet (documented), about one window in a hundred at most.
    rng = random.Random(5)
    n = over = 0
    worst = 0.0
    for _ in range(8):
        sim = Simulator("P100,nocpu")
        sim.set_workload(Periodic([(rng.uniform(0.05, 0.5), rng.uniform(0.0, 1.0)) for _ in range(3)]))
        mon = EnergyMonitor(devices=sim.devices())
        sim.advance(2.0)
        for _ in range(50):
            sim.advance(rng.uniform(0, 0.3))
            before = sim.true_gpu_energy_j()[0]
            mon.begin_window("w")
            sim.advance(rng.choice([0.1, 0.3, 1.0]))
            d = mon.end_window("w").gpu[0]
            err = abs(d.energy_j - (sim.true_gpu_energy_j()[0] - before))
            n += 1
            if d.source is Source.SAMPLED and err > d.uncertainty_j:
                over += 1
                worst = max(worst, err / d.uncertainty_j)
        mon.close()
    assert over <= 0.01 * n and worst < 2.0, (over, n, worst)  # were 7 of 400, up to 2.3x


@pytest.mark.parametrize("spec", ["A100", "V100", "H100"])
def test_work_starting_as_the_window_opens_is_within_the_uncertainty(spec: str) -> None:
    # The usual pattern: the GPU idles, a window opens, the work starts. The interpolated
    # begin edge assumes one power over the counter period around the edge, which is not
    # so here: the reported bound must still hold (it did not, on every model).
    import random

    rng = random.Random(5)
    sim = Simulator(f"{spec},nocpu")
    mon = EnergyMonitor(devices=sim.devices())
    sim.advance(3.0)
    g = sim.gpus[0]
    for _ in range(40):
        sim.set_workload(Constant(0.0))
        sim.advance(rng.uniform(1.0, 2.0))
        if rng.random() < 0.5:  # or the work began a little before the window
            sim.set_workload(Constant(1.0))
            sim.advance(rng.uniform(0.0, 0.2))
        e0 = g.true_energy_j()
        mon.begin_window("w")
        sim.set_workload(Constant(1.0))
        sim.advance(rng.uniform(0.5, 2.0))
        d = mon.end_window("w").gpu[0]
        assert d.source == Source.COUNTER
        assert abs(d.energy_j - (g.true_energy_j() - e0)) <= d.uncertainty_j
    mon.close()



@pytest.mark.parametrize("spec", ["A100,nocpu", "H100,nocpu", "V100,nocpu"])
def test_a_window_opened_as_the_monitor_starts_is_re_anchored_once_the_phase_is_known(spec: str) -> None:
    """The begin edge of a window opened with the monitor (as ``joules measure``'s is) cannot know
    when the counter last updated: it took the middle of the period before, up to half a
    period of power off (1.7 J of 27.5 J on a 0.5 s idle A100 window). By the end the phase
    is known and places that update within milliseconds."""
    for start in (0.013, 0.041, 0.067, 0.089):
        sim = Simulator(spec)
        sim.set_workload(Constant(0.6))
        sim.advance(2.0 + start)  # the monitor starts at every phase of the counter's updates
        g = sim.gpus[0]
        mon = EnergyMonitor(devices=sim.devices())
        m, truth = measure_span(sim, mon, "w", 1.5)
        d = m.gpu[0]
        power = g.true_power_w()
        assert d.source is Source.COUNTER
        # Before: off by 3-29 % of one period's energy. The bound stays as wide (53-84 % of it):
        # a single power reading at the edge says nothing of how the power varied before it.
        assert_bounded(d, truth["gpu"][0], power * g.model.counter_period_s, start)
        assert abs(d.energy_j - truth["gpu"][0]) <= 0.01 * power * g.model.counter_period_s + 0.005, start
        mon.close()


def test_measure_without_parentheses_measures_the_function() -> None:
    """``@monitor.measure`` (no call) took the function for the name: calls returned a function
    and ran nothing."""
    import functools

    sim, mon = setup("A100,nocpu", Constant(0.5))

    @mon.measure
    def step(x: int) -> int:
        sim.advance(0.5)
        return 2 * x

    assert step(21) == 42 and step.__name__ == "step"
    m = mon.last[step.__qualname__]
    assert m.elapsed_s == pytest.approx(0.5) and m.gpu[0].energy_j > 0
    # Callables without a __qualname__ get a name too; a name that is not a string is refused.
    assert mon.measure()(functools.partial(step, 1))() == 2 and "partial" in mon.last
    with pytest.raises(TypeError, match="name must be a string"):
        mon.measure(3)  # type: ignore[call-overload]
    mon.close()


def test_a_monitor_that_finds_nothing_to_measure_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from joules.devices.base import Problem
    from joules.errors import NothingMeasuredWarning
    from joules.monitoring import monitor as monitor_module

    nothing = DeviceSet(problems=[Problem("nvml", "the NVML library was not found")])
    monkeypatch.setattr(monitor_module, "discover", lambda sim=None: nothing)
    with pytest.warns(NothingMeasuredWarning, match=r"\(nvml: the NVML library was not found\), so every"):
        EnergyMonitor().close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EnergyMonitor([], []).close()  # asked for nothing: no warning
        EnergyMonitor(devices=nothing).close()


def test_a_monitor_dropped_without_close_closes_its_log(tmp_path: Path) -> None:
    import gc
    import warnings

    sim = Simulator("A100,nocpu")
    mon = EnergyMonitor(devices=sim.devices(), log=tmp_path / "w.jsonl")
    mon.begin_window("w")
    sim.advance(0.2)
    mon.end_window("w")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del mon
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught
    assert len((tmp_path / "w.jsonl").read_text().splitlines()) == 1


def test_a_gap_in_the_samples_of_a_gpu_without_a_counter_widens_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads that failed for 3 s while the load rose and fell again: the integral took the next
    reading's power over the gap, 352 J off, with a bound of 0 J."""
    from joules.errors import JoulesError

    sim, mon = setup("P100,nocpu", Constant(0.2), warm=5.0)
    gpu = sim.gpus[0]
    failing = [False]
    real = type(gpu).power_w

    def power_w(self):  # type: ignore[no-untyped-def]
        if failing[0]:
            raise JoulesError("GPU 0 (sim): NVML error trying to read the power: Unknown Error")
        return real(self)

    monkeypatch.setattr(type(gpu), "power_w", power_w)
    before = Truth(sim)
    mon.begin_window("w")
    sim.advance(2.0)
    failing[0] = True
    sim.advance(0.25)
    sim.set_workload(Constant(1.0))
    sim.advance(2.0)
    sim.set_workload(Constant(0.2))
    sim.advance(0.75)
    failing[0] = False
    sim.advance(2.0)
    m = mon.end_window("w")
    true = Truth(sim).since(before)["gpu"][0]
    d = m.gpu[0]
    assert d.source is Source.SAMPLED and mon.sampler.errors > 50
    assert abs(d.energy_j - true) > 100  # the gap's load was never seen ...
    # ... and the bound says so: up to the highest power over the 3 s (plus a sample interval).
    assert_bounded(d, true, 3.1 * gpu.power_limit_range_w()[1] + steady_ceiling(gpu))
    # A window beside the gap is not widened.
    m, truth = measure_span(sim, mon, "after", 1.0)
    assert_bounded(m.gpu[0], truth["gpu"][0], steady_ceiling(gpu))
    # Reads that fail until the window ends (working again only for its end edge): the gap
    # is still open, and counts up to the end.
    before = Truth(sim)
    mon.begin_window("open")
    sim.advance(1.0)
    failing[0] = True
    sim.set_workload(Constant(1.0))
    sim.advance(3.0)
    failing[0] = False
    m = mon.end_window("open")
    true = Truth(sim).since(before)["gpu"][0]
    assert abs(m.gpu[0].energy_j - true) > 100
    assert_bounded(m.gpu[0], true, 3.1 * gpu.power_limit_range_w()[1] + steady_ceiling(gpu))
    mon.close()


# -- a partial end: devices that cannot be read are left out, not every device's numbers ---------
@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_partial_end_measures_the_devices_it_can_read(suffix: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU whose counter and power stopped answering 2 s before the end (the load changed
    meanwhile) and a CPU package that cannot be read at the end: ``end_window`` fails, and with
    ``partial=True`` every other device is measured as usual, the GPU from its power samples with
    a bound covering the unseen 2 s, and the package is named as left out."""
    from joules.errors import JoulesError

    log = tmp_path / f"windows{suffix}"
    sim, mon = setup("A100x2,XEON8480x2", Constant(0.3), warm=5.0, log=log)
    gone = sim.gpus[1]
    down = {"gpu": False, "cpu": False}

    def fails(kind: str, who: object, real):  # type: ignore[no-untyped-def]
        def read(self):  # type: ignore[no-untyped-def]
            if down[kind] and self is who:
                raise JoulesError(f"{kind} (sim): read failed: Unknown Error")
            return real(self)
        return read

    for name in ("energy_j", "power_w"):
        monkeypatch.setattr(type(gone), name, fails("gpu", gone, getattr(type(gone), name)))
    cpu = sim.cpus[1]
    monkeypatch.setattr(type(cpu), "package_energy_j", fails("cpu", cpu, type(cpu).package_energy_j))
    before = Truth(sim)
    mon.begin_window("w")
    sim.advance(3.0)
    down["gpu"] = True
    sim.set_workload(Constant(1.0))
    sim.advance(2.0)
    down["cpu"] = True
    with pytest.raises(JoulesError, match="read failed"):
        mon.end_window("w")
    assert mon.open_windows == ["w"]
    m = mon.end_window("w", partial=True)
    truth = Truth(sim).since(before)
    assert mon.open_windows == []
    assert m.missing == ("cpu1",) and set(m.cpu) == {0} and set(m.dram) == {0, 1}
    assert m.gpu[0].source is Source.COUNTER
    assert_bounded(m.gpu[0], truth["gpu"][0], steady_ceiling(sim.gpus[0]))
    d = m.gpu[1]
    assert d.source is Source.SAMPLED
    assert abs(d.energy_j - truth["gpu"][1]) > 50  # the load rose while it could not be read ...
    # ... and the bound says so: up to the highest power over the 2 s (and the sampling lag).
    assert_bounded(d, truth["gpu"][1], 2.2 * gone.power_limit_range_w()[1])
    assert m.cpu[0].energy_j == pytest.approx(truth["cpu"][0], rel=1e-3)
    assert m.total_energy_j == pytest.approx(
        sum(x.energy_j for zone in (m.gpu, m.cpu, m.dram) for x in zone.values()))
    # The log has the window, the package left out.
    if suffix == ".jsonl":
        row = json.loads(log.read_text().splitlines()[-1])
        assert row["missing"] == ["cpu1"] and set(row["cpu"]) == {"0"}
        assert Measurement.from_dict(row).missing == ("cpu1",)
    else:
        row = list(csv.DictReader(log.open()))[-1]
        assert row["cpu1_energy_j"] == "" and row["cpu1_source"] == "unread"
        assert row["gpu1_source"] == "sampled" and float(row["cpu0_energy_j"]) > 0
    mon.close()


def test_a_partial_end_still_fails_on_a_window_that_is_not_open() -> None:
    sim, mon = setup("A100,nocpu", Constant(0.5))
    with pytest.raises(WindowError):
        mon.end_window("nope", partial=True)
    m, truth = measure_span(sim, mon, "w", 1.0)  # and a plain end is unchanged
    assert m.missing == () and "missing" not in m.to_dict()
    mon.close()


def test_a_partial_end_of_a_gpu_whose_counter_fails_uses_the_power_read_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler skipped a GPU's power reading whenever its counter read failed: the partial
    end stretched the last reading from before the failure (984 J for 4090 J, within a bound
    as wide as the whole power range)."""
    from joules.errors import JoulesError

    sim, mon = setup("A100,nocpu", Constant(0.1), warm=3.0)
    gpu = sim.gpus[0]
    down = [False]
    real = type(gpu).energy_j

    def energy_j(self):  # type: ignore[no-untyped-def]
        if down[0]:
            raise JoulesError("GPU 0 (sim): energy counter: Unknown Error")
        return real(self)

    monkeypatch.setattr(type(gpu), "energy_j", energy_j)
    before = Truth(sim)
    mon.begin_window("w")
    sim.advance(1.0)
    down[0] = True
    sim.set_workload(Constant(1.0))  # the load rises while the counter cannot be read
    sim.advance(10.0)
    d = mon.end_window("w", partial=True).gpu[0]
    true = Truth(sim).since(before)["gpu"][0]
    assert d.source is Source.SAMPLED
    assert_bounded(d, true, 0.05 * true)  # from the power readings: close, and said so
    mon.close()


def test_a_machine_name_with_a_comma_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host names joined by commas name a total combined across hosts: one with a comma made a
    monitor's own devices count as several hosts' (a MIG GPU twice)."""
    from joules.errors import InvalidSpecError

    monkeypatch.setenv("JOULES_HOST", "rack1,node7")
    with pytest.raises(InvalidSpecError, match="JOULES_HOST='rack1,node7': a host name cannot have a comma"):
        EnergyMonitor(sim="A100")


@pytest.mark.parametrize("steps", [2, 4, 10])
def test_windows_ending_in_a_periodic_load_keep_their_error_within_the_bound(steps: int) -> None:
    """``joules demo``'s epochs (training steps, then an evaluation whose load alternates every
    0.2 and 0.1 s): an end edge in a low phase extrapolated the high phase's reading, 15.5 J
    off, with a bound of 13.5 J. The readings' spread forgot each low phase (a forgetting average
    of the extremes) before the next; it is now the wider of that and the range of the last
    second's readings."""
    sim, mon = setup("A100,nocpu", Constant(0.0), warm=0.0)
    gpu = sim.gpus[0]
    for epoch in range(5):
        before = Truth(sim)
        mon.begin_window(f"e{epoch}")
        sim.set_workload(Constant(0.94))
        for _ in range(steps):
            sim.run(0.35, 0.8)
        sim.set_workload(Periodic([(0.2, 0.55), (0.1, 0.1)]))
        sim.advance(6.0)
        d = mon.end_window(f"e{epoch}").gpu[0]
        assert_bounded(d, Truth(sim).since(before)["gpu"][0], whole_range(gpu, 0.2), epoch)  # two edges
    mon.close()


def test_a_sampled_window_longer_than_the_spread_window_keeps_its_begin_edges_bound() -> None:
    """A P100 whose load dropped 250 W just after a window began, then held for 2 s: its spread
    at the end (the last second's readings) was 0, and the bound 2 mJ against a 3.3 J error."""
    worst = 0.0
    for k in range(0, 50, 7):
        sim, mon = setup("P100,nocpu", Constant(1.0), warm=3.0, sample_interval_s=0.05)
        before = Truth(sim)
        mon.begin_window("w")
        sim.advance(0.001 * k)
        sim.set_workload(Constant(0.0))
        sim.advance(2.0)
        d = mon.end_window("w").gpu[0]
        true = Truth(sim).since(before)["gpu"][0]
        assert_bounded(d, true, whole_range(sim.gpus[0], 0.15), k)
        worst = max(worst, abs(d.energy_j - true))
        mon.close()
    assert worst > 1.0  # the begin edge's error is there to bound
