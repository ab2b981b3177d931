"""Drive a :class:`PowerLimitOptimizer` from a Hugging Face ``transformers.Trainer``.

::

    from joules.integrations.huggingface import PowerLimitCallback
    from joules.monitoring.monitor import EnergyMonitor
    from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer

    optimizer = PowerLimitOptimizer(EnergyMonitor(), selector="cost:0.5", workload="bert-base/b32")
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[PowerLimitCallback(optimizer)])
    with optimizer:          # restores the GPUs' limits even when training raises
        trainer.train()

What counts as a step: the Trainer's ``on_step_begin`` / ``on_step_end`` bracket one
*optimizer* step, so with ``gradient_accumulation_steps=k`` one joules step is ``k``
micro-batches (``warmup_steps`` and ``profile_steps`` count optimizer steps). An epoch whose
batches ``k`` does not divide ends with a shorter cycle, which is not a step like the others:
the measurement pauses for it (as the Lightning callback does). It is told from the train
dataloader's length and the optimizer steps of the epoch so far (a run resumed in the
middle of an epoch included); an epoch of fewer than ``k`` batches is one step, as the
Trainer makes it, and each is measured. Where the length is unknown (an iterable dataset),
a cycle seen to end short (fewer ``on_substep_end`` calls than ``k - 1``) pauses instead:
the pause then comes within a step, which the optimizer handles by dropping what it measured
since the previous pause (the first time) and one step after that
(:meth:`~joules.optimizers.power_limit.optimizer.PowerLimitOptimizer.pause`).

Evaluation and checkpoint saving are not training steps: when the Trainer is about to
evaluate or save after a step (``control.should_evaluate`` / ``control.should_save``, set by
the Trainer's own flow callback, which runs before this one), the measurement pauses exactly
as at an epoch end, and warms up again afterwards. Logging does not pause it.

Restoring the limits: the Trainer calls ``on_train_end`` (which restores the limits the GPUs
had before) only when training finishes; when ``trainer.train()`` raises, no callback runs.
Wrap it in ``with optimizer:`` to restore at once; without it, the optimizer's restore guard
still restores when the exception ends the interpreter (``atexit``) and on SIGINT/SIGTERM/SIGHUP,
but a caught exception (e.g. in a notebook) would leave the limit set until then.

Every rank of a distributed job runs its own callback and optimizer; the optimizer agrees on
the limit with the other ranks through ``torch.distributed`` itself.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "joules.integrations.huggingface needs the transformers package: "
        "pip install 'joules[huggingface]'"
    ) from e

from joules.optimizers.power_limit.optimizer import PowerLimitOptimizer

__all__ = ["PowerLimitCallback"]


class PowerLimitCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that drives a :class:`PowerLimitOptimizer`.

    Args:
        optimizer: The power-limit optimizer to drive (one per process).
        pause_on_eval_and_save: Pause the measurement when the Trainer evaluates or saves a
            checkpoint in the middle of an epoch (as at an epoch end).
    """

    def __init__(self, optimizer: PowerLimitOptimizer, *, pause_on_eval_and_save: bool = True) -> None:
        if not isinstance(optimizer, PowerLimitOptimizer):
            raise TypeError(f"expected a PowerLimitOptimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.pause_on_eval_and_save = pause_on_eval_and_save
        self._cycles = 0  # optimizer steps begun in this epoch
        self._substeps = 0  # micro-batches of the current cycle before its last
        self._partial = False  # the current cycle is the epoch's short last one
        self._batch_size: int | None = None  # the Trainer's batch size in the latest run
        self._resumed = False  # the next epoch is the first of a run (which may resume part-way)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.optimizer.on_train_begin()
        self._resumed = True
        # ``auto_find_batch_size`` runs training again with a smaller batch size after running
        # out of memory: the steps measured so far were other steps.
        size = getattr(state, "train_batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            if self._batch_size is not None and size != self._batch_size:
                self.optimizer.workload_changed(f"the batch size changed from {self._batch_size} to {size}")
            self._batch_size = size

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A run resumed from a checkpoint starts part-way through its first epoch (unless the
        # Trainer replays it whole, ``ignore_data_skip``): count the steps done there.
        k, batches = _accumulation(args), _length(kwargs.get("train_dataloader"))
        step = getattr(state, "global_step", 0)
        per_epoch = -(-batches // k) if batches else 0
        first, self._resumed = self._resumed, False
        skipped = first and not getattr(args, "ignore_data_skip", False)
        self._cycles = step % per_epoch if skipped and per_epoch and isinstance(step, int) else 0
        self.optimizer.on_epoch_begin()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        k = _accumulation(args)
        self._substeps = 0
        batches = _length(kwargs.get("train_dataloader"))
        # (an epoch of fewer than k batches is one step of all of them, like every epoch's)
        self._partial = (k > 1 and batches is not None and batches >= k
                         and 0 < batches - self._cycles * k < k)
        self._cycles += 1
        if self._partial:  # the epoch's last cycle is short: not a step like the others
            self.optimizer.pause()
        else:
            self.optimizer.on_step_begin()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._substeps += 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._partial:  # (a short cycle foreseen paused at its begin)
            batches = _length(kwargs.get("train_dataloader"))
            full = min(_accumulation(args), batches) if batches else _accumulation(args)
            if self._substeps + 1 < full:  # short, though not foreseen: drop it
                self.optimizer.pause()
            else:
                self.optimizer.on_step_end()
        if self.pause_on_eval_and_save and (
            getattr(control, "should_evaluate", False) or getattr(control, "should_save", False)
        ):
            self.optimizer.pause()  # a profile in progress pauses; no-op otherwise

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.optimizer.on_epoch_end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.optimizer.on_train_end()


def _accumulation(args: Any) -> int:
    k = getattr(args, "gradient_accumulation_steps", 1)
    return k if isinstance(k, int) and k > 1 else 1


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:  # no dataloader, or one without a length (an iterable dataset)
        return None
