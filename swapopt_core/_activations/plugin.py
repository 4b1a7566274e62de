"""The built-in activation runtimes, registered like any plugin runtime."""

from __future__ import annotations

from collections.abc import Iterable

from swapopt_core._activations.async_runtime import AsyncLoopbackRuntime
from swapopt_core._activations.cuda_runtime import CudaActivationRuntime
from swapopt_core._activations.runtime import ActivationRuntime
from swapopt_core.hookspecs import hookimpl


@hookimpl
def swapopt_register_activation_runtimes() -> Iterable[type[ActivationRuntime]]:
    """``"loopback"`` (what ``"auto"`` uses off CUDA), ``"loopback-async"`` and ``"cuda"``."""
    return [ActivationRuntime, AsyncLoopbackRuntime, CudaActivationRuntime]
