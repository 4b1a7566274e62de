"""MindSpore's asynchronous loopback: worker threads play the device's two copy streams.

As in ``loopback``, CPU buffers play the device and separate CPU buffers the host, but
every copy is queued on a lane (``swapopt_core._device.lanes``, the lanes torch's
``loopback-async`` runs on): host-to-device copies on one thread, device-to-host copies on
another, each in queue order, while the step goes on. A ticket is the lane's point after
the copy. Compute is MindSpore's PyNative queue, which runs ops on a worker thread of its
own: a copy starts after the compute queued so far by draining that queue first (a CUDA
copy stream waits on an event recorded on the compute stream), and compute waits on a
ticket by blocking the caller before it queues the update. A release with ``after`` is
queued on the lane of the copy still using the memory, so the pool hands it out again only
once that copy ran.

Every wait the Ascend runtime needs is needed here too: one left out lets a copy read or
write memory that is in use, which the equivalence suite sees as wrong bits (especially
with ``SWAPOPT_LOOPBACK_JITTER_US`` set). A copy that fails on its lane is reported by
``failure``; memory released after it is kept, not recycled.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from swapopt_core._device.lanes import Lane, LaneSettings, Ticket, wait_all
from swapopt_core._mindspore.runtime import MindSporeLoopbackRuntime, drain_compute

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["MindSporeLoopbackAsyncRuntime"]


def _copy(moves: Sequence[tuple[np.ndarray, np.ndarray]]) -> int:
    """Copy each ``(destination, source)`` array pair; return the bytes moved (for pacing)."""
    import numpy

    moved = 0
    for dst, src in moves:
        numpy.copyto(dst, src)
        moved += dst.nbytes
    return moved


class MindSporeLoopbackAsyncRuntime(MindSporeLoopbackRuntime):
    """Loopback with one worker thread per copy direction, tickets and ordered frees.

    Its lanes are paced by ``SWAPOPT_LOOPBACK_GBPS`` and ``SWAPOPT_LOOPBACK_JITTER_US``,
    read when the runtime is built. Never picked by ``runtime="auto"``.

    Raises:
        ValueError: One of those variables holds a value it does not accept.
    """

    name = "loopback-async"

    def __init__(self) -> None:
        super().__init__()
        settings = LaneSettings.from_env()
        self.h2d = Lane("h2d", settings)
        self.d2h = Lane("d2h", settings)

    def copy_in(self, pairs: Sequence[tuple[Any, Any]], after: Sequence[Any] = ()) -> Ticket:
        # The copies start after the compute queued so far: it may still write the host
        # buffers (the packed layout) or use the device memory (the release before).
        drain_compute()
        moves = [(device.asnumpy(), host.asnumpy()) for device, host in pairs]
        return self.h2d.submit(lambda: _copy(moves), after=after)

    def copy_out(self, pairs: Sequence[tuple[Any, Any]]) -> Ticket:
        # The batch's update kernels, queued on MindSpore's worker, must have written the
        # device views before the copy reads them.
        drain_compute()
        moves = [(host.asnumpy(), device.asnumpy()) for device, host in pairs]
        return self.d2h.submit(lambda: _copy(moves))

    def release_device(self, tensor: Any, after: Sequence[Any] = ()) -> None:
        tickets = [ticket for ticket in after if ticket is not None]
        busy = [ticket for ticket in tickets if not ticket.done()]
        if not busy:
            self._recycle_unless_failed(tensor, tickets)
            return
        # Recycled on the lane of the copy still using it, once that copy (and the other
        # busy ones) ran: the pool hands the memory out only when no copy touches it. If
        # one of the others failed, the lane fails this operation too and keeps the memory.
        busy[0].lane.submit(lambda: self._recycle_unless_failed(tensor, tickets), after=busy[1:])

    def _recycle_unless_failed(self, tensor: Any, tickets: list[Ticket]) -> None:
        """Recycle ``tensor`` unless a copy that used it failed: then it keeps its memory."""
        if any(ticket.error is not None for ticket in tickets):
            logger.debug("a copy failed: its device memory is kept, not recycled")
            return
        self._recycle(tensor)

    def failure(self, ticket: Ticket | None) -> BaseException | None:
        return None if ticket is None else ticket.error

    def wait(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            # The update is queued by this thread after this returns: it reads the batch
            # only once its copy in landed.
            ticket.wait()

    def host_wait(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            # The host reads or rewrites memory this copy touches.
            ticket.wait()

    def synchronize(self) -> None:
        # Compute first (its queued ops may still write what the copies read), then a
        # point after everything queued on both lanes, which the host waits for.
        drain_compute()
        wait_all([self.h2d.marker(), self.d2h.marker()])
