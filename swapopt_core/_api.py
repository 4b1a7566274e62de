"""Public entry points: install, remove and inspect the optimizer-state swap.

Framework-neutral: the engine classes come from plugins (hook ``swapopt_register_engines``;
the built-in torch and MindSpore engines are registered by their backends' plugin modules),
each says whether it ``serves`` an optimizer, and everything after that choice is a call on
``EngineBase``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, TypeVar

import pluggy

from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._device.interface import TransferRuntime
from swapopt_core._device.registry import shared_runtime
from swapopt_core._errors import SwapOptError, SwapOptWarning, UnsupportedOptimizerError
from swapopt_core._launch import note_swapped
from swapopt_core._plugins import (
    engine_classes,
    get_plugin_manager,
    optimizer_adapters,
    runtime_classes,
)
from swapopt_core._record import record_unswap
from swapopt_core._stats import SwapStats
from swapopt_core._swap.engine import EngineBase, engine_of

logger = logging.getLogger(__name__)

__all__ = [
    "is_swap_optimizer",
    "offload_optimizer_state",
    "reconfigure_swap",
    "swap_optimizer",
    "swap_stats",
    "unswap_optimizer",
]

_warned_cpu_auto = False

#: A torch optimizer or a MindSpore optimizer Cell; the functions hand back the same object.
OptimizerT = TypeVar("OptimizerT")


def _engine_class(
    optimizer: object, manager: pluggy.PluginManager | None = None
) -> type[EngineBase] | None:
    """The first registered engine class that serves ``optimizer``, if any."""
    engines = engine_classes(get_plugin_manager() if manager is None else manager)
    return next((engine for engine in engines if engine.serves(optimizer)), None)


def _no_engine(optimizer: object, manager: pluggy.PluginManager) -> TypeError:
    """The error for an optimizer no registered engine serves, naming those registered."""
    engines = engine_classes(manager)
    registered = ", ".join(
        f"{engine.__module__}.{engine.__qualname__} ({engine.framework})" for engine in engines
    )
    return TypeError(
        "swap_optimizer needs a torch.optim.Optimizer or a MindSpore optimizer Cell, got "
        f"{type(optimizer).__module__}.{type(optimizer).__qualname__}, which no registered "
        f"swap engine serves (registered: {registered or 'none'}). Pass the optimizer itself, "
        "not a framework wrapper (e.g. use lightning_optimizer.optimizer or "
        "accelerated_optimizer.optimizer), or register a plugin whose "
        "swapopt_register_engines serves it."
    )


def _pick_runtime(
    optimizer: object,
    config: SwapOptimizerConfig,
    manager: pluggy.PluginManager,
    engine_class: type[EngineBase],
) -> TransferRuntime[Any, Any, Any] | None:
    """The runtime that swaps ``optimizer``'s state: ``config.runtime``'s class, or with
    ``"auto"`` the one declaring the parameters' device type (``None``: none does).

    The runtime is made (or shared) for the parameters' device, as
    ``engine_class.runtime_device`` reports it: the device of the first parameter the
    runtime's class serves, when they span several devices of that type. Not the current
    device: a process that placed its parameters with ``.to(f"cuda:{rank}")`` without
    ``set_device`` would time, meter and page-lock on GPU 0.
    """
    framework = engine_class.framework
    runtimes = runtime_classes(manager, framework)
    if config.runtime != "auto":
        chosen = runtimes.get(config.runtime)
        if chosen is None:
            raise ValueError(
                f"SwapOptimizerConfig.runtime={config.runtime!r} is not a registered {framework} "
                f"runtime. Choose one of {sorted(['auto', *runtimes])}, or register a plugin "
                "that provides it (swapopt_register_runtimes)."
            )
        try:
            return shared_runtime(
                chosen, engine_class.runtime_device(optimizer, chosen.device_types)
            )
        except RuntimeError:  # its device is absent: say first that it serves no parameter
            types = engine_class.param_devices(optimizer)
            if types and chosen.device_types and not set(chosen.device_types) & types:
                _refuse_named(chosen.name, types)
            raise
    types = engine_class.param_devices(optimizer)
    matching = {name: cls for name, cls in runtimes.items() if set(cls.device_types) & types}
    if len(matching) > 1:
        raise SwapOptError(
            f"runtime='auto' is ambiguous for parameters on {sorted(types)}: runtimes "
            f"{sorted(matching)} all apply. Name one in SwapOptimizerConfig.runtime."
        )
    if not matching:
        return None
    cls = next(iter(matching.values()))
    return shared_runtime(cls, engine_class.runtime_device(optimizer, cls.device_types))


def _check_serves(
    engine_class: type[EngineBase], runtime: TransferRuntime[Any, Any, Any], optimizer: object
) -> None:
    """Refuse a named runtime that would swap nothing (``"auto"`` picks by device already)."""
    types = engine_class.param_devices(optimizer)
    if types and not engine_class.runtime_serves(runtime, optimizer):
        _refuse_named(runtime.name, types)


def _refuse_named(name: str, types: set[str]) -> None:
    raise ValueError(
        f"SwapOptimizerConfig.runtime={name!r} swaps no state of this optimizer: "
        f"its parameters are on {sorted(types)}, which the {name!r} runtime does "
        "not serve. Move the model to that device before building the optimizer, or name "
        "the runtime for where the parameters are ('auto', or 'loopback' on the CPU)."
    )


def _pick_adapter(
    optimizer: object, config: SwapOptimizerConfig, manager: pluggy.PluginManager, framework: str
) -> Any:
    """The adapter serving ``optimizer``, after checking the config against its family."""
    adapters = optimizer_adapters(manager, framework)
    adapter = next((a for a in adapters if a.matches(optimizer)), None)
    if adapter is None:
        raise UnsupportedOptimizerError(_unserved(optimizer, adapters, framework))
    # The generic path keeps whatever state the family creates: any name may be asked for.
    if config.state_keys is not None and not getattr(adapter, "whole_tensors", False):
        unknown = [k for k in config.state_keys if k not in adapter.state_key_names]
        if unknown:
            raise ValueError(
                f"SwapOptimizerConfig.state_keys has {unknown} that {adapter.family} does not "
                f"keep. Choose from {list(adapter.state_key_names)}, or None for all."
            )
    if config.include_master_params and not adapter.keeps_masters(optimizer):
        raise ValueError(
            f"SwapOptimizerConfig.include_master_params=True, but this {adapter.family} keeps "
            "no master weights (it updates the model parameters directly). Leave "
            "include_master_params=False."
        )
    adapter.validate(optimizer)
    return adapter


def _unserved(optimizer: object, adapters: list[Any], framework: str) -> str:
    """Why no adapter serves ``optimizer``, and what to do about it."""
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if framework != "torch":
        families = ", ".join(sorted({a.family for a in adapters}))
        return (
            f"swapopt cannot swap {name}. Served {framework} optimizer families: {families}. "
            "A plugin adds a family by implementing swapopt_register_optimizer_adapters (see "
            "docs/plugins.md)."
        )
    # The generic torch path knows which optimizers read across parameters, and how a class
    # says it does not.
    from swapopt_core._torch.per_parameter import PER_PARAMETER_ATTR, refusal

    reason = refusal(optimizer)
    if reason is not None:
        return f"swapopt cannot swap {name}: {reason}. Leave it unswapped."
    families = ", ".join(sorted({a.family for a in adapters}))
    return (
        f"swapopt cannot swap {name}: it is not one of the served torch families ({families}) "
        f"and does not declare itself per parameter. If its step updates each parameter from "
        f"that parameter's gradient and state only, set the class attribute "
        f"{PER_PARAMETER_ATTR} = True and swapopt runs that step on one batch of parameters "
        "at a time; otherwise leave it unswapped."
    )


def swap_optimizer(
    optimizer: OptimizerT,
    config: SwapOptimizerConfig | None = None,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> OptimizerT:
    """Keep ``optimizer``'s state in host memory and pipeline its step; installed in place.

    The optimizer object keeps its identity, so LR schedulers, gradient scalers, closures
    and the frameworks' optimizer wrappers created before or after keep working. Its state
    entries that are swapped become host tensors between steps; ``state_dict()`` is the
    standard format and loads into the same optimizer without swapopt.

    Args:
        optimizer: A ``torch.optim.Optimizer`` or a MindSpore optimizer Cell of a family
            some plugin serves (built in: ``torch.optim.Adam``, ``torch.optim.AdamW``,
            ``mindspore.nn.Adam``, ``mindspore.nn.AdamWeightDecay`` and MindFormers'
            ``AdamW``; MindSpore in PyNative mode, where ``opt(grads)`` runs the swap).
        config: How to swap. Default: ``SwapOptimizerConfig()``.
        plugin_manager: Where to look up runtimes and optimizer families. Default: the
            process-wide ``get_plugin_manager()``.

    Returns:
        ``optimizer`` itself.

    Raises:
        TypeError: ``optimizer`` is neither a torch optimizer nor a MindSpore optimizer
            Cell, or ``config`` is not a ``SwapOptimizerConfig``.
        ValueError: A config value does not fit this optimizer or no runtime has its name.
        SwapOptError: The optimizer family, one of its flags or the state layout is not
            supported, or the optimizer is already swapped with another config.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> assert swap_optimizer(opt, SwapOptimizerConfig(swap_times=8)) is opt
    """
    global _warned_cpu_auto
    config = SwapOptimizerConfig() if config is None else config
    if not isinstance(config, SwapOptimizerConfig):
        raise TypeError(f"config must be a SwapOptimizerConfig, got {type(config).__name__}.")
    manager = get_plugin_manager() if plugin_manager is None else plugin_manager
    engine_class = _engine_class(optimizer, manager)
    if engine_class is None:
        raise _no_engine(optimizer, manager)
    existing = engine_of(optimizer)
    if existing is not None:
        if existing.config == config:
            return optimizer
        raise SwapOptError(
            f"{type(optimizer).__name__} is already swapped with {existing.config}. "
            "Call unswap_optimizer(optimizer) before installing another config."
        )
    adapter = _pick_adapter(optimizer, config, manager, engine_class.framework)
    runtime = _pick_runtime(optimizer, config, manager, engine_class)
    if runtime is None:
        if not _warned_cpu_auto:
            _warned_cpu_auto = True
            warnings.warn(
                "swap_optimizer(runtime='auto') found no accelerator for the parameters "
                f"(devices: {sorted(engine_class.param_devices(optimizer))}), so nothing "
                "is swapped. Use runtime='loopback' to exercise the swap on CPU.",
                SwapOptWarning,
                stacklevel=2,
            )
        return optimizer
    engine = engine_class(optimizer, config, adapter, runtime, manager)
    _check_serves(engine_class, runtime, optimizer)
    engine.install()
    note_swapped(engine)  # what `swapopt run` checks and sums up at exit
    logger.info(
        "swapopt installed on %s: runtime=%s packed=%s swap_times=%d; %d existing state "
        "tensors offloaded%s",
        type(optimizer).__name__,
        runtime.name,
        engine.staging.packed,
        config.swap_times,
        len(engine.slots),
        engine.install_note,
    )
    manager.hook.swapopt_on_install(optimizer=optimizer, config=config)
    return optimizer


def is_swap_optimizer(optimizer: object) -> bool:
    """Whether ``swap_optimizer`` is installed on ``optimizer``."""
    return engine_of(optimizer) is not None


def unswap_optimizer(optimizer: OptimizerT) -> OptimizerT:
    """Move the swapped state back to the device and remove the swap.

    An optimizer that is not swapped (never swapped, unswapped already, or left unswapped by
    an automatic way in as one swapopt cannot serve) is returned as it is with a
    ``SwapOptWarning`` naming its class: nothing was undone, which usually means the call
    got another object than the one swapped (a wrapper, or the optimizer before a
    ``prepare``). Check ``is_swap_optimizer(optimizer)`` first where either is fine.

    Returns:
        ``optimizer``, now a plain optimizer again.
    """
    engine = engine_of(optimizer)
    if engine is None:
        warnings.warn(
            f"unswap_optimizer: this {type(optimizer).__name__} is not swapped, so nothing "
            "was undone. Pass the optimizer swap_optimizer returned (not a wrapper around "
            "it), or check is_swap_optimizer(optimizer) first.",
            SwapOptWarning,
            stacklevel=2,
        )
        return optimizer
    record_unswap(engine)  # its figures outlive the swap, for `swapopt run`'s summary
    engine.uninstall()
    engine.plugin_manager.hook.swapopt_on_uninstall(optimizer=optimizer)
    return optimizer


def reconfigure_swap(optimizer: object, config: SwapOptimizerConfig) -> None:
    """Change the config of an installed swap in place, from the next step on.

    The copies still in flight are waited for first; then state that the new config keeps on
    the device (``resident_state_fraction``, ``min_numel``) is copied in and state it swaps
    is taken into host memory, one entry at a time: all swappable state is never on the
    device at once (unless the new config keeps it all resident). Training goes on bit for
    bit as without the change.

    Args:
        optimizer: A swapped optimizer.
        config: The new config. Only the fields the engine changes in place may differ
            (torch: ``swap_times``, ``resident_state_fraction``, ``min_numel``,
            ``prefetch_batches``, ``prefetch_during_backward``).

    Raises:
        TypeError: ``config`` is not a ``SwapOptimizerConfig``.
        ValueError: ``optimizer`` is not swapped.
        SwapOptError: A field that needs a new install differs (``runtime``,
            ``packed_swap``, ``state_keys``, ...).
    """
    if not isinstance(config, SwapOptimizerConfig):
        raise TypeError(f"config must be a SwapOptimizerConfig, got {type(config).__name__}.")
    engine = engine_of(optimizer)
    if engine is None:
        raise ValueError(
            f"{type(optimizer).__name__} is not swapped; reconfigure_swap changes an installed "
            "swap. Call swap_optimizer(optimizer, config) to install one."
        )
    old = engine.config
    for field in dataclasses.fields(SwapOptimizerConfig):
        before, after = getattr(old, field.name), getattr(config, field.name)
        if before != after and field.name not in engine.reconfigurable:
            raise SwapOptError(
                f"reconfigure_swap cannot change SwapOptimizerConfig.{field.name} of an "
                f"installed swap ({before!r} -> {after!r}); it changes in place only "
                f"{sorted(engine.reconfigurable)}. Call unswap_optimizer(optimizer), then "
                "swap_optimizer(optimizer, config) with the new config."
            )
    if config == old:
        return
    engine.reconfigure(config)
    logger.info(
        "swapopt reconfigured on %s: swap_times=%d resident_state_fraction=%g "
        "prefetch_batches=%d min_numel=%d",
        type(optimizer).__name__,
        config.swap_times,
        config.resident_state_fraction,
        config.effective_prefetch_batches,
        config.min_numel,
    )


def offload_optimizer_state(optimizer: object) -> int:
    """Take swappable state that something moved back to the device into host memory now.

    Frameworks restore checkpoints by moving optimizer state to the parameters' device
    (Lightning, Accelerate). The next step would take it back anyway; calling this right
    after such a restore frees the device memory before the next forward. A no-op for an
    optimizer that is not swapped.

    Returns:
        The number of state tensors that were moved to host memory.
    """
    engine = engine_of(optimizer)
    if engine is None:
        return 0
    return engine.offload()


def swap_stats(optimizer: object) -> SwapStats:
    """Memory and traffic of a swapped optimizer.

    Waits for the copies of the last step first, so that the host state (``optimizer.state``)
    is final once this returns (but for batches kept on the device, which
    ``resident_state_bytes`` counts: those an interrupted step could not copy back, and
    those whose copy out failed where it ran; ``state_dict()`` or the next step writes them
    back). Call it before reading swapped state directly, and before writing it: no copy
    then reads or writes the host tensors, and the next step updates from the state as it
    is when the step starts, even if a prefetch during backward copied the old values in
    (in-place edits with torch ops are seen by their version counters).

    Raises:
        ValueError: ``optimizer`` is not swapped.
    """
    engine = engine_of(optimizer)
    if engine is None:
        raise ValueError(
            f"{type(optimizer).__name__} is not swapped; call swap_optimizer(optimizer) first "
            "(with runtime='auto' on CPU-only parameters nothing is installed)."
        )
    engine.wait_copies()
    return engine.stats()
