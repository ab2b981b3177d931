"""Wait for queued device work at window edges, for the framework that queued it."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Literal

SyncSpec = Literal["torch", "jax", "cupy"] | Callable[[], None] | None


def make_sync(sync: SyncSpec, gpu_indices: Sequence[int]) -> Callable[[], None] | None:
    """Build the function that synchronizes the given GPUs, or ``None`` when nothing to do.

    A framework that was never imported has queued no work, so it is not imported here (and
    no error is raised); the check is repeated at each call, so importing it later works.

    Raises:
        ValueError: ``sync`` is not one of the accepted values.
    """
    if sync is None:
        return None
    if callable(sync):
        return sync
    indices = list(gpu_indices)
    if sync == "torch":
        return lambda: _sync_torch(indices)
    if sync == "jax":
        return _sync_jax
    if sync == "cupy":
        return lambda: _sync_cupy(indices)
    raise ValueError(f"sync must be 'torch', 'jax', 'cupy', a callable or None; got {sync!r}")


def _sync_torch(indices: list[int]) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    for i in indices:
        if i < torch.cuda.device_count():
            torch.cuda.synchronize(i)


def _sync_jax() -> None:
    jax = sys.modules.get("jax")
    if jax is None:
        return
    jax.effects_barrier()
    # Work runs in order per device: a tiny transfer completes after what was queued before.
    for d in jax.local_devices():
        jax.device_put(0.0, d).block_until_ready()


def _sync_cupy(indices: list[int]) -> None:
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return
    for i in indices:
        with cupy.cuda.Device(i):
            cupy.cuda.runtime.deviceSynchronize()
