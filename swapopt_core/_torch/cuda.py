"""The CUDA runtime: one copy stream per device, events, host memory pinned at exact size.

Device storage for swapped state is allocated and freed on the copy stream. The copy
stream waits for the compute stream before every copy out, so a block freed after a copy
out is only reused by copy-stream work queued after that copy, which needs no host sync.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from swapopt_core._runtime import CopyPair, TransferRuntime
from swapopt_core._torch.pinned import alloc_pinned

logger = logging.getLogger(__name__)

_Ticket = list[tuple[torch.device, "torch.cuda.Event"]]


class CudaRuntime(TransferRuntime):
    """Asynchronous runtime for CUDA tensors."""

    name = "cuda"
    device_types = ("cuda",)

    def __init__(self) -> None:
        super().__init__()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._register_failed = False

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
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
        # Allocated on the copy stream, so its reuse is ordered after earlier copy-outs.
        with torch.cuda.stream(self._stream(device)):
            return torch.empty(numel, dtype=dtype, device=device)

    def release_device(self, tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(0)

    def _by_device(self, pairs: Sequence[CopyPair]) -> dict[torch.device, list[CopyPair]]:
        grouped: dict[torch.device, list[CopyPair]] = {}
        for pair in pairs:
            grouped.setdefault(pair[0].device, []).append(pair)
        return grouped

    def copy_in(self, pairs: Sequence[CopyPair]) -> _Ticket:
        ticket: _Ticket = []
        for device, group in self._by_device(pairs).items():
            stream = self._stream(device)
            with torch.cuda.stream(stream):
                for device_tensor, host_tensor in group:
                    # Async from pinned memory; the compute stream waits on the ticket.
                    device_tensor.copy_(host_tensor, non_blocking=True)
                # Marks the point the compute stream must reach before reading this batch.
                ticket.append((device, stream.record_event()))
        return ticket

    def copy_out(self, pairs: Sequence[CopyPair]) -> _Ticket:
        ticket: _Ticket = []
        for device, group in self._by_device(pairs).items():
            stream = self._stream(device)
            # The copy out must read the batch only after the update queued on compute.
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for device_tensor, host_tensor in group:
                    host_tensor.copy_(device_tensor, non_blocking=True)
                ticket.append((device, stream.record_event()))
        return ticket

    def wait(self, ticket: _Ticket) -> None:
        for device, event in ticket:
            # Compute reads the batch only once its copy in has landed; no host block.
            torch.cuda.current_stream(device).wait_event(event)

    def synchronize(self) -> None:
        for stream in self._streams.values():
            # The host reads or rewrites the host copies next, so every copy must be done.
            stream.synchronize()
