"""HF Accelerate integration: swap prepared optimizers' state to host memory.

Switched on at launch: ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu accelerate launch --no_python
swapopt run train.py`` makes every ``Accelerator`` swap (``install_globally`` puts this
module's ``prepare`` and ``free_memory`` on the class), with no change to ``train.py``;
``SwapAccelerator`` has them as its own methods under plain ``accelerate launch``, and the
module functions take an ``Accelerator`` created elsewhere. All three ways in are the same
functions (``prepare``, ``free_memory``, ``load_state``, ``offload_session``) over one
``_SwapState`` kept as ``accelerator._swapopt``: the settings (``SwapOptimizerPlugin``, whose
``None`` fields default from ``SWAPOPT_*``), the swapped optimizers and the activation session.
The swap is installed in place on each ``AcceleratedOptimizer``'s inner optimizer, so
schedulers, the gradient scaler and accumulation keep working; loading needs no patch (the
optimizer's ``load_state_dict`` hooks put loaded state in host memory). See
``docs/accelerate.md``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from swapopt_core import (
    OffloadSession,
    is_swap_optimizer,
    offload_optimizer_state,
    swap_optimizer,
    unswap_optimizer,
)
from swapopt_core.callbacks import engine_refusal, note_swapped_by, release
from swapopt_core.options import SwapSettings

logger = logging.getLogger(__name__)

__all__ = [
    "SwapAccelerator",
    "SwapOptimizerPlugin",
    "free_memory",
    "install_globally",
    "installed_plugin",
    "load_state",
    "offload_session",
    "prepare",
    "release",
    "uninstall_globally",
]

_ATTR = "_swapopt"  # the one attribute swapopt sets on an accelerator: its _SwapState
#: Accelerate's own methods, which the swapping ones call (taken before any patch).
_OWN = {name: Accelerator.__dict__[name] for name in ("prepare", "free_memory", "load_state")}
_installed: SwapOptimizerPlugin | None = None  # the settings read by install_globally


class SwapOptimizerPlugin(SwapSettings):
    """Settings of the swap; each ``None`` field defaults from its ``SWAPOPT_*`` variable.

    The fields, variables and defaults are ``swapopt_core.options.SwapSettings``':
    ``offload_optimizer_device`` (``"cpu"`` swaps prepared optimizers), ``swap_times``,
    ``min_numel``, ``packed_swap``, ``runtime``, ``activation_budget_mb`` (when set,
    ``offload_session()`` offers an ``OffloadSession``) and ``activation_runtime``.

    Raises:
        ValueError: A field or environment variable has an invalid value; the message
            names it, shows the value and lists the accepted ones.
    """


def _check_supported(accelerator: Accelerator, plugin: SwapOptimizerPlugin) -> None:
    """Refuse a distributed type that manages optimizer state itself (when the swap is on)."""
    kind = accelerator.distributed_type.value
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    engine = {"DEEPSPEED": "deepspeed", "MEGATRON_LM": "megatron"}.get(kind)
    if kind == "FSDP" and getattr(getattr(fsdp, "cpu_offload", None), "offload_params", False):
        engine, kind = "fsdp-offload", "FSDP cpu_offload=True"
    if plugin.enabled and engine is not None:
        raise ValueError(
            engine_refusal(
                "swapopt",
                f"distributed type {kind}",
                engine,
                own_offload="the engine's own offload (deepspeed_config: "
                "offload_optimizer_device: cpu) with SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=none",
                instead="train with DDP or FSDP2 (fsdp_version: 2) without cpu_offload",
            )
        )


class _SwapState:
    """What swapopt keeps on one accelerator: settings, swapped optimizers, session."""

    def __init__(self, plugin: SwapOptimizerPlugin) -> None:
        self.plugin = plugin
        self.optimizers: list[AcceleratedOptimizer] = []
        self.session: OffloadSession | None = None

    def install(self, prepared: Any) -> None:
        """Swap the inner optimizer of each ``AcceleratedOptimizer`` in ``prepared``, once."""
        if not self.plugin.enabled:
            return
        config = self.plugin.swap_config()
        for obj in prepared if isinstance(prepared, tuple) else (prepared,):
            if not isinstance(obj, AcceleratedOptimizer) or any(obj is o for o in self.optimizers):
                continue
            if is_swap_optimizer(obj.optimizer):
                logger.info("swapopt: %s was swapped already; kept", type(obj.optimizer).__name__)
            else:
                swap_optimizer(obj.optimizer, config)
                note_swapped_by(obj.optimizer, self)  # so that release() can take it back
            self.optimizers.append(obj)

    def forget(self, optimizer: object) -> None:
        """Drop ``optimizer`` (unswapped by ``release``): the next ``prepare`` swaps it again."""
        self.optimizers = [opt for opt in self.optimizers if opt.optimizer is not optimizer]

    def unswap(self) -> None:
        optimizers, self.optimizers, self.session = self.optimizers, [], None
        for opt in optimizers:
            if not release(opt.optimizer):  # kept ones, swapped before prepare, too
                unswap_optimizer(opt.optimizer)


def _state(accelerator: Accelerator, plugin: SwapOptimizerPlugin | None = None) -> _SwapState:
    """The accelerator's swap state, created on first use (settings: ``plugin``, else those
    ``install_globally`` read, else the environment); the first settings stay."""
    state = accelerator.__dict__.get(_ATTR)
    if state is None:
        if plugin is None:
            plugin = (
                SwapOptimizerPlugin() if _installed is None else dataclasses.replace(_installed)
            )
        state = _SwapState(plugin)
        setattr(accelerator, _ATTR, state)
    elif plugin is not None and plugin != state.plugin:
        logger.warning("swapopt: the accelerator keeps its first settings %s", state.plugin)
    return state


def prepare(
    accelerator: Accelerator,
    *objects: Any,
    plugin: SwapOptimizerPlugin | None = None,
    device_placement: list[bool] | None = None,
) -> Any:
    """``accelerator.prepare(*objects, ...)``, then swap every optimizer it prepared (once).

    ``plugin`` gives the accelerator its settings on first use (default: from the
    environment); later calls keep them. ``SwapAccelerator.prepare`` and the patch of
    ``install_globally`` are this function.

    Raises:
        ValueError: The swap is on, an optimizer is prepared and the distributed type
            manages optimizer state itself (DeepSpeed, Megatron-LM, FSDP with CPU offload).
    """
    state = _state(accelerator, plugin)
    if any(isinstance(obj, torch.optim.Optimizer) for obj in objects):
        _check_supported(accelerator, state.plugin)
    prepared = _OWN["prepare"](accelerator, *objects, device_placement=device_placement)
    state.install(prepared)
    return prepared


def _patched_prepare(
    self: Accelerator, *args: Any, device_placement: list[bool] | None = None
) -> Any:
    """``Accelerator.prepare`` while ``install_globally`` is in force: the swapping one."""
    if _installed is None:  # a reference taken to a patch since removed
        return _OWN["prepare"](self, *args, device_placement=device_placement)
    return prepare(self, *args, device_placement=device_placement)


def free_memory(accelerator: Accelerator, *objects: Any) -> Any:
    """Unswap the optimizers swapped through ``accelerator`` (a reference still held keeps
    working, state back on the device), then Accelerate's ``free_memory(*objects)``."""
    if _ATTR in accelerator.__dict__:
        _state(accelerator).unswap()
    return _OWN["free_memory"](accelerator, *objects)


def load_state(
    accelerator: Accelerator,
    input_dir: str | None = None,
    load_kwargs: dict | None = None,
    **kwargs: Any,
) -> None:
    """Accelerate's ``load_state(...)``, then the loaded optimizer state back to host memory."""
    _OWN["load_state"](accelerator, input_dir, load_kwargs, **kwargs)
    optimizers = _state(accelerator).optimizers if _ATTR in accelerator.__dict__ else []
    moved = sum(offload_optimizer_state(opt.optimizer) for opt in optimizers)
    logger.debug("swapopt: %d optimizer state tensors offloaded after load_state", moved)


def offload_session(accelerator: Accelerator) -> OffloadSession:
    """The accelerator's ``OffloadSession`` (created once), to wrap forward and backward.

    Raises:
        ValueError: No activation budget is set (``activation_budget_mb`` /
            ``SWAPOPT_ACTIVATION_BUDGET_MB``).
    """
    state = _state(accelerator)
    if state.session is None:
        config = state.plugin.offload_config()
        if config is None:
            raise ValueError(
                "No activation budget is set, so there is no offload session. Set "
                "SwapOptimizerPlugin(activation_budget_mb=...) or SWAPOPT_ACTIVATION_BUDGET_MB."
            )
        state.session = OffloadSession(config)
    return state.session


class SwapAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare`` swaps the optimizers' state to host memory.

    ``free_memory`` unswaps first, ``load_state`` takes the loaded state back to host memory
    and ``offload_session()`` gives the session for the activation budget: each method is the
    module function of the same name.

    Args:
        *args: As for ``Accelerator``.
        swap_plugin: The settings. Default: ``SwapOptimizerPlugin()``, read from the
            ``SWAPOPT_*`` environment variables (off unless
            ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu``).
        **kwargs: As for ``Accelerator``.

    Raises:
        ValueError: The swap is on and the distributed type manages optimizer state itself.
    """

    def __init__(
        self, *args: Any, swap_plugin: SwapOptimizerPlugin | None = None, **kwargs: Any
    ) -> None:
        plugin = SwapOptimizerPlugin() if swap_plugin is None else swap_plugin
        if not isinstance(plugin, SwapOptimizerPlugin):
            raise TypeError(f"swap_plugin must be a SwapOptimizerPlugin, got {plugin!r}.")
        super().__init__(*args, **kwargs)
        _check_supported(self, _state(self, plugin).plugin)

    @property
    def swap_plugin(self) -> SwapOptimizerPlugin:
        """The swap settings of this accelerator."""
        return _state(self).plugin

    prepare = prepare  # type: ignore[assignment]
    free_memory = free_memory
    load_state = load_state
    offload_session = offload_session


def install_globally() -> bool:
    """Make every ``Accelerator`` swap the optimizers it prepares, when the environment asks.

    Reads the ``SWAPOPT_*`` variables as ``SwapAccelerator()`` does. With
    ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu`` it puts ``SwapAccelerator``'s ``prepare`` and
    ``free_memory`` on ``Accelerator`` itself, so existing and future instances swap alike
    (``swapopt run`` calls it); otherwise it changes nothing. Calling it again does nothing.

    Returns:
        Whether the patch is in place (``False`` when the variables ask for no swap).

    Raises:
        ValueError: A ``SWAPOPT_*`` variable has an invalid value (the message names it).
    """
    global _installed
    if _installed is not None:
        return True
    plugin = SwapOptimizerPlugin()
    if not plugin.enabled:
        logger.debug("swapopt: SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE is not cpu; Accelerator unchanged")
        return False
    Accelerator.prepare = _patched_prepare  # type: ignore[method-assign]
    Accelerator.free_memory = free_memory  # type: ignore[method-assign]
    _installed = plugin
    logger.info("swapopt: every Accelerator swaps the optimizers it prepares (%s)", plugin)
    return True


def uninstall_globally() -> bool:
    """Put ``Accelerator``'s own methods back; returns whether a patch was removed.
    Optimizers swapped meanwhile stay swapped (``free_memory(accelerator)`` unswaps them)."""
    global _installed
    if _installed is None:
        return False
    Accelerator.prepare, Accelerator.free_memory = _OWN["prepare"], _OWN["free_memory"]
    _installed = None
    return True


def installed_plugin() -> SwapOptimizerPlugin | None:
    """The settings ``install_globally`` put in place, or ``None`` when it is not installed."""
    return _installed
