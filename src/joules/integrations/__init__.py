"""Callbacks that drive joules optimizers from training frameworks.

- :mod:`joules.integrations.huggingface`: ``PowerLimitCallback`` for ``transformers.Trainer``
  (``pip install 'joules[huggingface]'``).
- :mod:`joules.integrations.lightning`: ``PowerLimitCallback`` for ``lightning.Trainer``
  (``pip install 'joules[lightning]'``).

Each submodule imports its framework only when it is itself imported; importing this package
imports neither. A plain PyTorch loop needs no integration: call the
:class:`~joules.optimizers.power_limit.optimizer.PowerLimitOptimizer` callbacks directly
(see ``examples/power_limit_pytorch.py``).
"""
