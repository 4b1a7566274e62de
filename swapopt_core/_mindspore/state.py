"""Swap slots of MindSpore optimizers, and MindSpore's tensor operations for the neutral swap.

A slot is one optimizer-owned state Parameter (``moment1[i]``, ``exp_avg[i]``, ...). Between
steps its data is ``host``, a CPU tensor; during its batch the update works on a device
view that the neutral staging (``swapopt_core._swap.staging``) carves with
``MindSporeTensorOps``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swapopt_core._device.interface import TransferRuntime
from swapopt_core._mindspore.runtime import MindSporeRuntime
from swapopt_core._swap.ops import Saved

__all__ = ["MindSporeTensorOps", "Slot"]


@dataclass(eq=False)
class Slot:
    """One swapped state Parameter of the optimizer.

    Attributes:
        key: State name (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``master_param``).
        index: Position of the parameter it belongs to in ``optimizer._parameters``.
        state: The optimizer-owned Parameter; its data is ``host`` between steps.
        host: CPU tensor with the values (shape of the state).
        device: Where the parameter lives (``"CPU"``, ``"Ascend:0"``).
        offset: Element offset in the packed host buffer of its dtype, ``-1`` if unpacked.
    """

    key: str
    index: int
    state: Any
    host: Any
    device: str
    offset: int = -1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.state.shape)

    @property
    def dtype(self) -> Any:
        return self.state.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def itemsize(self) -> int:
        return int(self.state.itemsize)

    @property
    def nbytes(self) -> int:
        return self.numel * int(self.state.itemsize)


class MindSporeTensorOps:
    """Views, sizes and undo copies of MindSpore tensors (``swapopt_core._swap.ops.TensorOps``).

    Buffers and views come from the runtime. The undo copies of a batch are made by one
    compiled launch (``graphs.save``: ``Parameter.copy()`` per tensor cost 20 times the copy
    on CPU) and put back with ``assign``.
    """

    def __init__(self, runtime: MindSporeRuntime) -> None:
        self.runtime = runtime
        self.views_at_offset = runtime.views_at_offset
        # A runtime that reports copies failing where they ran overrides ``failure``; the
        # others raise copy errors where the copy is queued or waited for, so a batch that
        # left can drop its views at once (the device memory is freed with the last one).
        self.failures_reported = type(runtime).failure is not TransferRuntime.failure

    def view(self, buffer: Any, offset: int, numel: int, shape: tuple[int, ...]) -> Any:
        return self.runtime.view(buffer, offset, numel, shape)

    def host_piece(self, buffer: Any, offset: int, numel: int, shape: tuple[int, ...]) -> Any:
        return self.runtime.view(buffer, offset, numel, shape)

    def describe(self, tensor: Any) -> tuple[Any, int, tuple[int, ...]]:
        return tensor.dtype, int(tensor.size), tuple(tensor.shape)

    def alloc_scratch(self, numel: int, dtype: Any, device: Any) -> Any:
        return self.runtime.alloc_device(numel, dtype, device)

    def free_scratch(self, buffer: Any) -> None:
        self.runtime.release_device(buffer)

    def save(self, sources: Sequence[Any], copies: Sequence[Any]) -> None:
        import mindspore as ms

        from swapopt_core._mindspore.graphs import save

        save(ms.mutable(tuple(sources)), ms.mutable(tuple(copies)))

    def restore(self, saved: Saved) -> None:
        from mindspore.ops import functional as F

        for target, copy in saved:
            F.assign(target, copy)
