"""The asynchronous loopback runtime: the CPU plays a device by CUDA's rules of memory and order.

CPU tensors play the device and separate CPU buffers the host, as in ``loopback``, but
every copy is queued on a lane (``swapopt_core._device.lanes``), one worker thread per copy
queue, in queue order, while the caller (the compute queue) goes on. Each half of swapopt
has its own pair of lanes (``ACTIVATIONS``, ``OPTIMIZER``), as it has its own pair of copy
streams on an accelerator. A ticket is the lane's point after the copy.

Emulating a device, this runtime is held to be at least as strict as CUDA in every rule
that decides what memory is used when:

* **The host runs ahead as far as it may.** A copy counts as finished for the host
  (``done``, and the allocator deciding whether a block may be reused) only once the host
  waited for it (``host_wait``, ``synchronize``). Compute waiting on a ticket (``wait``)
  orders compute; it tells the host nothing, as a stream wait on an event would not. (The
  calling thread does block there, because CPU kernels run on it: compute *is* the
  caller.)
* **The caching allocator's two rules** (``caching_pool``): a block released in compute
  order (``release_ordered``) is reused at once; one released while copies use it
  (``release_device``, CUDA's ``record_stream``) is reused only once those copies are
  seen finished, so a step that releases that way takes new memory for every batch, as on
  a device whose host queued the step in one go. ``allocated`` and ``reserved`` are kept
  apart, as ``torch.cuda.memory_reserved`` keeps them.
* **Host memory is not kept alive by the emulation.** A lane holds the host side of a
  queued copy by a weak reference; a copy whose host memory was freed before it ran
  fails, and is recorded in ``violations``: the runtime's ``HostKeeper`` (the code every
  runtime runs, not the emulation) must have kept it. The device side is held until the
  copy ran, and released on the calling thread, as the CUDA allocator's own streams keep
  their blocks.
* **Copies queue FIFO per lane**: a copy queued behind another waits for it.

Copies wait for the compute queued before them trivially here (CPU kernels return done);
that wait is checked with streams faked by PyTorch's rules instead (tests). Unlike CUDA, a
copy here can fail on its own, on its lane: its ticket then reports the error
(``failure``), and memory released after it is kept (the device copy of a batch whose copy
out failed is the only one left; the engine writes it back later).

``SWAPOPT_LOOPBACK_GBPS`` and ``SWAPOPT_LOOPBACK_JITTER_US`` pace the lanes; they are read
when an instance is made (never at import) and are part of its ``shared_key``, so a changed
environment gets new lanes.
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Callable, Sequence

import torch

from swapopt_core._device.interface import ACTIVATIONS, OPTIMIZER, CopyPair, HostKeeper
from swapopt_core._device.lanes import Lane, LaneSettings, Ticket, wait_all
from swapopt_core._device.loopback import LoopbackRuntime

logger = logging.getLogger(__name__)

__all__ = ["LoopbackAsyncRuntime", "copier"]

#: A calibration copy on an emulated link should take about this long (seconds).
_CALIBRATION_S = 0.02


class HostMemoryFreed(RuntimeError):
    """A queued copy's host memory was freed before the copy ran (a device would have
    read or written freed memory)."""


class _WeakHost:
    """The host side of a queued copy, held weakly: its storage and the view on it."""

    __slots__ = ("dtype", "offset", "ref", "size", "stride")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ref = weakref.ref(tensor.untyped_storage())
        self.dtype = tensor.dtype
        self.offset = tensor.storage_offset()
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())

    def resolve(self) -> torch.Tensor:
        storage = self.ref()
        if storage is None:
            raise HostMemoryFreed(
                "the host memory of a queued copy was freed before the copy ran: nothing "
                "kept it alive until the copy finished"
            )
        view = torch.empty(0, dtype=self.dtype)
        return view.set_(storage, self.offset, self.size, self.stride)


def copier(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], host_side: int) -> Callable[[], int]:
    """A lane operation copying each ``(destination, source)`` pair; it returns the bytes
    it moved (for pacing).

    The host side (index ``host_side`` of each pair) is held weakly: host memory freed
    before the copy runs makes it fail (``HostMemoryFreed``). Written through ``.data``,
    which shares the memory but not the version counter: the prefetch tells the user's
    in-place edits of host state by that counter, and a copy that lands late on a lane is
    swapopt's, not an edit (on CUDA ``copy_`` counts when queued). The operation lets go
    of the device tensors before its ticket is done; the runtime holds them until then, so
    their last reference drops on the thread that drives the session.
    """
    refs: list[tuple[torch.Tensor | _WeakHost, torch.Tensor | _WeakHost]] = [
        (_WeakHost(dst), src) if host_side == 0 else (dst, _WeakHost(src)) for dst, src in pairs
    ]
    nbytes = sum(dst.numel() * dst.element_size() for dst, _ in pairs)

    def run() -> int:
        moves = list(refs)
        refs.clear()
        try:
            for dst, src in moves:
                target = dst.resolve() if isinstance(dst, _WeakHost) else dst
                source = src.resolve() if isinstance(src, _WeakHost) else src
                target.data.copy_(source)
                del target, source
        finally:
            del moves
        return nbytes

    return run


class LoopbackAsyncRuntime(LoopbackRuntime):
    """Loopback with a worker thread per copy queue, tickets, and CUDA's memory rules.

    The device tensors a queued copy uses are held here, on the calling thread, until its
    ticket is done, and their last reference drops on this thread (``prune``); host tensors
    are kept by the runtime's ``HostKeeper`` only, the code every runtime runs. Every copy
    and every op of a session entry call ``prune``.

    Args:
        settings: Pacing of the lanes; ``None`` reads ``SWAPOPT_LOOPBACK_GBPS`` and
            ``SWAPOPT_LOOPBACK_JITTER_US``.

    Attributes:
        violations: What broke a device's rules here (a copy whose host memory was freed
            before it ran), newest last: a device would have moved freed memory.

    Raises:
        ValueError: One of those variables holds a value it does not accept; the message
            names it.
    """

    name = "loopback-async"
    copy_queues = (ACTIVATIONS, OPTIMIZER)

    def __init__(self, settings: LaneSettings | None = None) -> None:
        super().__init__()
        self.settings = settings if settings is not None else LaneSettings.from_env()
        self.lanes: dict[tuple[str, str], Lane] = {
            (direction, queue): Lane(
                direction if queue == ACTIVATIONS else f"{queue}-{direction}", self.settings
            )
            for queue in (ACTIVATIONS, OPTIMIZER)
            for direction in ("h2d", "d2h")
        }
        #: The activation offload's lanes (the optimizer's: ``lane(direction, OPTIMIZER)``).
        self.h2d = self.lanes[("h2d", ACTIVATIONS)]
        self.d2h = self.lanes[("d2h", ACTIVATIONS)]
        self._held: dict[Lane, collections.deque[tuple[Ticket, list[torch.Tensor]]]] = {
            lane: collections.deque() for lane in self.lanes.values()
        }
        self.hosts = HostKeeper(lambda ticket: ticket.done())
        self.violations: collections.deque[str] = collections.deque(maxlen=64)
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

    def lane(self, direction: str, queue: str = ACTIVATIONS) -> Lane:
        """The lane of ``queue``'s copies in one ``direction`` (``"h2d"`` or ``"d2h"``).

        Raises:
            ValueError: ``queue`` is not ``ACTIVATIONS`` or ``OPTIMIZER``.
        """
        lane = self.lanes.get((direction, queue))
        if lane is None:
            raise ValueError(
                f"copy queue {queue!r} does not exist; use {ACTIVATIONS!r} or {OPTIMIZER!r}"
            )
        return lane

    def begin_entry(self, device: torch.device) -> Callable[[], None]:
        """Called at an entry's first op; the returned check lets go of finished copies."""
        self.prune()
        return self.prune

    def prune(self) -> None:
        """Let go of the tensors of copies that finished (on this, the calling thread)."""
        for held in self._held.values():
            # A lane finishes its copies in queue order: only the front can be done first.
            while held and held[0][0].done():
                ticket, _ = held.popleft()
                self._check(ticket)
        self.hosts.prune()

    def _check(self, ticket: Ticket) -> None:
        """Record a copy that found its host memory freed (a device would have moved it)."""
        error = ticket.error
        if isinstance(error, HostMemoryFreed):
            message = f"a copy on lane {ticket.lane.name!r}: {error}"
            if message not in self.violations:
                logger.error("swapopt: %s", message)
            self.violations.append(message)

    def _issue(
        self,
        lane: Lane,
        pairs: list[CopyPair],
        host_side: int,
        after: Sequence[Ticket | None],
    ) -> Ticket:
        self.prune()
        # No wait for compute before the copy, unlike a stream's wait_stream: every op
        # queued before this point already ran, since CPU kernels return when done.
        ticket = lane.submit(copier(pairs, host_side), after=after)
        # The device side is held until the ticket is done: it stays allocated while the
        # lane uses it, and its last reference drops on this thread.
        self._held[lane].append((ticket, [pair[1 - host_side] for pair in pairs]))
        # The host side only as every runtime keeps it (the lane holds it weakly).
        self.hosts.keep(ticket, [pair[host_side] for pair in pairs])
        return ticket

    def copy_in(
        self,
        pairs: Sequence[CopyPair],
        after: Sequence[Ticket | None] = (),
        queue: str = ACTIVATIONS,
    ) -> Ticket:
        moves = [(device, host) for device, host in pairs]
        return self._issue(self.lane("h2d", queue), moves, 1, after)

    def copy_out(self, pairs: Sequence[CopyPair], queue: str = ACTIVATIONS) -> Ticket:
        # The caller is the compute queue: what it queued before (the update) has run.
        moves = [(host, device) for device, host in pairs]
        return self._issue(self.lane("d2h", queue), moves, 0, ())

    # ---- the allocator's two rules -------------------------------------------------------

    def _collect(self) -> None:
        # An allocation first gives back the blocks whose copies the host has seen finish.
        self.pool.collect(
            lambda ticket: ticket.seen,
            lambda ticket: ticket.error is not None,
            self._recycle,
        )

    def release_device(self, tensor: torch.Tensor, after: Sequence[Ticket | None] = ()) -> None:
        """CUDA's ``record_stream`` rule: reused once the copies are seen finished."""
        tickets = [ticket for ticket in after if ticket is not None]
        if all(ticket.seen for ticket in tickets):
            self._recycle_unless_failed(tensor, tickets)
            return
        # Held back until the host saw the copies finish (on a device that queued the step
        # in one go: not before the step's end); until then it stays reserved.
        self.pool.hold(tensor, tickets)

    def release_ordered(self, tensor: torch.Tensor, after: Sequence[Ticket | None] = ()) -> None:
        tickets = [ticket for ticket in after if ticket is not None and not ticket.done()]
        if not tickets:
            self._recycle_unless_failed(tensor, [t for t in after if t is not None])
            return
        # Free in compute order: the next allocation may take it, and the compute queue
        # (this thread) waits for these copies then, where a stream would have waited here.
        self.pool.give_fenced(tensor, tickets)
        self._note_release(tensor.untyped_storage())

    @staticmethod
    def _settle(tickets: Sequence[Ticket]) -> bool:
        """Compute reuses a fenced block only after the copies that used it: the calling
        thread is the compute queue, so it blocks. Whether they all succeeded."""
        for ticket in tickets:
            # Compute writes the block next: the copies reading or writing it must be done.
            ticket.settle()
        return all(ticket.error is None for ticket in tickets)

    def _recycle_unless_failed(self, tensor: torch.Tensor, tickets: list[Ticket]) -> None:
        """Recycle ``tensor`` unless a copy that used it failed: then it keeps its memory."""
        if any(ticket.error is not None for ticket in tickets):
            logger.debug("a copy failed: its device memory is kept, not recycled")
            return
        self._recycle(tensor)

    # ---- waits ---------------------------------------------------------------------------

    def failure(self, ticket: Ticket | None) -> BaseException | None:
        return None if ticket is None else ticket.error

    def wait(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            # Compute touches the copied memory only once the copy landed: the calling
            # thread is the compute queue, so it blocks (a stream would wait on the event).
            # The host learns nothing from it: the ticket is not ``seen``.
            ticket.wait()

    def host_wait(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            try:
                # The host reads or rewrites memory this copy touches.
                ticket.wait()
            finally:
                ticket.lane.observe(ticket)

    def done(self, ticket: Ticket | None) -> bool:
        # What a host that may be any distance ahead of its device knows: only what it
        # waited for.
        return ticket is None or ticket.seen

    def synchronize(self) -> None:
        # A point after everything queued on every lane; the host waits for all of them.
        markers = [lane.marker() for lane in self.lanes.values()]
        wait_all(markers)
        for marker in markers:
            marker.lane.observe(marker)
        self.prune()
        # The allocator's next request would give the held blocks back: no copy uses them.
        self._collect()

    def measure_bandwidth(self, nbytes: int = 32 * 2**20, repeats: int = 5) -> tuple[float, float]:
        """Median D2H and H2D bandwidth in GB/s of copies through the lanes.

        The planner then prices copies at the emulated bandwidth (and with the jitter) the
        replays will see. On an emulated link the copies are shortened to about 20 ms each:
        the lane paces them to the same rate.
        """
        if self.settings.gbps is not None:
            nbytes = min(nbytes, max(2**20, int(self.settings.gbps * 1e9 * _CALIBRATION_S)))
        try:
            return super().measure_bandwidth(nbytes, repeats)
        finally:
            # The calibration's buffer is no state: kept cached, it would count as memory
            # the swap reserved (``SwapStats.peak_reserved_state_bytes``) for good.
            self.pool.empty_cache()
