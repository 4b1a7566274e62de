"""Copies, waits and clocks for activation offload: one stream per copy direction.

Every copy is issued at a point of the compute stream and starts only after the compute
work queued before that point (the copy stream waits for it), which is the rule the
simulator and the planner assume. Device storage is allocated and freed on the compute
stream; a release waits for the copies still using the storage. The compute stream is the
one current when an entry's first op ran: ops on another stream, or inside a CUDA graph
capture, are refused, since the copies would not be ordered with them.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from swapopt_core._torch.pinned import alloc_pinned

logger = logging.getLogger(__name__)

__all__ = ["ActivationRuntime", "CudaActivationRuntime", "byte_view", "choose_runtime"]


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def choose_runtime(wanted: str, device: torch.device | None = None) -> ActivationRuntime:
    """The runtime that ``OffloadConfig.runtime`` names.

    Args:
        wanted: ``"auto"`` follows ``device``: the CUDA runtime on that CUDA device, loopback
            for anything else (CPU tensors are then the "device" and their copies go to
            other CPU buffers). ``"cuda"`` is the current CUDA device, ``"loopback"`` CPU
            tensors, wherever the activations are; ``"loopback-async"`` too, with the
            copies on worker threads as on CUDA streams (``async_runtime.py``).
        device: Where the activations are, as an entry's first op shows it; what
            ``"auto"`` follows.

    Raises:
        RuntimeError: ``"cuda"`` is asked for and CUDA is not available.
        ValueError: ``"loopback-async"`` is asked for and a ``SWAPOPT_LOOPBACK_*`` variable
            holds a value it does not accept.
    """
    if wanted == "auto" and device is not None and device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return CudaActivationRuntime(torch.device("cuda", index))
    if wanted == "loopback-async":
        # Imported here: that module builds on this one.
        from swapopt_core._activations.async_runtime import AsyncLoopbackRuntime

        return AsyncLoopbackRuntime()
    if wanted != "cuda":
        return ActivationRuntime()
    if not torch.cuda.is_available():
        raise RuntimeError(
            "OffloadConfig.runtime='cuda' but CUDA is not available. Use runtime='loopback' "
            "to run the offload on CPU, or 'auto' to follow the activations."
        )
    return CudaActivationRuntime(torch.device("cuda", torch.cuda.current_device()))


class ActivationRuntime:
    """Loopback behaviour; the CUDA runtime overrides the parts that involve streams."""

    name = "loopback"

    def serves(self, device: torch.device) -> bool:
        """Whether storages on ``device`` are the ones this runtime moves."""
        return device.type == "cpu"

    def begin_entry(self) -> Callable[[], None] | None:
        """Called at an entry's first op; returns a check to run before each op, if any."""
        return None

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_out(self, storage: torch.UntypedStorage, host: torch.Tensor) -> Any:
        host.copy_(byte_view(storage))
        return None

    def copy_in(self, storage: torch.UntypedStorage, host: torch.Tensor) -> Any:
        byte_view(storage).copy_(host)
        return None

    def wait(self, ticket: Any) -> None:
        return None

    def host_wait(self, ticket: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    # ---- timing --------------------------------------------------------------------------

    def stamp(self) -> Any:
        """A point on the compute stream whose time ``elapsed_ms`` can read later."""
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1e3

    def measure_bandwidth(self, nbytes: int = 32 * 2**20, repeats: int = 5) -> tuple[float, float]:
        """Median D2H and H2D bandwidth in GB/s over ``repeats`` warm copies."""
        device = torch.empty(nbytes, dtype=torch.uint8)
        host = self.alloc_host(nbytes)
        device.fill_(1)
        host.fill_(2)
        d2h, h2d = [], []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            host.copy_(device)
            middle = time.perf_counter()
            device.copy_(host)
            end = time.perf_counter()
            d2h.append(nbytes / max(middle - start, 1e-9) / 1e9)
            h2d.append(nbytes / max(end - middle, 1e-9) / 1e9)
        return statistics.median(d2h[1:]), statistics.median(h2d[1:])


class CudaActivationRuntime(ActivationRuntime):
    """Asynchronous copies on one D2H and one H2D stream per device."""

    name = "cuda"

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
        # compute wait on it first, so the block returns to the pool after the copy; a
        # storage that dies first is host-waited on in Residency._died before anything else
        # is queued. record_stream would only hold freed blocks back from reuse.
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
            # Compute touches the storage only after its copy landed; no host block.
            torch.cuda.current_stream(self.device).wait_event(ticket)

    def host_wait(self, ticket: torch.cuda.Event | None) -> None:
        if ticket is not None:
            # The host is about to reuse or drop the host buffer this copy touches.
            ticket.synchronize()

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
