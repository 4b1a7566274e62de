"""``runtime="loopback-async"``: the CUDA activation runtime's stream logic, run on the CPU.

CPU tensors play the device, as with ``"loopback"``, but every copy is queued on a copy
lane (``swapopt_core._lanes``): one worker thread per direction, in queue order, as the
CUDA runtime's D2H and H2D streams run their copies. A copy returns a ``Ticket`` at once,
the way ``CudaActivationRuntime`` returns a recorded event, and the caller goes on with
the next op. Where the CUDA runtime makes the compute stream wait on an event, this one
blocks the calling thread on the ticket (on the CPU, the calling thread *is* the compute
stream). So the residency code waits through exactly the calls it makes on CUDA, and a
wait missing there shows up here as wrong bits, most reliably with
``SWAPOPT_LOOPBACK_JITTER_US`` set.

``SWAPOPT_LOOPBACK_GBPS`` and ``SWAPOPT_LOOPBACK_JITTER_US`` are read when the runtime is
made, at the session's first entry.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections.abc import Callable

import torch

from swapopt_core._activations.runtime import ActivationRuntime, byte_view
from swapopt_core._lanes import Lane, LaneSettings, Ticket

logger = logging.getLogger(__name__)

__all__ = ["AsyncLoopbackRuntime"]

#: A calibration copy on an emulated link should take about this long (seconds).
_CALIBRATION_S = 0.02


def _copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], int]:
    """A lane operation copying ``src`` into ``dst``; it returns the bytes it moved.

    The operation lets go of both tensors before its ticket is done, so the lane's thread
    never holds the last reference to a storage: a storage's finalizer (which updates the
    session's bookkeeping) must run on the thread that drives the session.
    """
    refs = [dst, src]
    nbytes = dst.numel() * dst.element_size()

    def run() -> int:
        target, source = refs
        refs.clear()
        try:
            target.copy_(source)
        finally:
            del target, source
        return nbytes

    return run


class AsyncLoopbackRuntime(ActivationRuntime):
    """Copies on one D2H and one H2D worker thread; tickets play the CUDA events.

    The tensors a queued copy reads and writes are also held here, on the calling thread,
    until its ticket is done (the CPU's counterpart of the CUDA allocator keeping a block
    for its stream): a storage that dies while its copy is queued is freed only after the
    copy, and always on the calling thread. ``prune`` lets go of finished copies; the
    session calls it before every op.

    Args:
        settings: Pacing of both lanes; ``None`` reads ``SWAPOPT_LOOPBACK_GBPS`` and
            ``SWAPOPT_LOOPBACK_JITTER_US``.

    Raises:
        ValueError: One of those variables holds a value it does not accept; the message
            names it.
    """

    name = "loopback-async"

    def __init__(self, settings: LaneSettings | None = None) -> None:
        self.settings = settings if settings is not None else LaneSettings.from_env()
        self.d2h = Lane("act-d2h", self.settings)
        self.h2d = Lane("act-h2d", self.settings)
        self._held: dict[Lane, collections.deque[tuple[Ticket, torch.Tensor, torch.Tensor]]] = {
            self.d2h: collections.deque(),
            self.h2d: collections.deque(),
        }
        logger.debug(
            "loopback-async activation runtime: %s GB/s per lane, jitter %d us",
            self.settings.gbps,
            self.settings.jitter_us,
        )

    def begin_entry(self) -> Callable[[], None]:
        """Called at an entry's first op; the returned check lets go of finished copies."""
        self.prune()
        return self.prune

    def prune(self) -> None:
        """Drop this runtime's references to the tensors of copies that finished."""
        for held in self._held.values():
            # A lane finishes its copies in queue order: only the front can be done first.
            while held and held[0][0].done():
                held.popleft()

    def _issue(self, lane: Lane, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        self.prune()
        # No wait for compute before the copy, unlike CUDA's wait_stream: every op queued
        # before this point already ran, since CPU kernels return when they are done.
        ticket = lane.submit(_copier(dst, src))
        # Held until the ticket is done: the copy's storage stays allocated while the lane
        # uses it, and its last reference drops on this thread.
        self._held[lane].append((ticket, dst, src))
        # Compute (a reader, or a release) waits on this before touching the storage.
        return ticket

    def copy_out(self, storage: torch.UntypedStorage, host: torch.Tensor) -> Ticket:
        return self._issue(self.d2h, host, byte_view(storage))

    def copy_in(self, storage: torch.UntypedStorage, host: torch.Tensor) -> Ticket:
        return self._issue(self.h2d, byte_view(storage), host)

    def wait(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            # Compute touches the storage only after its copy landed: the calling thread is
            # the compute stream, so it blocks (CUDA: the stream waits on the event).
            ticket.wait()

    def host_wait(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            # The host is about to reuse or drop the host buffer this copy touches.
            ticket.wait()

    def done(self, ticket: Ticket | None) -> bool:
        return ticket is None or ticket.done()

    def synchronize(self) -> None:
        # Leaving the session: every copy must be done before anyone reads the data.
        for lane in (self.d2h, self.h2d):
            lane.marker().wait()
        self.prune()

    def measure_bandwidth(self, nbytes: int = 32 * 2**20, repeats: int = 5) -> tuple[float, float]:
        """Median D2H and H2D bandwidth in GB/s of copies through the lanes.

        The planner then prices copies at the emulated bandwidth (and with the jitter) the
        replays will see. On an emulated link the copies are shortened to about 20 ms each:
        the lane paces them to the same rate.
        """
        if self.settings.gbps is not None:
            nbytes = min(nbytes, max(2**20, int(self.settings.gbps * 1e9 * _CALIBRATION_S)))
        device = torch.ones(nbytes, dtype=torch.uint8)
        host = self.alloc_host(nbytes)
        host.fill_(2)
        results: dict[str, list[float]] = {"d2h": [], "h2d": []}
        for _ in range(repeats + 1):
            for name, lane, dst, src in (
                ("d2h", self.d2h, host, device),
                ("h2d", self.h2d, device, host),
            ):
                start = time.perf_counter()
                # Calibration happens once per warmup; it needs the finished copy's time.
                lane.submit(_copier(dst, src)).wait()
                seconds = time.perf_counter() - start
                results[name].append(nbytes / max(seconds, 1e-9) / 1e9)
        return statistics.median(results["d2h"][1:]), statistics.median(results["h2d"][1:])
