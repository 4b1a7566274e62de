"""The framework-neutral optimizer swap: the engine base with the one step transaction, the
pipeline, the batch partition, the packed host layout, the staging, the undo copy and the
ledger of device bytes. The backends (``swapopt_core._torch``, ``swapopt_core._mindspore``)
supply their tensor operations and state bookkeeping; nothing here imports a backend.
"""

from swapopt_core._swap.engine import ENGINE_ATTR, EngineBase, engine_of
from swapopt_core._swap.ops import SwapSlot, TensorOps
from swapopt_core._swap.step import StepUnit, StepWork

__all__ = [
    "ENGINE_ATTR",
    "EngineBase",
    "StepUnit",
    "StepWork",
    "SwapSlot",
    "TensorOps",
    "engine_of",
]
