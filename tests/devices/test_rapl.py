from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
from _fork import held_in_thread, needs_fork, run_in_forked_child

from joules.clock import VirtualClock
from joules.devices.base import WrappingCounter
from joules.devices.rapl import NO_RAPL_MESSAGE, RaplCPU, discover_rapl
from joules.devices.sim import Constant, SimCPU
from joules.devices.sim.catalog import cpu_model
from joules.errors import DevicePermissionError, NotSupportedError
from joules.testing.fake_sysfs import FakePowercap


def discover(fake: FakePowercap, **kwargs: object) -> tuple[list[RaplCPU], list]:
    cpus, problems = discover_rapl(fake.root, cpuinfo=fake.cpuinfo_path, **kwargs)  # type: ignore[arg-type]
    assert all(isinstance(c, RaplCPU) for c in cpus)
    return cpus, problems  # type: ignore[return-value]


# -- discovery --------------------------------------------------------------------------------
def test_two_packages_with_dram(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=2, dram=True)
    cpus, problems = discover(fake)
    assert problems == []
    assert [c.index for c in cpus] == [0, 1]
    assert [c.name for c in cpus] == ["Intel(R) Xeon(R) Platinum 8480+"] * 2
    assert [c.vendor for c in cpus] == ["intel", "intel"]
    assert all(c.has_dram() for c in cpus)
    assert not any(c.has_psys() for c in cpus)
    # core and uncore subzones are ignored; only package and dram are read
    assert [z.name for z in cpus[1].zones()] == ["package-1", "dram"]
    assert cpus[1].dram is not None and cpus[1].dram.path == fake.zone_dir(1, "dram")
    info = cpus[0].describe()
    assert info["dram"] is True and info["psys"] is False and info["readable"] is True


def test_dram_absent(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=1, dram=False)
    (cpu,), problems = discover(fake)
    assert problems == []
    assert not cpu.has_dram()
    with pytest.raises(NotSupportedError, match="no RAPL DRAM zone"):
        cpu.dram_energy_j()


def test_dram_is_read_per_package(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=2)
    cpus, _ = discover(fake)
    d0, d1 = cpus[0].dram_energy_j(), cpus[1].dram_energy_j()
    fake.add_energy(1, "dram", 3.25)
    assert cpus[0].dram_energy_j() == d0
    assert cpus[1].dram_energy_j() - d1 == pytest.approx(3.25, abs=1e-6)


def test_psys_is_attached_to_package_zero(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=2, psys=True)
    cpus, problems = discover(fake)
    assert problems == []
    assert len(cpus) == 2  # psys is not a package
    assert cpus[0].has_psys() and not cpus[1].has_psys()
    assert cpus[0].describe()["psys"] is True
    p0, pkg0 = cpus[0].psys_energy_j(), cpus[0].package_energy_j()
    fake.add_energy(0, "psys", 42.0)
    assert cpus[0].psys_energy_j() - p0 == pytest.approx(42.0, abs=1e-6)
    assert cpus[0].package_energy_j() == pkg0
    with pytest.raises(NotSupportedError, match="psys"):
        cpus[1].psys_energy_j()


def test_psys_wraps_are_tracked_by_package_reads(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=1, psys=True, max_energy_range_uj=1_000_000)
    (cpu,), _ = discover(fake)
    p0 = cpu.psys_energy_j()
    for _ in range(10):
        fake.add_energy(0, "psys", 0.6)
        cpu.package_energy_j()  # what the sampler reads
    assert cpu.psys_energy_j() - p0 == pytest.approx(6.0, abs=1e-5)


def test_amd_rapl_naming(tmp_path: Path) -> None:
    fake = FakePowercap(
        tmp_path, packages=2, dram=False, prefix="amd-rapl", max_power_uw=None,
        model_name="AMD EPYC 7763 64-Core Processor", vendor_id="AuthenticAMD",
        max_energy_range_uj=65_712_999_613,
    )
    cpus, problems = discover(fake)
    assert problems == []
    assert [c.vendor for c in cpus] == ["amd", "amd"]
    assert cpus[0].name == "AMD EPYC 7763 64-Core Processor"
    assert not cpus[0].has_dram()
    # without cpuinfo the zone prefix still tells the vendor
    cpus2, _ = discover_rapl(fake.root, cpuinfo=None)
    assert [c.vendor for c in cpus2] == ["amd", "amd"]
    assert cpus2[0].name == "package-0"


def test_amd_cpu_with_intel_rapl_naming_uses_cpuinfo_vendor(tmp_path: Path) -> None:
    # Since Linux 5.8, AMD Zen packages appear as intel-rapl:N.
    fake = FakePowercap(tmp_path, packages=1, dram=False, vendor_id="AuthenticAMD",
                        model_name="AMD EPYC 9654 96-Core Processor")
    (cpu,), _ = discover(fake)
    assert cpu.vendor == "amd"


def test_mmio_zone_duplicating_a_package_is_ignored(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=1, dram=False)
    mmio = fake.root / "intel-rapl-mmio:0"
    mmio.mkdir()
    (mmio / "name").write_text("package-0\n")
    (mmio / "max_energy_range_uj").write_text("262143328850\n")
    (mmio / "energy_uj").write_text("5\n")
    cpus, problems = discover(fake)
    assert problems == []
    assert len(cpus) == 1
    assert cpus[0].package.path == fake.zone_dir(0, "package")


def test_single_die_packages_keep_their_names(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=2)
    cpus, _ = discover(fake)
    assert [(c.package_id, c.die_id) for c in cpus] == [(0, None), (1, None)]
    assert [c.location for c in cpus] == ["package 0", "package 1"]
    assert [c.name for c in cpus] == ["Intel(R) Xeon(R) Platinum 8480+"] * 2
    assert cpus[1].describe()["package_id"] == 1 and cpus[1].describe()["die_id"] is None


def test_multi_die_packages_give_one_cpu_per_die(tmp_path: Path) -> None:
    # The kernel names the zones package-P-die-D when a package has several dies
    # (Cascade Lake-AP: 2 dies per socket); each die has its own DRAM subzone.
    fake = FakePowercap(tmp_path, packages=2, dies=2, dram=True, model_name="Intel(R) Xeon(R) Platinum 9282")
    assert (fake.zone_dir(3, "package") / "name").read_text() == "package-1-die-1\n"
    cpus, problems = discover(fake)
    assert problems == []
    assert [c.index for c in cpus] == [0, 1, 2, 3]
    assert [(c.package_id, c.die_id) for c in cpus] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [c.name for c in cpus] == [
        f"Intel(R) Xeon(R) Platinum 9282 (package {p}, die {d})" for p in (0, 1) for d in (0, 1)
    ]
    assert cpus[1].location == "package 0, die 1"
    assert cpus[2].describe()["package_id"] == 1 and cpus[2].describe()["die_id"] == 0
    assert all(c.has_dram() for c in cpus)
    for n, cpu in enumerate(cpus):
        assert cpu.package.path == fake.zone_dir(n, "package")
        assert cpu.dram is not None and cpu.dram.path == fake.zone_dir(n, "dram")
    # each die reads its own counters
    before = [(c.package_energy_j(), c.dram_energy_j()) for c in cpus]
    fake.add_energy(fake.zone_number(0, 1), "package", 5.5)
    fake.add_energy(fake.zone_number(1, 0), "dram", 2.25)
    after = [(c.package_energy_j(), c.dram_energy_j()) for c in cpus]
    deltas = [(round(a[0] - b[0], 6), round(a[1] - b[1], 6)) for a, b in zip(after, before, strict=True)]
    assert deltas == [(0.0, 0.0), (5.5, 0.0), (0.0, 2.25), (0.0, 0.0)]


def test_zone_numbers_are_hexadecimal_past_nine(tmp_path: Path) -> None:
    # powercap_sys.c names zones "%s:%x": the eleventh package zone is intel-rapl:a.
    fake = FakePowercap(tmp_path, packages=12, dram=True)
    assert (fake.root / "intel-rapl:a").is_dir() and (fake.root / "intel-rapl:b:2").exists()
    cpus, problems = discover(fake)
    assert problems == []
    assert [c.package_id for c in cpus] == list(range(12))
    assert cpus[10].package.path.name == "intel-rapl:a" and cpus[10].dram is not None
    before = cpus[11].dram_energy_j()
    fake.add_energy(11, "dram", 1.5)
    assert cpus[11].dram_energy_j() - before == pytest.approx(1.5, abs=1e-6)


def mirror_package_counter(fake: FakePowercap, package: int, joules: float) -> None:
    """What AMD kernels with die zones show: every die zone reads the package's one counter."""
    for die in range(fake.dies):
        fake.add_energy(fake.zone_number(package, die), "package", joules)


def test_amd_die_zones_are_one_package_counter(tmp_path: Path) -> None:
    # AMD RAPL has package scope; kernels with the 0x80000026 topology made one zone per CCD,
    # all reading the socket's counter. Adding them up would count the socket 8 times.
    fake = FakePowercap(tmp_path, packages=2, dies=8, dram=False, vendor_id="AuthenticAMD",
                        model_name="AMD EPYC 9654 96-Core Processor")
    cpus, problems = discover(fake)
    assert problems == []
    assert [(c.package_id, c.die_id) for c in cpus] == [(0, None), (1, None)]
    assert [c.package.path.name for c in cpus] == ["intel-rapl:0", "intel-rapl:8"]
    before = [c.package_energy_j() for c in cpus]
    mirror_package_counter(fake, 0, 40.0)
    mirror_package_counter(fake, 1, 25.0)
    after = [c.package_energy_j() for c in cpus]
    assert [round(a - b, 6) for a, b in zip(after, before, strict=True)] == [40.0, 25.0]


def test_die_zones_reading_one_counter_without_cpuinfo(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=2, dies=2, dram=False)
    mirror_package_counter(fake, 0, 3.0)  # package 0's dies read one counter; package 1's do not
    fake.add_energy(fake.zone_number(1, 0), "package", 10.0)  # two counters: they differ by
    fake.add_energy(fake.zone_number(1, 1), "package", 25.0)  # what each die used
    cpus, problems = discover_rapl(fake.root, cpuinfo=None)
    assert problems == []
    assert [(c.package_id, c.die_id) for c in cpus] == [(0, None), (1, 0), (1, 1)]
    fake.add_energy(fake.zone_number(0, 1), "package", 0.000061)  # a tick between two reads
    cpus, _ = discover_rapl(fake.root, cpuinfo=None)
    assert [(c.package_id, c.die_id) for c in cpus] == [(0, None), (1, 0), (1, 1)]
    # with the vendor known to be Intel, die zones are dies whatever they read
    cpus, _ = discover(fake)
    assert [(c.package_id, c.die_id) for c in cpus] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_multi_die_counters_wrap_per_die(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=2, dies=2, max_energy_range_uj=1_000_000)
    cpus, _ = discover(fake)
    start = [(c.package_energy_j(), c.dram_energy_j()) for c in cpus]
    for _ in range(40):
        fake.add_energy(3, "package", 0.75)
        fake.add_energy(1, "dram", 0.6)
        for cpu in cpus:
            cpu.poll()
    assert cpus[3].package_energy_j() - start[3][0] == pytest.approx(30.0, abs=1e-5)  # 30 wraps
    assert cpus[1].dram_energy_j() - start[1][1] == pytest.approx(24.0, abs=1e-5)
    assert cpus[0].package_energy_j() == start[0][0] and cpus[3].dram_energy_j() == start[3][1]


def test_multi_die_names_without_cpuinfo_and_mmio_duplicates(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=1, dies=2, dram=False, psys=True)
    mmio = fake.root / "intel-rapl-mmio:1"
    mmio.mkdir()
    (mmio / "name").write_text("package-0-die-1\n")
    (mmio / "max_energy_range_uj").write_text("262143328850\n")
    (mmio / "energy_uj").write_text("5\n")
    cpus, problems = discover_rapl(fake.root, cpuinfo=None)
    assert problems == []
    assert [c.name for c in cpus] == ["package-0-die-0", "package-0-die-1"]
    assert cpus[1].package.path == fake.zone_dir(1, "package")  # MSR zone, not the MMIO one
    assert cpus[0].has_psys() and not cpus[1].has_psys()


def test_fake_powercap_zone_numbers(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=2, dies=3)
    assert fake.zone_number(1, 2) == 5
    with pytest.raises(KeyError, match="no die 3 in package 0"):
        fake.zone_number(0, 3)
    with pytest.raises(ValueError, match="dies must be at least 1"):
        FakePowercap(tmp_path / "x", dies=0)


def test_missing_root(tmp_path: Path) -> None:
    cpus, problems = discover_rapl(tmp_path / "nonexistent")
    assert cpus == []
    assert len(problems) == 1
    assert problems[0].message == NO_RAPL_MESSAGE
    assert "modprobe intel_rapl_common" in problems[0].message


def test_root_without_packages(tmp_path: Path) -> None:
    cpus, problems = discover_rapl(tmp_path)
    assert cpus == []
    assert len(problems) == 1 and "no package zones" in problems[0].message


# -- readings and wraparound ------------------------------------------------------------------
def test_energy_in_joules(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=1)
    fake.set_energy(0, "package", 123_456_789)
    (cpu,), _ = discover(fake)
    e0 = cpu.package_energy_j()
    assert e0 == pytest.approx(123.456789, abs=1e-9)
    fake.set_energy(0, "package", 135_956_789)
    assert cpu.package_energy_j() - e0 == pytest.approx(12.5, abs=1e-9)


def test_many_wraps_are_exact_when_read_each_wrap(tmp_path: Path) -> None:
    wrap = 1_000_000  # 1 J, to wrap quickly
    fake = FakePowercap(tmp_path, packages=1, max_energy_range_uj=wrap)
    fake.set_energy(0, "package", 999_000)
    (cpu,), _ = discover(fake)
    start = cpu.package.energy_uj()  # the zone in µJ, to check exactness to the last digit
    total = 999_000
    for i in range(2_500):
        total += 700_001 + (i % 7) * 41_999  # 0.70 to 0.95 J per step: always under one wrap
        fake.set_energy(0, "package", total % wrap)
        cpu.poll()
    assert cpu.package.energy_uj() - start == total - 999_000  # exact, in µJ
    assert (total - 999_000) / wrap > 1_900  # ... across about 2,000 wraps
    assert cpu.package_energy_j() - start * 1e-6 == pytest.approx((total - 999_000) * 1e-6, abs=1e-6)


def test_add_energy_wraps_and_reading_follows(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=1, max_energy_range_uj=1_000_000)
    (cpu,), _ = discover(fake)
    e0 = cpu.package_energy_j()
    for _ in range(40):
        fake.add_energy(0, "package", 0.75)
        cpu.poll()
    assert fake.energy_uj(0, "package") == 0  # 30 J = exactly 30 wraps
    assert cpu.package_energy_j() - e0 == pytest.approx(30.0, abs=1e-5)


def test_window_longer_than_a_wrap_is_exact_with_one_poll_per_wrap(tmp_path: Path) -> None:
    clock = VirtualClock()
    sim = SimCPU(cpu_model("XEON8480"), clock, workload=Constant(1.0))  # 350 W package, 45 W DRAM
    fake = FakePowercap.for_sim(tmp_path, [sim])
    (cpu,), problems = discover(fake)
    assert problems == []
    interval = cpu.max_read_interval_s()
    # The DRAM zone reports no power constraint, so 1000 W is assumed: 262,143 J / 1000 W =
    # 262 s (the package alone would allow 499 s; it really wraps every 749 s at 350 W).
    assert interval == pytest.approx(262143.328850 / 1000.0, rel=1e-6)
    assert cpu.package.max_read_interval_s() == pytest.approx(262143.328850 / 525.0, rel=1e-6)

    def poll(_now: float) -> None:  # what the monitor's sampler thread does
        fake.sync_from([sim])
        cpu.poll()

    timer = clock.every(interval, poll)
    e0, d0 = cpu.package_energy_j(), cpu.dram_energy_j()
    t0, true0, dtrue0 = clock.now(), sim.true_package_energy_j(), sim.true_dram_energy_j()
    clock.advance(3600.0)  # one window of an hour: 4.8 package wraps
    fake.sync_from([sim])
    e1, d1 = cpu.package_energy_j(), cpu.dram_energy_j()
    timer.cancel()
    assert clock.now() - t0 == 3600.0
    assert sim.true_package_energy_j() - true0 == pytest.approx(1_260_000.0)
    # exact up to the counter's 1 ms update tick (0.35 J) and energy unit (61 µJ)
    assert e1 - e0 == pytest.approx(1_260_000.0, abs=0.4)
    assert d1 - d0 == pytest.approx(sim.true_dram_energy_j() - dtrue0, abs=0.1)
    assert d1 - d0 == pytest.approx(162_000.0, abs=0.1)


@pytest.mark.parametrize(("model", "package_uj", "dram_uj"), [
    ("XEON8480", 262_143_328_850, 262_143_328_850),
    ("XEON6248", 262_143_328_850, 65_712_999_613),  # DRAM in the fixed 15.3 µJ unit
    ("EPYC7763", 65_532_610_987, None),  # 2**-16 J units, no DRAM zone
])
def test_simulated_packages_wrap_where_the_kernel_says(
        tmp_path: Path, model: str, package_uj: int, dram_uj: int | None) -> None:
    clock = VirtualClock()
    sim = SimCPU(cpu_model(model), clock, workload=Constant(1.0))
    fake = FakePowercap.for_sim(tmp_path, [sim])

    def wrap(zone: str) -> int:
        return int((fake.zone_dir(0, zone) / "max_energy_range_uj").read_text())

    assert wrap("package") == pytest.approx(package_uj, abs=100)
    if dram_uj is None:
        assert not sim.has_dram()
        return
    assert wrap("dram") == pytest.approx(dram_uj, abs=100)
    # DRAM counted in its own unit, read through the wrap-extending reader.
    (cpu,), _ = discover(fake)
    d0, t0 = cpu.dram_energy_j(), sim.true_dram_energy_j()
    clock.advance(10.0)
    fake.sync_from([sim])
    assert cpu.dram_energy_j() - d0 == pytest.approx(sim.true_dram_energy_j() - t0, abs=0.05)


def test_without_polls_a_long_window_loses_whole_wraps(tmp_path: Path) -> None:
    clock = VirtualClock()
    sim = SimCPU(cpu_model("XEON8480"), clock, workload=Constant(1.0))
    fake = FakePowercap.for_sim(tmp_path, [sim])
    (cpu,), _ = discover(fake)
    e0 = cpu.package_energy_j()
    clock.advance(3600.0)
    fake.sync_from([sim])
    lost = 1_260_000.0 - (cpu.package_energy_j() - e0)
    wrap_j = fake.max_energy_range_uj(0, "package") * 1e-6
    assert lost > wrap_j  # the polls are what make long windows right
    assert lost / wrap_j == pytest.approx(round(lost / wrap_j), abs=1e-5)


def test_max_read_interval(tmp_path: Path) -> None:
    no_dram = FakePowercap(tmp_path / "a", packages=1, dram=False, max_power_uw=350_000_000)
    (cpu,), _ = discover(no_dram)
    assert cpu.max_read_interval_s() == pytest.approx(262143.328850 / (350 * 1.5))  # 499.3 s
    # zones without power constraints (the fake's DRAM, some AMD packages) assume 1000 W
    with_dram = FakePowercap(tmp_path / "b", packages=1, dram=True, max_power_uw=350_000_000,
                             dram_max_energy_range_uj=65_712_999_613)
    (cpu,), _ = discover(with_dram)
    assert cpu.max_read_interval_s() == pytest.approx(65712.999613 / 1000.0)  # 65.7 s
    assert cpu.max_power_w() == pytest.approx(350.0)  # what the monitor's RAPL bound uses
    assert cpu.max_power_w(dram=True) is None  # the fake's DRAM has no power constraint


def test_concurrent_readers_never_see_a_false_wrap(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=1, max_energy_range_uj=50_000_000)
    (cpu,), _ = discover(fake)
    e0 = cpu.package_energy_j()
    stop = threading.Event()
    seen: list[list[float]] = [[] for _ in range(4)]

    def reader(out: list[float]) -> None:
        while not stop.is_set():
            out.append(cpu.package_energy_j())

    threads = [threading.Thread(target=reader, args=(s,)) for s in seen]
    for t in threads:
        t.start()
    for _ in range(2_000):
        fake.add_energy(0, "package", 0.5)  # a wrap every 100 steps
        cpu.poll()  # the sampler's poll races with the readers
    stop.set()
    for t in threads:
        t.join()
    for s in seen:
        assert all(b >= a for a, b in zip(s, s[1:], strict=False))
    assert cpu.package_energy_j() - e0 == pytest.approx(1000.0, abs=1e-5)


# -- permissions and unreadable zones ---------------------------------------------------------
def test_unreadable_counters_give_a_problem_and_a_permission_error(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=2, readable=False)
    cpus, problems = discover(fake, opener=fake.opener)
    assert len(cpus) == 2  # still listed, so the user sees which packages exist
    assert [p.device for p in problems] == ["CPU 0", "CPU 1"]
    p = problems[0]
    assert "not readable" in p.message and str(fake.zone_dir(0, "package") / "energy_uj") in p.message
    assert f"sudo chmod a+r {fake.root}/*/energy_uj" in p.fix
    assert "udev" in p.fix and "CVE-2020-8694" in p.fix
    with pytest.raises(DevicePermissionError) as err:
        cpus[0].package_energy_j()
    assert p.message in str(err.value) and p.fix in str(err.value)
    with pytest.raises(DevicePermissionError):
        cpus[1].dram_energy_j()
    assert cpus[0].describe()["readable"] is False
    # after the fix, discovery reads the counters
    fake.set_readable(True)
    cpus, problems = discover(fake, opener=fake.opener)
    assert problems == []
    assert cpus[0].package_energy_j() == 0.0


def test_zone_that_cannot_be_read_is_reported(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=1, dram=True)

    def opener(path: str, flags: int) -> int:
        if "intel-rapl:0:2" in path:  # DRAM MSR unreadable, as in some virtual machines
            raise OSError(errno.ENODATA, os.strerror(errno.ENODATA), path)
        return os.open(path, flags)

    (cpu,), problems = discover(fake, opener=opener)
    assert len(problems) == 1 and "No data available" in problems[0].message
    assert cpu.package_energy_j() == 0.0
    with pytest.raises(NotSupportedError, match="No data available"):
        cpu.dram_energy_j()


def unloaded(tmp_path: Path, fd: int) -> None:
    """Make the open file ``fd`` fail every read, as after its driver was unloaded."""
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        os.dup2(directory, fd)
    finally:
        os.close(directory)


def package_opening(tmp_path: Path) -> tuple[object, list[int]]:
    """One package without DRAM, and the descriptors its zones' files were opened as."""
    fake = FakePowercap(tmp_path, packages=1, dram=False)
    opened: list[int] = []

    def opener(path: str, flags: int) -> int:
        opened.append(os.open(path, flags))
        return opened[-1]

    (cpu,), _ = discover(fake, opener=opener)
    return cpu, opened


def test_a_zone_that_stops_being_readable_says_which(tmp_path: Path) -> None:
    cpu, opened = package_opening(tmp_path)
    assert cpu.package_energy_j() >= 0.0
    unloaded(tmp_path, opened[0])
    (cpu.package.path / "energy_uj").rename(tmp_path / "gone")  # and no new file to open
    with pytest.raises(NotSupportedError, match=r"CPU 0: RAPL zone package-0 .* cannot be read any more"):
        cpu.package_energy_j()


def test_a_zone_whose_driver_was_reloaded_is_opened_again(tmp_path: Path) -> None:
    """The driver unloaded and loaded again: the open file failed every read from then on, and
    every window (GPUs' too) with it, for the monitor's whole life. The new file is opened."""
    cpu, opened = package_opening(tmp_path)
    energy = cpu.package.path / "energy_uj"
    energy.write_text("5000000\n")
    before = cpu.package_energy_j()
    unloaded(tmp_path, opened[0])  # the old file fails to read ...
    energy.unlink()
    energy.write_text("7000000\n")  # ... and the reloaded driver made a new one
    assert cpu.package_energy_j() - before == pytest.approx(2.0)
    assert len(opened) == 2
    energy.write_text("7500000\n")
    assert cpu.package_energy_j() - before == pytest.approx(2.5)
    assert len(opened) == 2  # the new file, kept open


def test_a_psys_zone_that_stops_being_readable_leaves_the_package_read(tmp_path: Path) -> None:
    """psys is read beside the package only to catch its wraps: its failure broke every package
    read (a raw OSError), and so every window."""
    fake = FakePowercap(tmp_path, packages=1, dram=True, psys=True)
    (cpu,), _ = discover(fake)
    assert cpu.psys is not None
    before = cpu.package_energy_j()
    unloaded(tmp_path, cpu.psys._fd)  # the psys file now fails to read, and cannot be opened again
    (cpu.psys.path / "energy_uj").rename(tmp_path / "psys-gone")
    fake.add_energy(0, "package", 5.0)
    assert cpu.package_energy_j() == pytest.approx(before + 5.0)


# -- read cost ----------------------------------------------------------------------------------
def test_files_are_opened_once_and_read_with_one_pread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakePowercap(tmp_path, packages=2, dram=True, psys=True)
    opened: list[str] = []

    def opener(path: str, flags: int) -> int:
        opened.append(path)
        return os.open(path, flags)

    cpus, _ = discover(fake, opener=opener)
    assert len(opened) == 5  # 2 packages + 2 DRAM + psys; core/uncore never opened
    preads = 0
    real_pread = os.pread

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        nonlocal preads
        preads += 1
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", counting_pread)
    for _ in range(1_000):
        cpus[1].package_energy_j()
    assert preads == 1_000
    for _ in range(1_000):
        cpus[0].package_energy_j()  # package 0 also refreshes psys
    assert preads == 3_000
    assert len(opened) == 5  # no re-open per reading
    monkeypatch.setattr(os, "pread", real_pread)

    n = 20_000
    t = time.perf_counter()
    for _ in range(n):
        cpus[0].package_energy_j()
    per_read_us = (time.perf_counter() - t) / n * 1e6
    # A few µs here (tmpfs); on real sysfs the kernel's MSR read adds a few µs more.
    assert per_read_us < 100.0


@needs_fork
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads running
def test_forked_child_reads_zones_whose_locks_the_parent_held(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=1, dram=True)
    (cpu,), _ = discover(fake)
    assert cpu.dram is not None
    fake.add_energy(0, "package", 7.0)
    fake.add_energy(0, "dram", 3.0)
    # the sampler is mid-read of the package zone, and another reader is updating a counter
    release_zone = held_in_thread(cpu.package._lock)
    release_counter = held_in_thread(cpu.dram._counter._lock)
    try:
        out = run_in_forked_child(lambda: (cpu.package_energy_j(), cpu.dram_energy_j()))
    finally:
        release_zone.set()
        release_counter.set()
    assert out is not None, "the child hung on a lock held in its parent at fork()"
    assert out == "(7.0, 3.0)"


@needs_fork
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_forked_child_updates_a_wrapping_counter_held_in_the_parent() -> None:
    counter = WrappingCounter(100)
    counter.update(90)
    release = held_in_thread(counter._lock)
    try:
        out = run_in_forked_child(lambda: counter.update(10))
    finally:
        release.set()
    assert out == "110"  # a wrap, counted in the child


def test_a_reopened_zone_keeps_its_number_when_its_old_one_was_closed_elsewhere(tmp_path: Path) -> None:
    """Its descriptor closed behind its back, the zone reopened onto the same (lowest free)
    number and then closed it: the next file the program opened took the number, read as RAPL."""
    fake = FakePowercap(tmp_path, packages=1, dram=False)
    (cpu,), _ = discover(fake)
    (cpu.package.path / "energy_uj").write_text("5000000\n")
    before = cpu.package_energy_j()
    os.close(cpu.package._fd)  # closed by someone else (a library that closes every descriptor)
    (cpu.package.path / "energy_uj").write_text("6000000\n")
    assert cpu.package_energy_j() - before == pytest.approx(1.0)
    with open(tmp_path / "other.txt", "w") as other:  # takes the lowest free number
        assert other.fileno() != cpu.package._fd
        other.write("123456789\n")
        other.flush()
        (cpu.package.path / "energy_uj").write_text("6500000\n")
        assert cpu.package_energy_j() - before == pytest.approx(1.5)


def test_a_reloaded_zone_whose_new_file_is_root_only_says_so(tmp_path: Path) -> None:
    fake = FakePowercap(tmp_path, packages=1, dram=False)
    opened: list[int] = []

    def opener(path: str, flags: int) -> int:
        if opened:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        opened.append(os.open(path, flags))
        return opened[-1]

    (cpu,), _ = discover(fake, opener=opener)
    unloaded(tmp_path, opened[0])
    with pytest.raises(NotSupportedError, match="Permission denied"):
        cpu.package_energy_j()
