"""What the framework-neutral swap needs from a backend's tensors.

The staging (``swapopt_core._swap.staging``) and the undo copy (``swapopt_core._swap.undo``)
are written once for torch and MindSpore. They allocate and free through the transfer
runtime, and do the few things that differ between the tensor libraries through a
backend's ``TensorOps``: carve views out of flat buffers, describe a tensor, copy a batch of
tensors for the undo and put them back. A swapped state tensor is described by a ``SwapSlot``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["Saved", "SwapSlot", "Target", "TensorOps"]

#: A tensor an update changes in place and the device it lives on.
Target = tuple[Any, Any]
#: The undo copies of one batch: (target, its copy on the target's device).
Saved = list[tuple[Any, Any]]


@runtime_checkable
class SwapSlot(Protocol):
    """One swapped state tensor, as the staging sees it.

    ``host`` holds its values between steps; ``offset`` is its element offset in the
    packed host buffer of its dtype (``-1`` while it owns its memory); ``device`` is where
    its parameter lives.
    """

    host: Any
    device: Any
    offset: int

    @property
    def dtype(self) -> Any: ...
    @property
    def numel(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


class TensorOps(Protocol):
    """A backend's tensor operations for the neutral staging and undo copy."""

    #: Whether ``view`` can start at a non-zero offset (packed staging and a shared
    #: undo arena need it).
    views_at_offset: bool
    #: Whether the runtime can report a copy out that failed where it ran (``failure``):
    #: then a batch that left keeps its copy pairs until its copy out is known to be done.
    failures_reported: bool

    def view(self, buffer: Any, offset: int, numel: int, shape: tuple[int, ...]) -> Any:
        """A tensor of ``shape`` over ``buffer[offset:offset + numel]`` of a flat buffer."""

    def host_piece(self, buffer: Any, offset: int, numel: int, shape: tuple[int, ...]) -> Any:
        """A tensor of ``shape`` over ``buffer[offset:offset + numel]`` (a host buffer) that a
        state entry can hold between steps."""

    def describe(self, tensor: Any) -> tuple[Any, int, tuple[int, ...]]:
        """``(dtype, numel, shape)`` of ``tensor``, without waiting for queued work."""

    def alloc_scratch(self, numel: int, dtype: Any, device: Any) -> Any:
        """A 1-D buffer on ``device`` for undo copies."""

    def free_scratch(self, buffer: Any) -> None:
        """Give back a buffer from ``alloc_scratch`` (at the end of a step)."""

    def save(self, sources: Sequence[Any], copies: Sequence[Any]) -> None:
        """Copy each of ``sources`` into the same position of ``copies``."""

    def restore(self, saved: Saved) -> None:
        """Copy each saved copy back into its target."""
