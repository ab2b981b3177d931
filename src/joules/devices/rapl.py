"""CPU package and DRAM energy from the Linux powercap RAPL interface.

The kernel exposes Intel (and, since Linux 5.8, AMD Zen) RAPL counters under
``/sys/class/powercap``::

    intel-rapl:0/            name = package-0    (one per socket)
        energy_uj            cumulative energy, µJ, wraps at max_energy_range_uj
        max_energy_range_uj
        constraint_0_max_power_uw, constraint_0_power_limit_uw, ...
        intel-rapl:0:0/      name = core         (ignored)
        intel-rapl:0:1/      name = uncore       (ignored)
        intel-rapl:0:2/      name = dram         (DRAM of that socket, servers)
    intel-rapl:1/            name = psys         (platform, client machines)

On processors with several dies per package (Cascade Lake-AP, some AMD Zen kernels) the
kernel makes one zone per die, named ``package-P-die-D`` (``intel-rapl:N`` numbered by die
across the machine, in hexadecimal from the eleventh zone on: ``intel-rapl:a``), each with its
own subzones. On Intel each die zone has its own counter and is one :class:`RaplCPU`, with its
own DRAM subzone; :attr:`RaplCPU.package_id` and :attr:`RaplCPU.die_id` say which. On AMD and
Hygon the RAPL counters have package scope: kernels that make die zones there (those with the
CPUID 0x80000026 topology, before the fix that went back to package zones) show the same
package counter in every die zone of a package, so one zone per package is kept and the
package is one :class:`RaplCPU` (adding the die zones up would count it once per die). Without
``/proc/cpuinfo``, die zones of a package whose counters all read non-zero and within 1 J of
each other (one counter read several times) are taken as one such package.

Subzones also appear at the top level (``intel-rapl:0:2``); either place is searched.
Zones named ``amd-rapl:N`` are read the same way, and ``intel-rapl-mmio:N`` zones are used
only for packages the MSR interface does not provide (they describe the same counter).

**Wraparound.** ``energy_uj`` wraps every few minutes at full power. Each zone feeds its
readings to a :class:`~joules.devices.base.WrappingCounter`; as long as the counters are read
at least once per :meth:`RaplCPU.max_read_interval_s` (the monitor's sampler thread does this,
no helper process is involved) the wrap-corrected energy is exact over any window length.
The modulus used is ``max_energy_range_uj``; the kernel's true modulus is one energy unit
(61 µJ or 15.3 µJ) larger, an error of one unit per wrap (2e-10 relative).

**Read cost.** Each ``energy_uj`` is opened once and re-read with :func:`os.pread` at offset
0, which makes sysfs regenerate the value: one system call per reading, no open/close.

**psys.** The platform zone (``psys``, whole-SoC energy on client machines) is not a package;
it is attached to package 0 as :attr:`RaplCPU.psys` and read with
:meth:`RaplCPU.psys_energy_j`. It is reported by :meth:`RaplCPU.describe` and is not part of
package or DRAM energy. Reading package 0's energy also updates the psys counter, so a sampler
that reads packages keeps psys wraps tracked too.

**Permissions.** Since November 2020 (Linux 5.10 and stable backports, CVE-2020-8694
"PLATYPUS") ``energy_uj`` is readable by root only. A package whose counter cannot be read is
still returned, with a :class:`~joules.devices.base.Problem` that explains the fix; reading it
raises :class:`~joules.errors.DevicePermissionError` with the same text.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from pathlib import Path

from joules.devices.base import CPU, Problem, WrappingCounter, fork_safe_lock
from joules.errors import DevicePermissionError, NotSupportedError

#: ``opener(path, flags) -> fd``; :func:`os.open` unless a test injects another.
Opener = Callable[[str, int], int]

DEFAULT_ROOT = "/sys/class/powercap"

#: Power bound used for the wrap period of a zone that reports no power constraint, W.
DEFAULT_MAX_POWER_W = 1000.0
#: Reported power constraints are multiplied by this before computing wrap periods (short
#: bursts may exceed the long-term limit).
POWER_SAFETY_FACTOR = 1.5

NO_RAPL_MESSAGE = "no RAPL (not Linux, or powercap driver not loaded: modprobe intel_rapl_common)"
NO_RAPL_FIX = (
    "on Linux: sudo modprobe intel_rapl_common intel_rapl_msr (Intel and AMD Zen CPUs); "
    "virtual machines and some containers do not expose RAPL at all"
)

# The kernel numbers zones in hexadecimal (powercap_sys.c: "%s:%x"): intel-rapl:9, intel-rapl:a, ...
_ZONE_DIR = re.compile(r"^(intel-rapl|amd-rapl|intel-rapl-mmio):([0-9a-f]+)(?::([0-9a-f]+))?$")
_PACKAGE_NAME = re.compile(r"^package-(\d+)(?:-die-(\d+))?$")
_READ_SIZE = 64
# Die zones whose counters read this close (µJ) are one counter read several times: a package
# draws far less than this in the microseconds the reads take, and separate counters differ by
# what each die used since boot.
_SAME_COUNTER_UJ = 1_000_000


def permission_fix(root: str | Path) -> str:
    """How to make the ``energy_uj`` files under ``root`` readable, and what it costs."""
    return (
        f"run as root, or make the counters readable: sudo chmod a+r {root}/*/energy_uj "
        "(until reboot); to persist, add a udev rule such as "
        '/etc/udev/rules.d/99-joules-rapl.rules: SUBSYSTEM=="powercap", ACTION=="add", '
        'RUN+="/bin/chgrp powercap /sys%p/energy_uj", RUN+="/bin/chmod g+r /sys%p/energy_uj" '
        "with a group made for it (sudo groupadd powercap) holding the trusted users. "
        "Security note: the counters are root-only because fine-grained energy readings leak "
        "secrets through a power side channel "
        "(CVE-2020-8694, PLATYPUS); only grant access on machines whose users you trust"
    )


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


class RaplZone:
    """One powercap zone: its ``energy_uj`` file kept open and a wrap-extended counter.

    Args:
        path: The zone directory (``.../intel-rapl:0``).
        opener: Function used to open ``energy_uj`` (``os.open`` by default).

    Attributes:
        path: Zone directory.
        name: Zone name (``package-0``, ``dram``, ``psys``).
        max_energy_range_uj: Value at which ``energy_uj`` wraps.
        max_power_w: Highest power the zone's constraints report, W (``None`` if none).
        error: Why the counter cannot be read (``None`` when it can).
        permission_denied: Whether ``error`` is a permission problem.

    """

    def __init__(self, path: str | Path, opener: Opener = os.open) -> None:
        self._fd: int | None = None
        self.path = Path(path)
        self.name = _read_text(self.path / "name") or self.path.name
        max_range = _read_int(self.path / "max_energy_range_uj")
        if max_range is None or max_range <= 0:
            raise ValueError(f"{self.path}: missing or invalid max_energy_range_uj")
        self.max_energy_range_uj = max_range
        self.max_power_w = self._max_power_w()
        self.error: str | None = None
        self.permission_denied = False
        self._counter = WrappingCounter(max_range)
        self._lock = fork_safe_lock(self)
        self._opener = opener
        energy_path = str(self.path / "energy_uj")
        try:
            self._fd = opener(energy_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self.raw_uj()  # first reading: checks the file and sets the counter's origin
        except PermissionError:
            self._close_fd()
            self.permission_denied = True
            self.error = f"cannot read {energy_path}: permission denied"
        except (OSError, ValueError) as e:
            # e.g. ENODATA when the MSR behind the file cannot be read (virtual machines).
            self._close_fd()
            reason = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)
            self.error = f"cannot read {energy_path}: {reason}"

    def _max_power_w(self) -> float | None:
        best = 0
        for i in range(4):
            for key in (f"constraint_{i}_max_power_uw", f"constraint_{i}_power_limit_uw"):
                value = _read_int(self.path / key)
                if value is not None and value > best:
                    best = value
        return best / 1e6 if best > 0 else None

    @property
    def readable(self) -> bool:
        """Whether ``energy_uj`` can be read."""
        return self._fd is not None

    def raw_uj(self) -> int:
        """The raw (wrapping) counter, µJ: one ``pread`` on the open file.

        A read that fails opens the file again once and reads that: a driver reloaded
        (``intel_rapl`` unloaded and loaded again) made the file anew, and the counter, the
        processor's own, went on counting meanwhile.
        """
        fd = self._fd
        if fd is None:
            raise OSError(errno.EBADF, f"{self.path / 'energy_uj'} is not open")
        try:
            return int(os.pread(fd, _READ_SIZE, 0))
        except OSError as first:
            try:
                fresh = self._opener(str(self.path / "energy_uj"), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except PermissionError:
                raise  # (the new file is root's: say so)
            except OSError:
                raise first from None
            try:
                value = int(os.pread(fresh, _READ_SIZE, 0))
            except (OSError, ValueError):
                if fresh != fd:
                    os.close(fresh)
                raise first from None
            self._fd = fresh
            if fresh != fd:  # (a number closed behind this zone's back may have come back to it)
                try:
                    os.close(fd)
                except OSError:
                    pass
            return value

    def energy_uj(self) -> int:
        """Wrap-corrected cumulative energy, µJ (arbitrary origin)."""
        with self._lock:  # read and update together, or a late update looks like a wrap
            return self._counter.update(self.raw_uj())

    def energy_j(self) -> float:
        """Wrap-corrected cumulative energy, J (arbitrary origin)."""
        return self.energy_uj() * 1e-6

    def max_read_interval_s(self) -> float:
        """Time the counter takes to wrap at the highest power this zone can draw."""
        bound = (self.max_power_w or DEFAULT_MAX_POWER_W / POWER_SAFETY_FACTOR) * POWER_SAFETY_FACTOR
        return self.max_energy_range_uj * 1e-6 / bound

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def close(self) -> None:
        """Close the counter file. Further readings fail."""
        with self._lock:
            self._close_fd()

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self._close_fd()


class RaplCPU(CPU):
    """One CPU package (or one die of a multi-die package) read through powercap RAPL.

    Args:
        index: Position among the CPUs found (package, then die, order).
        package: The package zone (``package-P``, or ``package-P-die-D`` for one die).
        dram: The DRAM subzone of this package or die, if any.
        psys: The platform zone (attached to the first CPU only).
        name: CPU model name.
        vendor: ``intel``, ``amd`` or ``unknown``.
        root: The powercap directory (used in fix messages).
        package_id: The package (socket) number the kernel gives the zone (default: ``index``).
        die_id: The die number within the package, for the zones of multi-die packages
            (``None`` when the zone covers the whole package).

    Attributes:
        package_id: Package (socket) number.
        die_id: Die number within the package, or ``None``.

    """

    def __init__(
        self,
        index: int,
        package: RaplZone,
        dram: RaplZone | None = None,
        psys: RaplZone | None = None,
        name: str = "",
        vendor: str = "unknown",
        root: str | Path = DEFAULT_ROOT,
        *,
        package_id: int | None = None,
        die_id: int | None = None,
    ) -> None:
        self.index = index
        self.name = name or package.name
        self.vendor = vendor
        self.package = package
        self.dram = dram
        self.psys = psys
        self.root = Path(root)
        self.package_id = index if package_id is None else package_id
        self.die_id = die_id
        self._problems: list[Problem] = []
        denied = [z for z in self.zones() if z.permission_denied]
        if denied:
            self._problems.append(
                Problem(
                    f"CPU {index}",
                    f"RAPL energy counters of {self.location} are not readable by this user "
                    f"({', '.join(str(z.path / 'energy_uj') for z in denied)}); they are root-only "
                    "since Linux 5.10 (November 2020)",
                    permission_fix(self.root),
                )
            )
        for zone in self.zones():
            if zone.error is not None and not zone.permission_denied:
                self._problems.append(
                    Problem(
                        f"CPU {index}",
                        f"RAPL zone {zone.name}: {zone.error}",
                        "RAPL is often unavailable in virtual machines; measure on bare metal",
                    )
                )

    @property
    def location(self) -> str:
        """Which package (and die) this is, in words: ``package 1`` or ``package 1, die 0``."""
        if self.die_id is None:
            return f"package {self.package_id}"
        return f"package {self.package_id}, die {self.die_id}"

    def zones(self) -> list[RaplZone]:
        """The zones read for this package (package, then DRAM and psys when present)."""
        return [z for z in (self.package, self.dram, self.psys) if z is not None]

    def _read(self, zone: RaplZone) -> float:
        if zone.readable:
            try:
                return zone.energy_j()
            except (OSError, ValueError) as e:  # readable at discovery, not now (driver unloaded, ...)
                raise NotSupportedError(f"CPU {self.index}: RAPL zone {zone.name} "
                                        f"({zone.path / 'energy_uj'}) cannot be read any more: {e}") from e
        if zone.permission_denied:
            p = self._problems[0]
            raise DevicePermissionError(f"{p.message}. Fix: {p.fix}")
        raise NotSupportedError(f"CPU {self.index}: RAPL zone {zone.name}: {zone.error}")

    def package_energy_j(self) -> float:
        value = self._read(self.package)
        if self.psys is not None and self.psys.readable:
            try:  # so that a sampler reading packages also catches psys wraps
                self.psys.energy_uj()
            except (OSError, ValueError):  # psys is not measured: its failure is not the package's
                pass
        return value

    def readable(self) -> bool:
        return self.package.readable

    def has_dram(self) -> bool:
        return self.dram is not None and self.dram.readable

    def dram_energy_j(self) -> float:
        if self.dram is None:
            raise NotSupportedError(f"CPU {self.index} ({self.name}) has no RAPL DRAM zone")
        return self._read(self.dram)

    def has_psys(self) -> bool:
        """Whether the platform (psys) zone is attached to this package."""
        return self.psys is not None

    def psys_energy_j(self) -> float:
        """Cumulative platform (psys) energy, J, wrap-corrected. NotSupportedError if none."""
        if self.psys is None:
            raise NotSupportedError(f"CPU {self.index}: no RAPL psys (platform) zone")
        return self._read(self.psys)

    def poll(self) -> None:
        """Read every readable zone once, so that no wrap is missed (the sampler calls this)."""
        for zone in self.zones():
            if zone.readable:
                zone.energy_uj()

    def max_read_interval_s(self) -> float:
        return min(z.max_read_interval_s() for z in self.zones())

    def max_power_w(self, dram: bool = False) -> float | None:
        zone = self.dram if dram else self.package
        return None if zone is None else zone.max_power_w

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def describe(self) -> dict[str, object]:
        info = super().describe()
        info["package_id"] = self.package_id
        info["die_id"] = self.die_id
        info["psys"] = self.has_psys()
        info["zones"] = {z.name: str(z.path) for z in self.zones()}
        info["readable"] = all(z.readable for z in self.zones())
        return info

    def close(self) -> None:
        """Close the counter files."""
        for zone in self.zones():
            zone.close()


def _cpu_identity(cpuinfo: str | Path | None) -> tuple[str, str]:
    """(model name, vendor) from ``/proc/cpuinfo``-format text; ("", "unknown") if unknown."""
    if cpuinfo is None:
        return "", "unknown"
    text = _read_text(Path(cpuinfo))
    if not text:
        return "", "unknown"
    model, vendor = "", "unknown"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and not model:
            model = value
        elif key == "vendor_id" and vendor == "unknown":
            vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd", "HygonGenuine": "amd"}.get(
                value, "unknown"
            )
        if model and vendor != "unknown":
            break
    return model, vendor


def _zone_dirs(root: Path) -> list[Path]:
    """Every zone directory under root: top-level entries and subzones nested in them."""
    found: dict[str, Path] = {}
    try:
        top = sorted(root.iterdir())
    except OSError:
        return []
    for entry in top:
        if _ZONE_DIR.match(entry.name) and entry.is_dir():
            found.setdefault(entry.name, entry)
            try:
                for sub in sorted(entry.iterdir()):
                    if _ZONE_DIR.match(sub.name) and sub.is_dir():
                        found.setdefault(sub.name, sub)
            except OSError:
                continue
    return list(found.values())


def _package_scope(chosen: dict[tuple[int, int], tuple[str, Path]],
                   vendor: str) -> dict[tuple[int, int], tuple[str, Path]]:
    """One zone per package where the die zones show one package counter.

    That is every multi-die package on AMD and Hygon (package-scope RAPL); with the vendor
    unknown, a package whose die zones' ``energy_uj`` all read non-zero and within
    ``_SAME_COUNTER_UJ`` of each other. The first
    die's zone then stands for the package (as a whole-package zone, die ``-1``).
    """
    dies: dict[int, list[tuple[int, tuple[str, Path]]]] = {}
    for (package_id, die), zone in sorted(chosen.items()):
        dies.setdefault(package_id, []).append((die, zone))
    out: dict[tuple[int, int], tuple[str, Path]] = {}
    for package_id, zones in dies.items():
        shared = len(zones) > 1 and zones[0][0] >= 0
        if shared and vendor != "amd":
            readings = [_read_int(path / "energy_uj") for _, (_, path) in zones]
            # One counter read a few times in a row: equal but for the ticks between the reads.
            shared = (vendor == "unknown" and None not in readings and 0 not in readings
                      and max(readings) - min(readings) <= _SAME_COUNTER_UJ)  # type: ignore[type-var,operator]
        if shared:
            out[(package_id, -1)] = zones[0][1]
        else:
            out.update(((package_id, die), zone) for die, zone in zones)
    return out


def discover_rapl(
    root: str | Path = DEFAULT_ROOT,
    *,
    cpuinfo: str | Path | None = "/proc/cpuinfo",
    opener: Opener = os.open,
) -> tuple[list[CPU], list[Problem]]:
    """Find the CPU packages RAPL exposes under ``root``.

    Args:
        root: The powercap directory.
        cpuinfo: A ``/proc/cpuinfo``-format file for the model name and vendor (``None``:
            use zone names).
        opener: Function used to open ``energy_uj`` files (tests inject one that simulates
            a non-root user).

    Returns:
        The packages, ordered by package number (one per die, in die order, for packages
        with several dies), and the problems found. Packages whose counters cannot be read
        are included; their problems are in the list too.

    """
    root = Path(root)
    if not root.is_dir():
        return [], [Problem("CPU", NO_RAPL_MESSAGE, NO_RAPL_FIX)]
    # prefix -> (package number, die number or -1 for a whole-package zone) -> zone dir
    packages: dict[str, dict[tuple[int, int], Path]] = {}
    subzones: dict[tuple[str, str], list[Path]] = {}
    psys_dirs: list[Path] = []
    for path in _zone_dirs(root):
        m = _ZONE_DIR.match(path.name)
        assert m is not None
        prefix, top, sub = m.group(1), m.group(2), m.group(3)
        if sub is not None:
            subzones.setdefault((prefix, top), []).append(path)
            continue
        name = _read_text(path / "name") or ""
        pm = _PACKAGE_NAME.match(name)
        if pm:
            die = -1 if pm.group(2) is None else int(pm.group(2))
            packages.setdefault(prefix, {})[(int(pm.group(1)), die)] = path
        elif name == "psys":
            psys_dirs.append(path)
    # The MSR interface (intel-rapl / amd-rapl) first; MMIO only for packages (dies) it lacks.
    chosen: dict[tuple[int, int], tuple[str, Path]] = {}
    for prefix in ("intel-rapl", "amd-rapl", "intel-rapl-mmio"):
        for key, path in packages.get(prefix, {}).items():
            chosen.setdefault(key, (prefix, path))
    if not chosen:
        return [], [Problem("CPU", f"{NO_RAPL_MESSAGE}; {root} has no package zones", NO_RAPL_FIX)]

    model, vendor = _cpu_identity(cpuinfo)
    chosen = _package_scope(chosen, "amd" if vendor == "unknown" and "amd-rapl" in packages else vendor)
    cpus: list[CPU] = []
    problems: list[Problem] = []
    psys: RaplZone | None = None
    if psys_dirs:
        try:
            psys = RaplZone(psys_dirs[0], opener)
        except ValueError as e:
            problems.append(Problem("CPU", f"RAPL psys zone ignored: {e}", ""))
    for key in sorted(chosen):
        index = len(cpus)
        package_id, die = key
        prefix, path = chosen[key]
        try:
            package = RaplZone(path, opener)
        except ValueError as e:
            problems.append(Problem(f"CPU {index}", f"RAPL package zone ignored: {e}", ""))
            continue
        dram: RaplZone | None = None
        top = _ZONE_DIR.match(path.name).group(2)  # type: ignore[union-attr]
        for sub in sorted(subzones.get((prefix, top), [])):
            if _read_text(sub / "name") == "dram":
                try:
                    dram = RaplZone(sub, opener)
                except ValueError as e:
                    problems.append(Problem(f"CPU {index}", f"RAPL DRAM zone ignored: {e}", ""))
                break
        zone_vendor = vendor
        if zone_vendor == "unknown" and prefix == "amd-rapl":
            zone_vendor = "amd"
        die_id = None if die < 0 else die
        name = model or package.name
        if model and die_id is not None:
            name = f"{model} (package {package_id}, die {die_id})"
        cpu = RaplCPU(
            index, package, dram=dram, name=name, vendor=zone_vendor, root=root,
            psys=psys if not cpus else None, package_id=package_id, die_id=die_id,
        )
        cpus.append(cpu)
        problems.extend(cpu.problems())
    return cpus, problems
