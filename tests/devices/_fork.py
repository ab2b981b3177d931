"""Helpers for tests of what a forked child inherits (locks held by the parent's threads)."""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable

import pytest

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def run_in_forked_child(fn: Callable[[], object], timeout_s: float = 10.0) -> str | None:
    """Fork; the child runs ``fn()`` and sends back ``str`` of its result. ``None`` if it hangs."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            os.close(r)
            signal.alarm(int(timeout_s) + 5)  # in case the parent cannot kill it
            try:
                out = str(fn())
            except BaseException as e:  # noqa: BLE001
                out = f"error: {e!r}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        if not select.select([r], [], [], timeout_s)[0]:
            os.kill(pid, signal.SIGKILL)
            return None
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        return data.decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def held_in_thread(lock: threading.Lock | threading.RLock) -> threading.Event:
    """Have another thread take ``lock`` and keep it until the returned event is set."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(20)

    threading.Thread(target=hold, daemon=True).start()
    assert taken.wait(10)
    return release
