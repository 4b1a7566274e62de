"""The asynchronous loopback runtime: worker threads play the device's two copy streams.

CPU tensors play the device and separate CPU buffers the host, as in ``loopback``, but
every copy is queued on a lane (``swapopt_core._device.lanes``): host-to-device copies on
one thread, device-to-host copies on another, each in queue order, while the caller (the
compute queue) goes on. A ticket is the lane's point after the copy. The caller is the
compute queue, so making compute wait on a ticket blocks the caller; a release with
``after`` is queued on the lane of the copy it waits for, as the CUDA allocator holds a
block back from reuse until the copy that used it finished.

One instance (one pair of lanes) serves the optimizer swap and the activation offload, as
one pair of copy streams per device does on an accelerator. Every wait the accelerator
runtime needs is needed here too: one left out lets a copy read or write memory that is in
use, which the equivalence suites see as wrong bits (especially with
``SWAPOPT_LOOPBACK_JITTER_US`` set). ``SWAPOPT_LOOPBACK_GBPS`` and
``SWAPOPT_LOOPBACK_JITTER_US`` are read when an instance is made (never at import); they are
part of its ``shared_key``, so a changed environment gets new lanes.

Unlike CUDA, a copy here can fail on its own, on its lane: its ticket then reports the
error (``failure``), and a release ordered after it keeps the memory (the device copy of a
batch whose copy out failed is the only one left; the engine writes it back later).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence

import torch

from swapopt_core._device.interface import CopyPair
from swapopt_core._device.lanes import Lane, LaneSettings, Ticket, wait_all
from swapopt_core._device.loopback import LoopbackRuntime

logger = logging.getLogger(__name__)

__all__ = ["LoopbackAsyncRuntime", "copier"]

#: A calibration copy on an emulated link should take about this long (seconds).
_CALIBRATION_S = 0.02


def copier(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], int]:
    """A lane operation copying each ``(destination, source)`` pair; it returns the bytes
    it moved (for pacing).

    Written through ``.data``, which shares the memory but not the version counter: the
    prefetch tells the user's in-place edits of host state by that counter, and a copy that
    lands late on a lane is swapopt's, not an edit (on CUDA ``copy_`` counts when queued).
    The operation lets go of the tensors before its ticket is done, so the lane's thread
    never holds the last reference to a storage: a storage's finalizer (which updates the
    session's bookkeeping) must run on the thread that drives the session.
    """
    refs = list(pairs)
    nbytes = sum(dst.numel() * dst.element_size() for dst, _ in refs)

    def run() -> int:
        moves = list(refs)
        refs.clear()
        try:
            for dst, src in moves:
                dst.data.copy_(src)
        finally:
            del moves
        return nbytes

    return run


class LoopbackAsyncRuntime(LoopbackRuntime):
    """Loopback with one worker thread per copy direction, tickets and ordered frees.

    The tensors a queued copy reads and writes are also held here, on the calling thread,
    until its ticket is done (the CPU's counterpart of the CUDA allocator keeping a block
    for its stream): a storage that dies while its copy is queued is freed only after the
    copy, and always on the calling thread. ``prune`` lets go of finished copies; every copy
    and every op of a session entry call it.

    Args:
        settings: Pacing of both lanes; ``None`` reads ``SWAPOPT_LOOPBACK_GBPS`` and
            ``SWAPOPT_LOOPBACK_JITTER_US``.

    Raises:
        ValueError: One of those variables holds a value it does not accept; the message
            names it.
    """

    name = "loopback-async"

    def __init__(self, settings: LaneSettings | None = None) -> None:
        super().__init__()
        self.settings = settings if settings is not None else LaneSettings.from_env()
        self.h2d = Lane("h2d", self.settings)
        self.d2h = Lane("d2h", self.settings)
        self._held: dict[Lane, collections.deque[tuple[Ticket, list[CopyPair]]]] = {
            self.d2h: collections.deque(),
            self.h2d: collections.deque(),
        }
        logger.debug(
            "loopback-async runtime: %s GB/s per lane, jitter %d us",
            self.settings.gbps,
            self.settings.jitter_us,
        )

    @classmethod
    def shared_key(cls, device: torch.device | None) -> object:
        # Lanes paced otherwise are another instance: the environment is read here, when
        # an instance is asked for, never at import.
        return LaneSettings.from_env()

    def begin_entry(self, device: torch.device) -> Callable[[], None]:
        """Called at an entry's first op; the returned check lets go of finished copies."""
        self.prune()
        return self.prune

    def prune(self) -> None:
        """Drop this runtime's references to the tensors of copies that finished."""
        for held in self._held.values():
            # A lane finishes its copies in queue order: only the front can be done first.
            while held and held[0][0].done():
                held.popleft()

    def _issue(self, lane: Lane, moves: list[CopyPair], after: Sequence[Ticket | None]) -> Ticket:
        self.prune()
        # No wait for compute before the copy, unlike a stream's wait_stream: every op
        # queued before this point already ran, since CPU kernels return when done.
        ticket = lane.submit(copier(moves), after=after)
        # Held until the ticket is done: the storages stay allocated while the lane uses
        # them, and their last reference drops on this thread.
        self._held[lane].append((ticket, moves))
        return ticket

    def copy_in(self, pairs: Sequence[CopyPair], after: Sequence[Ticket | None] = ()) -> Ticket:
        return self._issue(self.h2d, [(device, host) for device, host in pairs], after)

    def copy_out(self, pairs: Sequence[CopyPair]) -> Ticket:
        # The caller is the compute queue: what it queued before (the update) has run.
        return self._issue(self.d2h, [(host, device) for device, host in pairs], ())

    def release_device(self, tensor: torch.Tensor, after: Sequence[Ticket | None] = ()) -> None:
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
            # Compute touches the copied memory only once the copy landed: the calling
            # thread is the compute queue, so it blocks (a stream would wait on the event).
            ticket.wait()

    def host_wait(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            # The host reads or rewrites memory this copy touches.
            ticket.wait()

    def done(self, ticket: Ticket | None) -> bool:
        return ticket is None or ticket.done()

    def synchronize(self) -> None:
        # A point after everything queued on both lanes; the host waits for both.
        wait_all([self.h2d.marker(), self.d2h.marker()])
        self.prune()

    def measure_bandwidth(self, nbytes: int = 32 * 2**20, repeats: int = 5) -> tuple[float, float]:
        """Median D2H and H2D bandwidth in GB/s of copies through the lanes.

        The planner then prices copies at the emulated bandwidth (and with the jitter) the
        replays will see. On an emulated link the copies are shortened to about 20 ms each:
        the lane paces them to the same rate.
        """
        if self.settings.gbps is not None:
            nbytes = min(nbytes, max(2**20, int(self.settings.gbps * 1e9 * _CALIBRATION_S)))
        return super().measure_bandwidth(nbytes, repeats)
