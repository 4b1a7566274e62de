"""The step as a pipeline: batch i+1 comes in and batch i-1 goes out while batch i updates.

Order of operations (queues: compute, copy in, copy out)::

    stage+copy_in(0)
    for i: stage+copy_in(i+1) -> wait(in i) -> update(i) -> copy_out(i)
           -> unstage(i-1 after its copy out)

The two copy queues run at the same time (full duplex), so three batches have device
memory at once: one going out, one updating, one coming in. Device memory is given back in
compute-queue order (``release_ordered``): compute waits for batch i-1's copy out once
update(i) is queued (that copy ran beside update(i), so the wait costs little), and the
block is free at once for batch i+2, whose copy in waits for that compute. No host sync,
and no ``record_stream``: the caching allocator would hold such a block until the host saw
the copy finish, which a host that queues the whole step in one go never does inside the
step, so every batch would take new memory. The copies go on the optimizer's own copy
queues (``OPTIMIZER``), so a prefetch never holds back an activation's copy.

The step ends once its copies are queued: no host sync. The next step's pipeline is given
this one (``previous``): each copy in waits for the copy out that last wrote the host memory
it reads (the same batch of the previous step when the batches are unchanged, else every
copy out of the previous step), and whoever reads host state waits on the host.

A step is a transaction per batch. The engine's ``update`` either finishes or leaves its
batch as it found it (it keeps an undo copy of what it changes in place). A batch whose
update finished counts as done once its copy out is queued; if that copy fails in the
call, it is tried once more, and if that fails too, the batch's device storage is kept
(``kept``) until ``write_back`` succeeds. A copy out can also fail where it runs, after the
call returned (a runtime's ``failure``): a batch's device memory is given up only once its
copy out landed, so the runtime keeps the memory released after a failed copy, the
pipeline remembers each batch that left (``reclaim`` turns the failed ones into ``kept``),
and a copy in that reads host memory such a copy should have written fails with it. A
SIGINT that arrives during a step is delivered when the step ends (``deferred_interrupt``),
so no asynchronous ``KeyboardInterrupt`` splits the bookkeeping; a second one is delivered
at once.

The first batches of a step can be staged and copied in before the step (``Pipeline.start``,
during backward); the step then continues the same ``Pipeline`` if its batches are the
ones predicted (copying again a batch whose host memory changed since, ``refetch``), and
otherwise ``abandon``s it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from swapopt_core._device.interface import OPTIMIZER, AnyRuntime, on_queue
from swapopt_core._swap.ops import SwapSlot
from swapopt_core._swap.staging import Staged, Staging

logger = logging.getLogger(__name__)

__all__ = ["Pipeline", "deferred_interrupt", "write_back"]


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


def write_back(kept: list[Staged], staging: Staging, runtime: AnyRuntime) -> None:
    """Copy batches kept on the device by an interrupted step to host memory, then free them.

    Each batch leaves ``kept`` only once its copy has finished; on failure the rest stay.
    """
    while kept:
        batch = kept[0]
        ticket = runtime.copy_out(batch.pairs, **on_queue(runtime, OPTIMIZER))
        # The host copy is the state from now on: it must have landed before the device
        # storage that holds the only other copy is given up.
        runtime.host_wait(ticket)
        kept.pop(0)
        staging.unstage(batch)


class Pipeline:
    """One step's batches on their way through the device.

    Args:
        batches: The slots of each batch, in order.
        staging: Allocates and frees each batch's device storage.
        runtime: Queues the copies.
        previous: The previous step's pipeline, whose copies out wrote the host memory
            the copies in read.
    """

    def __init__(
        self,
        batches: Sequence[Sequence[SwapSlot]],
        staging: Staging,
        runtime: AnyRuntime,
        previous: Pipeline | None = None,
    ) -> None:
        self.batches = [list(batch) for batch in batches]
        self.staging = staging
        self.runtime = runtime
        n = len(self.batches)
        # The copies out that wrote the host memory each batch reads. Any of them may fail
        # where it runs, so an unchanged batch waits for its own and any other for all
        # (not just the last: a failed one must fail the copy in that reads its memory).
        self.host_ready: list[tuple[Any, ...]]
        if previous is not None and previous.matches(self.batches):
            self.host_ready = [(ticket,) for ticket in previous.tickets]
        else:
            self.host_ready = [() if previous is None else tuple(previous.tickets)] * n
        self.staged: list[Staged | None] = [None] * n
        # Batches whose copy out is queued and whose memory was released after it.
        self.left: list[Staged | None] = [None] * n
        self.tickets: list[Any] = [None] * n  # copy in, then copy out, of each batch
        self.began = False
        self.h2d = self.d2h = 0
        self.last_out: Any = None

    def matches(self, batches: Sequence[Sequence[SwapSlot]]) -> bool:
        """Whether ``batches`` are the ones this pipeline was built for (same objects)."""
        return len(batches) == len(self.batches) and all(
            len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
            for a, b in zip(batches, self.batches, strict=True)
        )

    def start(self, ahead: int) -> None:
        """Stage the first ``ahead`` batches and queue their copies in.

        Raises:
            BaseException: Whatever was raised; nothing is left on the device.
        """
        try:
            self._begin()
            for j in range(min(ahead, len(self.batches))):
                self._fetch(j)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Give back everything staged, ordered after the copies in still writing it."""
        for j, batch in enumerate(self.staged):
            if batch is not None:
                self.staged[j] = None
                _quietly(
                    functools.partial(self.staging.unstage, batch, self.tickets[j]),
                    "releasing a prefetched batch",
                )
        if self.began:
            self.began = False
            _quietly(self.staging.end, "releasing the staging")

    def _begin(self) -> None:
        if not self.began:
            self.staging.begin(self.batches)
            self.began = True

    def _fetch(self, j: int) -> None:
        if self.staged[j] is not None:
            return
        self.staged[j] = batch = self.staging.stage(j, self.batches[j])
        self._copy_in(j, batch)

    def _copy_in(self, j: int, batch: Staged) -> None:
        # Written only after the host memory it reads was written by the previous step.
        self.tickets[j] = self.runtime.copy_in(
            batch.pairs, self.host_ready[j], **on_queue(self.runtime, OPTIMIZER)
        )
        self.h2d += batch.copy_bytes

    def refetch(self, j: int) -> None:
        """Copy staged batch ``j`` in again: its host memory changed since its copy in was
        queued, or that copy failed. Queued behind the first on the same copy queue."""
        batch = self.staged[j]
        assert batch is not None
        self._copy_in(j, batch)

    def _leave(self, j: int) -> None:
        batch = self.staged[j]
        if batch is not None:
            self.staged[j] = None
            self.staging.unstage(batch, self.tickets[j])
            self.left[j] = batch  # until its copy out is known to have landed

    def reclaim(self, kept: list[Staged]) -> None:
        """Move the batches whose copy out failed where it ran into ``kept``.

        Their memory was released after that copy, so the runtime kept it: it holds the
        only copy of their update until ``write_back``. Only failures the runtime knows of
        are found (this does not block): after ``synchronize``, all of them.
        """
        for j, batch in enumerate(self.left):
            error = None if batch is None else self.runtime.failure(self.tickets[j])
            if batch is None or error is None:
                continue
            logger.warning(
                "swapopt: the copy of batch %d of %d to host memory failed where it ran; "
                "its update stays on the device until it is written back",
                j + 1,
                len(self.left),
                exc_info=error,
            )
            self.left[j] = None
            self.staging.reclaim(batch)
            kept.append(batch)
            # The host memory is rewritten by the write back, which the host waits for.
            if self.last_out is self.tickets[j]:
                self.last_out = None
            self.tickets[j] = None

    def run(
        self,
        update: Callable[[int, dict[Any, Any]], None],
        kept: list[Staged],
        lead: Callable[[], None] | None = None,
    ) -> None:
        """Run ``update`` over every batch with its state on the device.

        Args:
            update: ``update(i, views)`` updates batch ``i`` given a device view per slot;
                if it raises, it must have left the batch (parameters and state) as it
                found it.
            kept: Receives the batches that were updated but could not be copied back.
            lead: Work that moves nothing (the update of the state resident for good), run
                once the copies in of the first two batches are queued, so it hides them.

        The caller holds SIGINT over the whole step (``deferred_interrupt``), so a
        ``KeyboardInterrupt`` only comes from code that raises it.

        Raises:
            BaseException: Whatever was raised, once every batch that was updated is in
                host memory or in ``kept``, every queued copy has finished and all other
                device storage was released.
        """
        n = len(self.batches)
        unwritten: int | None = None  # updated, copy out not queued yet
        try:
            self._begin()
            if n:
                self._fetch(0)
            if lead is not None:
                if n > 1:
                    self._fetch(1)
                lead()
            for i in range(n):
                if i + 1 < n:
                    self._fetch(i + 1)
                batch = self.staged[i]
                assert batch is not None
                self.runtime.wait(self.tickets[i])
                update(i, batch.views)
                unwritten = i
                self.tickets[i] = self.last_out = self.runtime.copy_out(
                    batch.pairs, **on_queue(self.runtime, OPTIMIZER)
                )
                unwritten = None
                self.d2h += batch.copy_bytes
                if i:
                    # After update(i) is queued: compute waits for this copy out only
                    # once the update it overlapped with is in its queue.
                    self._leave(i - 1)
            if n:
                self._leave(n - 1)
        except BaseException:
            self._recover(unwritten, kept)
            _quietly(self.staging.end, "releasing the staging")
            self.began = False
            logger.debug("swap pipeline interrupted with %d of %d batches kept", len(kept), n)
            raise
        self.began = False
        self.staging.end()

    def _recover(self, unwritten: int | None, kept: list[Staged]) -> None:
        """After a failure: write back or keep the updated batch, then drain and free the rest."""
        if unwritten is not None:
            batch = self.staged[unwritten]
            assert batch is not None
            self.staged[unwritten] = None
            self.staging.keep(batch)
            kept.append(batch)
            _quietly(
                lambda: write_back(kept, self.staging, self.runtime),
                "writing back an updated batch",
            )
        # Nothing may still be reading device storage released below.
        _quietly(self.runtime.synchronize, "draining the copy queues")
        # The batches whose copy out failed where it ran join ``kept`` (their memory stays).
        self.reclaim(kept)
        self.last_out = None
        for index, leftover in enumerate(self.staged):
            if leftover is not None:
                self.staged[index] = None
                _quietly(
                    functools.partial(self.staging.unstage, leftover), "releasing a staged batch"
                )


def _quietly(action: Callable[[], None], what: str) -> None:
    """Run a clean-up ``action``; an error in it is logged, the original one propagates."""
    try:
        action()
    except BaseException:  # a second fault must not stop the clean-up of the first
        logger.warning("swapopt: %s after an interrupted step failed", what, exc_info=True)
