"""Simulated GPU settings that outlive a process (``JOULES_SIM_STATE=path``).

Real GPUs keep their power limit and locked clocks after the process that set them exits;
by default a simulated GPU forgets them. With a state file, each :class:`SimGPU` starts
from the power limit and SM clock lock recorded there and records every change, so tests
can check what a crashed or killed process leaves behind, and that a later process puts it
back.

The file is JSON: ``{"gpus": {"<index>": {"uuid": ..., "name": ..., "power_limit_w": ...,
"sm_clock_lock_mhz": [min, max] or null}}}``. Each write holds an exclusive ``flock`` on
the sidecar ``<path>.lock``, re-reads the file, updates only its own GPU's entry and
replaces the file atomically, so several processes may share one state file.
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


class SimStateFile:
    """A JSON file holding the power limit and SM clock lock of simulated GPUs.

    Args:
        path: The state file; it and its directory are created on the first change.

    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

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
        """Record ``gpu``'s current power limit and SM clock lock, keeping other GPUs' entries."""
        lock = gpu.sm_clock_locked()
        entry = {
            "uuid": gpu.uuid,
            "name": gpu.name,
            "power_limit_w": gpu.power_limit_w(),
            "sm_clock_lock_mhz": list(lock) if lock is not None else None,
        }
        with self._locked():
            gpus = self.load()
            gpus[str(gpu.index)] = entry
            text = json.dumps({"format": FORMAT, "gpus": dict(sorted(gpus.items()))}, indent=2)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text + "\n")
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

    def attach(self, gpus: Sequence[SimGPU]) -> None:
        """Start each GPU from its recorded settings (same index and UUID), and record its changes."""
        recorded = self.load()
        for gpu in gpus:
            entry = recorded.get(str(gpu.index))
            if entry is not None and entry.get("uuid") == gpu.uuid:
                limit = entry.get("power_limit_w")
                lock = entry.get("sm_clock_lock_mhz")
                valid_lock = (isinstance(lock, list) and len(lock) == 2
                              and all(isinstance(x, int | float) and not isinstance(x, bool) for x in lock))
                gpu.load_control_state(
                    float(limit) if isinstance(limit, int | float) and not isinstance(limit, bool) else None,
                    (float(lock[0]), float(lock[1])) if valid_lock else None,  # a malformed entry is ignored
                )
            gpu.on_change = self.save
