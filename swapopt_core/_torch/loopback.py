"""The loopback runtime: CPU tensors play the device, separate CPU buffers the host.

Every step of the pipeline runs for real (storage is released and re-allocated, bytes are
copied), only synchronously. This is how the engine is exercised without an accelerator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swapopt_core._runtime import CopyPair, TransferRuntime


class LoopbackRuntime(TransferRuntime):
    """Synchronous runtime for CPU tensors; its host buffers count as the pinned tier."""

    name = "loopback"
    device_types = ()  # never picked by "auto": swapping CPU state to CPU only costs time

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        host = torch.empty(numel, dtype=dtype)
        self._count_host(host)
        return host

    def alloc_device(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def release_device(self, tensor: torch.Tensor, after: Sequence[Any] = ()) -> None:
        tensor.untyped_storage().resize_(0)

    def copy_in(self, pairs: Sequence[CopyPair], after: Sequence[Any] = ()) -> None:
        for device_tensor, host_tensor in pairs:
            device_tensor.copy_(host_tensor)

    def copy_out(self, pairs: Sequence[CopyPair]) -> None:
        for device_tensor, host_tensor in pairs:
            host_tensor.copy_(device_tensor)

    def wait(self, ticket: object) -> None:
        return None

    def synchronize(self) -> None:
        return None
