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

What counts as a step: every *training batch* (``on_train_batch_start`` /
``on_train_batch_end``). With ``accumulate_grad_batches=k`` only every ``k``-th batch runs the
optimizer, so steps are not all alike: choose ``warmup_steps`` and ``profile_steps`` as
multiples of ``k`` so that every profile holds whole accumulation cycles.

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

    # -- training -------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.optimizer.on_train_begin()
        if self.pause_on_validation_and_save:
            self._pause_on_save(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.optimizer.on_epoch_begin()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.optimizer.on_step_begin()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.optimizer.on_step_end()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
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
