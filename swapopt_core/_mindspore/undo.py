"""The undo copy that keeps a MindSpore batch's update a transaction.

A batch's update changes in place its parameters and the state that is not swapped (too
small, or not in ``state_keys``); the swapped state needs no copy, because its host copy is
only overwritten by the copy out that follows a successful update. Before the update those
tensors are copied on their device into an ``UndoArena``; if the update raises, they are
copied back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from swapopt_core._mindspore.runtime import MindSporeRuntime

__all__ = ["UndoArena"]

#: Saved copies of one batch: (target, its copy on the device).
Saved = list[tuple[Any, Any]]
#: A tensor to save and the name of its device (``Tensor.device`` waits for queued work).
Target = tuple[Any, str]


class UndoArena:
    """Device memory for the undo copies of one step, reused from batch to batch.

    With a runtime that carves views at an offset, one flat buffer per device and dtype,
    sized for the batch that needs most, serves every batch: a batch's copy is not needed
    once its update finished, so the next batch takes the same memory, and the cost of the
    undo stays the copy itself (``Parameter.copy()`` per tensor cost 20 times the copy on
    CPU), copied by one compiled launch per batch (``graphs.save``). Other runtimes give
    each tensor a buffer of its own for the time of its batch.

    Args:
        runtime: Allocates the device buffers.
        batches: Per batch, the tensors its update changes in place, with their devices.
    """

    def __init__(self, runtime: MindSporeRuntime, batches: Sequence[Sequence[Target]]) -> None:
        self.runtime = runtime
        self.shared = runtime.views_at_offset
        self._sizes: dict[tuple[str, Any], int] = {}
        for targets in batches:
            need: dict[tuple[str, Any], int] = {}
            for target, device in targets:
                key = (device, target.dtype)
                need[key] = need.get(key, 0) + int(target.size)
            for key, numel in need.items():
                self._sizes[key] = max(self._sizes.get(key, 0), numel)
        self._buffers: dict[tuple[str, Any], Any] = {}
        self._loose: list[Any] = []  # per-tensor buffers of the current batch

    def save(self, targets: Sequence[Target]) -> Saved:
        """Copy ``targets`` (on their device) into the arena; return what ``restore`` needs."""
        import mindspore as ms

        from swapopt_core._mindspore.graphs import save

        self._release_loose()
        cursor: dict[tuple[str, Any], int] = {}
        saved: Saved = []
        for target, device in targets:
            numel, shape, dtype = int(target.size), tuple(target.shape), target.dtype
            key = (device, dtype)
            if self.shared:
                flat = self._buffers.get(key)
                if flat is None:
                    flat = self._buffers[key] = self.runtime.alloc_device(
                        self._sizes[key], dtype, device
                    )
                start = cursor.get(key, 0)
                cursor[key] = start + numel
                copy = self.runtime.view(flat, start, numel, shape)
            else:
                flat = self.runtime.alloc_device(numel, dtype, device)
                self._loose.append(flat)
                copy = self.runtime.view(flat, 0, numel, shape)
            saved.append((target, copy))
        if saved:
            sources, copies = zip(*saved, strict=True)
            save(ms.mutable(sources), ms.mutable(copies))
        return saved

    @staticmethod
    def restore(saved: Saved) -> None:
        """Put every target of a batch back as ``save`` found it."""
        from mindspore.ops import functional as F

        for target, copy in saved:
            F.assign(target, copy)

    def release(self) -> None:
        """Give every buffer back (at the end of the step)."""
        self._release_loose()
        buffers, self._buffers = list(self._buffers.values()), {}
        for flat in buffers:
            self.runtime.release_device(flat)

    def _release_loose(self) -> None:
        loose, self._loose = self._loose, []
        for flat in loose:
            self.runtime.release_device(flat)
