"""The torch backend as a plugin: its engine and its optimizer family.

Registered by default like every built-in, through the same hooks a third-party plugin uses.
Its runtimes, shared with the activation offload, are registered by
``swapopt_core._device.plugin``.
"""

from __future__ import annotations

from collections.abc import Iterable

from swapopt_core._swap.engine import EngineBase
from swapopt_core._torch.adam import TorchAdamAdapter
from swapopt_core._torch.adapter import OptimizerAdapter
from swapopt_core._torch.engine import SwapEngine
from swapopt_core._torch.per_parameter import PerParameterAdapter
from swapopt_core.hookspecs import hookimpl


@hookimpl
def swapopt_register_optimizer_adapters() -> Iterable[OptimizerAdapter]:
    # Asked in order: the dedicated Adam path before the generic one.
    return [TorchAdamAdapter(), PerParameterAdapter()]


@hookimpl
def swapopt_register_engines() -> Iterable[type[EngineBase]]:
    return [SwapEngine]
