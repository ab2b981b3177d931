"""AMD GPUs through the ``amdsmi`` Python package (ROCm's AMD SMI library).

``amdsmi`` is imported lazily with :func:`importlib.import_module`, so tests can put a fake in
``sys.modules["amdsmi"]`` (see :mod:`joules.testing.fake_amdsmi`).

Units as amdsmi reports them and as converted here:

* ``amdsmi_get_energy_count``: ``energy_accumulator`` (``power`` before ROCm 6.1) ticks times
  ``counter_resolution`` µJ -> J.
* ``amdsmi_get_power_info``: ``current_socket_power`` (MI300 and newer) and
  ``average_socket_power`` (MI200 and older, Navi), W; unsupported fields read ``"N/A"``.
* ``amdsmi_get_power_cap_info``: ``power_cap``, ``default_power_cap``, ``min_power_cap``,
  ``max_power_cap`` in µW -> W (values below 10,000 are taken to be W already: no GPU has a
  cap under 10 mW or over 10 kW). ``amdsmi_set_power_cap`` takes µW.
* ``amdsmi_get_clock_info``: ``clk`` (``cur_clk`` in older versions), ``min_clk``,
  ``max_clk`` in MHz; ``amdsmi_get_clk_freq``: supported frequencies in Hz.
* ``amdsmi_get_temp_metric``: degrees Celsius (millidegrees are converted if seen).

**Broken energy counters.** Some amdsmi/driver combinations return an energy counter that
never advances within a process, or that jumps by impossible amounts (ROCm/amdsmi issues 22
and 38; the secondary die of an MI250X reads zero). :func:`check_energy_counters` reads each
counter twice, ``counter_check_s`` apart, and compares the implied power with the power
reading; a GPU that fails reports ``has_energy_counter() == False`` and a
:class:`~joules.devices.base.Problem`, and its energy comes from power sampling.
"""

from __future__ import annotations

import importlib
import math
import os
import re
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from joules.clock import Clock, RealClock
from joules.devices.base import GPU, Problem, WrappingCounter, fork_safe_lock
from joules.errors import DevicePermissionError, JoulesError, NotSupportedError

#: amdsmi status codes (``amdsmi_status_t``) that map to joules errors.
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NO_PERM = 10

#: Default time between the two readings of the energy-counter check, s.
DEFAULT_COUNTER_CHECK_S = 0.2

_INVALID_UINTS = {0xFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF}
#: ``counter_resolution`` as rocm_smi reports it for every ASIC (a hard-coded 15.3 µJ) and the
#: real tick the firmware counts in, 2**-16 J (15.259 µJ, the kernel's and amdsmi.h's figure):
#: trusting 15.3 reads 0.27 % high.
_ROCM_RESOLUTION_UJ = 15.3
_TICK_UJ = 1e6 / 65536
_WRAP_32 = 1 << 32
#: The most power a wrap of a 32-bit energy counter is taken to have come from, W (twice the
#: highest power cap of any AMD GPU so far): a counter that went back by more than this could
#: have drawn since the previous reading was reset, not wrapped.
_WRAP_POWER_W = 3000.0
_HEX = re.compile(r"^[0-9a-f]+$")


def _number(value: Any) -> float | None:
    """A reading as a float, or None for ``"N/A"``, the UINT_MAX markers and negatives."""
    if value is None or isinstance(value, (str, bytes)) or isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    if v < 0 or int(v) in _INVALID_UINTS:
        return None
    return v


def _cap_w(value: Any) -> float | None:
    """A power-cap value in W (amdsmi reports µW; tolerate versions that report W)."""
    v = _number(value)
    if v is None:
        return None
    return v / 1e6 if v >= 10_000 else v


def load_amdsmi() -> ModuleType:
    """Import the ``amdsmi`` package (whatever ``sys.modules`` holds, fakes included)."""
    return importlib.import_module("amdsmi")


class AMDGPU(GPU):
    """One AMD GPU (or GCD: an MI250X shows as two) read and controlled through amdsmi.

    Args:
        smi: The ``amdsmi`` module (already initialized with ``amdsmi_init``).
        handle: The processor handle from ``amdsmi_get_processor_handles``.
        index: Index among the GPUs visible to this process (what HIP calls device N; HIP's
            order, which :func:`discover_amd` takes from amdsmi's ``hip_id`` where reported).
        physical_index: Position in ``amdsmi_get_processor_handles`` (default: ``index``).
        clock: Clock for the energy-counter check (a virtual clock in tests).
        counter_check_s: Interval of the energy-counter check done at construction;
            ``None`` skips it (:func:`discover_amd` checks all GPUs at once instead).

    """

    vendor = "amd"

    def __init__(
        self,
        smi: ModuleType,
        handle: Any,
        index: int,
        physical_index: int | None = None,
        *,
        clock: Clock | None = None,
        counter_check_s: float | None = DEFAULT_COUNTER_CHECK_S,
    ) -> None:
        self._smi = smi
        self._handle = handle
        self._exc: type[BaseException] = getattr(smi, "AmdSmiException", Exception)
        self.index = index
        self.physical_index = index if physical_index is None else physical_index
        self.clock = clock or RealClock()
        self._problems: list[Problem] = []
        self.name = "AMD GPU"
        try:
            asic = self._call("amdsmi_get_gpu_asic_info", "the ASIC name")
            self.name = str(asic["market_name"]) or self.name
        except (JoulesError, KeyError, TypeError):
            pass
        try:
            self.uuid = str(self._call("amdsmi_get_gpu_device_uuid", "the UUID"))
        except JoulesError:
            self.uuid = f"AMD-GPU-{self.physical_index}"
        self.counter_check: dict[str, object] | None = None
        self._counter_ok = True
        # The die whose power cap this one sets: itself, or an MI250X's first die (see
        # attach_first_die); and the 32-bit wrap of an RDNA energy counter, once seen.
        self._cap_handle = handle
        self._control_uuid = self.uuid
        self._energy_lock = fork_safe_lock(self, "_energy_lock")
        self._ticks_32 = WrappingCounter(_WRAP_32)
        self._ticks_32_t: float | None = None  # when it was read last
        self._ticks_64bit = False
        self.secondary_die = self._is_secondary_die()
        if self.secondary_die:
            self._counter_ok = False
            self._problems.append(
                Problem(
                    f"GPU {index}",
                    f"{self.name}: the second die (GCD) of its package: amdsmi reports the package's "
                    "power, energy and power cap, both dies included, on the first die; this one "
                    "reads 0 W and has no power cap of its own",
                    "measure the package through its first die (the GPU before this one in "
                    "amdsmi's list), whose figures cover both dies; its power cap is set there",
                )
            )
            return
        try:
            self._energy_raw_j()
        except JoulesError as e:
            self._counter_ok = False
            self._problems.append(
                Problem(
                    f"GPU {index}",
                    f"{self.name}: no energy counter ({e}); energy comes from power sampling",
                    "energy counters are not available in virtual-machine guests; use bare metal "
                    "and a recent ROCm",
                )
            )
        if self._counter_ok and counter_check_s is not None:
            check_energy_counters([self], self.clock, counter_check_s)

    def _is_secondary_die(self) -> bool:
        """Whether this is the second GCD of an MI250(X) package (energy counter and caps read 0).

        ROCm reports such a package's power, energy and cap on its first GCD and zeros on the
        second (as ``rocm-smi`` tells the second die apart). The caps must read a number, 0:
        "N/A" caps and a counter at 0 just after a reset are not that.
        """
        if "MI250" not in self.name.upper():
            return False
        try:
            info = self._call("amdsmi_get_energy_count", "the energy counter")
            caps = self._cap_info()
        except (JoulesError, TypeError, ValueError):
            return False
        ticks = info.get("energy_accumulator", info.get("power"))
        return _number(ticks) == 0 and all(_number(caps.get(k)) == 0 for k in ("power_cap", "max_power_cap"))

    def attach_first_die(self, handle: Any, uuid: str) -> None:
        """Set this second die's power cap through its package's first die (``handle``).

        An MI250X package has one power cap, read and set on its first die; the kernel
        refuses it on the second. With the first die attached, this die's power-limit calls
        go there and :attr:`control_uuid` names it, so two processes (one per die) that set
        the cap share one device, as MIG instances share a GPU.
        """
        if not self.secondary_die:
            raise ValueError(f"GPU {self.index} ({self.name}) is not the second die of a package")
        self._cap_handle = handle
        self._control_uuid = uuid

    @property
    def control_uuid(self) -> str:
        """This GPU's UUID, or for an MI250X's second die its first die's (the package cap)."""
        return self._control_uuid

    # -- amdsmi calls -----------------------------------------------------------------------
    def _call(self, fn_name: str, what: str, *args: Any) -> Any:
        return self._call_on(self._handle, fn_name, what, *args)

    def _call_on(self, handle: Any, fn_name: str, what: str, *args: Any) -> Any:
        fn = getattr(self._smi, fn_name, None)
        if fn is None:
            raise NotSupportedError(f"GPU {self.index}: this amdsmi version has no {fn_name} ({what})")
        try:
            return fn(handle, *args)
        except self._exc as e:
            raise self._translate(e, fn_name, what) from e

    def _translate(self, e: BaseException, fn_name: str, what: str) -> JoulesError:
        code = getattr(e, "err_code", None)
        name = getattr(self, "name", "AMD GPU")
        if code == AMDSMI_STATUS_NO_PERM or isinstance(e, PermissionError):
            return DevicePermissionError(
                f"GPU {self.index} ({name}): no permission for {what} ({fn_name}); changing AMD GPU "
                "power caps and clocks needs root: run with sudo"
            )
        if code == AMDSMI_STATUS_NOT_SUPPORTED:
            return NotSupportedError(f"GPU {self.index} ({name}): {what} is not supported ({fn_name})")
        return JoulesError(f"GPU {self.index} ({name}): {fn_name} failed: {e}")

    def _enum(self, enum_name: str, *members: str) -> Any:
        enum = getattr(self._smi, enum_name, None)
        for member in members:
            value = getattr(enum, member, None)
            if value is not None:
                return value
        raise NotSupportedError(f"GPU {self.index}: this amdsmi version has no {enum_name}.{members[0]}")

    # -- energy and power -------------------------------------------------------------------
    def _energy_raw_j(self) -> float:
        # Read and extend together: a later reading fed first would look like a wrap.
        with self._energy_lock:
            info = self._call("amdsmi_get_energy_count", "the energy counter")
            ticks = info.get("energy_accumulator", info.get("power"))
            resolution = _number(info.get("counter_resolution"))
            if _number(ticks) is None or resolution is None:
                raise NotSupportedError(f"GPU {self.index} ({self.name}): energy counter reads {info!r}")
            if abs(resolution - _ROCM_RESOLUTION_UJ) < 1e-3:
                resolution = _TICK_UJ
            return self._extend(int(ticks), resolution * 1e-6) * resolution * 1e-6

    def _extend(self, ticks: int, tick_j: float) -> int:
        """The tick count, with the wraps of a 32-bit counter added.

        RDNA GPUs' firmware accumulates energy in 32 bits, which the driver passes on as is:
        it wraps every 2**32 ticks (65.5 kJ, minutes at full power). A counter that was
        never seen past 32 bits and goes back is taken to have wrapped, if a GPU could
        have drawn the energy of that wrap since the previous reading (at 3 kW, twice the
        highest power cap of any AMD GPU so far); else the counter was reset (a GPU reset, a
        driver reload; also a 64-bit counter not yet past 32 bits), and the value goes back,
        as resets do. One seen past
        32 bits is 64-bit, and never wraps in practice. Read at least once per wrap period
        (the sampler reads counters far more often) for no wrap to be missed.
        """
        if ticks >= _WRAP_32:
            self._ticks_64bit = True
        if self._ticks_64bit:
            return ticks
        now = self.clock.now()
        last, self._ticks_32_t = self._ticks_32_t, now
        max_gain = None if last is None else (_WRAP_POWER_W * max(0.0, now - last) + 1.0) / tick_j
        return self._ticks_32.update(ticks, max_gain)

    def has_energy_counter(self) -> bool:
        return self._counter_ok

    def energy_j(self) -> float:
        if not self._counter_ok:
            raise NotSupportedError(
                f"GPU {self.index} ({self.name}): energy counter unavailable or unreliable; "
                "use power sampling"
            )
        return self._energy_raw_j()

    def mark_counter_broken(self, reason: str) -> None:
        """Stop using the energy counter (energy will come from power sampling)."""
        if not self._counter_ok:
            return
        self._counter_ok = False
        self._problems.append(
            Problem(
                f"GPU {self.index}",
                f"{self.name}: the energy counter is unreliable ({reason}); energy comes from "
                "power sampling",
                "update ROCm (amdsmi) and the amdgpu driver; stale or jumping counters are known "
                "amdsmi/driver issues (ROCm/amdsmi issues 22 and 38), and a reboot has cleared them "
                "on some MI100 systems",
            )
        )

    def _power_field(self, keys: Sequence[str]) -> float:
        info = self._call("amdsmi_get_power_info", "the power reading")
        for key in keys:
            v = _number(info.get(key))
            if v is not None:
                return v
        raise NotSupportedError(f"GPU {self.index} ({self.name}): no power reading ({info!r})")

    def power_w(self) -> float:
        return self._power_field(("current_socket_power", "average_socket_power", "socket_power"))

    def average_power_w(self) -> float:
        return self._power_field(("average_socket_power", "current_socket_power", "socket_power"))

    def _power_or_none(self) -> float | None:
        try:
            return self.power_w()
        except JoulesError:
            return None

    # -- power limit ------------------------------------------------------------------------
    def _cap_info(self) -> dict[str, Any]:
        return dict(self._call_on(self._cap_handle, "amdsmi_get_power_cap_info", "the power cap"))

    def _cap(self, *keys: str) -> float:
        info = self._cap_info()
        for key in keys:
            v = _cap_w(info.get(key))
            if v is not None:
                return v
        raise NotSupportedError(f"GPU {self.index} ({self.name}): no {keys[0]} in {info!r}")

    def power_limit_w(self) -> float:
        return self._cap("power_cap")

    def default_power_limit_w(self) -> float:
        return self._cap("default_power_cap", "power_cap_default")

    def power_limit_range_w(self) -> tuple[float, float]:
        return (self._cap("min_power_cap"), self._cap("max_power_cap"))

    def set_power_limit_w(self, watts: float) -> None:
        """Set the power cap, rounded to the nearest whole watt (the driver drops fractions).

        Raises:
            ValueError: ``watts`` is out of range.
            NotSupportedError: A second die whose first die is not known.
        """
        if self.secondary_die and self._cap_handle is self._handle:
            raise NotSupportedError(
                f"GPU {self.index} ({self.name}) is the second die of its package, which has one "
                "power cap: set it on the package's first die"
            )
        self.check_power_limit(watts)
        lo, hi = self.power_limit_range_w()
        whole = min(max(math.floor(watts + 0.5), math.ceil(lo - 1e-9)), math.floor(hi + 1e-9))
        self._call_on(self._cap_handle, "amdsmi_set_power_cap", "setting the power cap", 0, whole * 1_000_000)

    # -- clocks -----------------------------------------------------------------------------
    def _clock_info(self, *kind: str) -> dict[str, Any]:
        return dict(self._call("amdsmi_get_clock_info", "clock readings", self._enum("AmdSmiClkType", *kind)))

    def _clock_mhz(self, *kind: str) -> float:
        info = self._clock_info(*kind)
        v = _number(info.get("clk", info.get("cur_clk")))
        if v is None:
            raise NotSupportedError(f"GPU {self.index} ({self.name}): no {kind[0]} clock reading")
        return v

    def sm_clock_mhz(self) -> float:
        return self._clock_mhz("GFX", "SYS")

    def memory_clock_mhz(self) -> float:
        return self._clock_mhz("MEM")

    def supported_sm_clocks_mhz(self) -> list[float]:
        clocks: set[float] = set()
        try:
            gfx = self._enum("AmdSmiClkType", "GFX", "SYS")
            freq = self._call("amdsmi_get_clk_freq", "supported clocks", gfx)
            clocks.update(v / 1e6 for v in (_number(f) for f in freq.get("frequency", [])) if v)
        except JoulesError:
            pass
        try:
            # Some amdsmi versions drop the last frequency from amdsmi_get_clk_freq.
            info = self._clock_info("GFX", "SYS")
            clocks.update(v for v in (_number(info.get("min_clk")), _number(info.get("max_clk"))) if v)
        except JoulesError:
            pass
        if not clocks:
            raise NotSupportedError(f"GPU {self.index} ({self.name}): supported clocks unknown")
        return sorted(clocks, reverse=True)

    def lock_sm_clock(self, min_mhz: float, max_mhz: float) -> None:
        supported = self.supported_sm_clocks_mhz()
        lo, hi = min(supported), max(supported)
        if not lo <= min_mhz <= max_mhz <= hi:
            raise ValueError(
                f"GPU {self.index} ({self.name}): SM clock range [{min_mhz:g}, {max_mhz:g}] MHz is "
                f"outside [{lo:g}, {hi:g}] MHz"
            )
        self._call(
            "amdsmi_set_gpu_clk_range", "locking clocks", int(min_mhz), int(max_mhz),
            self._enum("AmdSmiClkType", "GFX", "SYS"),
        )

    def reset_sm_clock(self) -> None:
        self._call("amdsmi_set_gpu_perf_level", "resetting clocks", self._enum("AmdSmiDevPerfLevel", "AUTO"))

    # -- misc -------------------------------------------------------------------------------
    def temperature_c(self) -> float:
        metric = self._enum("AmdSmiTemperatureMetric", "CURRENT")
        last: JoulesError | None = None
        for sensor in (("EDGE",), ("HOTSPOT", "JUNCTION")):  # MI300 has no edge sensor
            try:
                v = _number(self._call("amdsmi_get_temp_metric", "temperature",
                                       self._enum("AmdSmiTemperatureType", *sensor), metric))
            except JoulesError as e:
                last = e
                continue
            if v is not None and v > 0:
                return v / 1000.0 if v > 1000 else v
        raise last or NotSupportedError(f"GPU {self.index} ({self.name}): no temperature reading")

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def describe(self) -> dict[str, object]:
        info = super().describe()
        info["energy_counter_check"] = self.counter_check
        info["secondary_die"] = self.secondary_die
        return info


def _judge(e0: float, e1: float, dt: float, power_w: float | None, max_cap_w: float | None) -> str | None:
    """Why two counter readings ``dt`` apart are implausible, or None if they look right."""
    if dt <= 0:
        return None
    de = e1 - e0
    if de < 0:
        return f"went backwards by {-de:.3f} J in {dt:.3f} s"
    if de == 0:
        during = f" while the GPU drew {power_w:.0f} W" if power_w else ""
        return f"did not advance in {dt:.3f} s{during}"
    implied = de / dt
    ceiling = 5000.0
    if power_w is not None:
        ceiling = 4.0 * power_w + 100.0
    if max_cap_w is not None:
        ceiling = max(ceiling, 2.0 * max_cap_w) if power_w is not None else 2.0 * max_cap_w
    if implied > ceiling:
        reading = f" while the power reading is {power_w:.0f} W" if power_w is not None else ""
        return f"advanced {de:.1f} J in {dt:.3f} s, i.e. {implied:.0f} W{reading}"
    if power_w is not None and implied < power_w / 4.0 - 20.0:
        return (f"advanced {de:.3f} J in {dt:.3f} s, i.e. {implied:.1f} W, while the power reading is "
                f"{power_w:.0f} W")
    return None


def check_energy_counters(gpus: Sequence[AMDGPU], clock: Clock, interval_s: float = DEFAULT_COUNTER_CHECK_S
                          ) -> list[Problem]:
    """Check that each GPU's energy counter advances in line with its power reading.

    All GPUs are read, then ``clock.sleep(interval_s)``, then read again, so the check costs
    one interval whatever the number of GPUs. GPUs that fail are marked with
    :meth:`AMDGPU.mark_counter_broken`.

    Returns:
        The problems added (one per failing GPU).

    """
    todo = [g for g in gpus if g.has_energy_counter()]
    if not todo:
        return []
    first: list[tuple[float | None, float | None]] = []
    t0 = clock.now()
    for g in todo:
        try:
            first.append((g._energy_raw_j(), g._power_or_none()))
        except JoulesError:
            first.append((None, None))
    clock.sleep(interval_s)
    t1 = clock.now()
    added: list[Problem] = []
    for g, (e0, p0) in zip(todo, first, strict=True):
        try:
            e1: float | None = g._energy_raw_j()
        except JoulesError as e:
            e1 = None
            reason: str | None = f"reading failed: {e}"
        p1 = g._power_or_none()
        powers = [p for p in (p0, p1) if p is not None]
        power = max(powers) if powers else None
        try:
            cap: float | None = g.power_limit_range_w()[1]
        except JoulesError:
            cap = None
        if e0 is None:
            reason = "reading failed"
        elif e1 is not None:
            reason = _judge(e0, e1, t1 - t0, power, cap)
        g.counter_check = {
            "interval_s": t1 - t0,
            "energy_delta_j": None if e0 is None or e1 is None else e1 - e0,
            "power_w": power,
            "ok": reason is None,
        }
        if reason is not None:
            g.mark_counter_broken(reason)
            added.append(g.problems()[-1])
    return added


#: amdsmi's UUID layout (``amdsmi_uuid_gen``): ``{b7}{fcn}{did}-0000-1000-80{b6}-{b5..b0}``,
#: where b7..b0 are the bytes of the GPU's 64-bit unique id, most significant first.
_AMDSMI_UUID = re.compile(
    r"^([0-9a-f]{2})[0-9a-f]{6}-0000-1000-80([0-9a-f]{2})-([0-9a-f]{12})$"
)
#: The runtimes' form of the unique id: ``GPU-`` and 16 hex digits (``rocminfo``'s ``Uuid``).
_RUNTIME_UUID = re.compile(r"^gpu-([0-9a-f]{16})$")


def unique_id(uuid: str) -> str | None:
    """The GPU's 64-bit unique id, as 16 lowercase hex digits, from an amdsmi or runtime UUID.

    ROCr, HIP and ``rocminfo`` name a GPU ``GPU-<unique id>`` (``GPU-%016llx``); amdsmi's
    ``amdsmi_get_gpu_device_uuid`` spreads the same id over an RFC 4122-shaped UUID,
    ``{b7}{fcn}{did}-0000-1000-80{b6}-{b5 b4 b3 b2 b1 b0}`` (b7 the most significant byte,
    ``fcn`` a function or partition index, ``did`` the PCI device id). Both forms are
    accepted; ``None`` for anything else.
    """
    text = uuid.strip().lower()
    m = _RUNTIME_UUID.match(text)
    if m:
        found = m.group(1)
    else:
        m = _AMDSMI_UUID.match(text)
        if not m:
            return None
        found = m.group(1) + m.group(2) + m.group(3)
    return None if found == "0" * 16 else found  # ROCr gives a GPU with id 0 no UUID


def _match_uuid(token: str, ids: Sequence[str | None], candidates: Sequence[int]) -> tuple[int | None, str]:
    """Position in ``candidates`` of the GPU a ``GPU-<hex>`` token names, and why not if none.

    As ROCr does, the token's hex digits are compared with the start of each GPU's 16-digit
    unique id (``ids``, by physical index): a prefix that names one GPU selects it, one that
    names several is refused.
    """
    want = token.strip().lower()
    if _AMDSMI_UUID.match(want):
        named = unique_id(want)
        hint = f"; the unique id of that GPU is GPU-{named}" if named in ids else ""
        return None, f"is an amdsmi UUID, which the ROCm runtimes do not accept{hint}"
    if not want.startswith("gpu-"):
        return None, "is neither an index nor a GPU-<hex> unique id"
    digits = want[4:]
    if not 1 <= len(digits) <= 16 or not _HEX.match(digits):
        return None, "is not GPU- followed by 1 to 16 hex digits of a GPU's unique id"
    found = [pos for pos, physical in enumerate(candidates)
             if (have := ids[physical]) is not None and have.startswith(digits)]
    if len(found) > 1:
        names = ", ".join(f"GPU-{ids[candidates[pos]]}" for pos in found)
        return None, f"is ambiguous: it starts the unique ids of {len(found)} GPUs ({names})"
    if not found:
        return None, "is the start of no GPU's unique id"
    return found[0], ""


_VISIBLE_VARS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
"""The variables that select AMD GPUs: ROCr's among all, then HIP's (or CUDA's) among those."""


def visible_devices(
    count: int,
    uuids: Sequence[str],
    env: Mapping[str, str],
    unique_ids: Sequence[str | None] | None = None,
    runtime_order: Sequence[int] | None = None,
) -> tuple[list[int], list[Problem]]:
    """The physical indices of the GPUs this process sees, in the order it numbers them.

    ``ROCR_VISIBLE_DEVICES`` selects among all GPUs; ``HIP_VISIBLE_DEVICES`` (or, when unset,
    ``CUDA_VISIBLE_DEVICES``, which HIP also honors) selects among those. Entries are indices
    or unique ids in the runtimes' form, ``GPU-<16 hex digits>`` as ``rocminfo`` prints them,
    or any prefix of one that names a single GPU (``GPU-2a17``). The id is taken from
    ``unique_ids`` or, where that has none, recovered from amdsmi's UUID (see
    :func:`unique_id`); case does not matter. As in the runtimes, an invalid or ambiguous
    entry hides it and every entry after it; an empty value hides every GPU.

    Args:
        count: Number of GPUs amdsmi reports.
        uuids: Their amdsmi UUIDs, by physical index.
        env: The environment.
        unique_ids: Their unique ids (16 hex digits, or ``GPU-`` and 16 hex digits), by
            physical index, where known otherwise (``hip_uuid`` of
            ``amdsmi_get_gpu_enumeration_info``); ``None`` entries fall back to ``uuids``.
        runtime_order: The physical indices in the order the ROCm runtimes number the GPUs
            (see :func:`runtime_order`; default: amdsmi's order).

    """
    ids: list[str | None] = []
    for physical in range(count):
        given = unique_ids[physical] if unique_ids is not None and physical < len(unique_ids) else None
        have = None if given is None else unique_id(given if "-" in given else f"GPU-{given}")
        if have is None and physical < len(uuids):
            have = unique_id(uuids[physical])
        ids.append(have)
    order = list(range(count)) if runtime_order is None else list(runtime_order)
    problems: list[Problem] = []
    hip_var = _VISIBLE_VARS[1] if _VISIBLE_VARS[1] in env else _VISIBLE_VARS[2]
    for var in (_VISIBLE_VARS[0], hip_var):
        value = env.get(var)
        if value is None:
            continue
        selected: list[int] = []
        for raw in value.split(",") if value.strip() else []:
            token = raw.strip()
            pos: int | None
            why = ""
            if re.fullmatch(r"\d+", token):
                pos = int(token) if int(token) < len(order) else None
                why = f"is not an index from 0 to {len(order) - 1}"
            else:
                pos, why = _match_uuid(token, ids, order)
            if pos is not None and order[pos] in selected:
                pos, why = None, "names a GPU already listed"
            if pos is None:
                known = [f"GPU-{ids[p]}" for p in order if ids[p] is not None]
                fix = f"use indices 0 to {len(order) - 1}"
                fix += (f" or unique ids ({', '.join(known)}; 'rocminfo' prints them as Uuid)" if known
                        else " ('rocminfo' prints the GPUs' unique ids as Uuid)")
                problems.append(
                    Problem(
                        "AMD",
                        f"{var}={value}: entry {token!r} {why}; it and the entries after it are "
                        f"ignored ({len(order)} GPUs available to it)",
                        fix,
                    )
                )
                break
            selected.append(order[pos])
        order = selected
    return order, problems


def runtime_order(smi: ModuleType, handles: Sequence[Any]) -> list[int] | None:
    """The positions in ``handles`` in the order HIP numbers the GPUs, where amdsmi says.

    HIP numbers GPUs by KFD node, which need not be amdsmi's handle order; newer amdsmi
    reports each GPU's ``hip_id`` (``amdsmi_get_gpu_enumeration_info``). ``None`` when it does
    not, or when the ids are missing, invalid or repeated (amdsmi's order is then used).
    """
    fn = getattr(smi, "amdsmi_get_gpu_enumeration_info", None)
    if fn is None:
        return None
    ids: list[int] = []
    for h in handles:
        try:
            info = fn(h)
            value = info.get("hip_id") if isinstance(info, Mapping) else None
        except Exception:  # noqa: BLE001 - an optional extra
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value in _INVALID_UINTS:
            return None
        ids.append(value)
    if len(set(ids)) != len(ids):
        return None
    return sorted(range(len(handles)), key=ids.__getitem__)


def _enumeration_hip_uuid(smi: ModuleType, handle: Any) -> str | None:
    """The ``hip_uuid`` amdsmi reports for a GPU (newer ROCm), or ``None``."""
    fn = getattr(smi, "amdsmi_get_gpu_enumeration_info", None)
    if fn is None:
        return None
    try:
        info = fn(handle)
        value = info.get("hip_uuid") if isinstance(info, Mapping) else None
    except Exception:  # noqa: BLE001 - an optional extra; the amdsmi UUID serves otherwise
        return None
    return value if isinstance(value, str) else None  # parsed (and checked) by visible_devices


def discover_amd(
    env: Mapping[str, str] | None = None,
    *,
    clock: Clock | None = None,
    counter_check_s: float | None = DEFAULT_COUNTER_CHECK_S,
    kfd_path: str = "/dev/kfd",
) -> tuple[list[GPU], list[Problem]]:
    """Find the AMD GPUs visible to this process.

    Args:
        env: Environment to read ``ROCR_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES`` from
            (default: ``os.environ``).
        clock: Clock for the energy-counter check (default: the real clock).
        counter_check_s: Interval of the energy-counter check (one interval in total, all GPUs
            at once); ``None`` trusts the counters.
        kfd_path: The ROCm kernel driver's device; when amdsmi is missing, its absence means
            there is no AMD GPU, and no problem is reported.

    Returns:
        The GPUs (``index`` = position among visible GPUs) and the problems found.

    """
    env = os.environ if env is None else env
    clock = clock or RealClock()
    try:
        smi = load_amdsmi()
    except ImportError:
        if os.path.exists(kfd_path):
            return [], [
                Problem(
                    "AMD",
                    f"an AMD GPU driver is present ({kfd_path}) but the amdsmi Python package is not "
                    "installed",
                    "pip install amdsmi (the version matching your ROCm), or pip install "
                    "/opt/rocm/share/amd_smi",
                )
            ]
        return [], []
    except Exception as e:  # noqa: BLE001 - e.g. OSError loading libamd_smi.so
        return [], [Problem("AMD", f"amdsmi could not be loaded: {e}",
                            "check the ROCm installation (libamd_smi.so in /opt/rocm/lib)")]
    exc: type[BaseException] = getattr(smi, "AmdSmiException", Exception)
    try:
        flags = getattr(getattr(smi, "AmdSmiInitFlags", None), "INIT_AMD_GPUS", None)
        smi.amdsmi_init(flags) if flags is not None else smi.amdsmi_init()
        handles = list(smi.amdsmi_get_processor_handles())
    except exc as e:
        return [], [
            Problem(
                "AMD",
                f"amdsmi could not be initialized: {e}",
                "check that the amdgpu driver is loaded (lsmod | grep amdgpu) and that this user can "
                "open /dev/kfd and /dev/dri/renderD* (groups 'render' and 'video')",
            )
        ]
    uuids: list[str] = []
    for i, h in enumerate(handles):
        try:
            uuids.append(str(smi.amdsmi_get_gpu_device_uuid(h)))
        except Exception:  # noqa: BLE001 - a GPU without a UUID can still be used by index
            uuids.append(f"AMD-GPU-{i}")
    # The runtimes' ids are only needed to resolve a selection by unique id.
    selecting = any(env.get(v) for v in _VISIBLE_VARS)
    hip_uuids = [_enumeration_hip_uuid(smi, h) for h in handles] if selecting else None
    physical, problems = visible_devices(len(handles), uuids, env, hip_uuids, runtime_order(smi, handles))
    gpus: list[AMDGPU] = []
    for index, p in enumerate(physical):
        try:
            gpus.append(AMDGPU(smi, handles[p], index, p, clock=clock, counter_check_s=None))
        except JoulesError as e:
            problems.append(Problem(f"GPU {index}", f"AMD GPU {p} could not be opened: {e}", ""))
    for g in gpus:
        # A second die sets its package's cap on the first die, the GPU before it in
        # amdsmi's list (which lists every GPU, whatever the runtime's selection).
        p = g.physical_index
        if g.secondary_die and p > 0 and "MI250" in _name_of(smi, handles[p - 1]).upper():
            g.attach_first_die(handles[p - 1], uuids[p - 1])
    if counter_check_s is not None:
        check_energy_counters(gpus, clock, counter_check_s)
    for g in gpus:
        problems.extend(g.problems())
    return list(gpus), problems


def _name_of(smi: ModuleType, handle: Any) -> str:
    try:
        return str(smi.amdsmi_get_gpu_asic_info(handle)["market_name"])
    except Exception:  # noqa: BLE001 - an unreadable name is just not an MI250X's
        return ""
