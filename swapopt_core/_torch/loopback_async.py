"""The asynchronous loopback runtime: worker threads play the device's two copy streams.

CPU tensors play the device and separate CPU buffers the host, as in ``loopback``, but
every copy is queued on a lane (``swapopt_core._lanes``): host-to-device copies on one
thread, device-to-host copies on another, each in queue order, while the caller (the
compute queue) goes on. A ticket is the lane's point after the copy. The caller is the
compute queue, so making compute wait on a ticket blocks the caller; a release with
``after`` is queued on the lane of the copy it waits for, as the CUDA allocator holds a
block back from reuse until the copy that used it finished.

Every wait the CUDA runtime needs is needed here too: one left out lets a copy read or
write memory that is in use, which the equivalence suites see as wrong bits (especially
with ``SWAPOPT_LOOPBACK_JITTER_US`` set).

Unlike CUDA, a copy here can fail on its own, on its lane: its ticket then reports the
error (``failure``), and a release ordered after it keeps the memory (the device copy of a
batch whose copy out failed is the only one left; the engine writes it back later).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from swapopt_core._lanes import Lane, LaneSettings, Ticket, wait_all
from swapopt_core._runtime import CopyPair
from swapopt_core._torch.loopback import LoopbackRuntime

logger = logging.getLogger(__name__)

__all__ = ["LoopbackAsyncRuntime", "copy_pairs"]


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Copy each ``(destination, source)`` pair; return the bytes moved (for pacing).

    Written through ``.data``, which shares the memory but not the version counter: the
    prefetch tells the user's in-place edits of host state by that counter, and a copy that
    lands late on a lane is the engine's, not an edit (on CUDA ``copy_`` counts when queued).
    """
    moved = 0
    for dst, src in pairs:
        dst.data.copy_(src)
        moved += dst.numel() * dst.element_size()
    return moved


class LoopbackAsyncRuntime(LoopbackRuntime):
    """Loopback with one worker thread per copy direction, tickets and ordered frees.

    Its lanes are paced by ``SWAPOPT_LOOPBACK_GBPS`` and ``SWAPOPT_LOOPBACK_JITTER_US``,
    read when the runtime is built.

    Raises:
        ValueError: One of those variables holds a value it does not accept.
    """

    name = "loopback-async"

    def __init__(self) -> None:
        super().__init__()
        settings = LaneSettings.from_env()
        self.h2d = Lane("h2d", settings)
        self.d2h = Lane("d2h", settings)

    def copy_in(self, pairs: Sequence[CopyPair], after: Sequence[Any] = ()) -> Ticket:
        moves = [(device, host) for device, host in pairs]
        return self.h2d.submit(lambda: copy_pairs(moves), after=after)

    def copy_out(self, pairs: Sequence[CopyPair]) -> Ticket:
        # The caller is the compute queue: what it queued before (the update) has run.
        moves = [(host, device) for device, host in pairs]
        return self.d2h.submit(lambda: copy_pairs(moves))

    def release_device(self, tensor: torch.Tensor, after: Sequence[Any] = ()) -> None:
        tickets = [ticket for ticket in after if ticket is not None]
        busy = [ticket for ticket in tickets if not ticket.done()]
        if not busy:
            self._recycle_unless_failed(tensor, tickets)
            return
        # Freed on the lane of the copy still using it, once that copy (and the other
        # busy ones) ran: the memory goes back only when no copy touches it. If one of
        # the others failed, the lane fails this operation too and keeps the memory.
        busy[0].lane.submit(lambda: self._recycle_unless_failed(tensor, tickets), after=busy[1:])

    def _recycle_unless_failed(self, tensor: torch.Tensor, tickets: list[Ticket]) -> None:
        """Recycle ``tensor`` unless a copy that used it failed: then it keeps its memory."""
        if any(ticket.error is not None for ticket in tickets):
            logger.debug("a copy failed: its device memory is kept, not recycled")
            return
        self._recycle(tensor)

    def failure(self, ticket: Ticket | None) -> BaseException | None:
        return None if ticket is None else ticket.error

    def wait(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            # Compute is the calling thread: it reads the copied batch only once it landed.
            ticket.wait()

    def host_wait(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            # The host reads or rewrites memory this copy touches.
            ticket.wait()

    def synchronize(self) -> None:
        # A point after everything queued on both lanes; the host waits for both.
        wait_all([self.h2d.marker(), self.d2h.marker()])
