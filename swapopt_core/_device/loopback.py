"""The loopback runtime: CPU tensors play the device, separate CPU buffers the host.

Every step of the pipeline runs for real (storage is released and re-allocated, bytes are
copied), only synchronously. This is how the engine and the activation offload are
exercised without an accelerator; ``runtime="auto"`` also uses it for activations on device
types no runtime declares.

Released "device" memory goes back to a caching pool (``caching_pool``) that later
allocations take from, by CUDA's caching allocator's rules: without it every step would
fault in fresh pages (large blocks come straight from the OS on the CPU), a cost no device
has, and the reserved memory a device would hold could not be told.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swapopt_core._device.caching_pool import CachingPool
from swapopt_core._device.interface import CopyPair, TransferRuntime

__all__ = ["LoopbackRuntime"]


class LoopbackRuntime(TransferRuntime[torch.Tensor, torch.device, Any]):
    """Synchronous runtime for CPU tensors; its host buffers count as the pinned tier.

    One instance serves every CPU tensor (``shared_key`` ignores the device), whichever half
    asks for it.
    """

    name = "loopback"
    device_types = ()  # never picked by "auto" for state: swapping CPU to CPU only costs time

    def __init__(self) -> None:
        super().__init__()
        self.pool = CachingPool()  # the emulated device's blocks

    @classmethod
    def shared_key(cls, device: torch.device | None) -> object:
        return None  # the CPU is one device, whatever index a tensor names

    def serves(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # A storage made without an op, known as a host buffer before any op shows it: an
        # open step meter never counts it as device memory.
        storage = torch.UntypedStorage(numel * dtype.itemsize)  # type: ignore[no-untyped-call]
        if storage.nbytes():
            self._count_pinned(storage, storage.nbytes(), key=storage.data_ptr())
        return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))

    def alloc_device(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self._collect()
        storage = self.pool.take(numel * dtype.itemsize, self._settle, self._empty)
        tensor = torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))
        self._note_alloc(tensor)
        return tensor

    @staticmethod
    def _settle(tickets: Sequence[Any]) -> bool:
        """Wait for the copies of a block freed in compute order; whether they succeeded.
        Copies here are done when their call returns: nothing to wait for."""
        return True

    @staticmethod
    def _empty(tensor: torch.Tensor) -> torch.UntypedStorage:
        """Take the block from a tensor released in compute order."""
        storage = tensor.untyped_storage()
        tensor.set_()  # type: ignore[call-overload]  # the tensor handed out is empty now
        return storage

    def _collect(self) -> None:
        """Give back the blocks held for copies now seen finished (an allocation's first
        step, as CUDA's allocator processes its events); none are held here."""

    def release_device(self, tensor: torch.Tensor, after: Sequence[Any] = ()) -> None:
        self._recycle(tensor)

    def reserved_bytes(self) -> int:
        return self.pool.reserved

    def _cached_device_bytes(self) -> int:
        return self.pool.cached

    def _recycle(self, tensor: torch.Tensor) -> None:
        """Empty ``tensor`` and give its block back to the pool."""
        storage = tensor.untyped_storage()
        tensor.set_()  # type: ignore[call-overload]  # the tensor handed out is empty now
        self._note_release(storage)  # in the pool: no longer held by the step
        self.pool.give(storage)

    def copy_in(self, pairs: Sequence[CopyPair], after: Sequence[Any] = ()) -> Any:
        for device_tensor, host_tensor in pairs:
            device_tensor.copy_(host_tensor)
        return None

    def copy_out(self, pairs: Sequence[CopyPair]) -> Any:
        for device_tensor, host_tensor in pairs:
            host_tensor.copy_(device_tensor)
        return None

    def wait(self, ticket: Any) -> None:
        return None

    def host_wait(self, ticket: Any) -> None:
        return None  # every copy is done when its call returns

    def synchronize(self) -> None:
        return None
