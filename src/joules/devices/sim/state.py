"""Simulated GPU settings that outlive a process (``JOULES_SIM_STATE=path``).

Real GPUs keep their power limit and locked clocks after the process that set them exits;
by default a simulated GPU forgets them. With a state file, each :class:`SimGPU` starts
from the power limit and SM clock lock recorded there and records every change, so tests
can check what a crashed or killed process leaves behind, and that a later process puts it
back.

The file is JSON: ``{"gpus": {"<index>": {"uuid": ..., "name": ..., "power_limit_w": ...,
"sm_clock_lock_mhz": [min, max] or null}}}``. Each write holds an exclusive ``flock`` on
the sidecar ``<path>.lock``, re-reads the file, updates only the settings its GPU changed
and replaces the file atomically, so several processes may share one state file. A GPU
takes up another process's changes when its settings are next read or changed, as a real
GPU shows every process the one setting it has.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from joules.devices.sim.gpu import SimGPU
from joules.filelock import exclusive

FORMAT = 1
_SETTINGS = ("power_limit_w", "sm_clock_lock_mhz")


class SimStateFile:
    """A JSON file holding the power limit and SM clock lock of simulated GPUs.

    Args:
        path: The state file; it and its directory are created on the first change.

    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._versions: dict[int, tuple[int, int, int] | None] = {}  # the file each GPU last saw
        self._known: dict[str, dict[str, Any]] = {}  # each GPU's settings as the file had them

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size  # a write replaces the file: a new inode

    @staticmethod
    def _settings(gpu: SimGPU) -> dict[str, Any]:
        with gpu._lock:  # (unlocked reads: no refresh from inside a refresh)
            lock = gpu._sm_lock
            return {"power_limit_w": gpu._epochs[-1].limit_w,
                    "sm_clock_lock_mhz": list(lock) if lock is not None else None}

    def refresh(self, gpu: SimGPU) -> None:
        """Take up the settings another process wrote for ``gpu`` since this one last looked."""
        version = self._stat()
        if version is None or version == self._versions.get(gpu.index):
            return
        self._versions[gpu.index] = version
        entry = self.load().get(str(gpu.index))
        if entry is None or entry.get("uuid") != gpu.uuid:
            return
        self._known[str(gpu.index)] = {k: entry.get(k) for k in _SETTINGS}
        # The file has every process's changes: it is the GPU's setting (a malformed lock aside).
        lock = _lock(entry) if entry.get("sm_clock_lock_mhz") is None or _lock(entry) else gpu._sm_lock
        gpu.sync_control_state(_limit(entry), lock)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as lock, exclusive(lock):
            yield

    def load(self) -> dict[str, dict[str, Any]]:
        """The recorded GPUs by index (as a string); empty when the file is missing or unreadable."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        gpus = data.get("gpus") if isinstance(data, dict) else None
        return {k: v for k, v in gpus.items() if isinstance(v, dict)} if isinstance(gpus, dict) else {}

    def save(self, gpu: SimGPU) -> None:
        """Record what ``gpu`` changed (power limit, SM clock lock), keeping the rest of the file."""
        now = self._settings(gpu)
        known = self._known.setdefault(str(gpu.index), {})
        with self._locked():
            gpus = self.load()
            old = gpus.get(str(gpu.index))
            entry = dict(old) if old is not None and old.get("uuid") == gpu.uuid else {}
            entry.update(uuid=gpu.uuid, name=gpu.name)
            for key, value in now.items():
                # (a setting this GPU just set is its, even where it set the value it last saw)
                if key not in entry or value != known.get(key) or key == gpu.changed_setting:
                    entry[key] = value
            known.update((k, entry[k]) for k in now)
            # What another process changed since this one last looked is this GPU's setting too
            # (the version written below is taken as seen: a refresh would not take it up).
            others = {k: entry[k] for k in now if entry[k] != now[k]}
            if others:
                limit = _limit(entry) if "power_limit_w" in others else None
                lock = _lock(entry) if "sm_clock_lock_mhz" in others else gpu._sm_lock
                gpu.sync_control_state(limit, lock)
            gpus[str(gpu.index)] = entry
            text = json.dumps({"format": FORMAT, "gpus": dict(sorted(gpus.items()))}, indent=2)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text + "\n")
                os.replace(tmp, self.path)
                self._versions[gpu.index] = self._stat()
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

    def attach(self, gpus: Sequence[SimGPU]) -> None:
        """Start each GPU from its recorded settings (same index and UUID), and keep it in step.

        Its changes are recorded, and other processes' changes taken up.
        """
        version = self._stat()
        recorded = self.load()
        for gpu in gpus:
            entry = recorded.get(str(gpu.index))
            if entry is not None and entry.get("uuid") == gpu.uuid:
                gpu.load_control_state(_limit(entry), _lock(entry))  # a malformed entry is ignored
                self._known[str(gpu.index)] = {k: entry.get(k) for k in _SETTINGS}
            else:  # none recorded: the GPU's own settings are what this process saw
                self._known[str(gpu.index)] = self._settings(gpu)
            self._versions[gpu.index] = version
            gpu.on_change = self.save
            gpu.on_read = self.refresh


def _limit(entry: dict[str, Any]) -> float | None:
    limit = entry.get("power_limit_w")
    if not isinstance(limit, int | float) or isinstance(limit, bool):
        return None
    try:
        return float(limit)
    except OverflowError:  # (an integer too large for a float: malformed, ignored)
        return None


def _lock(entry: dict[str, Any]) -> tuple[float, float] | None:
    lock = entry.get("sm_clock_lock_mhz")
    valid = (isinstance(lock, list) and len(lock) == 2
             and all(isinstance(x, int | float) and not isinstance(x, bool) for x in lock))
    try:
        return (float(lock[0]), float(lock[1])) if valid else None
    except OverflowError:
        return None
