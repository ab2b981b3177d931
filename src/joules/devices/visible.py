"""Which GPUs a process can see: ``CUDA_VISIBLE_DEVICES`` parsed the way CUDA parses it.

CUDA accepts a comma-separated list of

* integer ordinals (``0,2``), parsed like C ``strtoul`` (``1gpu`` reads as ``1``);
* GPU UUIDs (``GPU-8f3a1c2e-...``) or any prefix of one that names a single GPU
  (``GPU-8f3a``);
* MIG device UUIDs (``MIG-c6d4f1ef-...``, prefixes allowed) or the legacy MIG form
  ``MIG-GPU-<gpu uuid>/<gpu instance id>/<compute instance id>``.

The kind of the first entry sets the kind of the list. Parsing stops at the first entry that
is invalid (a negative or out-of-range ordinal, an empty entry, an entry of another kind):
only the devices before it are visible, so ``0,1,-1,2`` shows GPUs 0 and 1. A device named
twice makes no device visible. An unset variable shows every GPU; an empty one shows none.

A process enumerates at most one MIG device: with several MIG entries, only the first is
visible.

Integer ordinals are positions among the GPUs present (those NVML can open, by NVML index;
a GPU the process has no permission for is not counted, by CUDA either). CUDA numbers GPUs
fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; on machines with different GPU models
the two orders can differ, which :func:`joules.devices.nvidia.discover_nvml` reports.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from joules.errors import DeviceNotFoundError

__all__ = [
    "MigDevice",
    "Visibility",
    "VisibleTarget",
    "resolve_visible_devices",
    "visible_targets",
]


class MigDevice(NamedTuple):
    """A MIG device (compute instance) present on a physical GPU.

    The instance ids are only needed to resolve the legacy
    ``MIG-GPU-<uuid>/<gi>/<ci>`` form; a plain UUID string can stand in for a
    :class:`MigDevice` without them.
    """

    uuid: str
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


class VisibleTarget(NamedTuple):
    """One device the process can see: a physical GPU, or a MIG device on it."""

    physical_index: int
    mig_uuid: str | None = None


@dataclass(frozen=True)
class Visibility:
    """What ``CUDA_VISIBLE_DEVICES`` makes visible.

    Attributes:
        targets: Visible devices in CUDA order (position = CUDA device index).
        ignored: Entries CUDA does not apply (those from the first invalid entry on, or
            all of them when a device is named twice).
        note: Why entries were ignored, or ``""``.

    """

    targets: tuple[VisibleTarget, ...]
    ignored: tuple[str, ...] = ()
    note: str = ""


DeviceEntry = tuple[int, str, Sequence["str | MigDevice"]]

_LEGACY_MIG = re.compile(r"^MIG-(GPU-[^/]+)/(\d+)/(\d+)$")
_STRTOUL = re.compile(r"^\s*([+-]?)(\d+)")


def _strtoul(entry: str) -> int | None:
    """The ordinal ``entry`` starts with, like C ``strtoul``; ``None`` if none or negative."""
    m = _STRTOUL.match(entry)
    if not m:
        return None
    value = int(m.group(2))
    if m.group(1) == "-" and value != 0:
        return None
    return value


def _mig(entry: str | MigDevice) -> MigDevice:
    return entry if isinstance(entry, MigDevice) else MigDevice(str(entry))


def _describe_gpus(devices: Sequence[DeviceEntry]) -> str:
    return ", ".join(f"{idx}: {uuid}" for idx, uuid, _ in devices) or "none"


def _describe_migs(devices: Sequence[DeviceEntry]) -> str:
    found = [f"{_mig(m).uuid} (on GPU {idx})" for idx, _, migs in devices for m in migs]
    return ", ".join(found) or "none"


class _Stop(Exception):
    """An entry CUDA would stop parsing at; carries the reason."""


def _prefix_matches(entry: str, candidates: Sequence[tuple[str, VisibleTarget]]) -> list[VisibleTarget]:
    exact = [t for uuid, t in candidates if uuid == entry]
    if exact:
        return exact[:1]
    return [t for uuid, t in candidates if uuid.startswith(entry)]


def _resolve_uuid(
    entry: str,
    position: int,
    devices: Sequence[DeviceEntry],
    strict: bool,
) -> VisibleTarget:
    """Resolve one ``GPU-``/``MIG-`` entry; raise _Stop (or DeviceNotFoundError if strict)."""
    where = f"CUDA_VISIBLE_DEVICES entry {position} ({entry!r})"
    legacy = _LEGACY_MIG.match(entry)
    if legacy:
        gpu_uuid, gi, ci = legacy.group(1), int(legacy.group(2)), int(legacy.group(3))
        gpus = _prefix_matches(gpu_uuid, [(uuid, VisibleTarget(idx)) for idx, uuid, _ in devices])
        if len(gpus) != 1:
            problem = "matches no GPU UUID" if not gpus else "matches the UUIDs of several GPUs"
            msg = (
                f"{where}: {gpu_uuid!r} {problem} (GPUs present: {_describe_gpus(devices)}); "
                "list UUIDs with `nvidia-smi -L`"
            )
            if strict:
                raise DeviceNotFoundError(msg)
            raise _Stop(msg)
        parent = gpus[0].physical_index
        migs = [_mig(m) for idx, _, ms in devices if idx == parent for m in ms]
        for m in migs:
            if m.gpu_instance_id == gi and m.compute_instance_id == ci:
                return VisibleTarget(parent, m.uuid)
        msg = (
            f"{where}: GPU {parent} has no MIG device with GPU instance {gi} and compute "
            f"instance {ci} (MIG devices on it: {', '.join(m.uuid for m in migs) or 'none'}); "
            "list them with `nvidia-smi -L`"
        )
        if strict:
            raise DeviceNotFoundError(msg)
        raise _Stop(msg)

    if entry.startswith("MIG-"):
        candidates = [
            (_mig(m).uuid, VisibleTarget(idx, _mig(m).uuid)) for idx, _, migs in devices for m in migs
        ]
        kind, present = "MIG device", _describe_migs(devices)
    else:
        candidates = [(uuid, VisibleTarget(idx)) for idx, uuid, _ in devices]
        kind, present = "GPU", _describe_gpus(devices)
    matches = _prefix_matches(entry, candidates)
    if len(matches) == 1:
        return matches[0]
    if not matches:
        msg = (
            f"{where} matches no {kind} UUID ({kind}s present: {present}); CUDA hides it and "
            "every later entry. List UUIDs with `nvidia-smi -L`"
        )
    else:
        names = ", ".join(
            f"{t.mig_uuid} (on GPU {t.physical_index})" if t.mig_uuid else f"GPU {t.physical_index} ({u})"
            for u, t in candidates
            if u.startswith(entry)
        )
        msg = (
            f"{where} is ambiguous: it starts the UUIDs of {names}; give enough characters to "
            "name one device"
        )
    if strict:
        raise DeviceNotFoundError(msg)
    raise _Stop(msg)


def resolve_visible_devices(
    value: str | None,
    devices: Sequence[DeviceEntry],
    *,
    strict: bool = True,
) -> Visibility:
    """Apply ``CUDA_VISIBLE_DEVICES`` to the devices present.

    Args:
        value: The variable's value; ``None`` when it is unset.
        devices: The devices present, as ``(physical index, GPU UUID, MIG devices)``; MIG
            devices are UUID strings or :class:`MigDevice` (with instance ids, needed for
            the legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` form).
        strict: When true, a UUID entry that matches no device or several raises
            :class:`~joules.errors.DeviceNotFoundError` (almost always a typo). When false,
            it ends the list, as in CUDA.

    Returns:
        The visible devices in CUDA order, and the entries that were not applied.

    Raises:
        DeviceNotFoundError: In strict mode, for a UUID entry that matches no device or is
            ambiguous.

    """
    ordered = sorted(devices, key=lambda d: d[0])
    if value is None:
        return Visibility(tuple(VisibleTarget(idx) for idx, _, _ in ordered))
    entries = value.split(",")
    if not value.strip():
        return Visibility((), (), "CUDA_VISIBLE_DEVICES is set but empty: no GPU is visible")

    first = entries[0].strip()
    mode = "GPU-" if first.startswith("GPU-") else "MIG-" if first.startswith("MIG-") else ""
    targets: list[VisibleTarget] = []
    for pos, raw in enumerate(entries):
        entry = raw.strip()
        try:
            if mode == "MIG-" and targets:
                raise _Stop(
                    "CUDA enumerates only one MIG device per process, the first listed: entries "
                    f"from {pos} ({entry!r}) on are not visible to it"
                )
            if mode:
                if not entry.startswith(mode):
                    raise _Stop(
                        f"CUDA_VISIBLE_DEVICES entry {pos} ({entry!r}) is not a {mode} UUID like "
                        "the first entry; CUDA stops there"
                    )
                target = _resolve_uuid(entry, pos, ordered, strict)
            else:
                ordinal = _strtoul(entry)
                if ordinal is None:
                    raise _Stop(
                        f"CUDA_VISIBLE_DEVICES entry {pos} ({entry!r}) is not a GPU ordinal; "
                        "CUDA stops there"
                    )
                if ordinal >= len(ordered):
                    raise _Stop(
                        f"CUDA_VISIBLE_DEVICES entry {pos} ({entry!r}) names GPU {ordinal}, but only "
                        f"{len(ordered)} GPU(s) are present; CUDA stops there"
                    )
                # CUDA numbers the GPUs it can open; one that cannot be opened (no permission in
                # a cgroup) is not counted, as when the variable is unset.
                target = VisibleTarget(ordered[ordinal][0])
        except _Stop as stop:
            return Visibility(tuple(targets), tuple(e.strip() for e in entries[pos:]), str(stop))
        if target in targets:
            return Visibility(
                (),
                tuple(e.strip() for e in entries),
                f"CUDA_VISIBLE_DEVICES names the same device twice (entry {pos}, {entry!r}): "
                "CUDA then makes no device visible",
            )
        targets.append(target)
    return Visibility(tuple(targets))


def visible_targets(
    value: str | None,
    devices: Sequence[DeviceEntry],
    *,
    strict: bool = True,
) -> list[VisibleTarget]:
    """The devices ``CUDA_VISIBLE_DEVICES`` makes visible, in CUDA order.

    Args:
        value: The variable's value; ``None`` when it is unset.
        devices: The devices present, as ``(physical index, GPU UUID, MIG devices)``.
        strict: Raise on UUID entries that match no device or several (see
            :func:`resolve_visible_devices`).

    Returns:
        ``(physical index, MIG UUID or None)`` for each visible device.

    """
    return list(resolve_visible_devices(value, devices, strict=strict).targets)
