from __future__ import annotations

import sys
from pathlib import Path

import pytest

from joules.clock import VirtualClock
from joules.devices.amd import AMDGPU, discover_amd, unique_id, visible_devices
from joules.devices.sim import Constant, SimGPU
from joules.errors import DevicePermissionError, NotSupportedError
from joules.testing.fake_amdsmi import (
    COUNTER_RESOLUTION_UJ,
    MI250X,
    MI300X,
    amdsmi_uuid,
    installed,
    make_module,
)


def sims(clock: VirtualClock, n: int = 2, model=MI300X, **kwargs) -> list[SimGPU]:
    return [SimGPU(model, clock, index=i, **kwargs) for i in range(n)]


def amd_gpus(gpus: list) -> list[AMDGPU]:
    assert all(isinstance(g, AMDGPU) for g in gpus)
    return gpus


# -- discovery --------------------------------------------------------------------------------
def test_discovers_gpus() -> None:
    clock = VirtualClock()
    s = sims(clock, 2)
    with installed(s) as smi:
        gpus, problems = discover_amd({}, clock=clock)
    assert problems == []
    assert [g.index for g in gpus] == [0, 1]
    assert [g.physical_index for g in gpus] == [0, 1]
    assert [g.name for g in gpus] == ["AMD Instinct MI300X"] * 2
    assert [g.vendor for g in gpus] == ["amd", "amd"]
    assert [g.uuid for g in gpus] == [h.uuid for h in smi.handles]
    assert len(set(g.uuid for g in gpus)) == 2


def test_installed_restores_sys_modules() -> None:
    clock = VirtualClock()
    before = sys.modules.get("amdsmi")
    with installed(sims(clock, 1)) as smi:
        assert sys.modules["amdsmi"] is smi
    assert sys.modules.get("amdsmi") is before


def test_missing_amdsmi_without_driver_is_silent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi -> ImportError
    assert discover_amd({}, kfd_path=str(tmp_path / "kfd")) == ([], [])


def test_missing_amdsmi_with_driver_explains(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    kfd = tmp_path / "kfd"
    kfd.write_text("")
    gpus, problems = discover_amd({}, kfd_path=str(kfd))
    assert gpus == []
    assert len(problems) == 1 and "pip install amdsmi" in problems[0].fix


def test_init_failure_is_a_problem() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 1), fail_init=True):
        gpus, problems = discover_amd({}, clock=clock)
    assert gpus == []
    assert "could not be initialized" in problems[0].message
    assert "render" in problems[0].fix


# -- energy and power ---------------------------------------------------------------------------
@pytest.mark.parametrize("legacy", [False, True])
def test_energy_counter_in_joules(legacy: bool) -> None:
    clock = VirtualClock()
    (sim,) = sims(clock, 1)
    with installed([sim], legacy_energy_key=legacy):
        (gpu,), problems = discover_amd({}, clock=clock)
    assert problems == [] and gpu.has_energy_counter()
    sim.set_workload(Constant(1.0))  # 750 W, the MI300X cap
    e0, t0 = gpu.energy_j(), sim.true_energy_j()
    clock.advance(10.0)
    e1, t1 = gpu.energy_j(), sim.true_energy_j()
    assert t1 - t0 == pytest.approx(7500.0)
    # 15.3 µJ ticks of a counter updated every 1 ms in 1 mJ steps
    assert e1 - e0 == pytest.approx(7500.0, abs=0.75 + 2 * COUNTER_RESOLUTION_UJ * 1e-6)


def test_a_32_bit_counter_is_extended_across_its_wraps() -> None:
    # RDNA firmware counts energy in 32 bits: it wraps every 2**32 ticks of 2**-16 J (65.5 kJ).
    from joules.devices.base import DeviceSet
    from joules.monitoring import EnergyMonitor

    clock = VirtualClock()
    (sim,) = sims(clock, 1, workload=Constant(1.0))  # 750 W: a wrap every 87 s
    with installed([sim], counter_bits=32) as smi:
        (gpu,), problems = discover_amd({}, clock=clock)
        assert problems == [] and gpu.has_energy_counter()
        e0, t0 = gpu.energy_j(), sim.true_energy_j()
        for _ in range(5):
            clock.advance(60.0)
            assert smi.amdsmi_get_energy_count(smi.handles[0])["energy_accumulator"] < 2**32
            assert gpu.energy_j() - e0 == pytest.approx(sim.true_energy_j() - t0, abs=1.0)
        # Windows across wraps stay on the counter (a wrap is not a reset).
        monitor = EnergyMonitor(devices=DeviceSet(gpus=[gpu], cpus=[], clock=clock))
        try:
            for i in range(2):
                t0 = sim.true_energy_j()
                monitor.begin_window(f"w{i}")
                clock.advance(100.0)
                d = monitor.end_window(f"w{i}").gpu[0]
                assert d.source == "counter"
                assert d.energy_j == pytest.approx(sim.true_energy_j() - t0, abs=1.0)
        finally:
            monitor.close()


@pytest.mark.parametrize(("bits", "offset_j"), [(32, 20_000.0), (64, 20_000.0), (32, 5e6)])
def test_a_counter_reset_is_not_taken_for_a_32_bit_wrap(bits: int, offset_j: float) -> None:
    """A GPU reset restarts the counter near 0: a 32-bit counter (or a 64-bit one not yet past
    32 bits) that went back was taken to have wrapped, 43.6 kJ of a 2.2 kJ window, as "counter"
    with a 22 J bound. A drop the GPU could not have drawn since the previous read is a reset."""
    from joules.devices.base import DeviceSet
    from joules.monitoring import EnergyMonitor

    clock = VirtualClock()
    (sim,) = sims(clock, 1, workload=Constant(0.5), counter_offset_j=offset_j)
    with installed([sim], counter_bits=bits):
        (gpu,), _ = discover_amd({}, clock=clock)
        monitor = EnergyMonitor(devices=DeviceSet(gpus=[gpu], cpus=[], clock=clock))
        try:
            clock.advance(2.0)
            t0 = sim.true_energy_j()
            monitor.begin_window("w")
            clock.advance(2.0)
            sim._offset_j -= sim.energy_j()  # the firmware's counter restarts near 0
            clock.advance(3.0)
            d = monitor.end_window("w").gpu[0]
            true = sim.true_energy_j() - t0
            assert d.source == "sampled"  # across the reset: from the power samples
            assert abs(d.energy_j - true) <= d.uncertainty_j < 0.1 * true
            monitor.begin_window("after")  # and from the counter again after it
            t0 = sim.true_energy_j()
            clock.advance(2.0)
            d = monitor.end_window("after").gpu[0]
            assert d.source == "counter" and d.energy_j == pytest.approx(sim.true_energy_j() - t0, abs=1.0)
        finally:
            monitor.close()


def test_power_fields_by_generation() -> None:
    clock = VirtualClock()
    mi300 = SimGPU(MI300X, clock, index=0, workload=Constant(1.0))
    mi250 = SimGPU(MI250X, clock, index=1, workload=Constant(1.0))
    with installed([mi300, mi250]):
        g300, g250 = amd_gpus(discover_amd({}, clock=clock)[0])
    clock.advance(2.0)
    # MI300X reports current_socket_power only; the average falls back to it
    assert g300.power_w() == 750.0
    assert g300.average_power_w() == 750.0
    # MI250X reports average_socket_power only; the instant reading falls back to it
    assert g250.power_w() == 500.0
    assert g250.average_power_w() == 500.0


def test_idle_power() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 1)):
        (gpu,), _ = discover_amd({}, clock=clock)
    clock.advance(1.0)
    assert gpu.power_w() == 140.0


# -- broken energy counter ----------------------------------------------------------------------
def test_frozen_counter_is_detected_and_power_still_works() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 2), broken_energy_counter=True):
        gpus, problems = discover_amd({}, clock=clock, counter_check_s=0.2)
    assert [g.has_energy_counter() for g in gpus] == [False, False]
    assert len(problems) == 2
    assert "did not advance in 0.200 s while the GPU drew 140 W" in problems[0].message
    assert "power sampling" in problems[0].message
    assert "ROCm" in problems[0].fix
    with pytest.raises(NotSupportedError, match="power sampling"):
        gpus[0].energy_j()
    assert gpus[0].power_w() == 140.0
    assert amd_gpus(gpus)[0].describe()["energy_counter"] is False
    assert gpus[0].describe()["energy_counter_check"]["ok"] is False  # type: ignore[index]


def test_erratic_counter_is_detected() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 1), broken_energy_counter="erratic"):
        (gpu,), problems = discover_amd({}, clock=clock)
    assert not gpu.has_energy_counter()
    # 1e9 ticks of 15.3 µJ = 15.3 kJ in 0.2 s: 76 kW while the GPU reads 140 W
    assert "W while the power reading is 140 W" in problems[0].message


def test_only_the_broken_gpu_is_marked() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 3), broken_energy_counter=True, broken_gpus={1}):
        gpus, problems = discover_amd({}, clock=clock)
    assert [g.has_energy_counter() for g in gpus] == [True, False, True]
    assert [p.device for p in problems] == ["GPU 1"]


def test_check_costs_one_interval_for_all_gpus() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 4)):
        discover_amd({}, clock=clock, counter_check_s=0.25)
    assert clock.now() == 0.25


def test_check_can_be_skipped() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 1), broken_energy_counter=True):
        (gpu,), problems = discover_amd({}, clock=clock, counter_check_s=None)
    assert clock.now() == 0.0
    assert gpu.has_energy_counter() and problems == []


def test_constructor_runs_the_check() -> None:
    clock = VirtualClock()
    s = sims(clock, 1)
    smi = make_module(s, broken_energy_counter=True)
    smi.amdsmi_init()
    handle = smi.amdsmi_get_processor_handles()[0]
    gpu = AMDGPU(smi, handle, 0, clock=clock, counter_check_s=0.05)
    assert clock.now() == pytest.approx(0.05)
    assert not gpu.has_energy_counter()
    good = make_module(s)
    good.amdsmi_init()
    ok = AMDGPU(good, good.amdsmi_get_processor_handles()[0], 0, clock=clock, counter_check_s=0.05)
    assert ok.has_energy_counter()
    assert clock.now() == pytest.approx(0.10)


def test_counter_check_accepts_a_busy_gpu() -> None:
    clock = VirtualClock()
    s = sims(clock, 1, workload=Constant(1.0))
    with installed(s):
        (gpu,), problems = discover_amd({}, clock=clock)
    assert problems == []
    check = gpu.describe()["energy_counter_check"]
    assert check["ok"] is True  # type: ignore[index]
    assert check["energy_delta_j"] == pytest.approx(150.0, abs=0.01)  # type: ignore[index]  # 750 W x 0.2 s


# -- power limits -------------------------------------------------------------------------------
def test_power_limits_in_watts() -> None:
    clock = VirtualClock()
    (sim,) = sims(clock, 1)
    with installed([sim]):
        (gpu,), _ = discover_amd({}, clock=clock)
    assert gpu.power_limit_w() == 750.0
    assert gpu.default_power_limit_w() == 750.0
    assert gpu.power_limit_range_w() == (200.0, 750.0)
    gpu.set_power_limit_w(450)
    assert sim.power_limit_w() == 450.0  # 450,000,000 µW went to amdsmi_set_power_cap
    assert gpu.power_limit_w() == 450.0
    # The driver keeps whole watts (it would floor 450.6 W to 450): joules rounds.
    with installed([sim]) as smi:
        smi.amdsmi_init()
        smi.amdsmi_set_power_cap(smi.handles[0], 0, 450_600_000)
        assert sim.power_limit_w() == 450.0
    gpu.set_power_limit_w(450.6)
    assert gpu.power_limit_w() == 451.0
    gpu.set_power_limit_w(200.4)
    assert gpu.power_limit_w() == 200.0
    with pytest.raises(ValueError, match=r"outside the allowed range \[200, 750\] W"):
        gpu.set_power_limit_w(800)
    gpu.reset_power_limit()
    assert sim.power_limit_w() == 750.0


def test_power_cap_reported_in_watts_is_understood() -> None:
    clock = VirtualClock()
    smi = make_module(sims(clock, 1))
    smi.amdsmi_get_power_cap_info = lambda h: {  # an amdsmi that reports W
        "power_cap": 750, "default_power_cap": 750, "min_power_cap": 200, "max_power_cap": 750,
    }
    smi.amdsmi_init()
    gpu = AMDGPU(smi, smi.amdsmi_get_processor_handles()[0], 0, clock=clock, counter_check_s=None)
    assert gpu.power_limit_w() == 750.0
    assert gpu.power_limit_range_w() == (200.0, 750.0)


def test_setting_limits_without_permission() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 1, allow_control=False)):
        (gpu,), _ = discover_amd({}, clock=clock)
    with pytest.raises(DevicePermissionError, match="needs root"):
        gpu.set_power_limit_w(400)
    with pytest.raises(DevicePermissionError):
        gpu.lock_sm_clock(500, 1500)


# -- clocks and temperature ---------------------------------------------------------------------
def test_clocks() -> None:
    clock = VirtualClock()
    (sim,) = sims(clock, 1)
    with installed([sim]):
        (gpu,), _ = discover_amd({}, clock=clock)
    assert gpu.sm_clock_mhz() == 500.0  # idle
    assert gpu.memory_clock_mhz() == 1300.0
    supported = gpu.supported_sm_clocks_mhz()
    # amdsmi_get_clk_freq drops the last frequency; the clock info's max restores it
    assert supported[0] == 2100.0 and supported[-1] == 500.0 and len(supported) == 17
    gpu.lock_sm_clock(500, 1500)
    assert sim.sm_clock_locked() == (500.0, 1500.0)
    gpu.reset_sm_clock()
    assert sim.sm_clock_locked() is None
    with pytest.raises(ValueError, match=r"outside \[500, 2100\] MHz"):
        gpu.lock_sm_clock(500, 2500)


def test_temperature_falls_back_to_hotspot_on_mi300() -> None:
    clock = VirtualClock()
    mi300 = SimGPU(MI300X, clock, index=0)
    mi250 = SimGPU(MI250X, clock, index=1)
    with installed([mi300, mi250]):
        g300, g250 = discover_amd({}, clock=clock)[0]
    assert g300.temperature_c() == float(int(mi300.temperature_c() + 12))  # hotspot (junction)
    assert g250.temperature_c() == float(int(mi250.temperature_c()))  # edge


# -- visible devices ----------------------------------------------------------------------------
def test_rocr_visible_devices_selects_and_reorders() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 4)) as smi:
        gpus, problems = discover_amd({"ROCR_VISIBLE_DEVICES": "2,0"}, clock=clock)
    assert problems == []
    assert [(g.index, g.physical_index) for g in gpus] == [(0, 2), (1, 0)]
    assert gpus[0].uuid == smi.handles[2].uuid


def test_hip_visible_devices_indexes_the_rocr_selection() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 4)):
        gpus, _ = discover_amd({"ROCR_VISIBLE_DEVICES": "3,1,2", "HIP_VISIBLE_DEVICES": "2,0"}, clock=clock)
    assert [(g.index, g.physical_index) for g in gpus] == [(0, 2), (1, 3)]


def test_visible_devices_by_uuid() -> None:
    # ROCr, HIP and rocminfo name a GPU GPU-<16 hex digits of its unique id>; amdsmi's UUID holds
    # the same id in another layout, from which it is recovered.
    clock = VirtualClock()
    with installed(sims(clock, 3)) as smi:
        rocr = f"GPU-{smi.handles[2].unique_id:016x}"
        assert smi.handles[2].uuid != rocr
        gpus, problems = discover_amd({"ROCR_VISIBLE_DEVICES": f"{rocr.upper()},{rocr}"}, clock=clock)
    # the second entry names the same GPU again: it and what follows are dropped
    assert [g.physical_index for g in gpus] == [2]
    assert len(problems) == 1 and "already listed" in problems[0].message


def test_unique_id_from_amdsmi_uuid() -> None:
    # amdsmi_uuid_gen: {b7}{fcn}{did}-0000-1000-80{b6}-{b5..b0}; ROCr: GPU-%016llx
    assert unique_id("deff740f-0000-1000-8082-87300da37c72") == "de8287300da37c72"
    assert unique_id("DEFF740F-0000-1000-8082-87300DA37C72") == "de8287300da37c72"
    assert unique_id("1f0074a1-0000-1000-8045-d9c1b0f6a4b2") == "1f45d9c1b0f6a4b2"  # partition 0
    assert unique_id("GPU-de8287300da37c72") == "de8287300da37c72"
    assert unique_id(amdsmi_uuid(0x2A17E3B4C5D6E7F8, 0x74A1)) == "2a17e3b4c5d6e7f8"
    assert unique_id("GPU-0000000000000000") is None  # ROCr: no UUID
    assert unique_id("AMD-GPU-0") is None
    assert unique_id("6ba7b810-9dad-11d1-80b4-00c04fd430c8") is None  # another kind of UUID


_IDS = [0x1F45D9C1B0F6A4B2, 0x2A17E3B4C5D6E7F8, 0x2A17AA00C5D6E7F8, 0x3C00000000000001]
_UUIDS = [amdsmi_uuid(i, 0x74A1) for i in _IDS]


def test_visible_devices_accepts_unique_prefixes_of_the_id() -> None:
    assert visible_devices(4, _UUIDS, {"ROCR_VISIBLE_DEVICES": "GPU-2a17e3b4c5d6e7f8"}) == ([1], [])
    assert visible_devices(4, _UUIDS, {"ROCR_VISIBLE_DEVICES": "gpu-3C,GPU-2a17e"}) == ([3, 1], [])
    assert visible_devices(4, _UUIDS, {"HIP_VISIBLE_DEVICES": "GPU-1,1"}) == ([0, 1], [])
    # HIP selects among the GPUs ROCr left: there GPU-2a17 names one GPU only
    order, problems = visible_devices(
        4, _UUIDS, {"ROCR_VISIBLE_DEVICES": "0,GPU-2a17a", "HIP_VISIBLE_DEVICES": "GPU-2a17"}
    )
    assert (order, problems) == ([2], [])


def test_visible_devices_refuses_ambiguous_prefixes() -> None:
    order, problems = visible_devices(4, _UUIDS, {"ROCR_VISIBLE_DEVICES": "3,GPU-2a17,0"})
    assert order == [3]
    assert len(problems) == 1
    message = problems[0].message
    assert "'GPU-2a17' is ambiguous" in message and "GPU-2a17e3b4c5d6e7f8" in message
    assert "GPU-2a17aa00c5d6e7f8" in message and "entries after it are ignored" in message
    assert "GPU-1f45d9c1b0f6a4b2" in problems[0].fix


def test_visible_devices_refuses_what_the_runtimes_refuse() -> None:
    for token in ("GPU-", "GPU-2a17e3b4c5d6e7f8a", "GPU-xyz", "GPU-99", "2a17e3b4c5d6e7f8"):
        order, problems = visible_devices(4, _UUIDS, {"ROCR_VISIBLE_DEVICES": f"0,{token},1"})
        assert order == [0], token
        assert len(problems) == 1 and repr(token) in problems[0].message
    # an amdsmi UUID is not what the runtimes take; the message says what is
    order, problems = visible_devices(4, _UUIDS, {"ROCR_VISIBLE_DEVICES": _UUIDS[1]})
    assert order == []
    assert "amdsmi UUID" in problems[0].message and "GPU-2a17e3b4c5d6e7f8" in problems[0].message


def test_visible_devices_prefers_the_hip_uuid_of_enumeration_info() -> None:
    clock = VirtualClock()
    with installed(sims(clock, 3), enumeration_info=True) as smi:
        smi.handles[1].hip_uuid = "GPU-0123456789abcdef"  # not the id in amdsmi's UUID
        gpus, problems = discover_amd({"HIP_VISIBLE_DEVICES": "GPU-0123,0"}, clock=clock)
    assert problems == []
    assert [g.physical_index for g in gpus] == [1, 0]
    # given ids override amdsmi's UUID; missing or unusable ones fall back to it
    ids: list[str | None] = [None, "n/a", "GPU-0123456789abcdef", "0123456789ABCDEE"]
    assert visible_devices(4, _UUIDS, {"ROCR_VISIBLE_DEVICES": "GPU-0123456789abcdef"}, ids)[0] == [2]
    assert visible_devices(4, _UUIDS, {"ROCR_VISIBLE_DEVICES": "GPU-0123456789abcdee"}, ids)[0] == [3]
    assert visible_devices(4, _UUIDS, {"ROCR_VISIBLE_DEVICES": "GPU-2a17e,GPU-1f"}, ids)[0] == [1, 0]


def test_gpus_are_numbered_in_hips_order_where_amdsmi_reports_it() -> None:
    # HIP numbers GPUs by KFD node (amdsmi's hip_id), which need not be amdsmi's handle order.
    clock = VirtualClock()
    gpus = [SimGPU(MI300X, clock, index=0), SimGPU(MI250X, clock, index=1), SimGPU(MI300X, clock, index=2)]
    with installed(gpus, enumeration_info=True) as smi:
        for h, hip in zip(smi.handles, (2, 0, 1), strict=True):
            h.hip_id = hip
        found, problems = discover_amd({}, clock=clock, counter_check_s=None)
        assert problems == []
        assert [(g.index, g.physical_index) for g in found] == [(0, 1), (1, 2), (2, 0)]
        assert found[0].name == "AMD Instinct MI250X"
        found, _ = discover_amd({"HIP_VISIBLE_DEVICES": "0"}, clock=clock, counter_check_s=None)
        assert [g.physical_index for g in found] == [1]  # HIP device 0
        found, _ = discover_amd({"ROCR_VISIBLE_DEVICES": "2,0"}, clock=clock, counter_check_s=None)
        assert [g.physical_index for g in found] == [0, 1]
        smi.handles[2].hip_id = 0  # repeated ids are not an order: amdsmi's is kept
        found, _ = discover_amd({}, clock=clock, counter_check_s=None)
        assert [g.physical_index for g in found] == [0, 1, 2]


def test_enumeration_info_that_fails_is_not_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = VirtualClock()
    with installed(sims(clock, 2), enumeration_info=True) as smi:
        def broken(handle: object) -> dict:
            raise smi.AmdSmiLibraryException(2)

        monkeypatch.setattr(smi, "amdsmi_get_gpu_enumeration_info", broken)
        rocr = f"GPU-{smi.handles[1].unique_id:016x}"
        gpus, problems = discover_amd({"ROCR_VISIBLE_DEVICES": rocr}, clock=clock)
    assert problems == []
    assert [g.physical_index for g in gpus] == [1]


def test_invalid_entry_hides_it_and_the_rest() -> None:
    order, problems = visible_devices(4, [f"u{i}" for i in range(4)], {"HIP_VISIBLE_DEVICES": "1,7,2"})
    assert order == [1]
    assert "'7'" in problems[0].message and "0 to 3" in problems[0].fix


def test_empty_value_hides_every_gpu() -> None:
    assert visible_devices(4, ["a"] * 4, {"ROCR_VISIBLE_DEVICES": ""}) == ([], [])


def test_cuda_visible_devices_only_without_hip() -> None:
    uuids = [f"u{i}" for i in range(4)]
    assert visible_devices(4, uuids, {"CUDA_VISIBLE_DEVICES": "3"})[0] == [3]
    assert visible_devices(4, uuids, {"CUDA_VISIBLE_DEVICES": "3", "HIP_VISIBLE_DEVICES": "1"})[0] == [1]
    assert visible_devices(4, uuids, {})[0] == [0, 1, 2, 3]


def test_second_die_of_an_mi250x_is_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    # ROCm reports an MI250X package's power, energy and cap on its first GCD, zeros on the second.
    clock = VirtualClock()
    gcds = [SimGPU(MI250X, clock, index=i, workload=Constant(1.0)) for i in range(2)]
    with installed(gcds) as smi:
        second = smi.handles[1]
        energy, power = smi.amdsmi_get_energy_count, smi.amdsmi_get_power_info
        caps = smi.amdsmi_get_power_cap_info

        def package_energy(h: object) -> dict:
            return {**energy(h), "power": 0, "energy_accumulator": 0} if h is second else energy(h)

        def package_power(h: object) -> dict:
            return {**power(h), "average_socket_power": 0} if h is second else power(h)

        def package_caps(h: object) -> dict:
            zero = {"power_cap": 0, "default_power_cap": 0, "min_power_cap": 0, "max_power_cap": 0}
            return {**caps(h), **zero} if h is second else caps(h)

        monkeypatch.setattr(smi, "amdsmi_get_energy_count", package_energy)
        monkeypatch.setattr(smi, "amdsmi_get_power_info", package_power)
        monkeypatch.setattr(smi, "amdsmi_get_power_cap_info", package_caps)
        gpus, problems = discover_amd({}, clock=clock)
        a, b = amd_gpus(gpus)
        assert not a.secondary_die and a.has_energy_counter()
        assert b.secondary_die and not b.has_energy_counter() and b.describe()["secondary_die"]
        assert [p.device for p in problems] == ["GPU 1"]
        assert "second die (GCD)" in problems[0].message and "update ROCm" not in problems[0].fix
        # The package's one cap is read and set through the first die (the kernel refuses it
        # on the second), so the second die controls the first one's device.
        assert b.control_uuid == a.uuid == a.control_uuid != b.uuid
        assert b.power_limit_range_w() == a.power_limit_range_w() == (200.0, 560.0)
        b.set_power_limit_w(300)
        assert gcds[0].power_limit_w() == b.power_limit_w() == 300.0 and gcds[1].power_limit_w() == 560.0
        a.set_power_limit_w(350)
        assert b.power_limit_w() == 350.0
        # Also in a process that sees only the second die (one rank per die).
        (alone,), _ = discover_amd({"ROCR_VISIBLE_DEVICES": "1"}, clock=clock)
        assert amd_gpus([alone])[0].secondary_die and alone.control_uuid == a.uuid
        alone.set_power_limit_w(400)
        assert gcds[0].power_limit_w() == 400.0
        alone.reset_power_limit()
        assert gcds[0].power_limit_w() == 560.0
        # Without its first die known, a second die refuses (it has no cap of its own).
        lone = AMDGPU(smi, second, 0, 1, clock=clock, counter_check_s=None)
        with pytest.raises(NotSupportedError, match="set it on the package's first die"):
            lone.set_power_limit_w(300)


def test_a_zero_counter_and_caps_not_available_are_not_a_second_die(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = VirtualClock()
    with installed([SimGPU(MI250X, clock, index=0, workload=Constant(1.0))]) as smi:
        energy, caps = smi.amdsmi_get_energy_count, smi.amdsmi_get_power_cap_info
        reset = {"done": False}

        def fresh_counter(h: object) -> dict:  # reads 0 once (just reset), then counts
            if not reset["done"]:
                reset["done"] = True
                return {**energy(h), "power": 0, "energy_accumulator": 0}
            return energy(h)

        monkeypatch.setattr(smi, "amdsmi_get_energy_count", fresh_counter)
        monkeypatch.setattr(smi, "amdsmi_get_power_cap_info",
                            lambda h: {**caps(h), "power_cap": "N/A", "max_power_cap": "N/A"})
        gpus, _ = discover_amd({}, clock=clock, counter_check_s=None)
    assert not amd_gpus(gpus)[0].secondary_die and gpus[0].has_energy_counter()
