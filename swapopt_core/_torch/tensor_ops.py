"""torch's tensor operations for the framework-neutral staging and undo copy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swapopt_core._swap.ops import Saved

__all__ = ["TorchTensorOps", "carve"]


def carve(buffer: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """A 1-D tensor over ``buffer[offset:offset + numel]`` with a storage of its own.

    The piece aliases the buffer's memory and keeps it alive, but starts at storage offset
    0: it pickles on its own, and a DTensor wrapping it saves and deep-copies normally
    (a DTensor over a view with an offset cannot be saved in torch 2.13).
    """
    size = buffer.element_size()
    piece = buffer.untyped_storage()[offset * size : (offset + numel) * size]
    return torch.empty(0, dtype=buffer.dtype).set_(piece)


class TorchTensorOps:
    """Views, sizes and undo copies of torch tensors (``swapopt_core._swap.ops.TensorOps``)."""

    views_at_offset = True
    # Asynchronous torch runtimes report a copy out that failed where it ran.
    failures_reported = True

    def view(self, buffer: Any, offset: int, numel: int, shape: tuple[int, ...]) -> Any:
        return buffer.narrow(0, offset, numel).view(shape)

    def host_piece(self, buffer: Any, offset: int, numel: int, shape: tuple[int, ...]) -> Any:
        return carve(buffer, offset, numel).view(shape)

    def describe(self, tensor: Any) -> tuple[Any, int, tuple[int, ...]]:
        return tensor.dtype, tensor.numel(), tuple(tensor.shape)

    def alloc_scratch(self, numel: int, dtype: Any, device: Any) -> Any:
        return torch.empty(numel, dtype=dtype, device=device)

    def free_scratch(self, buffer: Any) -> None:
        return None  # freed with its last reference, in stream order like any temporary

    def save(self, sources: Sequence[Any], copies: Sequence[Any]) -> None:
        for source, copy in zip(sources, copies, strict=True):
            copy.copy_(source)

    def restore(self, saved: Saved) -> None:
        for target, copy in saved:
            target.copy_(copy)
