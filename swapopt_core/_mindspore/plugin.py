"""The MindSpore backend as a plugin: its engine, its runtimes and optimizer families.

Registered by default like every built-in. It imports MindSpore only when an optimizer of
one of its families is swapped, so it costs nothing where MindSpore is not installed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from swapopt_core._device.interface import TransferRuntime
from swapopt_core._mindspore.adapter import MindSporeAdapter
from swapopt_core._mindspore.families import (
    MindFormersAdamWAdapter,
    NnAdamAdapter,
    NnAdamWeightDecayAdapter,
)
from swapopt_core._mindspore.loopback_async import MindSporeLoopbackAsyncRuntime
from swapopt_core._mindspore.momentum import NnMomentumAdapter, NnSGDAdapter
from swapopt_core._mindspore.runtime import MindSporeAscendRuntime, MindSporeLoopbackRuntime
from swapopt_core._swap.engine import EngineBase
from swapopt_core.hookspecs import hookimpl


@hookimpl
def swapopt_register_runtimes() -> Iterable[type[TransferRuntime]]:
    return [MindSporeLoopbackRuntime, MindSporeLoopbackAsyncRuntime, MindSporeAscendRuntime]


@hookimpl
def swapopt_register_optimizer_adapters() -> Iterable[MindSporeAdapter]:
    return [
        NnAdamAdapter(),
        NnAdamWeightDecayAdapter(),
        MindFormersAdamWAdapter(),
        NnMomentumAdapter(),
        NnSGDAdapter(),
    ]


@hookimpl
def swapopt_register_engines() -> Iterable[type[EngineBase]]:
    # No MindSpore optimizer exists before MindSpore is imported; until then the engine
    # (and all it imports) stays unloaded, so swapping a torch optimizer loads none of it.
    if "mindspore" not in sys.modules:
        return []
    from swapopt_core._mindspore.engine import MindSporeSwapEngine

    return [MindSporeSwapEngine]
