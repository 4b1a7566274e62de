"""The built-in runtimes, registered like any plugin runtime, for both halves."""

from __future__ import annotations

from collections.abc import Iterable

from swapopt_core._device.accelerator import accelerator_runtime
from swapopt_core._device.interface import TorchRuntime
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._device.loopback_async import LoopbackAsyncRuntime
from swapopt_core.hookspecs import hookimpl


@hookimpl
def swapopt_register_runtimes() -> Iterable[type[TorchRuntime]]:
    """``"loopback"``, ``"loopback-async"`` and the accelerator runtime (``"cuda"`` on CUDA,
    ROCm and machines without an accelerator; the accelerator's type name elsewhere)."""
    return [LoopbackRuntime, LoopbackAsyncRuntime, accelerator_runtime()]
