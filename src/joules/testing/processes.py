"""Run real processes in tests.

Ranks of a ``torch.distributed`` job forked from one parent, and children that say when
they are ready.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def start_ready(args: Sequence[str], env: Mapping[str, str], ready: str, timeout_s: float = 60.0
                ) -> subprocess.Popen[str]:
    """Start ``args`` and wait until its first line of output is ``ready``.

    Raises:
        AssertionError: It printed something else or nothing in time (it is killed, and its
            output is in the message).
    """
    p = subprocess.Popen(list(args), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    got, _, _ = select.select([p.stdout], [], [], timeout_s)
    line = p.stdout.readline() if got else ""
    if line != ready + "\n":
        p.kill()
        out, err = p.communicate(timeout=10)
        raise AssertionError(f"child failed: {line}{out}{err}")
    return p


def sim_child_env(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A simulator state file under ``tmp_path`` and an environment for a child that uses it.

    The child's simulated GPUs keep their settings in the state file, so the parent sees
    what the child left; its journals go to ``tmp_path/joules-state``. ``JOULES_SIM`` is
    removed (the child names its own simulated hardware).
    """
    state = tmp_path / "sim-state.json"
    env = dict(os.environ, JOULES_SIM_STATE=str(state), JOULES_STATE_DIR=str(tmp_path / "joules-state"))
    env.pop("JOULES_SIM", None)
    return state, env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_forked(target: Callable[..., None], args: Sequence[tuple[Any, ...]], timeout_s: float) -> int:
    """Fork one process per ``args`` entry running ``target(*entry)``; 0 when all exit with 0.

    Forking from a parent that has already imported torch starts the ranks fast. A process
    still running after ``timeout_s`` is killed and reported on stderr.
    """
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    codes = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            print(f"process {r} timed out", file=sys.stderr)
        codes.append(p.exitcode)
    print(f"exit codes {codes}", file=sys.stderr)
    return 0 if all(c == 0 for c in codes) else 1
