"""Job totals across ``torch.distributed`` ranks: combine per-rank measurements correctly.

Every rank of a distributed job measures its own window with an
:class:`~joules.monitoring.monitor.EnergyMonitor`. Adding those measurements up naively
over-counts: all ranks on one node read the same CPU packages and DRAM zones, and two
ranks may both measure a GPU they can both see. :func:`combine` counts every physical
device once; :func:`gather` collects the measurements of all ranks and combines them.

Example:
    >>> with monitor.window("epoch") as w:
    ...     train_one_epoch()
    >>> total = gather(w.measurement)  # same call on every rank
    >>> if dist.get_rank() == 0:
    ...     print(total.total_energy_j)

Devices are identified by ``(host, device_id)``: a GPU's UUID, ``<host>/cpu<N>`` for a CPU
package, ``<host>/dram<N>`` for a DRAM zone. A device without a ``device_id`` is taken to
be a distinct device for GPUs (their indices are per process and say nothing about which
physical GPU is meant) and identified by its index for CPU packages and DRAM (all
processes of a host number the packages alike).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from joules.monitoring.measurement import DeviceEnergy, Measurement

__all__ = ["collect", "combine", "gather", "per_host"]

_Zone = dict[int, DeviceEnergy]


def _validate(measurements: Sequence[Measurement]) -> list[Measurement]:
    items = list(measurements)
    if not items:
        raise ValueError("combine() needs at least one Measurement (got an empty sequence)")
    for i, m in enumerate(items):
        if not isinstance(m, Measurement):
            raise TypeError(f"combine() item {i} is a {type(m).__name__}, not a Measurement")
    return items


def _name(items: Sequence[Measurement], name: str | None) -> str:
    if name is not None:
        return name
    names = list(dict.fromkeys(m.name for m in items))
    if len(names) > 1:
        warnings.warn(
            f"combining windows of different names {names}; pass name=... to choose the "
            "combined window's name",
            UserWarning,
            stacklevel=3,
        )
    return "+".join(names)


def _host_order(items: Sequence[Measurement]) -> list[str]:
    """Hosts in order of their first (lowest-rank) measurement."""
    return list(dict.fromkeys(m.host for m in items))


def _merge(
    groups: Iterable[tuple[str, Sequence[Measurement]]],
    attr: str,
    prefix: str,
    dedup_without_id: bool,
) -> _Zone:
    """Merge one kind of zone; keys renumbered 0..N-1, each ``(host, device)`` kept once.

    An entry's host is its own (``DeviceEnergy.host``, set in a measurement combined from
    several hosts) or its measurement's. With more than one host in ``groups``, each entry
    of the result records its host, so that the result can be combined again.
    """
    several = len({h for h, _ in groups}) > 1 or any(d.host for _, ms in groups for m in ms
                                                      for d in getattr(m, attr).values())
    seen: set[tuple[str, str]] = set()
    out: _Zone = {}
    for host, members in groups:
        for m in members:
            zones: _Zone = getattr(m, attr)
            for index in sorted(zones):
                d = zones[index]
                on = d.host or host
                if not d.host and "," in host and "/" in d.device_id:
                    # A total combined from several hosts before entries recorded their host
                    # (older files): a CPU package's or DRAM zone's id still names it.
                    on = d.device_id.split("/", 1)[0]
                if d.device_id or dedup_without_id:
                    if not d.device_id:  # named by its index, as the monitor names zones, so
                        d = replace(d, device_id=f"{on}/{prefix}{index}")  # renumbering keeps it
                    key = (on, d.device_id)
                    if key in seen:
                        continue
                    seen.add(key)
                out[len(out)] = replace(d, host=on) if several and not d.host else d
    return out


def combine(
    measurements: Sequence[Measurement],
    name: str | None = None,
    *,
    shared_clock: bool = False,
) -> Measurement:
    """Combine the measurements of the ranks of one job into a job total.

    Energy:

    * GPU energy is summed over ranks; a GPU that several ranks measured (same ``host``
      and ``device_id``) is counted once, with the reading of the first such rank.
    * CPU package and DRAM energy is counted once per host: every rank of a node reads the
      same sockets, so one reading per ``(host, device_id)`` is kept, from the first rank
      of that host that has it.

    Order and keys: the ranks are taken in the order given (``gather`` passes them in rank
    order), grouped by host, hosts in order of their first rank. The combined ``gpu``,
    ``cpu`` and ``dram`` dicts are renumbered ``0..N-1`` in that (host, rank, own index)
    order; each entry keeps its ``device_id`` (GPU UUID, ``<host>/cpu<N>``,
    ``<host>/dram<N>``), which says which physical device it is. Hence
    ``combined.gpu[k].device_id`` maps a combined key back to its device.

    Time: ``start_time`` and ``elapsed_s`` are measured on each host's own clock. With
    ``shared_clock=False`` (the default, right for ``time.monotonic`` whose origin differs
    from node to node), the span from the earliest start to the latest end is taken per
    host and ``elapsed_s`` is the longest of those spans; ``start_time`` is the earliest
    start on the first host's clock. With ``shared_clock=True`` (all hosts share one time
    base), ``elapsed_s`` is the span from the earliest start to the latest end over all.
    A total of several hosts keeps only its longest span: combined again (totals of
    subgroups), its energy is exact but its time is taken as that span on its first host's
    clock, so ``elapsed_s`` can differ from combining the ranks' own measurements at once.

    Args:
        measurements: One measurement per rank (a rank may also contribute several).
        name: Name of the combined window. Default: the common name; if the names differ,
            they are joined with ``+`` and a :class:`UserWarning` is issued.
        shared_clock: Whether ``start_time`` values of different hosts are comparable.

    Returns:
        The job total. Its ``host`` is the host name if there is one host, else the host
        names joined with ``,`` in order.

    Raises:
        ValueError: ``measurements`` is empty.
        TypeError: An item is not a :class:`Measurement`.
    """
    items = _validate(measurements)
    window = _name(items, name)
    hosts = _host_order(items)
    groups = [(h, [m for m in items if m.host == h]) for h in hosts]

    if shared_clock:
        start = min(m.start_time for m in items)
        elapsed = max(m.start_time + m.elapsed_s for m in items) - start
    else:
        spans = []
        for _, members in groups:
            s = min(m.start_time for m in members)
            spans.append(max(m.start_time + m.elapsed_s for m in members) - s)
        start = min(m.start_time for m in groups[0][1])
        elapsed = max(spans)

    cpu = _merge(groups, "cpu", "cpu", dedup_without_id=True)
    dram = _merge(groups, "dram", "dram", dedup_without_id=True)
    return Measurement(
        name=window,
        start_time=start,
        elapsed_s=max(0.0, elapsed),
        gpu=_merge(groups, "gpu", "gpu", dedup_without_id=False),
        cpu=cpu,
        dram=dram,
        host=",".join(hosts),
        missing=_missing(items, cpu, dram),
    )


def _missing(items: Sequence[Measurement], cpu: _Zone, dram: _Zone) -> tuple[str, ...]:
    """The devices the ranks could not read and no other rank measured, each once.

    A CPU package or DRAM zone is named by its id (``<host>/cpu0``), and left out when
    another rank of its host measured it. A GPU, named by each rank's own index, is named
    ``<host>/<position>/gpu<k>``, the position that of its measurement in ``items`` (the rank,
    as :func:`gather` passes them).
    """
    measured = {d.device_id for zone in (cpu, dram) for d in zone.values()}
    out: dict[str, None] = {}
    for i, m in enumerate(items):
        for x in m.missing:
            if "/" in x:  # from a measurement combined already
                if x not in measured:
                    out[x] = None
            elif x.startswith("gpu"):
                out[f"{m.host}/{i}/{x}"] = None
            elif f"{m.host}/{x}" not in measured:
                out[f"{m.host}/{x}"] = None
    return tuple(out)


def per_host(measurements: Sequence[Measurement], name: str | None = None) -> dict[str, Measurement]:
    """Combine the measurements of each host separately.

    Args:
        measurements: One measurement per rank, as for :func:`combine`.
        name: Name of the combined windows (see :func:`combine`).

    Returns:
        ``{host: combined measurement of that host's ranks}``, hosts in order of their first
        rank. Keys within each are renumbered per host, as :func:`combine` does.

    Raises:
        ValueError: ``measurements`` is empty.
        TypeError: An item is not a :class:`Measurement`.
    """
    items = _validate(measurements)
    window = _name(items, name)
    return {h: combine([m for m in items if m.host == h], window) for h in _host_order(items)}


def _dist(group: Any) -> Any | None:
    """``torch.distributed`` if it is initialized, else None (error if a group needs it)."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        if group is not None:
            raise ImportError(
                "a process group was given but torch is not installed; install it with "
                "`pip install torch` (or `pip install joules[torch]`)"
            ) from e
        return None
    if not dist.is_available():
        if group is not None:
            raise RuntimeError("a process group was given but this torch build has no torch.distributed")
        return None
    if not dist.is_initialized():
        return None
    return dist


def collect(measurement: Measurement, group: Any = None, dst: int | None = None) -> list[Measurement] | None:
    """Collect the measurement of every rank of ``group``, in rank order.

    A collective: every rank of the group must call it, with ``dst`` alike.

    Args:
        measurement: This rank's measurement.
        group: ``torch.distributed`` process group. Default: the whole world.
        dst: Global rank that receives the measurements (``gather_object``); default:
            every rank receives them (``all_gather_object``).

    Returns:
        The measurements of all ranks in group-rank order; None on ranks other than
        ``dst`` when ``dst`` is given. ``[measurement]`` when ``torch.distributed`` is not
        initialized (a single process).

    Raises:
        ImportError: ``group`` is given but torch is not installed.
        RuntimeError: ``group`` is given but torch has no ``torch.distributed``.
        ValueError: This rank is not a member of ``group``.
    """
    dist = _dist(group)
    if dist is None:
        return [measurement]
    if dist.get_rank(group) < 0:
        raise ValueError("this rank is not a member of the process group passed to gather()")
    payload = measurement.to_dict()  # plain data: no joules classes unpickled on the far side
    size = dist.get_world_size(group)
    if dst is None:
        received: list[Any] = [None] * size
        dist.all_gather_object(received, payload, group=group)
    else:
        received = [None] * size if dist.get_rank() == dst else None
        dist.gather_object(payload, received, dst=dst, group=group)
        if received is None:
            return None
    return [Measurement.from_dict(d) for d in received]


def gather(
    measurement: Measurement,
    group: Any = None,
    dst: int | None = None,
    *,
    name: str | None = None,
    shared_clock: bool = False,
) -> Measurement | None:
    """Job total of a window measured on every rank: :func:`collect`, then :func:`combine`.

    A collective: every rank of the group must call it, with ``dst`` alike. With the NCCL
    backend, ``torch.cuda.set_device`` must have been called first (torch requires it for
    object collectives).

    Args:
        measurement: This rank's measurement.
        group: ``torch.distributed`` process group. Default: the whole world.
        dst: Global rank that receives the total; default: every rank receives it.
        name: Name of the combined window (see :func:`combine`).
        shared_clock: Whether the hosts' clocks share a time base (see :func:`combine`).

    Returns:
        The combined measurement; None on ranks other than ``dst`` when ``dst`` is given;
        ``measurement`` itself, unchanged, when ``torch.distributed`` is not initialized.

    Raises:
        ImportError: ``group`` is given but torch is not installed.
        RuntimeError: ``group`` is given but torch has no ``torch.distributed``.
        ValueError: This rank is not a member of ``group``.
    """
    if _dist(group) is None:
        return measurement
    items = collect(measurement, group, dst)
    if items is None:
        return None
    return combine(items, name, shared_clock=shared_clock)
