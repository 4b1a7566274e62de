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
#: Where the process's mapped files are listed: builds that bundle the CUDA runtime under a
#: name of their own (``libcudart-<hash>.so.12``) are found there.
_MAPS_PATH = "/proc/self/maps"


def alloc_pinned(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A 1-D host tensor of exactly ``numel`` elements, page-locked in place.

    torch's pinned allocator rounds every block up to a power of two (a 20 GiB request pins
    32 GiB), so an ordinary allocation is registered with CUDA instead, and unregistered once
    its storage and every view of it are gone. A failed registration leaves CUDA's last
    error set, which the next kernel launch would report as its own; it is cleared here.

    Returns:
        The tensor and the ``cudaError`` code of the registration (0: pinned; otherwise the
        memory is pageable, which is still correct, only copies no longer overlap compute).
        Callers try each buffer anew, and count those that stay pageable.
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
    """``name`` from the CUDA runtime library already in this process, if it is there.

    Looked up by the sonames torch's CUDA wheels load it under, then by the paths the
    process has mapped (a build that bundles ``libcudart-<hash>.so.*``); each opened with
    ``RTLD_NOLOAD``, so only a library already loaded is found.
    """
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    if not mode:  # pragma: no cover - no dlopen flags (Windows)
        return None
    for library in (*_CUDART_NAMES, *_mapped_cudart_paths()):
        try:
            return getattr(ctypes.CDLL(library, mode=mode), name)
        except (OSError, AttributeError):
            continue
    return None


def _mapped_cudart_paths() -> list[str]:
    """Paths of the CUDA runtime libraries mapped into this process (``_MAPS_PATH``), in
    the order they appear; none where the list cannot be read (not Linux)."""
    try:
        with open(_MAPS_PATH, encoding="utf-8", errors="replace") as maps:
            lines = maps.readlines()
    except OSError:
        return []
    paths: list[str] = []
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if "libcudart" in os.path.basename(path) and path.startswith("/") and path not in paths:
            paths.append(path)
    return paths
