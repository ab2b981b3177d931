"""EnergyMonitor end to end on the real RAPL backend, over a fake powercap tree that wraps."""

from __future__ import annotations

from pathlib import Path

import pytest

from joules.devices.base import DeviceSet
from joules.devices.rapl import discover_rapl
from joules.devices.sim import Constant, Periodic, SimCPU, Simulator
from joules.devices.sim.catalog import cpu_model
from joules.monitoring import EnergyMonitor, Source
from joules.testing.fake_sysfs import FakePowercap


def test_monitor_on_rapl_backend_is_exact_across_many_wraps(tmp_path: Path) -> None:
    sim = Simulator("A100,nocpu")
    # Small counters (wrap at 2 kJ: every ~6 s at full load) so a 60 s window wraps ~10 times.
    cpus = [SimCPU(cpu_model("XEON8480").with_overrides(wrap_j=2000.0), sim.clock, index=i)
            for i in range(2)]
    tree = FakePowercap.for_sim(tmp_path, cpus)
    rapl, problems = discover_rapl(tree.root, cpuinfo=tree.cpuinfo_path)
    assert len(rapl) == 2 and not problems
    assert rapl[0].max_read_interval_s() < 6.0
    # The tree follows the simulated packages as virtual time passes (what the kernel does).
    sim.clock.every(0.005, lambda now: tree.sync_from(cpus))
    monitor = EnergyMonitor(devices=DeviceSet(gpus=sim.gpus, cpus=rapl, clock=sim.clock))
    for cpu in cpus:
        cpu.set_workload(Periodic([(0.7, 1.0), (0.3, 0.2)]))
    sim.set_workload(Constant(0.5))
    sim.advance(1.0)

    p0 = [c.true_package_energy_j() for c in cpus]
    d0 = [c.true_dram_energy_j() for c in cpus]
    monitor.begin_window("long")
    sim.advance(60.0)
    m = monitor.end_window("long")
    for k, cpu in enumerate(cpus):
        true_pkg = cpu.true_package_energy_j() - p0[k]
        assert true_pkg > 5 * 2000.0  # it did wrap many times
        assert m.cpu[k].source is Source.COUNTER
        # Exact to the RAPL update period and the tree's 5 ms sync.
        assert m.cpu_energy_j[k] == pytest.approx(true_pkg, abs=0.01 * 350)
        assert m.dram_energy_j[k] == pytest.approx(cpu.true_dram_energy_j() - d0[k], abs=0.01 * 45)
    monitor.close()


def test_unreadable_packages_are_left_out_with_a_warning_and_gpus_still_measured(tmp_path: Path) -> None:
    """RAPL is root-only since Linux 5.10: a default monitor must still measure the GPUs."""
    from joules.errors import DevicePermissionError

    sim = Simulator("A100,nocpu")
    fake = FakePowercap(tmp_path, packages=2, readable=False)
    rapl, problems = discover_rapl(fake.root, cpuinfo=fake.cpuinfo_path, opener=fake.opener)
    assert len(rapl) == 2 and not any(c.readable() for c in rapl) and problems
    devices = DeviceSet(gpus=sim.gpus, cpus=rapl, clock=sim.clock)
    with pytest.warns(RuntimeWarning, match=r"CPU 0, 1: RAPL energy counters .* not readable.*Fix: run"):
        monitor = EnergyMonitor(devices=devices)
    assert monitor.cpus == []
    sim.set_workload(Constant(1.0))
    monitor.begin_window("step")
    sim.advance(2.0)
    m = monitor.end_window("step")
    assert m.gpu_energy_j[0] == pytest.approx(2.0 * sim.gpus[0].power_w(), rel=0.02)
    assert m.cpu_energy_j == {}
    monitor.close()
    # Asked for by index, an unreadable package is an error at once, not at the first window.
    with pytest.raises(DevicePermissionError, match="cannot measure CPU 1: .*Fix: run as root"):
        EnergyMonitor([], [1], devices=devices)


def test_unreadable_dram_zone_is_left_out_and_the_package_measured(tmp_path: Path) -> None:
    import errno
    import os

    sim = Simulator("A100,nocpu")
    fake = FakePowercap(tmp_path, packages=1, dram=True)

    def opener(path: str, flags: int) -> int:  # the DRAM zone fails as in many VMs
        if "intel-rapl:0:2" in path:
            raise OSError(errno.ENODATA, os.strerror(errno.ENODATA), path)
        return os.open(path, flags)

    rapl, problems = discover_rapl(fake.root, cpuinfo=fake.cpuinfo_path, opener=opener)
    assert rapl[0].readable() and not rapl[0].has_dram() and problems
    monitor = EnergyMonitor(devices=DeviceSet(gpus=sim.gpus, cpus=rapl, clock=sim.clock))
    fake.add_energy(0, "package", 123.0)
    monitor.begin_window("step")
    fake.add_energy(0, "package", 50.0)
    m = monitor.end_window("step")
    assert m.cpu_energy_j[0] == pytest.approx(50.0, abs=1e-3)
    assert m.dram_energy_j == {}
    monitor.close()
