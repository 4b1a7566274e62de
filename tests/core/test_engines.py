"""Swap engines come from the hook ``swapopt_register_engines``, like runtimes and adapters."""

from __future__ import annotations

import sys
from collections.abc import Iterable

import pytest
import torch

from swapopt_core import (
    SwapOptError,
    SwapOptimizerConfig,
    hookimpl,
    new_plugin_manager,
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._api import _engine_class
from swapopt_core._mindspore.engine import MindSporeSwapEngine
from swapopt_core._plugins import engine_classes
from swapopt_core._swap.engine import EngineBase, engine_of
from swapopt_core._torch.engine import SwapEngine

LOOPBACK = SwapOptimizerConfig(runtime="loopback")


class CountingEngine(SwapEngine):
    """A third-party engine: the torch engine that counts its installs."""

    installs = 0

    def install(self) -> None:
        type(self).installs += 1
        super().install()


class CountingPlugin:
    @hookimpl
    def swapopt_register_engines(self) -> Iterable[type[EngineBase]]:
        return [CountingEngine]


def _adam() -> torch.optim.Adam:
    torch.manual_seed(0)
    return torch.optim.Adam(torch.nn.Linear(8, 8).parameters(), lr=0.1)


def test_the_built_in_engines_are_registered_as_plugins() -> None:
    engines = engine_classes(new_plugin_manager(load_entrypoints=False))
    assert SwapEngine in engines
    # The MindSpore engine is registered once MindSpore is imported (no Cell exists before).
    assert (MindSporeSwapEngine in engines) == ("mindspore" in sys.modules)
    assert _engine_class(_adam()) is SwapEngine


def test_a_third_party_engine_registered_through_the_hook_serves_first() -> None:
    manager = new_plugin_manager(load_entrypoints=False)
    manager.register(CountingPlugin())
    assert engine_classes(manager)[0] is CountingEngine
    opt = _adam()
    before = CountingEngine.installs
    assert swap_optimizer(opt, LOOPBACK, plugin_manager=manager) is opt
    assert type(engine_of(opt)) is CountingEngine
    assert CountingEngine.installs == before + 1
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert swap_stats(opt).steps == 1
    unswap_optimizer(opt)
    assert engine_of(opt) is None


def test_an_optimizer_no_engine_serves_names_the_registered_engines() -> None:
    manager = new_plugin_manager(load_entrypoints=False)
    manager.register(CountingPlugin())
    with pytest.raises(TypeError) as info:
        swap_optimizer(object(), plugin_manager=manager)
    message = str(info.value)
    assert "builtins.object" in message
    assert f"{__name__}.CountingEngine (torch)" in message
    assert "swapopt_core._torch.engine.SwapEngine (torch)" in message
    assert "swapopt_register_engines" in message


def test_a_plugin_returning_an_instance_as_engine_is_refused() -> None:
    class Broken:
        @hookimpl
        def swapopt_register_engines(self) -> Iterable[object]:
            return [object()]

    manager = new_plugin_manager(load_entrypoints=False)
    manager.register(Broken())
    with pytest.raises(SwapOptError, match="swapopt_register_engines must return subclasses"):
        swap_optimizer(_adam(), LOOPBACK, plugin_manager=manager)
