"""The torch backend as a plugin: its engine, its runtimes and its optimizer family.

Registered by default like every built-in, through the same hooks a third-party plugin uses.
"""

from __future__ import annotations

from collections.abc import Iterable

from swapopt_core._runtime import TransferRuntime
from swapopt_core._swap.engine import EngineBase
from swapopt_core._torch.adam import TorchAdamAdapter
from swapopt_core._torch.adapter import OptimizerAdapter
from swapopt_core._torch.cuda import CudaRuntime
from swapopt_core._torch.engine import SwapEngine
from swapopt_core._torch.loopback import LoopbackRuntime
from swapopt_core._torch.loopback_async import LoopbackAsyncRuntime
from swapopt_core.hookspecs import hookimpl


@hookimpl
def swapopt_register_runtimes() -> Iterable[type[TransferRuntime]]:
    return [LoopbackRuntime, LoopbackAsyncRuntime, CudaRuntime]


@hookimpl
def swapopt_register_optimizer_adapters() -> Iterable[OptimizerAdapter]:
    return [TorchAdamAdapter()]


@hookimpl
def swapopt_register_engines() -> Iterable[type[EngineBase]]:
    return [SwapEngine]
