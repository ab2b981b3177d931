"""A fake Linux powercap (RAPL) tree in a directory, for testing :mod:`joules.devices.rapl`.

Layout mirrors the kernel's: package zones ``intel-rapl:N`` (name ``package-N``) with
subzones ``intel-rapl:N:M`` (``core``, ``uncore``, ``dram``) nested inside them and also
linked at the top level, and an optional top-level ``psys`` zone. With ``dies > 1`` each
package has one zone per die, named ``package-P-die-D`` as the kernel names them on multi-die
processors; zone ``intel-rapl:N`` is die ``N % dies`` of package ``N // dies``, and the
``package`` argument of the counter methods is that zone number ``N`` (see
:meth:`FakePowercap.zone_number`). Counters are written in
place (the reader keeps the files open), padded to a fixed width so that a concurrent reader
never sees a mix of old and new digits.

Example::

    fake = FakePowercap(tmp_path, packages=2, max_energy_range_uj=1_000_000)
    cpus, problems = discover_rapl(fake.root, cpuinfo=fake.cpuinfo_path)
    fake.add_energy(0, "package", 0.75)  # 0.75 J, wrapping at 1 J
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from joules.devices.sim.cpu import SimCPU

#: Zone names and their subzone numbers inside a package (the kernel's usual order).
_SUBZONES = {"core": 0, "uncore": 1, "dram": 2}
_WIDTH = 24  # characters per counter value: enough for any µJ count


class FakePowercap:
    """A fake ``/sys/class/powercap`` directory.

    Args:
        root: Directory to build the tree in (created if missing; usually a pytest
            ``tmp_path``).
        packages: Number of CPU packages.
        dram: Whether each package has a ``dram`` subzone.
        psys: Whether to add a top-level platform (``psys``) zone.
        max_energy_range_uj: Wrap value of every counter, µJ (the Xeon default, 262 kJ).
        readable: Whether ``energy_uj`` files are readable by a non-root user (see
            :meth:`opener`).
        prefix: Zone directory prefix: ``intel-rapl`` or ``amd-rapl``.
        core: Whether to add the ``core`` and ``uncore`` subzones (readers ignore them).
        max_power_uw: ``constraint_0_max_power_uw`` of package zones (``None``: no
            constraint files, as on some AMD systems).
        dram_max_energy_range_uj: Wrap value of DRAM counters (default: same as packages).
        model_name: CPU model written to :attr:`cpuinfo_path`.
        vendor_id: ``GenuineIntel`` or ``AuthenticAMD``.
        dies: Dies per package; above 1, every die gets its own zone (``package-P-die-D``)
            with its own subzones, and counters are addressed by zone number.

    """

    def __init__(
        self,
        root: str | Path,
        packages: int = 2,
        dram: bool = True,
        psys: bool = False,
        max_energy_range_uj: int = 262_143_328_850,
        readable: bool = True,
        *,
        prefix: str = "intel-rapl",
        core: bool = True,
        max_power_uw: int | None = 350_000_000,
        dram_max_energy_range_uj: int | None = None,
        model_name: str = "Intel(R) Xeon(R) Platinum 8480+",
        vendor_id: str = "GenuineIntel",
        dies: int = 1,
    ) -> None:
        if dies < 1:
            raise ValueError(f"dies must be at least 1, got {dies}")
        self.root = Path(root) / "powercap"
        self.root.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.packages = packages
        self.dies = dies
        self._dirs: dict[tuple[int, str], Path] = {}
        self._max: dict[tuple[int, str], int] = {}
        self._total_uj: dict[tuple[int, str], float] = {}
        (self.root / prefix).mkdir(exist_ok=True)  # the control-type directory, as in sysfs
        for n in range(packages * dies):
            p, d = divmod(n, dies)
            zone_name = f"package-{p}-die-{d}" if dies > 1 else f"package-{p}"
            pkg = self.root / f"{prefix}:{n:x}"  # the kernel numbers zones in hexadecimal
            self._zone(pkg, (n, "package"), zone_name, max_energy_range_uj, max_power_uw)
            names = (["core", "uncore"] if core else []) + (["dram"] if dram else [])
            for name in names:
                sub = pkg / f"{prefix}:{n:x}:{_SUBZONES[name]:x}"
                wrap = dram_max_energy_range_uj if name == "dram" and dram_max_energy_range_uj else (
                    max_energy_range_uj
                )
                self._zone(sub, (n, name), name, wrap, None)
                (self.root / sub.name).symlink_to(sub, target_is_directory=True)
        if psys:
            self._zone(self.root / f"{prefix}:{packages * dies:x}", (-1, "psys"), "psys",
                       max_energy_range_uj, None)
        self.cpuinfo_path = Path(root) / "cpuinfo"
        lines = []
        for p in range(packages):
            lines += [f"processor\t: {p}", f"vendor_id\t: {vendor_id}", f"model name\t: {model_name}",
                      f"physical id\t: {p}", ""]
        self.cpuinfo_path.write_text("\n".join(lines))
        self.set_readable(readable)

    # -- building ---------------------------------------------------------------------------
    def _zone(self, path: Path, key: tuple[int, str], name: str, max_range: int,
              max_power_uw: int | None) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / "name").write_text(name + "\n")
        (path / "enabled").write_text("1\n")
        (path / "max_energy_range_uj").write_text(f"{max_range}\n")
        if max_power_uw is not None:
            (path / "constraint_0_name").write_text("long_term\n")
            (path / "constraint_0_max_power_uw").write_text(f"{max_power_uw}\n")
            (path / "constraint_0_power_limit_uw").write_text(f"{max_power_uw}\n")
        self._dirs[key] = path
        self._max[key] = max_range
        self._total_uj[key] = 0.0
        self._write(key, 0)

    def zone_number(self, package: int, die: int = 0) -> int:
        """The zone number ``N`` (``intel-rapl:N``) of a package's die: ``package * dies + die``.

        This is what the counter methods take as ``package``; with one die per package it is
        the package number.
        """
        if not (0 <= package < self.packages and 0 <= die < self.dies):
            raise KeyError(f"fake powercap has no die {die} in package {package}")
        return package * self.dies + die

    def _key(self, package: int, zone: str) -> tuple[int, str]:
        key = (-1, "psys") if zone == "psys" else (package, zone)
        if key not in self._dirs:
            raise KeyError(f"fake powercap has no zone {zone!r} for package {package}")
        return key

    def _write(self, key: tuple[int, str], uj: int) -> None:
        data = f"{uj}".ljust(_WIDTH - 1).encode() + b"\n"
        fd = os.open(self._dirs[key] / "energy_uj", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, 0)  # in place, same size: readers keep the file open
        finally:
            os.close(fd)

    # -- counters ---------------------------------------------------------------------------
    def zone_dir(self, package: int, zone: str) -> Path:
        """Directory of a zone (``zone``: ``package``, ``dram``, ``core``, ``uncore``, ``psys``)."""
        return self._dirs[self._key(package, zone)]

    def max_energy_range_uj(self, package: int, zone: str) -> int:
        """Wrap value of a zone's counter, µJ."""
        return self._max[self._key(package, zone)]

    def set_max_energy_range_uj(self, package: int, zone: str, uj: int) -> None:
        """Change a zone's wrap value (before readers are created)."""
        key = self._key(package, zone)
        self._max[key] = int(uj)
        (self._dirs[key] / "max_energy_range_uj").write_text(f"{int(uj)}\n")

    def energy_uj(self, package: int, zone: str) -> int:
        """The raw counter value as the file shows it, µJ."""
        return int((self._dirs[self._key(package, zone)] / "energy_uj").read_text())

    def set_energy(self, package: int, zone: str, uj: int) -> None:
        """Set the raw counter (``0 <= uj < max_energy_range_uj``) and reset the true total to it."""
        key = self._key(package, zone)
        if not 0 <= uj < self._max[key]:
            raise ValueError(f"counter value {uj} outside [0, {self._max[key]})")
        self._total_uj[key] = float(uj)
        self._write(key, int(uj))

    def add_energy(self, package: int, zone: str, joules: float) -> None:
        """Add energy to a zone; the raw counter wraps at ``max_energy_range_uj``."""
        if joules < 0:
            raise ValueError("energy counters only go up")
        key = self._key(package, zone)
        self._total_uj[key] += joules * 1e6
        self._write(key, int(self._total_uj[key]) % self._max[key])

    def total_j(self, package: int, zone: str) -> float:
        """Energy added to a zone since it was created or last set (not wrapped), J."""
        return self._total_uj[self._key(package, zone)] * 1e-6

    # -- permissions ------------------------------------------------------------------------
    def set_readable(self, readable: bool) -> None:
        """Make ``energy_uj`` files world-readable, or owner-only as the kernel does since 2020.

        The kernel uses mode 0400 (root); the fake uses 0600 so that its owner can still
        update the counters when tests do not run as root.
        """
        self.readable = readable
        for path in self._dirs.values():
            os.chmod(path / "energy_uj", 0o644 if readable else 0o600)

    def opener(self, path: str, flags: int) -> int:
        """:func:`os.open` as a non-root user would see it: files without ``o+r`` are refused.

        Tests usually run as root, for whom file modes do not stop reads; pass this as
        ``discover_rapl(..., opener=fake.opener)`` to get the behaviour of an ordinary user.
        """
        if not os.stat(path).st_mode & stat.S_IROTH:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return os.open(path, flags)

    # -- simulated CPUs ---------------------------------------------------------------------
    @classmethod
    def for_sim(cls, root: str | Path, sim_cpus: Iterable[SimCPU], *, psys: bool = False,
                readable: bool = True) -> FakePowercap:
        """A tree shaped like ``sim_cpus`` (wrap values, DRAM zones), synced to them."""
        cpus = list(sim_cpus)
        if not cpus:
            raise ValueError("need at least one simulated CPU")
        first = cpus[0].model
        fake = cls(
            root, packages=len(cpus), dram=any(c.has_dram() for c in cpus), psys=psys,
            max_energy_range_uj=_wrap_uj(cpus[0]), readable=readable,
            max_power_uw=int(first.tdp_w * 1e6), model_name=first.name,
            vendor_id="AuthenticAMD" if first.vendor == "amd" else "GenuineIntel",
        )
        for i, cpu in enumerate(cpus):
            fake.set_max_energy_range_uj(i, "package", _wrap_uj(cpu))
            if cpu.has_dram():
                fake.set_max_energy_range_uj(i, "dram", _wrap_uj(cpu, dram=True))
            elif (i, "dram") in fake._dirs:
                _remove_zone(fake, i, "dram")
        fake.sync_from(cpus)
        return fake

    def sync_from(self, sim_cpus: Iterable[SimCPU]) -> None:
        """Write each simulated CPU's raw (wrapping) counters into its zones' ``energy_uj``."""
        for i, cpu in enumerate(sim_cpus):
            unit_uj = cpu.model.energy_unit_j * 1e6
            key = self._key(i, "package")
            self._write(key, round(cpu.raw_package_units() * unit_uj) % self._max[key])
            if cpu.has_dram() and (i, "dram") in self._dirs:
                raw = _raw_dram_units(cpu)
                key = (i, "dram")
                dram_uj = (cpu.model.dram_energy_unit_j or cpu.model.energy_unit_j) * 1e6
                self._write(key, round(raw * dram_uj) % self._max[key])


def _wrap_uj(cpu: SimCPU, dram: bool = False) -> int:
    """The wrap value, µJ, of a simulated CPU's raw package (or DRAM) counters."""
    m = cpu.model
    unit = (m.dram_energy_unit_j or m.energy_unit_j) if dram else m.energy_unit_j
    wrap = (m.dram_wrap_j or m.wrap_j) if dram else m.wrap_j
    units = int(wrap / unit)
    return round(units * unit * 1e6)


def _raw_dram_units(cpu: SimCPU) -> int:
    """A simulated CPU's raw DRAM counter (SimCPU has no public accessor for it)."""
    public = getattr(cpu, "raw_dram_units", None)
    if callable(public):
        return int(public())
    with cpu._lock:
        return cpu._dram.raw_units()  # type: ignore[union-attr]


def _remove_zone(fake: FakePowercap, package: int, zone: str) -> None:
    path = fake._dirs.pop((package, zone))
    fake._max.pop((package, zone))
    fake._total_uj.pop((package, zone))
    link = fake.root / path.name
    if link.is_symlink():
        link.unlink()
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
