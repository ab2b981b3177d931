import json
import subprocess
import sys
import threading
import time
import types

import pytest
from _fork import needs_fork, run_in_forked_child

from joules.devices import nvidia
from joules.devices.nvidia import NVMLGPU, discover_nvml
from joules.devices.sim import Constant, Simulator
from joules.errors import DeviceNotFoundError, DevicePermissionError, NotSupportedError
from joules.testing import fake_pynvml

A100, V100, P100 = 0, 1, 2


@pytest.fixture
def sim():
    return Simulator("A100,V100,P100,nocpu")


@pytest.fixture
def nvml(sim):
    with fake_pynvml.installed(sim) as mod:
        yield mod


def gpus_of(env=None, **kw):
    gpus, problems = discover_nvml({} if env is None else env, **kw)
    return gpus, problems


# -- the fake module itself -------------------------------------------------------------------


def test_fake_errors_behave_like_nvidia_ml_py(nvml):
    e = nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
    assert type(e) is nvml.NVMLError_NotSupported
    assert isinstance(e, nvml.NVMLError)
    assert e.value == 3 and str(e) == "Not Supported"
    assert nvml.NVMLError_NoPermission().value == nvml.NVML_ERROR_NO_PERMISSION == 4
    assert nvml.NVMLError(4) == nvml.NVMLError_NoPermission()
    assert str(nvml.NVMLError(12345)) == "NVML Error with code 12345"
    assert nvml.nvmlExceptionClass(9) is nvml.NVMLError_DriverNotLoaded


def test_fake_needs_init_and_counts_calls(nvml):
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 3
    assert nvml.fake_calls["nvmlDeviceGetCount"] == 2
    nvml.nvmlShutdown()
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


def test_fake_units_and_unsupported_features(sim, nvml):
    sim.set_workload(Constant(1.0))
    sim.advance(2.05)
    nvml.nvmlInit()
    a100, v100, p100 = (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(3))
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(a100) == round(sim.gpus[A100].energy_j() * 1000)
    assert nvml.nvmlDeviceGetPowerUsage(a100) == 400_000  # mW
    assert nvml.nvmlDeviceGetPowerManagementLimitConstraints(a100) == [100_000, 400_000]
    assert nvml.nvmlDeviceGetArchitecture(v100) == nvml.NVML_DEVICE_ARCH_VOLTA == 5
    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetTotalEnergyConsumption(p100)
    fields = [(nvml.NVML_FI_DEV_POWER_INSTANT, nvml.NVML_POWER_SCOPE_GPU)]
    fv = nvml.nvmlDeviceGetFieldValues(a100, fields)[0]
    assert fv.nvmlReturn == nvml.NVML_SUCCESS
    assert fv.valueType == nvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert fv.value.uiVal == 400_000
    assert fv.timestamp == 2_050_000  # microseconds on the simulator's clock
    fv = nvml.nvmlDeviceGetFieldValues(v100, [nvml.NVML_FI_DEV_POWER_INSTANT])[0]
    assert fv.nvmlReturn == nvml.NVML_ERROR_NOT_SUPPORTED
    # Module scope only where the fake is told the board is a Grace-Hopper-like module.
    fv = nvml.nvmlDeviceGetFieldValues(a100, [(nvml.NVML_FI_DEV_POWER_INSTANT, nvml.NVML_POWER_SCOPE_MODULE)])
    assert fv[0].nvmlReturn == nvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetC2cModeInfoV(a100)
    with pytest.raises(nvml.NVMLError_NotSupported):  # a function the fake does not implement
        nvml.nvmlDeviceGetFanSpeed(a100)


def test_fake_zeus_style_usage(sim):
    """The calls Zeus' NVIDIAGPU makes, as it makes them."""
    sim.set_workload(Constant(0.5))
    sim.advance(1.5)
    with fake_pynvml.installed(sim, module_scope=[0]) as pynvml:
        assert hasattr(pynvml, "_nvmlGetFunctionPointer")  # Zeus' check for the official bindings
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetC2cModeInfoV(handle).isC2cEnabled == 1
        fields = [(pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_POWER_SCOPE_MODULE)]
        metric = pynvml.nvmlDeviceGetFieldValues(handle, fields)[0]
        assert metric.nvmlReturn == pynvml.NVML_SUCCESS
        assert metric.value.uiVal == round(sim.gpus[0].average_power_w() * 1000) == 227_500
        assert pynvml.nvmlDeviceGetArchitecture(handle) >= pynvml.NVML_DEVICE_ARCH_VOLTA
        assert pynvml.nvmlDeviceGetTemperatureV(handle, pynvml.NVML_TEMPERATURE_GPU) == round(
            sim.gpus[0].temperature_c()
        )
        default = pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle)
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, 300_000)
        assert sim.gpus[0].power_limit_w() == 300.0
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, default)
        assert sim.gpus[0].power_limit_w() == 400.0
        clocks = pynvml.nvmlDeviceGetSupportedGraphicsClocks(
            handle, pynvml.nvmlDeviceGetSupportedMemoryClocks(handle)[0]
        )
        pynvml.nvmlDeviceSetGpuLockedClocks(handle, clocks[-1], clocks[10])
        assert sim.gpus[0].sm_clock_locked() == (210.0, 1260.0)
        pynvml.nvmlDeviceResetGpuLockedClocks(handle)
        assert sim.gpus[0].sm_clock_locked() is None
        pynvml.nvmlShutdown()


def test_installed_restores_previous_module(sim, monkeypatch):
    sentinel = object()
    monkeypatch.setitem(sys.modules, "pynvml", sentinel)
    with fake_pynvml.installed(sim) as mod:
        assert sys.modules["pynvml"] is mod
    assert sys.modules["pynvml"] is sentinel
    monkeypatch.delitem(sys.modules, "pynvml")
    with fake_pynvml.installed(sim):
        pass
    assert "pynvml" not in sys.modules


def test_installed_patches_modules_that_imported_pynvml_earlier(sim, monkeypatch):
    import types

    tool = types.ModuleType("some_tool")
    tool.pynvml = "the real one"
    monkeypatch.setitem(sys.modules, "some_tool", tool)
    with fake_pynvml.installed(sim, patch=["some_tool"]) as mod:
        assert tool.pynvml is mod
        assert mod.nvmlLib is None
        mod.nvmlInit()
        assert mod.nvmlLib is not None
        # Constants copied from the installed nvidia-ml-py, beyond those the fake defines.
        assert mod.NVML_DEVICE_PCI_BUS_ID_FMT == "%08X:%02X:%02X.0"
        assert mod.NVML_FI_DEV_POWER_INSTANT == 186
    assert tool.pynvml == "the real one"
    before = sys.modules.get("pynvml")
    with pytest.raises(ValueError, match="not imported"):
        with fake_pynvml.installed(sim, patch=["not_imported_anywhere"]):
            pass
    assert sys.modules.get("pynvml") is before


def test_call_latency_is_spent_per_call(sim):
    with fake_pynvml.installed(sim, call_latency_s=0.002):
        (gpu,) = [g for g in gpus_of({"CUDA_VISIBLE_DEVICES": "0"})[0]]
        t0 = time.perf_counter()
        for _ in range(5):
            gpu.energy_j()
        assert time.perf_counter() - t0 >= 0.010


# -- NVMLGPU ----------------------------------------------------------------------------------


def test_energy_matches_the_simulated_counter(sim, nvml):
    sim.set_workload(Constant(0.6))
    gpus, _ = gpus_of()
    a100, v100 = gpus[A100], gpus[V100]
    e0 = a100.energy_j()
    assert e0 == pytest.approx(sim.gpus[A100].energy_j(), abs=1e-9)
    t0 = sim.gpus[A100].true_energy_j()
    sim.advance(10.03)
    assert a100.energy_j() == pytest.approx(sim.gpus[A100].energy_j(), abs=1e-9)
    assert v100.energy_j() == pytest.approx(sim.gpus[V100].energy_j(), abs=1e-9)
    # 0.6 load on an A100: 55 + 0.6 * 345 = 262 W; the counter lags by at most one 0.1 s update.
    measured = a100.energy_j() - e0
    true = sim.gpus[A100].true_energy_j() - t0
    assert true == pytest.approx(262.0 * 10.03)
    assert abs(measured - true) <= 262.0 * 0.1 + 1e-3
    assert a100.energy_counter_period_s() == 0.1
    assert v100.energy_counter_period_s() == 0.02


def test_energy_j_is_one_nvml_call(sim, nvml):
    gpus, _ = gpus_of()
    before = sum(nvml.fake_calls.values())
    gpus[A100].energy_j()
    gpus[A100].power_w()
    gpus[V100].power_w()
    assert sum(nvml.fake_calls.values()) - before == 3


def test_instant_power_on_a100_and_its_power_usage_is_instant_too(sim, nvml):
    # NVML: "On Ampere (except GA100) or newer GPUs, the API returns power averaged over 1 sec
    # interval. On GA100 and older architectures, instantaneous power is returned."
    gpus, _ = gpus_of()
    a100 = gpus[A100]
    sim.advance(5.0)  # idle: 55 W
    assert a100.power_w() == pytest.approx(55.0, abs=2e-3)
    sim.set_workload(Constant(1.0))  # 400 W (the default limit)
    sim.advance(0.35)
    # The instant field is updated every 0.1 s; the last update (t = 5.3) saw full load.
    assert a100.power_w() == pytest.approx(400.0, abs=2e-3)
    assert a100.average_power_w() == a100.power_w()  # GA100: nvmlDeviceGetPowerUsage is instant
    assert nvml.nvmlDeviceGetPowerUsage(nvml.nvmlDeviceGetHandleByIndex(A100)) == 400_000
    assert a100.power_source == "NVML_FI_DEV_POWER_INSTANT"
    assert a100.power_update_period_s() == 0.1
    assert a100.is_ga100 and not a100.power_usage_averaged
    assert a100.describe()["power_usage_averaged"] is False


@pytest.mark.parametrize("model", ["H100", "A40"])
def test_power_usage_is_a_one_second_average_on_other_ampere_and_newer(model):
    sim = Simulator(f"{model},nocpu")
    with fake_pynvml.installed(sim):
        (gpu,), _ = gpus_of()
        assert not gpu.is_ga100 and gpu.power_usage_averaged
        idle, full = sim.gpus[0].model.idle_w, min(sim.gpus[0].model.peak_w, sim.gpus[0].power_limit_w())
        sim.advance(5.0)
        sim.set_workload(Constant(1.0))
        sim.advance(0.35)
        assert gpu.power_w() == pytest.approx(full, abs=2e-3)
        # nvmlDeviceGetPowerUsage averages the last second: 0.7 s idle + 0.3 s at full load.
        assert gpu.average_power_w() == pytest.approx(0.7 * idle + 0.3 * full, abs=2e-3)
        assert gpu.describe()["power_usage_averaged"] is True


def test_v100_has_no_instant_field_but_its_power_usage_is_instant(sim, nvml):
    gpus, _ = gpus_of()
    v100 = gpus[V100]
    sim.advance(5.0)
    sim.set_workload(Constant(1.0))
    sim.advance(0.35)
    assert v100.power_source == "nvmlDeviceGetPowerUsage"
    assert v100.power_w() == pytest.approx(290.0, abs=2e-3)  # peak 290 W, under the 300 W limit
    assert v100.average_power_w() == v100.power_w()
    assert v100.power_update_period_s() == 0.02


def test_p100_has_no_energy_counter(sim, nvml):
    gpus, problems = gpus_of()
    p100 = gpus[P100]
    assert not p100.has_energy_counter()
    assert p100.energy_counter_period_s() is None
    with pytest.raises(NotSupportedError, match="Volta"):
        p100.energy_j()
    assert p100.power_w() == pytest.approx(30.0, abs=2e-3)  # idle
    (problem,) = p100.problems()
    assert "no energy counter" in problem.message and "Volta" in problem.fix
    assert problem in problems
    assert p100.describe()["energy_counter"] is False


def test_power_limit_get_set_and_range(sim, nvml):
    gpus, _ = gpus_of()
    a100 = gpus[A100]
    assert a100.power_limit_w() == 400.0
    assert a100.default_power_limit_w() == 400.0
    assert a100.power_limit_range_w() == (100.0, 400.0)
    a100.set_power_limit_w(250.5)
    assert a100.power_limit_w() == 250.5
    assert sim.gpus[A100].power_limit_w() == 250.5
    sim.set_workload(Constant(1.0))
    sim.advance(0.25)
    assert a100.power_w() == pytest.approx(250.5, abs=2e-3)  # the sensor has 1 mW steps
    with pytest.raises(ValueError, match=r"outside the allowed range \[100, 400\] W"):
        a100.set_power_limit_w(450)
    with pytest.raises(ValueError, match=r"\[100, 400\]"):
        a100.set_power_limit_w(99.9)
    assert a100.power_limit_w() == 250.5
    a100.reset_power_limit()
    assert sim.gpus[A100].power_limit_w() == 400.0


def test_permission_errors_say_how_to_fix_them(sim):
    with fake_pynvml.installed(sim, allow_control=False):
        a100 = gpus_of()[0][A100]
        with pytest.raises(DevicePermissionError) as info:
            a100.set_power_limit_w(300)
        msg = str(info.value)
        assert "no permission to set the power limit" in msg
        assert "root" in msg and "sudo nvidia-smi -i 0 -pl 300" in msg and "nvidia-smi -pm 1" in msg
        with pytest.raises(DevicePermissionError, match="-lgc 210,1005"):
            a100.lock_sm_clock(210, 1005)
        with pytest.raises(DevicePermissionError, match="-rgc"):
            a100.reset_sm_clock()
        assert sim.gpus[A100].power_limit_w() == 400.0
        assert a100.power_limit_w() == 400.0  # reading needs no permission


def test_clocks(sim, nvml):
    gpus, _ = gpus_of()
    a100, v100 = gpus[A100], gpus[V100]
    clocks = a100.supported_sm_clocks_mhz()
    assert clocks[0] == 1410.0 and clocks[-1] == 210.0 and len(clocks) == 81
    assert v100.supported_sm_clocks_mhz()[:3] == [1530.0, 1522.0, 1515.0]  # NVML lists whole MHz
    assert a100.memory_clock_mhz() == 1215.0
    assert a100.sm_clock_mhz() == 210.0  # idle
    sim.set_workload(Constant(1.0))
    assert a100.sm_clock_mhz() == 1410.0
    a100.lock_sm_clock(210, 1005)
    assert sim.gpus[A100].sm_clock_locked() == (210.0, 1005.0)
    assert a100.sm_clock_mhz() == 1005.0
    a100.reset_sm_clock()
    assert sim.gpus[A100].sm_clock_locked() is None
    with pytest.raises(ValueError, match=r"outside the supported range \[210, 1410\] MHz"):
        a100.lock_sm_clock(100, 1410)
    with pytest.raises(ValueError, match="empty"):
        a100.lock_sm_clock(1000, 900)
    a100.lock_sm_clock(210, 1005)
    a100.lock_memory_clock(1215, 1215)  # (an A100's only memory clock)
    assert sim.gpus[A100]._mem_lock == (1215.0, 1215.0)
    a100.reset_memory_clock()
    assert sim.gpus[A100]._mem_lock is None
    assert sim.gpus[A100].sm_clock_locked() == (210.0, 1005.0)  # the SM lock is another one
    a100.reset_sm_clock()
    with pytest.raises(ValueError, match="memory clock range"):
        a100.lock_memory_clock(2000, 2000)
    assert 28.0 <= a100.temperature_c() <= 70.0


def test_clock_locks_need_volta_and_memory_locks_ampere(sim, nvml):
    # NVML: SM locks "for Volta or newer", memory locks "for Ampere or newer" (NOT_SUPPORTED before).
    gpus, _ = gpus_of()
    with pytest.raises(NotSupportedError):
        gpus[P100].lock_sm_clock(900, 1000)
    with pytest.raises(NotSupportedError):
        gpus[V100].lock_memory_clock(877, 877)
    gpus[V100].lock_sm_clock(900, 1005)
    assert sim.gpus[V100].sm_clock_locked() == (900.0, 1005.0)
    gpus[V100].reset_sm_clock()


def test_fake_structures_read_strings_as_nvidia_ml_py_does(nvml):
    nvml.nvmlInit()
    pci = nvml.nvmlDeviceGetPciInfo(nvml.nvmlDeviceGetHandleByIndex(0))
    assert isinstance(pci.busId, str) and pci.busId.startswith("0000")
    pci.busId = "00000000:07:00.0"
    assert pci.busId == "00000000:07:00.0"
    nvml.nvmlShutdown()


def test_cuda_visible_devices_integers(sim, nvml):
    gpus, problems = gpus_of({"CUDA_VISIBLE_DEVICES": "2,0"})
    assert [(g.index, g.physical_index, g.name) for g in gpus] == [
        (0, 2, "Tesla P100-PCIE-16GB"),
        (1, 0, "NVIDIA A100-SXM4-40GB"),
    ]
    # Different models, default CUDA_DEVICE_ORDER: CUDA's numbering may differ from NVML's.
    assert any("CUDA_DEVICE_ORDER=PCI_BUS_ID" in p.fix for p in problems)
    _, problems = gpus_of({"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert not any("CUDA_DEVICE_ORDER" in p.fix for p in problems)


def test_cuda_visible_devices_invalid_entry_stops_the_list(sim, nvml):
    gpus, problems = gpus_of({"CUDA_VISIBLE_DEVICES": "1,-1,0"})
    assert [g.physical_index for g in gpus] == [1]
    (p,) = [p for p in problems if p.device == "CUDA_VISIBLE_DEVICES" and "'-1'" in p.message]
    assert "'-1'" in p.message and "0" in p.message
    gpus, _ = gpus_of({"CUDA_VISIBLE_DEVICES": ""})
    assert gpus == []


def test_cuda_visible_devices_uuids_and_prefixes(sim, nvml):
    uuid1 = sim.gpus[1].uuid
    gpus, _ = gpus_of({"CUDA_VISIBLE_DEVICES": f"{uuid1},{sim.gpus[0].uuid[:-8]}"})
    # A prefix that names one GPU is enough.
    assert [g.physical_index for g in gpus] == [1, 0]
    assert gpus[0].uuid == uuid1
    with pytest.raises(DeviceNotFoundError, match="ambiguous"):
        gpus_of({"CUDA_VISIBLE_DEVICES": "GPU-5e1a7ed0"})
    with pytest.raises(DeviceNotFoundError, match="matches no GPU"):
        gpus_of({"CUDA_VISIBLE_DEVICES": "GPU-00000000"})


def test_mig_instances_of_one_gpu_are_restored_as_that_gpu(sim, tmp_path):
    # The power limit is the physical GPU's: changed through two instances, it is restored to
    # what it was before either (not to the first change), and a guard that ends first hands
    # it to the one still running.
    from joules.devices.restore import RestoreGuard, recover_report

    with fake_pynvml.installed(sim, mig={0: 2}) as nvml:
        nvml.nvmlInit()
        parent = nvml.nvmlDeviceGetHandleByIndex(0)
        migs = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, k)) for k in range(2)]
        # One process sees one MIG device; two processes (one per instance) share the GPU.
        ((a,), _), ((b,), _) = (gpus_of({"CUDA_VISIBLE_DEVICES": m}) for m in migs)
        assert a.control_uuid == b.control_uuid == nvml.nvmlDeviceGetUUID(parent) != a.uuid
        one = RestoreGuard([a, b], journal_dir=tmp_path / "one", handle_signals=False)
        one.set_power_limit_w(a, 250)
        one.set_power_limit_w(b, 200)
        assert [c.original_power_limit_w for c in one.changed] == [400.0]
        assert one.restore() == [] and sim.gpus[0].power_limit_w() == 400.0

        jobs = tmp_path / "jobs"
        first = RestoreGuard([a], journal_dir=jobs, handle_signals=False)
        second = RestoreGuard([b], journal_dir=jobs, handle_signals=False)
        first.set_power_limit_w(a, 250)
        second.set_power_limit_w(b, 200)
        assert first.restore() == [] and sim.gpus[0].power_limit_w() == 200.0  # still second's
        assert second.restore() == [] and sim.gpus[0].power_limit_w() == 400.0

        # The journal names the physical GPU, so a job killed on one instance is recovered
        # through any instance (a journal of an older version, naming the instance, through it).
        third = RestoreGuard([a], journal_dir=jobs, handle_signals=False)
        third.set_power_limit_w(a, 220)
        (journal,) = jobs.glob("*.json")
        data = json.loads(journal.read_text())
        assert [g["uuid"] for g in data["gpus"]] == [a.control_uuid]
        assert third.restore() == []
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                              capture_output=True, text=True)
        for uuid, visible in ((a.control_uuid, b), (a.uuid, a)):
            b.set_power_limit_w(230)
            killed = {**data, "pid": int(gone.stdout), "process_start_time": None,
                      "gpus": [{**data["gpus"][0], "uuid": uuid}]}
            (jobs / "killed.json").write_text(json.dumps(killed))
            assert [x.kind for x in recover_report([visible], jobs)] == ["restored"]
            assert sim.gpus[0].power_limit_w() == 400.0


def test_mig_device_is_measured_through_its_parent(sim):
    sim.set_workload(Constant(0.5))
    with fake_pynvml.installed(sim, mig={0: 3}) as nvml:
        nvml.nvmlInit()
        parent = nvml.nvmlDeviceGetHandleByIndex(0)
        migs = [nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, k) for k in range(3)]
        mig_uuids = [nvml.nvmlDeviceGetUUID(h) for h in migs]
        # As on real hardware, MIG handles have no power or energy of their own.
        with pytest.raises(nvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetTotalEnergyConsumption(migs[0])

        gpus, problems = gpus_of({"CUDA_VISIBLE_DEVICES": f"{mig_uuids[1]},{mig_uuids[2][:16]}"})
        # A process enumerates only the first MIG device listed (as CUDA does).
        assert [(g.index, g.physical_index, g.mig_uuid) for g in gpus] == [(0, 0, mig_uuids[1])]
        assert any("only one MIG device" in p.message and mig_uuids[2][:16] in p.message for p in problems)
        g = gpus[0]
        assert g.is_mig and g.uuid == mig_uuids[1] and "MIG 2g.10gb" in g.name
        sim.advance(2.02)
        assert g.energy_j() == pytest.approx(sim.gpus[0].energy_j(), abs=1e-9)
        assert g.power_w() == pytest.approx(55 + 0.5 * 345, abs=2e-3)
        g.set_power_limit_w(300)  # per physical GPU
        assert sim.gpus[0].power_limit_w() == 300.0
        (p,) = [p for p in g.problems() if "MIG" in p.message]
        assert "whole GPU" in p.message and "per physical GPU" in p.message
        assert "-mig 0" in p.fix
        assert p in problems
        info = g.describe()
        assert info["mig"]["parent_uuid"] == sim.gpus[0].uuid
        assert "whole physical GPU" in info["mig"]["measures"]

        # The legacy MIG-GPU-<uuid>/<gi>/<ci> form.
        gpus, _ = gpus_of({"CUDA_VISIBLE_DEVICES": f"MIG-{sim.gpus[0].uuid}/3/0"})
        assert [g.mig_uuid for g in gpus] == [mig_uuids[2]]

        # The whole GPU, in MIG mode.
        gpus, _ = gpus_of({"CUDA_VISIBLE_DEVICES": "0"})
        assert not gpus[0].is_mig and gpus[0].mig_mode
        assert any("MIG mode is enabled" in p.message for p in gpus[0].problems())

        with pytest.raises(DeviceNotFoundError):
            NVMLGPU(1, mig_uuid=mig_uuids[0])


def test_module_power_scope(sim):
    sim.set_workload(Constant(1.0))
    sim.advance(1.25)
    with fake_pynvml.installed(sim, module_scope=[0]):
        gpus, _ = gpus_of({"CUDA_VISIBLE_DEVICES": "0"}, power_scope="module")
        assert gpus[0].power_scope == "module"
        assert gpus[0].power_source == "NVML_FI_DEV_POWER_INSTANT (module scope)"
        assert gpus[0].power_w() == pytest.approx(400.0, abs=2e-3)
        assert gpus[0].average_power_w() == pytest.approx(400.0, abs=2e-3)
        with pytest.raises(NotSupportedError, match="module-scope"):
            NVMLGPU(1, power_scope="module")
        with pytest.raises(ValueError, match="power_scope"):
            NVMLGPU(0, power_scope="board")


def test_public_and_fast_field_paths_agree(sim):
    sim.set_workload(Constant(0.3))
    sim.advance(3.3)
    with fake_pynvml.installed(sim) as nvml:
        fast = NVMLGPU(0)
        assert fast.power_w() == pytest.approx(55 + 0.3 * 345, abs=2e-3)
        # Without the C-level entry point the public nvmlDeviceGetFieldValues is used.
        del nvml.__dict__["_nvmlGetFunctionPointer"]
        nvml.__dict__["_nvmlGetFunctionPointer"] = None
        slow = NVMLGPU(0)
        assert slow.power_w() == fast.power_w()
        before = nvml.fake_calls["nvmlDeviceGetFieldValues"]
        slow.power_w()
        fast.power_w()
        assert nvml.fake_calls["nvmlDeviceGetFieldValues"] - before == 2


def test_persistence_and_driver_problems(sim):
    with fake_pynvml.installed(sim, persistence=[1], driver_version="470.82.01"):
        gpus, problems = gpus_of()
        a100 = [p.message for p in gpus[A100].problems()]
        assert any("persistence mode is off" in m for m in a100)
        # Without the instant field an A100 falls back to nvmlDeviceGetPowerUsage, which is
        # instantaneous on GA100: no "1 s averages" warning.
        assert any("470.82.01 is older than 525.60" in m and "power fields" in m for m in a100)
        assert not any("1 s average" in m for m in a100)
        assert gpus[A100].power_source == "nvmlDeviceGetPowerUsage"
        fixes = [p.fix for p in problems]
        assert "sudo nvidia-smi -pm 1" in fixes
        assert not any("persistence" in p.message for p in gpus[V100].problems())
        assert gpus[A100].describe()["persistence_mode"] is False


def test_old_driver_on_h100_warns_of_one_second_averages():
    sim = Simulator("H100,A100,nocpu")
    sim.advance(5.0)
    sim.set_workload(Constant(1.0))
    sim.advance(0.55)
    with fake_pynvml.installed(sim, driver_version="470.82.01"):
        (h100, a100), _ = gpus_of()
        assert h100.power_source == a100.power_source == "nvmlDeviceGetPowerUsage"
        h100_problems = [p.message for p in h100.problems()]
        assert any("470.82.01" in m and "power readings are 1 s averages" in m for m in h100_problems)
        assert not any("1 s average" in p.message for p in a100.problems())
        # the A100's reading follows the load; the H100's still averages idle time in
        assert a100.power_w() == pytest.approx(400.0, abs=2e-3)
        assert h100.power_w() == pytest.approx(0.5 * 70.0 + 0.5 * 690.0, abs=2e-3)


def test_ga100_is_told_by_compute_capability_or_else_by_name(sim, nvml):
    gpus, _ = gpus_of()
    assert [g.is_ga100 for g in gpus] == [True, False, False]
    assert [g.power_usage_averaged for g in gpus] == [False, False, False]
    del nvml.__dict__["nvmlDeviceGetCudaComputeCapability"]  # -> NVMLError_NotSupported
    gpus, _ = gpus_of()
    assert [g.is_ga100 for g in gpus] == [True, False, False]


def test_no_problems_on_a_healthy_a100(sim, nvml):
    gpus, problems = gpus_of({"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert gpus[0].problems() == []
    assert problems == []


def test_discover_when_nvml_init_fails(sim):
    with fake_pynvml.installed(sim, init_error=fake_pynvml.NVMLError(9).value):
        gpus, problems = gpus_of()
    assert gpus == []
    (p,) = problems
    assert "driver is not loaded" in p.message and "modprobe nvidia" in p.fix
    with fake_pynvml.installed(sim, init_error=12):
        _, (p,) = gpus_of()
    assert "libnvidia-ml.so.1" in p.message


def test_discover_when_pynvml_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    gpus, (p,) = gpus_of()
    assert gpus == []
    assert "cannot import pynvml" in p.message and p.fix == "pip install nvidia-ml-py"


def test_describe_is_json_ready(sim, nvml):
    import json

    info = gpus_of()[0][A100].describe()
    json.dumps(info)
    assert info["power_limit_range_w"] == (100.0, 400.0)
    assert info["architecture"] == "ampere" and info["driver_version"] == "550.54.15"


# -- fork -------------------------------------------------------------------------------------


@needs_fork
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads running
def test_forked_child_reads_power_while_the_parent_sampler_was_mid_read(sim, nvml):
    gpus, _ = gpus_of()
    a100 = gpus[A100]
    assert a100.power_source == "NVML_FI_DEV_POWER_INSTANT"
    st = nvml.fake_state
    original = st.c_field_values
    inside, release = threading.Event(), threading.Event()

    def slow(*args):  # an NVML call under load, with the reader's lock held
        inside.set()
        release.wait(20)
        return original(*args)

    st.c_field_values = slow
    sampler = threading.Thread(target=a100.power_w, daemon=True)
    sampler.start()
    try:
        assert inside.wait(10)
        st.c_field_values = original  # the child's own readings are quick
        out = run_in_forked_child(a100.power_w)
    finally:
        release.set()
        sampler.join(10)
    assert out is not None, "the child hung on the lock its parent's sampler held at fork()"
    assert float(out) == pytest.approx(a100.power_w())


@needs_fork
def test_forked_child_initializes_nvml_itself(sim, nvml):
    gpus_of()
    assert nvml.fake_calls["nvmlInit"] == 1

    def child() -> str:
        gpus, _ = discover_nvml({})
        return f"{len(gpus)} {nvml.fake_calls['nvmlInit']}"

    assert run_in_forked_child(child) == "3 2"  # the child called nvmlInit itself
    assert nvml.fake_calls["nvmlInit"] == 1  # the parent did not


@needs_fork
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_forked_child_gets_a_free_nvml_init_lock(sim, nvml):
    gpus_of()
    # another thread is inside nvmlInit (holding the init lock) when the process forks
    slow = types.ModuleType("slow_pynvml")
    inside, release = threading.Event(), threading.Event()

    def nvmlInit() -> None:
        inside.set()
        release.wait(20)

    slow.nvmlInit = nvmlInit  # type: ignore[attr-defined]
    t = threading.Thread(target=nvidia._ensure_init, args=(slow,), daemon=True)
    t.start()

    def child() -> str:
        gpus, _ = discover_nvml({})
        return f"{len(gpus)} {nvml.fake_calls['nvmlInit']}"

    try:
        assert inside.wait(10)
        out = run_in_forked_child(child)
    finally:
        release.set()
        t.join(10)
    assert out is not None, "the child hung on NVML's init lock"
    assert out == "3 2"


@pytest.mark.parametrize("what", ["energy", "field"])
def test_a_transient_error_as_the_gpu_is_opened_does_not_disable_a_capability(what):
    """One NVML timeout at start-up cost a GPU its energy counter (every window then sampled)
    or its instant power field (1 s averages) for the whole process, with a fix that said to
    use a Volta GPU or upgrade the driver."""
    sim = Simulator("H100,nocpu")
    with fake_pynvml.installed(sim) as mod:
        calls = {"n": 0}
        name = "nvmlDeviceGetTotalEnergyConsumption" if what == "energy" else "nvmlDeviceGetFieldValues"
        real = getattr(mod, name)

        def once(*args):
            calls["n"] += 1
            if calls["n"] == 1:
                raise mod.NVMLError(mod.NVML_ERROR_TIMEOUT)
            return real(*args)

        setattr(mod, name, once)
        (gpu,), problems = discover_nvml({})
        assert calls["n"] >= 2
        assert gpu.has_energy_counter() and "INSTANT" in gpu.power_source, gpu.power_source
        assert not [p for p in problems if "energy counter" in p.message or "INSTANT" in p.message]
    if what == "energy":  # a GPU that does not support it is still told apart, at once
        sim = Simulator("H100,nocpu")
        with fake_pynvml.installed(sim) as mod:
            unsupported = {"n": 0}

            def never(*args):
                unsupported["n"] += 1
                raise mod.NVMLError(mod.NVML_ERROR_NOT_SUPPORTED)

            mod.nvmlDeviceGetTotalEnergyConsumption = never
            (gpu,), _ = discover_nvml({})
            assert not gpu.has_energy_counter() and unsupported["n"] == 1
