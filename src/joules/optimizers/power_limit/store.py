"""Saved power-limit profiles, so that a recurring job skips profiling.

A profile is keyed by the GPU model, the number of GPUs of the job and a workload name the
user gives (the model, batch size and anything else that changes time or power per step).
Each is one small JSON file; writes are atomic, so a job killed while saving leaves the
previous file intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from joules.optimizers.power_limit.profile import LimitPoint, ProfileError

STATE_ENV = "JOULES_STATE_DIR"
FORMAT = 1


def default_state_dir() -> Path:
    """``$JOULES_STATE_DIR``, else ``$XDG_STATE_HOME/joules``, else ``~/.local/state/joules``."""
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "joules"


def _slug(text: str, limit: int = 255) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", text.strip()).strip("_")
    return slug[:limit] or "_"


class ProfileStore:
    """A directory of saved profiles (default: ``<state dir>/power-limit-profiles``).

    Args:
        directory: Where profiles live; created on first save.
    """

    def __init__(self, directory: str | Path | None = None) -> None:
        default = default_state_dir() / "power-limit-profiles"
        self.directory = Path(directory) if directory is not None else default

    def path(self, gpu_model: str, gpus: int, workload: str) -> Path:
        """The file that holds the profile for this key."""
        if not workload.strip():
            raise ValueError("a saved profile needs a non-empty workload name")
        # The slugs can make two keys alike ("a/b" and "a b"), and are cut short to keep the
        # name within the 255 bytes file systems allow: a hash of the exact key keeps their
        # files apart.
        digest = hashlib.sha256(json.dumps([gpu_model, gpus, workload]).encode()).hexdigest()[:8]
        return self.directory / f"{_slug(gpu_model, 64)}-x{gpus}-{_slug(workload, 120)}-{digest}.json"

    def load(self, gpu_model: str, gpus: int, workload: str) -> list[LimitPoint] | None:
        """The saved points for this key, or ``None`` when there are none.

        Raises:
            ProfileError: The file exists but is not a profile of this key.
        """
        return self.read(gpu_model, gpus, workload)[0]

    def read(self, gpu_model: str, gpus: int,
             workload: str) -> tuple[list[LimitPoint] | None, dict[str, Any]]:
        """The saved points for this key (``None`` when there are none), and the file's other fields.

        Raises:
            ProfileError: The file exists but is not a profile of this key.
        """
        path = self.path(gpu_model, gpus, workload)
        if not path.exists():
            # Saved before file names had the key's hash: used only if it is this key's.
            path = self.directory / f"{_slug(gpu_model)}-x{gpus}-{_slug(workload)}.json"
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                return None, {}
            if not isinstance(data, dict) or (data.get("gpu_model"), data.get("gpus"),
                                              data.get("workload")) != (gpu_model, gpus, workload):
                return None, {}
        else:
            data = self._parse(path)
            if data is None:
                return None, {}
            key = (data.get("gpu_model"), data.get("gpus"), data.get("workload"))
            if key != (gpu_model, gpus, workload):
                raise ProfileError(f"saved profile {path} is for {key}, not {(gpu_model, gpus, workload)}")
        try:
            points = [LimitPoint(float(p["limit_w"]), float(p["time_s"]), float(p["energy_j"]))
                      for p in data["points"]]
        except (KeyError, TypeError, ValueError):
            raise ProfileError(
                f"saved profile {path} has malformed points; delete it to profile again") from None
        return points or None, {k: v for k, v in data.items() if k != "points"}

    @staticmethod
    def _parse(path: Path) -> dict[str, Any] | None:
        """The profile object in ``path`` (``None``: gone meanwhile), its key not yet checked."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ProfileError(
                f"saved profile {path} is unreadable ({e}); delete it to profile again") from None
        if not isinstance(data, dict):
            raise ProfileError(
                f"saved profile {path} is not a profile (a JSON object); delete it to profile again")
        return data

    def save(self, gpu_model: str, gpus: int, workload: str, points: Sequence[LimitPoint],
             **meta: object) -> Path:
        """Save ``points`` (time and energy per step at each limit) for this key; return the file."""
        path = self.path(gpu_model, gpus, workload)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "format": FORMAT, "gpu_model": gpu_model, "gpus": gpus, "workload": workload,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta,
            "points": [{"limit_w": p.limit_w, "time_s": p.time_s, "energy_j": p.energy_j} for p in points],
        }
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path
