"""Put GPUs back the way they were, however the job that changed them ends.

A power limit or a locked clock outlives the process that set it: a training job that
lowers the limit and then crashes leaves the GPU slow for whoever comes next. A
:class:`RestoreGuard` makes every change of a GPU go through it, remembers what the GPU had
before its first change, and puts that back when the job ends:

- explicitly (:meth:`RestoreGuard.restore`, or leaving its ``with`` block);
- at interpreter exit, including after an uncaught exception (``atexit``);
- on SIGINT, SIGTERM and SIGHUP (a closed terminal or SSH session; not when SIGHUP is
  ignored, as under ``nohup``), when the first change is made in the main thread, or
  :meth:`RestoreGuard.install_signal_handlers` was called from it beforehand; the signal
  then goes on to the handler that was there before.

Several guards may change the same GPU (two components of a job, or two jobs on one
machine). The first change of a GPU takes the original limit from a running guard that
changed it already, when there is one: another guard of this process (whatever its journal
directory), else the journal of another running process in the same directory. A guard that
restores a GPU while such a guard still has it changed leaves the GPU to that guard: the
power limit goes back to the one that guard set last, a clock it locked stays locked (at the
range it locked last, where it is a guard of this process; another process's guard is not
told, and keeps the clock as it was left until its next lock of another range). So
every guard keeps its own setting while it runs, and the last one to restore puts back what
the GPU had before any of them. Restores, recoveries, and the changes they must see are
serialized (within a process, and among processes through a lock file in the journal
directory), so two guards that restore at the same moment do not both leave the GPU to the
other.

SIGKILL (and a machine or driver crash) cannot be caught. For those, each guard keeps a
small journal file, written *before* the device is changed, naming the GPUs, their original
settings and the limit it set last. :func:`recover` (run by every new guard, and by
``joules restore``) puts back what the journals of processes that are gone record, and
deletes the journals; where several name one GPU, the oldest journal's original limit is
applied last, and a GPU that a running guard still has changed is left to it.

Journals live in ``$JOULES_STATE_DIR/restore``, else ``$XDG_STATE_HOME/joules/restore``,
else ``~/.local/state/joules/restore``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import math
import os
import re
import secrets
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from joules.devices.base import GPU
from joules.errors import JoulesError
from joules.filelock import AVAILABLE as _FLOCK
from joules.filelock import exclusive

STATE_ENV = "JOULES_STATE_DIR"
# Format 1. Each GPU's entry: uuid, index, name, power_limit_w (the original, or null),
# sm_clock_locked, and, while the limit is changed, applied_power_limit_w and applied_at (the
# limit set last and when, in seconds since the epoch; absent in journals of older versions,
# which are read as "not known").
JOURNAL_FORMAT = 1

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def default_journal_dir() -> Path:
    """``$JOULES_STATE_DIR/restore``, else ``$XDG_STATE_HOME/joules/restore``, else ``~/.local/state/...``."""
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV]) / "restore"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "joules" / "restore"


def _hostname() -> str:
    return socket.gethostname()


def _journal_host() -> str:
    """The host name as journal file names carry it."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", _hostname()) or "host"


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) from ``/proc/<pid>/stat``, or ``None``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        # Field 2 (the command name) is in parentheses and may hold spaces and ')'.
        fields = text[text.rindex(")") + 2:].split()
        return fields[0], int(fields[19])  # fields 3 and 22
    except (OSError, ValueError, IndexError):
        return None


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (Linux: clock ticks since boot), or ``None`` where unknown.

    Recorded in journals so that a new process that happens to get a dead one's pid is not
    taken for it.
    """
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether process ``pid`` (of this host) still runs, and is the one started at ``start_time``.

    A zombie (exited, not yet reaped) counts as gone. Where it cannot be told, the answer
    is "alive", so that nothing a live process set is undone.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (no process has a pid beyond the C type)
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    except OSError:
        return True
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, started = stat
    if state in ("Z", "X"):
        return False
    return start_time is None or started == start_time


def _write_json_atomic(path: Path, data: object) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _journal_age(data: dict[str, Any], path: Path) -> tuple[float, int]:
    """A key that sorts journals from the oldest to the newest.

    When the journal was created (``created``; older journals only have ``written``, the
    time of their last write, else the file's time), then when its process started.
    """
    when = _number(data.get("created"))
    if when is None:
        try:
            when = datetime.strptime(str(data.get("written")), "%Y-%m-%dT%H:%M:%S%z").timestamp()
        except ValueError:
            try:
                when = path.stat().st_mtime
            except OSError:
                when = 0.0
    start = data.get("process_start_time")
    return when, start if isinstance(start, int) and not isinstance(start, bool) else 0


# -- what the guards of this process and of other running processes hold ------------------------
# The changes each guard of this process has not restored yet, as its journal entries (also
# for guards whose journal cannot be written, or that use another directory), with the age
# key of its journal. _LOCK guards it and serializes, with the lock file of a journal
# directory, the changes, restores and recoveries (see _directory_lock).
_LOCK = threading.RLock()
# Held around every SM clock lock through a guard and around a hand-over's re-lock (the last
# lock taken, never held while waiting for another): a hand-over sees each guard's latest range.
_CLOCK_LOCK = threading.RLock()
_CLOCK_SEQ = itertools.count(1)
_REGISTRY: dict[RestoreGuard, tuple[tuple[float, int], list[dict[str, Any]]]] = {}
# Signals to guards that arrived while this thread was inside a guard's operation, handled at
# its end (handlers run in the main thread only).
_busy = threading.local()
_PENDING_SIGNALS: list[tuple[RestoreGuard, int, FrameType | None, _Handler]] = []


# Every guard of this process, for a forked child to make them its own.
_GUARDS: weakref.WeakSet[RestoreGuard] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's changes (its journals speak for them), nor its locks.

    Its copies of the parent's guards start empty: restoring through them, or a change, must
    not undo the parent's changes or take over (and then delete) the parent's journal.
    """
    global _LOCK, _CLOCK_LOCK
    for guard in list(_GUARDS):
        guard._forked()
    _LOCK = threading.RLock()
    _CLOCK_LOCK = threading.RLock()
    _REGISTRY.clear()
    _PENDING_SIGNALS.clear()
    _busy.depth = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def restore_busy() -> bool:
    """Whether a restore guard's operation is under way in this thread (signals to guards wait for it)."""
    return getattr(_busy, "depth", 0) > 0


@contextlib.contextmanager
def _holding_signals() -> Iterator[None]:
    """Hold back signals to guards that arrive in this thread until the outermost such block ends.

    Handling one in the middle would restore a GPU while a change is half made, or take a
    lock that this thread holds.
    """
    _busy.depth = getattr(_busy, "depth", 0) + 1
    try:
        yield
    finally:  # also when the operation failed
        _busy.depth -= 1
        if _busy.depth == 0 and threading.current_thread() is threading.main_thread():
            pending = _PENDING_SIGNALS[:]
            _PENDING_SIGNALS.clear()
            raised: BaseException | None = None
            for guard, signum, frame, prev in pending:
                # Each one is handled, even when an earlier one's handler raised (Ctrl-C's
                # KeyboardInterrupt): a SIGTERM held with it still reaches its handler.
                try:
                    guard._on_signal(signum, frame, prev)
                except BaseException as e:  # noqa: BLE001 - raised once all were handled
                    raised = raised or e
            if raised is not None:
                raise raised


@contextlib.contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """Serialize changes, restores and recoveries of GPUs (several ranks of a job start at once).

    Within this process for every directory (its guards see each other whatever their
    directories), and among the processes of this host through a lock file in ``directory``.
    """
    with _holding_signals(), _LOCK:
        f = None
        if _FLOCK:
            with contextlib.suppress(OSError):
                directory.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                f = open(directory / ".recover.lock", "a")
        if f is None:
            yield
            return
        with f, exclusive(f):
            yield


@dataclass(frozen=True)
class _Holder:
    """A change of one GPU that a running guard (not the one asking) has not restored yet."""

    who: str
    age: tuple[float, int]
    original_power_limit_w: float | None
    applied_power_limit_w: float | None
    applied_at: float
    sm_clock_locked: bool
    guard: RestoreGuard | None = None  # the holder, where it is a guard of this process


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _holder(who: str, age: tuple[float, int], entry: dict[str, Any],
            guard: RestoreGuard | None = None) -> _Holder:
    at = _number(entry.get("applied_at"))
    return _Holder(who, age, _number(entry.get("power_limit_w")), _number(entry.get("applied_power_limit_w")),
                   -math.inf if at is None else at, bool(entry.get("sm_clock_locked")), guard)


def _live_holders(directory: Path, uuid: str, guard: RestoreGuard | None = None) -> list[_Holder]:
    """What running guards other than ``guard`` hold changed on GPU ``uuid``.

    The other guards of this process, whatever their journal directories, and the journals in
    ``directory`` of the other running processes of this host.
    """
    with _LOCK:
        mine = [(g, held) for g, held in list(_REGISTRY.items()) if g is not guard]
    found = [_holder("another joules guard in this process", age, e, g)
             for g, (age, entries) in mine for e in entries if e["uuid"] == uuid]
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError:
        return found
    host, me = _hostname(), os.getpid()
    mine_prefix = f"{_journal_host()}-{me}-"  # this process's journals: registered above
    for path in paths:
        if path.name.startswith(mine_prefix):
            continue
        try:
            data = json.loads(path.read_text())
            j_host, pid, start, entries = _parse_journal(data)
        except (OSError, ValueError):
            continue
        if j_host != host or pid == me or not process_alive(pid, start):
            continue  # this process's own guards are those registered above
        found += [_holder(f"joules process {pid}", _journal_age(data, path), e)
                  for e in entries if e["uuid"] == uuid]
    return found


def _power_heir(holders: list[_Holder]) -> _Holder | None:
    """Of the running guards that hold a GPU's power limit changed, the one that set it last."""
    changed = [h for h in holders if h.original_power_limit_w is not None]
    return max(changed, key=lambda h: h.applied_at) if changed else None


def _handed_over(heir: _Holder) -> str:
    """What is said when a GPU's power limit is left to ``heir``."""
    kept = ("as it is" if heir.applied_power_limit_w is None
            else f"at {heir.applied_power_limit_w:g} W, the limit it set")
    return (f"power limit left {kept} for {heir.who}, which changed it too and still runs "
            f"(it puts back {heir.original_power_limit_w:g} W)")


@dataclass
class _PutBack:
    """What :func:`_put_back` did to one GPU.

    Attributes:
        done: What was put back or left to another guard, a phrase each.
        handed_over: Of ``done``, what was left to another running guard.
        failed: What could not be done, a phrase each.
        clock_done: The SM clock needs nothing more (reset, or left to another guard).
        power_done: The power limit needs nothing more.
    """

    done: list[str] = field(default_factory=list)
    handed_over: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    clock_done: bool = False
    power_done: bool = False


def _lock_for_the_latest(gpu: GPU, holders: list[_Holder], out: _PutBack) -> bool:
    """Hand ``gpu``'s clock to the guard of this process that locked it last; whether one did.

    Guards of this process say which range they locked, and when: the clock goes back to the
    latest one's (it was at the leaving guard's range), and every other one, which would take
    the clock for its own range, locks again at its next change.
    """
    with _CLOCK_LOCK:
        mine = [(h, e) for h in holders if h.sm_clock_locked and h.guard is not None
                and (e := h.guard._entries.get(gpu.control_uuid)) is not None
                and e.sm_clock_range is not None]
        if not mine:
            return False
        holder, entry = max(mine, key=lambda he: he[1].sm_clock_seq)
        for _, e in mine:
            if e is not entry:
                e.sm_clock_range = None
        mhz = entry.sm_clock_range
        assert mhz is not None
        try:
            gpu.lock_sm_clock(*mhz)
        except Exception as e:  # noqa: BLE001 - reported
            out.failed.append(f"could not lock the SM clock at {mhz[0]:g}-{mhz[1]:g} MHz "
                              f"for {holder.who}: {e}")
            entry.sm_clock_range = None  # (that guard locks it again at its next change)
        else:
            message = (f"SM clock locked at {mhz[0]:g}-{mhz[1]:g} MHz for {holder.who}, which "
                       "locked it there and still runs")
            out.done.append(message)
            out.handed_over.append(message)
        out.clock_done = True
        return True


def _put_back(gpu: GPU, holders: list[_Holder], sm_clock_locked: bool,
              original_power_limit_w: float | None) -> _PutBack:
    """Undo one guard's changes of ``gpu``; what another running guard still holds is left to it.

    A clock another holder locked too stays locked; the power limit goes to the one the
    holder that changed it last set (:func:`_power_heir`), else back to the original. Used
    both by a guard restoring and by the recovery of a dead process's journal.
    """
    out = _PutBack()
    if sm_clock_locked and not _lock_for_the_latest(gpu, holders, out):
        other = next((h for h in holders if h.sm_clock_locked), None)
        if other is not None:  # another process's guard: its range is not known here
            message = f"SM clock left locked for {other.who}, which locked it too and still runs"
            out.done.append(message)
            out.handed_over.append(message)
            out.clock_done = True
        else:
            try:
                gpu.reset_sm_clock()
                out.done.append("SM clock unlocked")
                out.clock_done = True
            except Exception as e:  # noqa: BLE001 - reported; the other changes go on
                out.failed.append(f"could not reset the SM clock: {e}")
    if original_power_limit_w is None:
        return out
    heir = _power_heir(holders)
    if heir is not None:
        try:
            if heir.applied_power_limit_w is not None:
                gpu.set_power_limit_w(heir.applied_power_limit_w)
        except Exception as e:  # noqa: BLE001 - reported
            out.failed.append(f"could not set the power limit {heir.applied_power_limit_w:g} W: {e}")
        else:
            message = _handed_over(heir)
            out.done.append(message)
            out.handed_over.append(message)
            out.power_done = True
        return out
    try:
        before: float | None = gpu.power_limit_w()
    except Exception:  # noqa: BLE001 - only for the message
        before = None
    try:
        gpu.set_power_limit_w(original_power_limit_w)
    except Exception as e:  # noqa: BLE001 - reported
        out.failed.append(f"could not restore the power limit {original_power_limit_w:g} W: {e}")
    else:
        out.done.append(f"power limit {before:g} W -> {original_power_limit_w:g} W" if before is not None
                        else f"power limit set to {original_power_limit_w:g} W")
        out.power_done = True
    return out


@dataclass(frozen=True)
class Change:
    """What a :class:`RestoreGuard` changed on one GPU, and what it will put back.

    Attributes:
        uuid: The GPU's UUID.
        index: The GPU's index in this process.
        name: The GPU's model name.
        original_power_limit_w: The limit the GPU had before the guard first changed it (or
            before a running guard that had changed it already did), or ``None`` when the
            guard has not changed the limit.
        sm_clock_locked: Whether the guard locked the SM clock (restore resets it, unless
            another running guard has it locked too).

    """

    uuid: str
    index: int
    name: str
    original_power_limit_w: float | None
    sm_clock_locked: bool


class _Entry:
    """The mutable record of one changed GPU."""

    def __init__(self, gpu: GPU) -> None:
        self.gpu = gpu
        self.original_power_limit_w: float | None = None
        self.applied_power_limit_w: float | None = None  # the limit set last, and when
        self.applied_at: float | None = None
        self.sm_clock_locked = False
        self.sm_clock_range: tuple[float, float] | None = None  # the range this guard locked last
        self.sm_clock_seq = 0  # when (in the order of every guard's locks in this process)

    def empty(self) -> bool:
        return self.original_power_limit_w is None and not self.sm_clock_locked

    def journal(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "uuid": self.gpu.control_uuid,  # the physical GPU of a MIG instance
            "index": self.gpu.index,
            "name": self.gpu.name,
            "power_limit_w": self.original_power_limit_w,
            "sm_clock_locked": self.sm_clock_locked,
        }
        if self.applied_power_limit_w is not None:
            data["applied_power_limit_w"] = self.applied_power_limit_w
            data["applied_at"] = self.applied_at
        return data


class RestoreGuard:
    """Records the state GPUs had before joules first changed them, and puts it back.

    Change GPUs through :meth:`set_power_limit_w` and :meth:`lock_sm_clock`. The first time
    a GPU is changed, its current power limit (the one it had before, which need not be
    the default) is remembered and written to a journal file before the device is changed;
    an ``atexit`` hook and SIGINT/SIGTERM/SIGHUP handlers are installed. :meth:`restore` (also on
    leaving a ``with`` block, at exit and on those signals) puts every changed GPU back,
    removes the journal and uninstalls the hooks. After a signal, the handler that was
    installed before runs: Python's default SIGINT handler raises ``KeyboardInterrupt``, and
    a default SIGTERM is re-sent so the process still dies "killed by SIGTERM". Several
    guards in one process chain the same way.

    Signal handlers can only be installed from the main thread. When the changes will be
    made from another thread, call :meth:`install_signal_handlers` from the main thread
    first. Otherwise (or with ``handle_signals=False``) none are installed, and
    :meth:`restore`, the ``with`` block, an exception reaching the top and interpreter exit
    still restore (a signal with Python's default handling then skips them). The hooks act
    only in the process that made the changes, not in children forked from it. Thread-safe.

    The original limit of a GPU is the one it has at the guard's first change, unless
    another running guard has that GPU's limit changed: another guard of this process
    (whatever its journal directory), or another running process of this host whose journal
    is in the same directory. Then it is that guard's original (the oldest one's). Restoring
    a GPU that such a guard still has changed leaves it to that guard: the limit goes back to
    the one that guard set last (of several, the latest), and a clock it has locked too stays
    locked (at that guard's range, for a guard of this process); the hand-over is logged at
    info level. So when several guards change one GPU,
    each keeps its setting while it runs, and whichever restores last puts back what the GPU
    had before all of them.

    Args:
        gpus: The GPUs this guard may change; stale journals are recovered for these.
        journal_dir: Where journals live (default: :func:`default_journal_dir`).
        handle_signals: Restore on SIGINT, SIGTERM and SIGHUP too (main thread only).
        recover_stale: First put back what journals of processes that are gone record for
            these GPUs (see :func:`recover`); what was done is in :attr:`recovered`.

    Attributes:
        recovered: What the initial recovery restored, kept or could not read, one line
            each (journals of running processes and other hosts are not listed).

    """

    def __init__(
        self,
        gpus: Sequence[GPU],
        journal_dir: str | Path | None = None,
        handle_signals: bool = True,
        recover_stale: bool = True,
    ) -> None:
        self.gpus = list(gpus)
        self.journal_dir = Path(journal_dir) if journal_dir is not None else default_journal_dir()
        self.handle_signals = handle_signals
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._id = secrets.token_hex(4)
        self._owner_pid: int | None = None
        self._journal: Path | None = None
        self._created: float | None = None
        self._start: int | None = None  # this process's start time, for its journal
        self._journal_warned = False
        self._atexit_registered = False
        self._prev_handlers: dict[int, _Handler] = {}
        self._handlers_held = 0
        self.recovered: list[str] = []
        self.recover_stale = recover_stale
        _GUARDS.add(self)
        if recover_stale:
            for line in recover_report(self.gpus, self.journal_dir):
                if line.kind in ("live", "other-host"):
                    logger.debug("joules: %s", line.message)
                else:
                    self.recovered.append(line.message)
                    logger.warning("joules: %s", line.message)

    # -- public -----------------------------------------------------------------------------
    @property
    def changed(self) -> list[Change]:
        """The GPUs changed through this guard and not yet restored, in order of first change."""
        with self._lock:
            return [
                Change(e.gpu.uuid, e.gpu.index, e.gpu.name, e.original_power_limit_w, e.sm_clock_locked)
                for e in self._entries.values()
            ]

    def holds_sm_clock(self, gpu: GPU, mhz_range: tuple[float, float] | None = None) -> bool:
        """Whether this guard has ``gpu``'s SM clock locked (to ``mhz_range``, if given), not reset.

        No device call: lock-free, one dictionary lookup, cheap enough to check before every
        computation. The range is the one locked last through this guard (by whichever of
        the components sharing it).
        """
        entry = self._entries.get(gpu.control_uuid)
        if entry is None or not entry.sm_clock_locked:
            return False
        return mhz_range is None or entry.sm_clock_range == (float(mhz_range[0]), float(mhz_range[1]))

    @property
    def journal_path(self) -> Path | None:
        """The journal file while there is something to restore, else ``None``."""
        with self._lock:
            return self._journal

    def install_signal_handlers(self) -> bool:
        """Install the SIGINT/SIGTERM/SIGHUP handlers now, before any change, and keep them.

        Call it from the main thread when the changes will be made from other threads (which
        cannot install signal handlers). The handlers then stay while nothing is changed
        (passing signals on), until as many calls of :meth:`uninstall_signal_handlers`.

        Returns:
            Whether the handlers are in place: ``False`` with ``handle_signals=False`` or
            outside the main thread, where nothing is done.
        """
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return False
        with self._critical():
            if self._owner_pid is None:
                self._owner_pid = os.getpid()
            self._handlers_held += 1
            self._install_signal_handlers()
            return bool(self._prev_handlers)

    def uninstall_signal_handlers(self) -> None:
        """Undo one :meth:`install_signal_handlers`; the handlers go once nothing is left to restore."""
        with self._critical():
            self._handlers_held = max(0, self._handlers_held - 1)
            if not self._entries:
                self._unregister()

    def set_power_limit_w(self, gpu: GPU, watts: float) -> None:
        """Set ``gpu``'s power limit, remembering (and journaling) the limit it had first.

        The limit it had first is its current one, or the original of a running guard that
        changed it already (see the class description). The journal also records ``watts``
        as the limit set last, for a guard that restores while this one runs.

        Raises:
            ValueError: ``watts`` is outside the GPU's range (nothing is changed).
            DevicePermissionError: No permission (nothing is changed or left in the journal).
        """
        gpu.check_power_limit(watts)
        with self._critical(), _directory_lock(self.journal_dir):
            entry = self._entries.get(gpu.control_uuid)
            recorded = entry is None or entry.original_power_limit_w is None
            if recorded:
                if self.recover_stale:
                    self._recover_gpu(gpu)  # a job killed since this guard was made
                original = self._original_power_limit_w(gpu)
                if entry is None:
                    entry = self._entries[gpu.control_uuid] = _Entry(gpu)
                entry.original_power_limit_w = original
            assert entry is not None
            before = entry.applied_power_limit_w, entry.applied_at
            entry.applied_power_limit_w, entry.applied_at = float(watts), time.time()
            self._write_journal()
            self._register()  # also again after a restore that left something to restore
            try:
                gpu.set_power_limit_w(watts)
            except (JoulesError, ValueError):  # the device refused: it is unchanged
                if recorded:
                    entry.original_power_limit_w = None
                entry.applied_power_limit_w, entry.applied_at = before
                self._forget(entry)
                raise

    def lock_sm_clock(self, gpu: GPU, min_mhz: float, max_mhz: float) -> None:
        """Lock ``gpu``'s SM clock to [min_mhz, max_mhz]; restoring resets it.

        Raises:
            ValueError: The range is not supported (nothing is changed).
            DevicePermissionError: No permission (nothing is changed or left in the journal).
        """
        with self._critical():
            entry = self._entries.get(gpu.control_uuid)
            recorded = entry is None or not entry.sm_clock_locked
            # Only a first lock waits for the journal directory: one that restores meanwhile
            # must see it. Later locks (a pipeline's, often) do not.
            with _directory_lock(self.journal_dir) if recorded else contextlib.nullcontext():
                if recorded:
                    if entry is None:
                        entry = self._entries[gpu.control_uuid] = _Entry(gpu)
                    entry.sm_clock_locked = True
                    self._write_journal()
                self._register()
                assert entry is not None
                with _CLOCK_LOCK:
                    try:
                        gpu.lock_sm_clock(min_mhz, max_mhz)
                    except (JoulesError, ValueError):
                        if recorded:
                            entry.sm_clock_locked = False
                            self._forget(entry)
                        raise
                    entry.sm_clock_range = (float(min_mhz), float(max_mhz))
                    entry.sm_clock_seq = next(_CLOCK_SEQ)

    def restore(self, gpu: GPU | None = None) -> list[str]:
        """Put every changed GPU back (or only ``gpu``); idempotent.

        Resets the clocks the guard locked and sets the original power limits; a GPU that
        another running guard still has changed is left to it (see the class description:
        its limit goes back to the one that guard set last, a clock it locked too stays
        locked). An error on one GPU does not stop the others: each is logged as a warning and returned, and
        what could not be restored stays in the journal (for ``joules restore`` later) and
        in the guard (a later call tries again; the ``atexit`` hook and signal handlers stay
        for it). Once nothing is left, the journal file is removed and the ``atexit`` hook
        and signal handlers are uninstalled (the signal handlers stay while
        :meth:`install_signal_handlers` holds them). Nothing is raised.

        Args:
            gpu: Put back this GPU only, leaving the others the guard changed as they are (a
                guard shared by several stages, one of which is done with its GPU).

        Returns:
            One line per error; empty when everything was restored.
        """
        errors: list[str] = []
        with self._critical():
            # Each guard's journal (and registration) is updated before another one restores.
            with _directory_lock(self.journal_dir) if self._entries else contextlib.nullcontext():
                for uuid, entry in list(self._entries.items()):
                    if gpu is not None and uuid != gpu.control_uuid:
                        continue
                    errors += self._restore_entry(entry)
                    if entry.empty():
                        del self._entries[uuid]
                self._write_journal()
            if not self._entries:
                self._unregister()
        for line in errors:
            logger.warning("joules: %s", line)
        return errors

    def __enter__(self) -> RestoreGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    # -- internals --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _critical(self) -> Iterator[None]:
        """Hold the lock; a signal arriving in this thread meanwhile is handled on the way out.

        Handling it in the middle would restore a GPU while its change is half made.
        """
        with _holding_signals(), self._lock:
            yield

    def _restore_entry(self, entry: _Entry) -> list[str]:
        """Put one GPU back, or leave it to a running guard that has it changed too; the errors."""
        gpu = entry.gpu
        done = _put_back(gpu, _live_holders(self.journal_dir, gpu.control_uuid, self), entry.sm_clock_locked,
                         entry.original_power_limit_w)
        for message in done.handed_over:
            logger.info("joules: GPU %d (%s): %s", gpu.index, gpu.uuid, message)
        if done.clock_done:
            entry.sm_clock_locked = False
            entry.sm_clock_range = None
        if done.power_done:
            entry.original_power_limit_w = entry.applied_power_limit_w = entry.applied_at = None
        return [f"GPU {gpu.index} ({gpu.uuid}): {e}" for e in done.failed]

    def _original_power_limit_w(self, gpu: GPU) -> float:
        """The limit to put back on ``gpu``: its current one, or a running guard's original.

        The current limit is read first: a guard journals before it changes a GPU, so a
        change seen here already has its journal.
        """
        current = gpu.power_limit_w()
        changed = [h for h in _live_holders(self.journal_dir, gpu.control_uuid, self)
                   if h.original_power_limit_w is not None]
        if not changed:
            return current
        oldest = min(changed, key=lambda h: h.age)
        original = oldest.original_power_limit_w
        assert original is not None
        if original != current:
            logger.info("joules: GPU %d (%s) is at %g W, changed by %s, which still runs and "
                        "records %g W before; restoring puts back %g W", gpu.index, gpu.uuid,
                        current, oldest.who, original, original)
        return original

    def _forked(self) -> None:
        """In a forked child: forget the parent's changes, journal and ownership."""
        self._lock = threading.RLock()
        self._entries = {}
        self._journal = None
        self._created = self._start = None
        self._owner_pid = None

    def _recover_gpu(self, gpu: GPU) -> None:
        """Put back what processes that are gone left changed on ``gpu`` and the guard's GPUs.

        The directory lock is held.

        A job killed after this guard was made (its journal ignored then, as it ran) must not
        have its lowered limit taken for the GPU's original.
        """
        for line in _recover_in(self.journal_dir, [*self.gpus, gpu]):
            if line.kind in ("restored", "failed"):  # (the rest was said when the guard was made)
                self.recovered.append(line.message)
                logger.warning("joules: %s", line.message)

    def _forget(self, entry: _Entry) -> None:
        """Drop an entry with nothing left to restore, and the journal and hooks if none is left."""
        if entry.empty():
            self._entries.pop(entry.gpu.control_uuid, None)
        self._write_journal()
        if not self._entries:
            self._unregister()

    def _write_journal(self) -> None:
        """Write the journal of what is left to restore, or remove it when nothing is.

        The other guards of this process see it at once (through the registry), whether or
        not the file can be written.
        """
        if self._entries and self._journal is None:
            self._journal = self.journal_dir / f"{_journal_host()}-{os.getpid()}-{self._id}.json"
            self._created = time.time()
            self._start = process_start_time(os.getpid())
        entries = [e.journal() for e in self._entries.values()]
        with _LOCK:
            if entries:
                _REGISTRY[self] = ((self._created or 0.0, self._start or 0), entries)
            else:
                _REGISTRY.pop(self, None)
        try:
            if not entries:
                if self._journal is not None:
                    self._journal.unlink(missing_ok=True)
                    self._journal = None
                return
            assert self._journal is not None
            _write_json_atomic(self._journal, {
                "format": JOURNAL_FORMAT,
                "host": _hostname(),
                "pid": os.getpid(),
                "process_start_time": self._start,
                "created": self._created,
                "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "gpus": entries,
            })
        except OSError as e:
            if not self._journal_warned:
                self._journal_warned = True
                logger.warning(
                    "joules: cannot write the restore journal in %s (%s); GPUs are still restored "
                    "on exit and on SIGINT/SIGTERM/SIGHUP, but not after SIGKILL, and other processes "
                    "that change these GPUs cannot see this one's changes (one may take a limit "
                    "set here for the GPU's own, and put it back). Set %s to a writable directory "
                    "to fix this.", self.journal_dir, e, STATE_ENV,
                )

    def _register(self) -> None:
        if self._owner_pid is None:
            self._owner_pid = os.getpid()
        if not self._atexit_registered:
            atexit.register(self._at_exit)
            self._atexit_registered = True
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        self._install_signal_handlers()

    def _install_signal_handlers(self) -> None:
        for signum in _SIGNALS:
            if signum in self._prev_handlers:
                # Installed and not put back: on top, or under a later guard's handler that
                # chains to ours. Installing again could make a loop.
                continue
            try:
                prev = signal.getsignal(signum)
                if signum == getattr(signal, "SIGHUP", None) and prev == signal.SIG_IGN:
                    continue  # (under nohup a hang-up ends nothing: the GPUs stay as they are)
                signal.signal(signum, self._handle_signal)
            except (ValueError, OSError):
                continue
            self._prev_handlers[signum] = prev

    def _unregister(self) -> None:
        if self._atexit_registered:
            atexit.unregister(self._at_exit)
            self._atexit_registered = False
        if self._handlers_held:
            return
        for signum, prev in list(self._prev_handlers.items()):
            try:
                if signal.getsignal(signum) == self._handle_signal:
                    signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
                    del self._prev_handlers[signum]
                # Otherwise a later handler chains to ours: ours stays, passing signals on.
            except (ValueError, OSError):  # not the main thread: ours stays, passing signals on
                pass

    def _at_exit(self) -> None:
        if os.getpid() == self._owner_pid:
            self.restore()

    def _handle_signal(self, signum: int, frame: FrameType | None) -> None:
        # The handler to pass the signal on to is taken now: a restore in progress (whose
        # end handles a deferred signal) uninstalls ours and forgets it.
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        if getattr(_busy, "depth", 0):  # a guard's operation is under way in this thread
            _PENDING_SIGNALS.append((self, signum, frame, prev))
            return
        self._on_signal(signum, frame, prev)

    def _on_signal(self, signum: int, frame: FrameType | None, prev: _Handler) -> None:
        if os.getpid() == self._owner_pid:
            self.restore()
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:  # SIG_DFL, or a handler installed outside Python
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


# -- recovery of what processes that are gone left ----------------------------------------------
@dataclass(frozen=True)
class RecoveryLine:
    """One thing :func:`recover_report` did or found.

    Attributes:
        kind: ``restored`` (a GPU was put back), ``failed`` (putting it back failed; the
            journal keeps it), ``kept`` (the GPU is not among those given; the journal keeps
            it), ``live`` (the journal's process still runs), ``other-host`` (written on
            another host), ``corrupt`` (unreadable journal, left as is).
        message: The human-readable line.
        journal: The journal file.

    """

    kind: str
    message: str
    journal: str

    @property
    def ok(self) -> bool:
        """Whether nothing here needs a person's attention."""
        return self.kind not in ("failed", "corrupt")


def _parse_journal(data: object) -> tuple[str, int, int | None, list[dict[str, Any]]]:
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    host, pid, gpus = data.get("host"), data.get("pid"), data.get("gpus")
    start = data.get("process_start_time")
    if not isinstance(host, str) or not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
        raise ValueError("no valid host and pid")
    if start is not None and not isinstance(start, int):
        raise ValueError("bad process_start_time")
    if not isinstance(gpus, list):
        raise ValueError("no GPU list")
    for g in gpus:
        if not isinstance(g, dict) or not isinstance(g.get("uuid"), str):
            raise ValueError("a GPU entry without a uuid")
        limit = g.get("power_limit_w")
        if limit is not None and (not isinstance(limit, int | float) or isinstance(limit, bool)):
            raise ValueError(f"bad power_limit_w {limit!r}")
    return host, pid, start, gpus


def _recover_journal(path: Path, by_uuid: dict[str, GPU], host: str) -> list[RecoveryLine]:
    def line(kind: str, message: str) -> RecoveryLine:
        return RecoveryLine(kind, message, str(path))

    try:
        data = json.loads(path.read_text())
        j_host, pid, start, entries = _parse_journal(data)
    except FileNotFoundError:
        return []  # removed meanwhile
    except (OSError, ValueError) as e:
        return [line("corrupt", f"{path}: unreadable restore journal, left as is ({e})")]
    if j_host != host:
        return [line("other-host", f"{path.name}: written on host {j_host}, not this one; left alone")]
    if process_alive(pid, start):
        return [line("live", f"{path.name}: process {pid} still runs; left alone")]

    lines: list[RecoveryLine] = []
    remaining: list[dict[str, Any]] = []
    for entry in entries:
        gpu = by_uuid.get(entry["uuid"])
        label = f"GPU {entry.get('index', '?')} ({entry.get('name', '?')}, {entry['uuid']})"
        if gpu is None:
            remaining.append(entry)
            lines.append(line("kept", f"{label}: left changed by process {pid}, which is gone, but not "
                                      f"visible here; kept in {path.name}"))
            continue
        label = f"GPU {gpu.index} ({gpu.name}, {gpu.uuid})"
        left = dict(entry)
        original = _number(entry.get("power_limit_w"))
        result = _put_back(gpu, _live_holders(path.parent, gpu.control_uuid),
                           bool(entry.get("sm_clock_locked")), original)
        done, failed = result.done, result.failed
        if result.clock_done:
            left["sm_clock_locked"] = False
        if result.power_done:
            left["power_limit_w"] = None
        if done:
            lines.append(line("restored", f"{label}: {', '.join(done)} (left by process {pid}, now gone)"))
        if failed:
            lines.append(line("failed", f"{label}: {'; '.join(failed)}; kept in {path.name}"))
            remaining.append(left)
        elif not done:
            lines.append(line("restored", f"{label}: nothing left to restore (process {pid} is gone)"))
    try:
        if remaining:
            if remaining != entries:
                _write_json_atomic(path, {**data, "gpus": remaining})
        else:
            path.unlink(missing_ok=True)
    except OSError as e:
        lines.append(line("failed", f"{path}: could not update the journal: {e}"))
    return lines


def _path_age(path: Path) -> tuple[float, int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return math.inf, 0  # unreadable: reported whatever its place
    return _journal_age(data, path) if isinstance(data, dict) else (math.inf, 0)


def recover_report(gpus: Sequence[GPU], journal_dir: str | Path | None = None) -> list[RecoveryLine]:
    """Like :func:`recover`, with each line's kind (see :class:`RecoveryLine`)."""
    directory = Path(journal_dir) if journal_dir is not None else default_journal_dir()
    if not directory.is_dir():
        return []
    with _directory_lock(directory):
        return _recover_in(directory, gpus)


def _recover_in(directory: Path, gpus: Sequence[GPU]) -> list[RecoveryLine]:
    """:func:`recover_report`'s work, the directory lock held."""
    # Journals name the physical GPU (control_uuid); older ones a MIG instance's own UUID.
    by_uuid = {g.uuid: g for g in gpus}
    for g in gpus:
        by_uuid.setdefault(g.control_uuid, g)
    host = _hostname()
    lines: list[RecoveryLine] = []
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError:
        return lines
    # The newest first: where several journals name one GPU, the oldest one's original (the
    # limit it had before any of those processes changed it) is applied last.
    for path in sorted(paths, key=_path_age, reverse=True):
        lines += _recover_journal(path, by_uuid, host)
    return lines


def recover(gpus: Sequence[GPU], journal_dir: str | Path | None = None) -> list[str]:
    """Put back what processes that are gone left changed on ``gpus``, from their journals.

    For each journal written on this host by a process that no longer runs (its pid is
    gone, a zombie, or now belongs to a process started at another time), the GPUs among
    ``gpus`` it names (matched by UUID) get their clocks reset and their original power
    limits back; journals are handled from the newest to the oldest, so where several name
    one GPU, the oldest one's original limit is the one it keeps. A GPU that a running guard
    still has changed (another process's journal in ``journal_dir``, or a guard of this
    process) is left to it instead: its clock stays locked if that guard locked it, and its
    limit goes back to the one that guard set last. A journal is deleted once
    every GPU in it was handled; GPUs not among ``gpus`` (another container, other visible
    devices) stay in it. Journals of running processes and of other hosts are left alone;
    unreadable ones are reported and kept.

    Args:
        gpus: The GPUs that may be restored.
        journal_dir: Where journals live (default: :func:`default_journal_dir`).

    Returns:
        Human-readable lines of what was done and found; empty when there were no journals.
    """
    return [line.message for line in recover_report(gpus, journal_dir)]
