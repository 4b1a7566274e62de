"""The step as a pipeline: copy in batch i+1 and copy out batch i-1 while batch i updates.

Order of operations (queues: compute, copy)::

    stage+copy_in(0); stage+copy_in(1)
    for i: wait(in i) -> update(i) -> copy_out(i) -> unstage(i) -> stage+copy_in(i+2)

Batch ``i + 2`` takes the device memory batch ``i`` gave back, in copy-queue order, so at
most two batches are on the device at any moment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

from swapopt_core._runtime import TransferRuntime

logger = logging.getLogger(__name__)

__all__ = ["Staging", "StagedBatch", "run_pipeline"]


class StagedBatch(Protocol):
    """One batch on the device, as a backend's staging hands it over."""

    views: dict[Any, Any]  #: device view of each slot
    pairs: Sequence[tuple[Any, Any]]  #: (device, host) copies that move the batch

    @property
    def copy_bytes(self) -> int: ...


class Staging(Protocol):
    """Allocates and frees each batch's device storage (one per backend and mode)."""

    def begin(self, batches: Sequence[Sequence[Any]]) -> None: ...
    def stage(self, index: int, slots: Sequence[Any]) -> StagedBatch: ...
    def unstage(self, staged: Any) -> None: ...
    def end(self) -> None: ...


def run_pipeline(
    batches: Sequence[Sequence[Hashable]],
    staging: Staging,
    runtime: TransferRuntime,
    update: Callable[[int, dict[Any, Any]], None],
) -> tuple[int, int]:
    """Run ``update`` over every batch with its state on the device.

    Args:
        batches: The slots of each batch, in order.
        staging: Allocates and frees each batch's device storage.
        runtime: Queues the copies.
        update: ``update(i, views)`` updates batch ``i`` given a device view per slot.

    Returns:
        Bytes copied host to device and device to host.

    Raises:
        BaseException: Whatever ``update`` raised, after every queued copy has finished, the
            failed batch's state was written back and all device storage was released.
    """
    n = len(batches)
    staged: list[StagedBatch | None] = [None] * n
    tickets: list[object] = [None] * n
    h2d = d2h = 0
    failed: int | None = None

    def prefetch(j: int) -> None:
        nonlocal h2d
        staged[j] = batch = staging.stage(j, batches[j])
        tickets[j] = runtime.copy_in(batch.pairs)
        h2d += batch.copy_bytes

    try:
        staging.begin(batches)
        for j in range(min(2, n)):
            prefetch(j)
        for i in range(n):
            batch = staged[i]
            assert batch is not None
            runtime.wait(tickets[i])
            failed = i
            update(i, batch.views)
            failed = None
            runtime.copy_out(batch.pairs)
            d2h += batch.copy_bytes
            staging.unstage(batch)
            staged[i] = None
            if i + 2 < n:
                prefetch(i + 2)
    except BaseException:
        batch = staged[failed] if failed is not None else None
        if batch is not None:
            # Whatever the failed update wrote stays paired with the parameters it touched.
            runtime.copy_out(batch.pairs)
            d2h += batch.copy_bytes
        # Nothing may still be reading device storage we are about to release.
        runtime.synchronize()
        for leftover in staged:
            if leftover is not None:
                staging.unstage(leftover)
        logger.debug("swap pipeline interrupted in batch %s of %d; drained", failed, n)
        raise
    finally:
        staging.end()
        # The host copies are the optimizer's public state: they must be final on return.
        runtime.synchronize()
    return h2d, d2h
