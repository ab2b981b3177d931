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

What counts as a step: the training batches up to an optimizer step, from the
``on_train_batch_start`` of the first to the ``on_train_batch_end`` after which
``trainer.global_step`` has moved. Without gradient accumulation that is every batch; with
``accumulate_grad_batches=k`` it is a whole accumulation cycle of ``k`` batches (the batches
that only accumulate are cheaper than the one that steps, so counting batches would make
measured spans hold uneven shares of each), as ``warmup_steps`` and ``profile_steps`` count
them.

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
        self._step_from: int | None = None  # trainer.global_step when the current step began

    # -- training -------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._step_from = None
        self.optimizer.on_train_begin()
        if self.pause_on_validation_and_save:
            self._pause_on_save(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.optimizer.on_epoch_begin()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._step_from is None:  # the first batch of an optimizer step
            self._step_from = trainer.global_step
            self.optimizer.on_step_begin()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step_from is None or trainer.global_step != self._step_from:  # the optimizer stepped
            self._step_from = None
            self.optimizer.on_step_end()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._step_from = None  # a cycle the strategy carries over is not measured across the end
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
