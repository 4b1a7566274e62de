"""The MindSpore backend: runtimes, optimizer families and the engine for MindSpore Cells.

``swapopt_core.swap_optimizer`` routes MindSpore optimizers here. Nothing in this package
imports MindSpore at import time.
"""

from swapopt_core._mindspore.adapter import MindSporeAdapter, qualified_names

__all__ = ["MindSporeAdapter", "is_mindspore_optimizer"]

_OPTIMIZER_BASE = "mindspore.nn.optim.optimizer.Optimizer"


def is_mindspore_optimizer(obj: object) -> bool:
    """Whether ``obj`` is a MindSpore optimizer Cell (checked without importing MindSpore)."""
    return _OPTIMIZER_BASE in qualified_names(obj)
