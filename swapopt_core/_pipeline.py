"""The step as a pipeline: copy in batch i+1 and copy out batch i-1 while batch i updates.

Order of operations (queues: compute, copy)::

    stage+copy_in(0); stage+copy_in(1)
    for i: wait(in i) -> update(i) -> copy_out(i) -> unstage(i) -> stage+copy_in(i+2)

Batch ``i + 2`` takes the device memory batch ``i`` gave back, in copy-queue order, so at
most two batches are on the device at any moment.

A step is a transaction per batch. The engine's ``update`` either finishes or leaves its
batch as it found it (it keeps an undo copy of what it changes in place). A batch whose
update finished counts as done once its copy out is queued; if that copy fails, it is
tried once more, and if that fails too, the batch's device storage is kept (``kept``)
until ``write_back`` succeeds. A SIGINT that arrives during a step is delivered when the
step ends (``deferred_interrupt``), so no asynchronous ``KeyboardInterrupt`` splits the
bookkeeping; a second one is delivered at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol

from swapopt_core._runtime import TransferRuntime

logger = logging.getLogger(__name__)

__all__ = ["Staging", "StagedBatch", "deferred_interrupt", "run_pipeline", "write_back"]


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
    def keep(self, staged: Any) -> None: ...
    def unstage(self, staged: Any) -> None: ...
    def end(self) -> None: ...


_deferring = threading.local()


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a SIGINT that arrives inside the block until the block ends; a second one at once.

    Only the main thread receives SIGINT, so elsewhere (and when nested) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread() or getattr(
        _deferring, "active", False
    ):
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # installed outside Python: leave it alone
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if received:  # asked twice: the user means it
            received.clear()  # delivered here, not again on the way out
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        received.append(signum)

    signal.signal(signal.SIGINT, hold)
    _deferring.active = True
    try:
        yield
    finally:
        _deferring.active = False
        if signal.getsignal(signal.SIGINT) is hold:
            signal.signal(signal.SIGINT, previous)
        if received:
            logger.debug("delivering a SIGINT held over a swapped step")
            signal.raise_signal(signal.SIGINT)


def write_back(kept: list[Any], staging: Staging, runtime: TransferRuntime) -> None:
    """Copy batches kept on the device by an interrupted step to host memory, then free them.

    Each batch leaves ``kept`` only once its copy has finished; on failure the rest stay.
    """
    while kept:
        batch = kept[0]
        runtime.copy_out(batch.pairs)
        # The host copy is the state from now on: it must have landed before the device
        # storage that holds the only other copy is given up.
        runtime.synchronize()
        kept.pop(0)
        staging.unstage(batch)


def run_pipeline(
    batches: Sequence[Sequence[Hashable]],
    staging: Staging,
    runtime: TransferRuntime,
    update: Callable[[int, dict[Any, Any]], None],
    kept: list[Any],
) -> tuple[int, int]:
    """Run ``update`` over every batch with its state on the device.

    Args:
        batches: The slots of each batch, in order.
        staging: Allocates and frees each batch's device storage.
        runtime: Queues the copies.
        update: ``update(i, views)`` updates batch ``i`` given a device view per slot; if it
            raises, it must have left the batch (parameters and state) as it found it.
        kept: Receives the batches that were updated but could not be copied back.

    The caller holds SIGINT over the whole step (``deferred_interrupt``), so a
    ``KeyboardInterrupt`` only comes from code that raises it.

    Returns:
        Bytes copied host to device and device to host.

    Raises:
        BaseException: Whatever was raised, once every batch that was updated is in host
            memory or in ``kept``, every queued copy has finished and all other device
            storage was released.
    """
    n = len(batches)
    staged: list[StagedBatch | None] = [None] * n
    tickets: list[object] = [None] * n
    h2d = d2h = 0
    unwritten: int | None = None  # updated, copy out not queued yet

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
            update(i, batch.views)
            unwritten = i
            runtime.copy_out(batch.pairs)
            unwritten = None
            d2h += batch.copy_bytes
            staged[i] = None
            staging.unstage(batch)
            if i + 2 < n:
                prefetch(i + 2)
    except BaseException:
        _recover(staged, unwritten, staging, runtime, kept)
        _quietly(staging.end, "releasing the staging")
        logger.debug("swap pipeline interrupted with %d of %d batches kept", len(kept), n)
        raise
    try:
        staging.end()
    finally:
        # The host copies are the optimizer's public state: they must be final on return.
        runtime.synchronize()
    return h2d, d2h


def _recover(
    staged: list[Any],
    unwritten: int | None,
    staging: Staging,
    runtime: TransferRuntime,
    kept: list[Any],
) -> None:
    """After a failure: write back or keep the updated batch, then drain and free the rest."""
    if unwritten is not None:
        batch = staged[unwritten]
        staged[unwritten] = None
        staging.keep(batch)
        kept.append(batch)
        _quietly(lambda: write_back(kept, staging, runtime), "writing back an updated batch")
    # Nothing may still be reading device storage released below.
    _quietly(runtime.synchronize, "draining the copy queue")
    for index, leftover in enumerate(staged):
        if leftover is not None:
            staged[index] = None
            _quietly(lambda b=leftover: staging.unstage(b), "releasing a staged batch")


def _quietly(action: Callable[[], None], what: str) -> None:
    """Run a clean-up ``action``; an error in it is logged, the original one propagates."""
    try:
        action()
    except BaseException:  # a second fault must not stop the clean-up of the first
        logger.warning("swapopt: %s after an interrupted step failed", what, exc_info=True)
