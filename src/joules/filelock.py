"""An exclusive lock on an open file, held across processes of one host (``flock``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import IO, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows, where callers serialize otherwise
    fcntl = None  # type: ignore[assignment]

#: Whether this platform has ``flock`` (without it :func:`exclusive` holds nothing).
AVAILABLE = fcntl is not None


@contextlib.contextmanager
def exclusive(f: IO[Any] | int) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the open file ``f`` (or descriptor) across the block.

    Other holders wait.
    """
    if fcntl is None:
        yield
        return
    fd = f if isinstance(f, int) else f.fileno()
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
