"""The plugin manager: built-ins first, then the ``swapopt`` entry-point group."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
import warnings
from typing import Any, cast

import pluggy

from swapopt_core._device.interface import TransferRuntime
from swapopt_core._errors import SwapOptError, SwapOptWarning
from swapopt_core._launch import warn_without_run
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._swap.engine import EngineBase
from swapopt_core.hookspecs import PROJECT, SwapOptSpecs

logger = logging.getLogger(__name__)

#: Entry-point group third-party plugins register under.
ENTRY_POINT_GROUP = PROJECT
#: The built-in plugins (one module per backend, one for the planners, one for the torch
#: runtimes of both halves), registered like any third-party plugin.
DEFAULT_PLUGINS = (
    "swapopt_core._torch.plugin",
    "swapopt_core._planning.plugin",
    "swapopt_core._device.plugin",
    "swapopt_core._mindspore.plugin",
)
#: Set to 1 to skip loading third-party plugins from entry points.
DISABLE_AUTOLOAD_ENV = "SWAPOPT_DISABLE_PLUGIN_AUTOLOAD"

__all__ = [
    "ENTRY_POINT_GROUP",
    "engine_classes",
    "get_plugin_manager",
    "new_plugin_manager",
    "runtime_names",
    "state_key_names",
]


def new_plugin_manager(*, load_entrypoints: bool = True) -> pluggy.PluginManager:
    """Build a fresh plugin manager with the built-in plugins registered.

    Args:
        load_entrypoints: Also load plugins from the ``swapopt`` entry-point group (skipped
            when ``SWAPOPT_DISABLE_PLUGIN_AUTOLOAD=1``). A plugin that fails to import is
            reported with a warning and left out, so a broken plugin never stops training.

    Returns:
        The manager, with every registered implementation validated against the specs.
    """
    # The offload flag set without `swapopt run`: say once, on first use, what to run instead.
    warn_without_run()
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(SwapOptSpecs)
    for dotted in DEFAULT_PLUGINS:
        manager.register(importlib.import_module(dotted), name=dotted)
    if load_entrypoints and os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("1", "true"):
        _load_entry_points(manager)
    manager.check_pending()
    return manager


def _load_entry_points(manager: pluggy.PluginManager) -> None:
    for distribution in importlib.metadata.distributions():
        for entry_point in distribution.entry_points:
            if entry_point.group != ENTRY_POINT_GROUP or manager.has_plugin(entry_point.name):
                continue
            try:
                plugin = entry_point.load()
            except Exception as error:  # noqa: BLE001 - a broken plugin must not stop training
                warnings.warn(
                    f"swapopt left out the plugin {entry_point.name!r} ({entry_point.value}): "
                    f"it failed to load with {error!r}. Fix or uninstall it, or set "
                    f"{DISABLE_AUTOLOAD_ENV}=1 to skip third-party plugins.",
                    SwapOptWarning,
                    stacklevel=3,
                )
                continue
            manager.register(plugin, name=entry_point.name)
            logger.debug("swapopt plugin %r loaded from %s", entry_point.name, entry_point.value)


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager that ``swap_optimizer`` uses by default.

    Register a plugin on it to make its runtimes and adapters available everywhere:
    ``get_plugin_manager().register(my_plugin)``.
    """
    return new_plugin_manager()


def runtime_classes(
    manager: pluggy.PluginManager, framework: str = "torch"
) -> dict[str, type[TransferRuntime[Any, Any, Any]]]:
    """Runtime classes of ``framework`` by name, for both halves.

    Raises:
        SwapOptError: A plugin registered something else than a runtime class, a runtime
            named ``"auto"`` or nothing, or two runtimes of one framework with one name.
    """
    found: dict[str, type[TransferRuntime[Any, Any, Any]]] = {}
    for batch in manager.hook.swapopt_register_runtimes():
        for runtime in batch:
            if not (isinstance(runtime, type) and issubclass(runtime, TransferRuntime)):
                raise SwapOptError(
                    f"A plugin registered {runtime!r} as a runtime; swapopt_register_runtimes "
                    "must return subclasses of swapopt_core.TransferRuntime (classes, not "
                    "instances)."
                )
            name = getattr(runtime, "name", None)
            if not isinstance(name, str) or not name or name == "auto":
                raise SwapOptError(
                    f"The runtime {runtime.__module__}.{runtime.__qualname__} is named "
                    f"{name!r}; give it a non-empty name other than 'auto'."
                )
            if runtime.framework != framework:
                continue
            other = found.get(name)
            if other is not None and other is not runtime:
                raise SwapOptError(
                    f"Two plugins register a {framework} runtime named {name!r}: "
                    f"{other.__module__}.{other.__qualname__} and "
                    f"{runtime.__module__}.{runtime.__qualname__}. Give one another name (a "
                    "subclass inherits its parent's) or unregister one of them."
                )
            found[name] = runtime
    return found


def runtime_names(
    framework: str = "torch", manager: pluggy.PluginManager | None = None
) -> list[str]:
    """``"auto"`` and the names of the runtimes registered for ``framework``, sorted.

    Args:
        framework: ``"torch"`` or ``"mindspore"`` (or a plugin's framework).
        manager: The plugin manager to ask. Default: ``get_plugin_manager()``.
    """
    found = runtime_classes(manager or get_plugin_manager(), framework)
    return sorted({"auto", *found})


def state_key_names(
    framework: str = "torch", manager: pluggy.PluginManager | None = None
) -> list[str]:
    """Every state key some registered optimizer family of ``framework`` can swap, sorted."""
    adapters = optimizer_adapters(manager or get_plugin_manager(), framework)
    return sorted({key for adapter in adapters for key in adapter.state_key_names})


def optimizer_adapters(manager: pluggy.PluginManager, framework: str = "torch") -> list[Any]:
    """Adapters of ``framework`` in the order they are asked: later-registered plugins first.

    Every adapter meets ``SwapAdapter`` (a ``framework``, a ``family``, its
    ``state_key_names`` and ``matches(optimizer)``), and the protocol of its framework where
    swapopt has an engine for it: ``TorchAdapterProtocol`` (``OptimizerAdapter`` implements
    it), ``MindSporeAdapterProtocol`` (``MindSporeAdapter``).
    """
    # Imported here: the adapter protocols live with their backends, above this module.
    from swapopt_core._mindspore.adapter import MindSporeAdapterProtocol
    from swapopt_core._swap.adapter import SwapAdapter, missing_members
    from swapopt_core._torch.adapter import TorchAdapterProtocol

    protocols: dict[str, type] = {
        "torch": TorchAdapterProtocol,
        "mindspore": MindSporeAdapterProtocol,
    }
    adapters: list[Any] = []
    for batch in manager.hook.swapopt_register_optimizer_adapters():
        for adapter in batch:
            protocol = protocols.get(str(getattr(adapter, "framework", "")), SwapAdapter)
            if isinstance(adapter, type) or not isinstance(adapter, protocol):
                missing = (
                    "a class, not an instance"
                    if isinstance(adapter, type)
                    else ("it lacks " + ", ".join(missing_members(adapter, protocol)))
                )
                raise SwapOptError(
                    f"A plugin registered {adapter!r} as an optimizer adapter ({missing}); "
                    "swapopt_register_optimizer_adapters must return OptimizerAdapter (or, for "
                    "MindSpore, MindSporeAdapter) instances."
                )
            if cast(SwapAdapter, adapter).framework == framework:  # it met its protocol above
                adapters.append(adapter)
    return adapters


def engine_classes(manager: pluggy.PluginManager) -> list[type[EngineBase]]:
    """Engine classes in the order they are asked: later-registered plugins first."""
    engines: list[type[EngineBase]] = []
    for batch in manager.hook.swapopt_register_engines():
        for engine in batch:
            if not (isinstance(engine, type) and issubclass(engine, EngineBase)):
                raise SwapOptError(
                    f"A plugin registered {engine!r} as a swap engine; swapopt_register_engines "
                    "must return subclasses of swapopt_core._swap.engine.EngineBase (classes, "
                    "not instances)."
                )
            if engine not in engines:
                engines.append(engine)
    return engines


def residency_planners(manager: pluggy.PluginManager) -> dict[str, ResidencyPlanner]:
    """Planners by name; a name registered twice is an error."""
    found: dict[str, ResidencyPlanner] = {}
    for batch in manager.hook.swapopt_register_planners():
        for planner in batch:
            if not isinstance(planner, ResidencyPlanner):
                raise SwapOptError(
                    f"A plugin registered {planner!r} as a planner; swapopt_register_planners "
                    "must return ResidencyPlanner instances."
                )
            if planner.name in found:
                raise SwapOptError(
                    f"Two plugins register a planner named {planner.name!r}. Unregister one."
                )
            found[planner.name] = planner
    return found
