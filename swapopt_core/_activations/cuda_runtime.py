"""The CUDA activation runtime: asynchronous copies on one D2H and one H2D stream per device,
ordered with the entry's compute stream by events (the rules of ``runtime.py``)."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch

from swapopt_core._activations.runtime import ActivationRuntime, byte_view
from swapopt_core._torch.pinned import alloc_pinned

logger = logging.getLogger(__name__)

__all__ = ["CudaActivationRuntime"]


class CudaActivationRuntime(ActivationRuntime):
    """Asynchronous copies on one D2H and one H2D stream per device."""

    name = "cuda"
    device_types = ("cuda",)

    @classmethod
    def create(cls, device: torch.device | None) -> CudaActivationRuntime:
        """The runtime for ``device``, or for the current CUDA device when ``None``.

        Raises:
            RuntimeError: CUDA is not available.
        """
        if device is None or device.index is None:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "OffloadConfig.runtime='cuda' but CUDA is not available. Use "
                    "runtime='loopback' to run the offload on CPU, or 'auto' to follow the "
                    "activations."
                )
            return cls(torch.device("cuda", torch.cuda.current_device()))
        return cls(device)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device=device)
        self.h2d = torch.cuda.Stream(device=device)
        self.compute: torch.cuda.Stream | None = None  # set at each entry's first op
        self.pageable = False  # set once page-locking failed: later buffers do not retry

    def serves(self, device: torch.device) -> bool:
        return device == self.device

    def begin_entry(self) -> Callable[[], None]:
        """Remember the compute stream of this entry and refuse to start inside a capture.

        Raises:
            RuntimeError: A CUDA graph is being captured on the current stream.
        """
        self.compute = torch.cuda.current_stream(self.device)
        self.check_ordering()
        return self.check_ordering

    def check_ordering(self) -> None:
        """Refuse an op the copies could not be ordered with.

        Raises:
            RuntimeError: The op runs while a CUDA graph is captured (a replayed graph would
                skip the copies and releases), or on another stream than the entry's first
                op (the copies wait for that stream only).
        """
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "An OffloadSession op ran while a CUDA graph was being captured: the graph "
                "would replay without the session's copies. Capture CUDA graphs outside the "
                "session, or wrap the captured part in skip_offload."
            )
        current = torch.cuda.current_stream(self.device)
        if current != self.compute:
            raise RuntimeError(
                f"An OffloadSession op ran on CUDA stream {current}, but the session's entry "
                f"started on {self.compute}: its copies are ordered with that stream only. "
                "Run the step on one stream, or wrap side-stream work in skip_offload."
            )

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        if self.pageable:
            return torch.empty(nbytes, dtype=torch.uint8)
        # alloc_pinned clears CUDA's sticky error after a failed registration.
        host, error = alloc_pinned(nbytes, torch.uint8)
        if error:
            self.pageable = True
            logger.warning(
                "cudaHostRegister failed (cudaError %d); offloaded activations use pageable "
                "memory from now on, so their copies will not overlap compute.",
                error,
            )
        return host

    def _issue(
        self,
        stream: torch.cuda.Stream,
        dst: torch.Tensor,
        src: torch.Tensor,
    ) -> torch.cuda.Event:
        # The copy starts after the compute work queued so far (producer done, or the
        # re-allocated block no longer in use by earlier kernels).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        # No record_stream: the event keeps the block safe. A release (resize to 0) makes
        # compute wait on it first, so the block returns to the pool after the copy; for a
        # storage that dies first, Residency._died makes compute wait on it before anything
        # else is queued. record_stream would only hold freed blocks back from reuse.
        # Compute (a reader, or a release) waits on this before touching the storage.
        return stream.record_event()

    def copy_out(self, storage: torch.UntypedStorage, host: torch.Tensor) -> torch.cuda.Event:
        view = byte_view(storage)
        return self._issue(self.d2h, host, view)

    def copy_in(self, storage: torch.UntypedStorage, host: torch.Tensor) -> torch.cuda.Event:
        view = byte_view(storage)
        return self._issue(self.h2d, view, host)

    def wait(self, ticket: torch.cuda.Event | None) -> None:
        if ticket is not None:
            # Compute touches the storage (or its freed block) only after the copy landed;
            # no host block. The entry's compute stream, not whichever is current: a storage
            # may die while a side stream is current, and its block belongs to compute.
            stream = self.compute or torch.cuda.current_stream(self.device)
            stream.wait_event(ticket)

    def host_wait(self, ticket: torch.cuda.Event | None) -> None:
        if ticket is not None:
            # The host is about to reuse or drop the host buffer this copy touches.
            ticket.synchronize()

    def done(self, ticket: torch.cuda.Event | None) -> bool:
        return ticket is None or ticket.query()

    def synchronize(self) -> None:
        # Leaving the session: every copy must be done before anyone reads the data.
        self.d2h.synchronize()
        self.h2d.synchronize()

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        # Timing only: recorded on compute, read once at the end of the warmup.
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))

    def measure_bandwidth(self, nbytes: int = 64 * 2**20, repeats: int = 5) -> tuple[float, float]:
        device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        host = self.alloc_host(nbytes)
        results: dict[str, list[float]] = {"d2h": [], "h2d": []}
        for _ in range(repeats + 1):
            for name, stream, dst, src in (
                ("d2h", self.d2h, host, device),
                ("h2d", self.h2d, device, host),
            ):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record()
                    dst.copy_(src, non_blocking=True)
                    end.record()
                # Calibration happens once per warmup; it needs the measured time.
                end.synchronize()
                results[name].append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        return (statistics.median(results["d2h"][1:]), statistics.median(results["h2d"][1:]))
