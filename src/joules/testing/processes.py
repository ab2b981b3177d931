"""Run real processes in tests: ranks of a ``torch.distributed`` job forked from one parent."""

from __future__ import annotations

import multiprocessing
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


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
