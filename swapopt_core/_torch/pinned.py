"""Host memory page-locked at its exact size, shared by the CUDA runtimes."""

from __future__ import annotations

import weakref

import torch

__all__ = ["alloc_pinned"]

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context


def alloc_pinned(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A 1-D host tensor of exactly ``numel`` elements, page-locked in place.

    torch's pinned allocator rounds every block up to a power of two (a 20 GiB request pins
    32 GiB), so an ordinary allocation is registered with CUDA instead, and unregistered once
    its storage and every view of it are gone.

    Returns:
        The tensor and the ``cudaError`` code of the registration (0: pinned; otherwise the
        memory is pageable, which is still correct, only copies no longer overlap compute).
    """
    host = torch.empty(numel, dtype=dtype)
    nbytes = host.untyped_storage().nbytes()
    if not nbytes:
        return host, 0
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(host.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
    if error == 0:
        weakref.finalize(host.untyped_storage(), cudart.cudaHostUnregister, host.data_ptr())
    return host, error
