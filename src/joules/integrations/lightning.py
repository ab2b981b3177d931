"""Drive a :class:`PowerLimitOptimizer` from a PyTorch Lightning ``Trainer``.

::

    from joules.integrations.lightning import PowerLimitCallback
    from joules.monitoring.monitor import EnergyMonitor
    from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer

    optimizer = PowerLimitOptimizer(EnergyMonitor(), selector="cost:0.5", workload="resnet50/b256")
    trainer = lightning.Trainer(max_epochs=10, callbacks=[PowerLimitCallback(optimizer)])
    trainer.fit(model, train_loader, val_loader)

The callback subclasses ``lightning.pytorch.Callback``, or ``pytorch_lightning.Callback`` when
only the older ``pytorch_lightning`` package is installed (Lightning calls callback hooks by
name, so either works with either ``Trainer``).

What counts as a step: an optimizer step. Without gradient accumulation (and under manual
optimization) that is every training batch; with ``accumulate_grad_batches=k`` it is a whole
accumulation cycle of ``k`` batches, as Lightning counts them (batch indices ``0..k-1``,
``k..2k-1``, ... of each epoch), since the batches that only accumulate cost less than the
one that steps, and counting batches would make measured spans hold uneven shares of each.
``warmup_steps`` and ``profile_steps`` count cycles then. A last cycle of fewer than ``k``
batches at an epoch's end is not measured (the measurement pauses before it); an epoch of
fewer than ``k`` batches is one step of all of them, as Lightning makes it, and each is
measured. Where the number of batches is unknown (an iterable dataset without a length), the
epoch's end comes within the short cycle: the optimizer then drops what it measured since
the previous pause (the first time) and one step after that
(:meth:`~joules.optimizers.power_limit.optimizer.PowerLimitOptimizer.pause`).

Validation (including the sanity check before training) and checkpoint saving are not
training steps: the measurement pauses when a validation loop starts and when a checkpoint is
saved, as at an epoch end, and warms up again on the next training batches. (Lightning runs
end-of-epoch validation *before* ``on_train_epoch_end``, so pausing at the epoch end alone
would count it.)

Restoring the limits: ``on_train_end`` puts back the limits the GPUs had before; so does
``on_exception``, which Lightning calls when ``fit`` raises or is interrupted (Ctrl-C).
Every rank runs its own callback and optimizer; the optimizer agrees on the limit with the
other ranks through ``torch.distributed`` itself.
"""

from __future__ import annotations

import functools
import math
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:
    try:
        from pytorch_lightning import Callback  # type: ignore[no-redef]
    except ImportError as e:  # pragma: no cover - exercised only without lightning
        raise ImportError(
            "joules.integrations.lightning needs the lightning package: pip install 'joules[lightning]'"
        ) from e

from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer

__all__ = ["PowerLimitCallback"]


class PowerLimitCallback(Callback):
    """A Lightning ``Callback`` that drives a :class:`PowerLimitOptimizer`.

    Args:
        optimizer: The power-limit optimizer to drive (one per process).
        pause_on_validation_and_save: Pause the measurement when a validation loop runs or a
            checkpoint is saved during training (as at an epoch end).
    """

    def __init__(self, optimizer: PowerLimitOptimizer, *, pause_on_validation_and_save: bool = True) -> None:
        if not isinstance(optimizer, PowerLimitOptimizer):
            raise TypeError(f"expected a PowerLimitOptimizer, got {type(optimizer).__name__}")
        super().__init__()
        self.optimizer = optimizer
        self.pause_on_validation_and_save = pause_on_validation_and_save
        self._partial = False  # the batches of an epoch's last, partial accumulation cycle
        self._cycle_end = -1  # batch index that ends the current cycle

    def __copy__(self) -> PowerLimitCallback:
        new = self.__class__.__new__(self.__class__)  # (a shallow copy drives the same optimizer)
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self) -> dict[str, Any]:
        # The optimizer drives this process's GPUs (its monitor's sampler thread, its restore
        # guard): it cannot be sent to other processes, as ``ddp_spawn`` sends the trainer.
        raise TypeError(
            "joules' PowerLimitCallback cannot be sent to another process (strategy='ddp_spawn' "
            "or another spawning strategy pickles the callbacks): use strategy='ddp' (each rank "
            "runs the script and makes its own optimizer), or make the callback and its "
            "optimizer inside each spawned process"
        )

    # -- training -------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._partial = False
        self.optimizer.on_train_begin()
        if self.pause_on_validation_and_save:
            self._pause_on_save(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.optimizer.on_epoch_begin()

    @staticmethod
    def _cycle(trainer: Any, pl_module: Any) -> int:
        """Batches per optimizer step: ``accumulate_grad_batches`` under automatic optimization."""
        if not getattr(pl_module, "automatic_optimization", True):
            return 1  # the module steps its optimizers itself, where it likes: every batch is a step
        k = getattr(trainer, "accumulate_grad_batches", 1)
        return k if isinstance(k, int) and k > 1 else 1

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        k = self._cycle(trainer, pl_module)
        if batch_idx % k:
            return  # within a cycle
        left = getattr(trainer, "num_training_batches", math.inf)
        left = left - batch_idx if isinstance(left, (int, float)) else math.inf
        # (an epoch of fewer than k batches is one step of all of them, like every epoch's)
        self._partial = k > 1 and left < k and batch_idx > 0
        if self._partial:  # the epoch's last cycle is short: not a step like the others
            self.optimizer.pause()
        else:
            self._cycle_end = batch_idx + (k if left >= k else int(left)) - 1
            self.optimizer.on_step_begin()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._partial and batch_idx == self._cycle_end:
            self.optimizer.on_step_end()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._partial = False
        self.optimizer.on_epoch_end()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._unwrap_save(trainer)
        self.optimizer.on_train_end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._unwrap_save(trainer)
        try:
            self.optimizer.on_train_end()  # drops a measurement in progress, then restores
        finally:
            self.optimizer.restore()  # idempotent: restores even if the line above failed

    # -- not training steps ---------------------------------------------------------------
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # Also runs for the sanity check, before on_train_start: the optimizer ignores it then.
        if self.pause_on_validation_and_save:
            self.optimizer.pause()

    def _pause_on_save(self, trainer: Any) -> None:
        """Pause before every checkpoint the trainer saves while it trains.

        ``trainer.save_checkpoint`` is wrapped for the duration of ``fit``: Lightning calls the
        callbacks' ``on_save_checkpoint`` only for full checkpoints, not for weights-only ones
        (``ModelCheckpoint(save_weights_only=True)``).
        """
        if getattr(vars(trainer).get("save_checkpoint"), "_joules_callback", None) is self:
            return  # fit again: still wrapped
        save = trainer.save_checkpoint

        @functools.wraps(save)
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            self.optimizer.pause()
            return save(*args, **kwargs)

        save_checkpoint._joules_callback = self  # type: ignore[attr-defined]
        trainer.save_checkpoint = save_checkpoint

    def _unwrap_save(self, trainer: Any) -> None:
        if getattr(vars(trainer).get("save_checkpoint"), "_joules_callback", None) is self:
            del trainer.save_checkpoint
