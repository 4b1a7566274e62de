"""The CUDA runtime: one copy stream per direction and device, events, exact-size pinned host.

Device storage for swapped state is allocated on the compute stream, so a batch's memory
goes back to the pool forward and backward draw from. Each copy stream first waits for the
compute work queued so far (that work wrote the batch, or just gave the memory back), and a
release passes the copy streams still using the memory to the allocator
(``record_stream``), which reuses it only after those copies finished: no host sync and no
compute wait. Copies in and out run on separate streams, so batch i+1 comes in while
batch i-1 goes out (full duplex).

A step ends with its copies out still queued; at normal exit every live runtime waits for
its copy streams, so the host state is final once the process ends.

A copy that fails on its stream is an asynchronous CUDA error: it is sticky (the context is
unusable from then on) and surfaces at the next synchronizing call, without telling which
copy failed. There is nothing to recover in-process, so ``failure`` reports nothing here.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from swapopt_core._runtime import CopyPair, TransferRuntime
from swapopt_core._torch.pinned import alloc_pinned

logger = logging.getLogger(__name__)

#: One recorded event per device the copies touched, with the stream it was recorded on.
_Ticket = list[tuple["torch.cuda.Stream", "torch.cuda.Event"]]


class CudaRuntime(TransferRuntime):
    """Asynchronous runtime for CUDA tensors."""

    name = "cuda"
    device_types = ("cuda",)

    def __init__(self) -> None:
        super().__init__()
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self._register_failed = False
        _LIVE.add(self)

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def _stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        stream = self._streams.get((device, direction))
        if stream is None:
            stream = self._streams[(device, direction)] = torch.cuda.Stream(device=device)
        return stream

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._register_failed:
            return torch.empty(numel, dtype=dtype)
        host, error = alloc_pinned(numel, dtype)
        if error == 0:
            self._count_host(host)
        else:
            self._register_failed = True
            logger.warning(
                "cudaHostRegister failed (cudaError %d); swapped state uses pageable host "
                "memory, so copies will not overlap with compute.",
                error,
            )
        return host

    def alloc_device(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # On the compute stream: freed blocks return to the pool forward and backward use.
        return torch.empty(numel, dtype=dtype, device=device)

    def release_device(self, tensor: torch.Tensor, after: Sequence[Any] = ()) -> None:
        for ticket in after:
            for stream, _event in ticket or ():
                if stream.device == tensor.device:
                    # The allocator reuses the block only once this stream's queued copies
                    # (which still read or write it) finished.
                    tensor.record_stream(stream)
        tensor.untyped_storage().resize_(0)

    def _by_device(self, pairs: Sequence[CopyPair]) -> dict[torch.device, list[CopyPair]]:
        grouped: dict[torch.device, list[CopyPair]] = {}
        for pair in pairs:
            grouped.setdefault(pair[0].device, []).append(pair)
        return grouped

    def copy_in(self, pairs: Sequence[CopyPair], after: Sequence[Any] = ()) -> _Ticket:
        ticket: _Ticket = []
        for device, group in self._by_device(pairs).items():
            stream = self._stream(device, "h2d")
            # The memory may have been given back by compute work queued just before.
            stream.wait_stream(torch.cuda.current_stream(device))
            for other in after:
                for _stream, event in other or ():
                    # A copy still using this memory, or writing the host memory read here.
                    stream.wait_event(event)
            with torch.cuda.stream(stream):
                for device_tensor, host_tensor in group:
                    # Async from pinned memory; the compute stream waits on the ticket.
                    device_tensor.copy_(host_tensor, non_blocking=True)
                # Marks the point the compute stream must reach before reading this batch.
                ticket.append((stream, stream.record_event()))
        return ticket

    def copy_out(self, pairs: Sequence[CopyPair]) -> _Ticket:
        ticket: _Ticket = []
        for device, group in self._by_device(pairs).items():
            stream = self._stream(device, "d2h")
            # The copy out must read the batch only after the update queued on compute.
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for device_tensor, host_tensor in group:
                    host_tensor.copy_(device_tensor, non_blocking=True)
                # Marks the point after which the host copy is final and the memory free.
                ticket.append((stream, stream.record_event()))
        return ticket

    def wait(self, ticket: _Ticket | None) -> None:
        for stream, event in ticket or ():
            # Compute reads the batch only once its copy in has landed; no host block.
            torch.cuda.current_stream(stream.device).wait_event(event)

    def host_wait(self, ticket: _Ticket | None) -> None:
        for _stream, event in ticket or ():
            # The host reads or rewrites the host memory this copy writes or reads.
            event.synchronize()

    def synchronize(self) -> None:
        for stream in self._streams.values():
            # The host reads or rewrites the host copies next, so every copy must be done.
            stream.synchronize()


#: Runtimes that may have copies queued, held weakly: the exit hook keeps none alive.
_LIVE: weakref.WeakSet[CudaRuntime] = weakref.WeakSet()


def _synchronize_all() -> None:
    """At exit: wait for the copies every live runtime still has queued."""
    for runtime in list(_LIVE):
        try:
            # The last step's copies out write the host state: it is final once they land.
            runtime.synchronize()
        except Exception:  # a sticky CUDA error from earlier; nothing left to finish
            logger.warning("swapopt: waiting for the copy streams at exit failed", exc_info=True)


# An atexit hook runs before the interpreter and torch tear CUDA down, so the streams are
# still valid; a step's last copies out land before the process ends.
atexit.register(_synchronize_all)
