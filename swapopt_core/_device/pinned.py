"""Host memory page-locked at its exact size through cudaHostRegister (CUDA only)."""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from typing import Any

import torch

__all__ = ["alloc_pinned", "clear_last_error"]

logger = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context
#: Sonames under which torch may have loaded the CUDA runtime into this process.
_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


def alloc_pinned(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A 1-D host tensor of exactly ``numel`` elements, page-locked in place.

    torch's pinned allocator rounds every block up to a power of two (a 20 GiB request pins
    32 GiB), so an ordinary allocation is registered with CUDA instead, and unregistered once
    its storage and every view of it are gone. A failed registration leaves CUDA's last
    error set, which the next kernel launch would report as its own; it is cleared here.

    Returns:
        The tensor and the ``cudaError`` code of the registration (0: pinned; otherwise the
        memory is pageable, which is still correct, only copies no longer overlap compute).
        Callers warn once and stop registering after a failure.
    """
    host = torch.empty(numel, dtype=dtype)
    nbytes = host.untyped_storage().nbytes()
    if not nbytes:
        return host, 0
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(host.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
    if error == 0:
        weakref.finalize(host.untyped_storage(), cudart.cudaHostUnregister, host.data_ptr())
    else:
        clear_last_error(cudart)
    return host, error


def clear_last_error(cudart: Any) -> bool:
    """Reset CUDA's last error after a call whose failure was handled.

    torch's ``cudart()`` binding has no ``cudaGetLastError`` in the versions this was written
    for, so the CUDA runtime library torch already loaded is looked up (never loaded anew:
    a second copy would keep an error state of its own).

    Returns:
        Whether the error was cleared.
    """
    get_last_error = getattr(cudart, "cudaGetLastError", None)
    if get_last_error is None:
        get_last_error = _loaded_cudart_function("cudaGetLastError")
    if get_last_error is None:
        logger.warning(
            "could not clear CUDA's last error after a failed cudaHostRegister; the next CUDA "
            "call may report it as its own"
        )
        return False
    get_last_error()
    return True


def _loaded_cudart_function(name: str) -> Any:
    """``name`` from the CUDA runtime library already in this process, if it is there."""
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    if not mode:  # pragma: no cover - no dlopen flags (Windows)
        return None
    for soname in _CUDART_NAMES:
        try:
            return getattr(ctypes.CDLL(soname, mode=mode), name)
        except (OSError, AttributeError):
            continue
    return None
