"""The undo copy that keeps a batch's update a transaction, for every backend.

A batch's update changes in place its parameters and the state that is not swapped (too
small, not in ``state_keys``, a step counter); the swapped state needs no copy, because its
host copy is only overwritten by the copy out that follows a successful update. Before the
update those tensors are copied on their device into an ``UndoArena``; if the update raises,
they are copied back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from swapopt_core._swap.ops import Saved, Target, TensorOps

__all__ = ["UndoArena"]


class UndoArena:
    """Device memory for the undo copies of one step, reused from batch to batch.

    With views at an offset, one flat buffer per device and dtype, sized for the batch that
    needs most, serves every batch: a batch's copy is not needed once its update finished,
    so the next batch takes the same memory, and the cost of the undo stays the copy itself.
    Otherwise each tensor gets a buffer of its own for the time of its batch.

    Args:
        ops: The backend's tensor operations (allocation, views, the copies).
        batches: Per batch, the tensors its update changes in place, with their devices.
    """

    def __init__(self, ops: TensorOps, batches: Sequence[Sequence[Target]]) -> None:
        self.ops = ops
        self.shared = ops.views_at_offset
        self._sizes: dict[tuple[Any, Any], int] = {}
        for targets in batches:
            need: dict[tuple[Any, Any], int] = {}
            for target, device in targets:
                dtype, numel, _ = ops.describe(target)
                need[(device, dtype)] = need.get((device, dtype), 0) + numel
            for key, numel in need.items():
                self._sizes[key] = max(self._sizes.get(key, 0), numel)
        self._buffers: dict[tuple[Any, Any], Any] = {}
        self._loose: list[Any] = []  # buffers of the current batch only
        #: Most device bytes the arena held at once (``OptimizerCosts.staging_factor``).
        self.peak_bytes = 0

    def save(self, targets: Sequence[Target]) -> Saved:
        """Copy ``targets`` (on their device) into the arena; return what ``restore`` needs."""
        self._release_loose()
        cursor: dict[tuple[Any, Any], int] = {}
        saved: Saved = []
        for target, device in targets:
            dtype, numel, shape = self.ops.describe(target)
            key = (device, dtype)
            start = cursor.get(key, 0)
            if self.shared and start + numel <= self._sizes.get(key, 0):
                flat = self._buffers.get(key)
                if flat is None:
                    flat = self._buffers[key] = self.ops.alloc_scratch(
                        self._sizes[key], dtype, device
                    )
                cursor[key] = start + numel
                copy = self.ops.view(flat, start, numel, shape)
            else:  # no views at an offset (or more than planned): a buffer of its own
                flat = self.ops.alloc_scratch(numel, dtype, device)
                self._loose.append(flat)
                copy = self.ops.view(flat, 0, numel, shape)
            saved.append((target, copy))
        held = sum(int(b.nbytes) for b in (*self._buffers.values(), *self._loose))
        self.peak_bytes = max(self.peak_bytes, held)
        if saved:
            self.ops.save([t for t, _ in saved], [c for _, c in saved])
        return saved

    def restore(self, saved: Saved) -> None:
        """Put every target of a batch back as ``save`` found it."""
        self.ops.restore(saved)

    def release(self) -> None:
        """Give every buffer back (at the end of the step)."""
        self._release_loose()
        buffers, self._buffers = list(self._buffers.values()), {}
        for flat in buffers:
            self.ops.free_scratch(flat)

    def _release_loose(self) -> None:
        loose, self._loose = self._loose, []
        for flat in loose:
            self.ops.free_scratch(flat)
