"""HF Accelerate integration: swap prepared optimizers' state to host memory.

Switched on at launch: ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu accelerate launch --no_python
swapopt run train.py`` makes every ``Accelerator`` swap (``install_globally``), with no change
to ``train.py``; ``SwapAccelerator`` does it under plain ``accelerate launch``. The settings
are ``SwapOptimizerPlugin``, whose ``None`` fields default from the ``SWAPOPT_*`` variables
(``swapopt_core.options.SwapSettings``), the way Accelerate's plugins read ``ACCELERATE_*``.

All swapopt keeps for an accelerator is one ``_SwapState`` stored as ``accelerator._swapopt``:
settings, swapped optimizers, activation session. ``SwapAccelerator``'s ``prepare``,
``load_state``, ``offload_session`` and ``free_memory`` do Accelerate's part, then the swap's;
for an ``Accelerator`` created elsewhere, the module functions of the same names take it first
and keep the same state, and ``install_globally`` replaces ``Accelerator.prepare`` and
``Accelerator.free_memory`` on the class so every instance behaves like ``SwapAccelerator``
(loading needs no patch: the optimizer's ``load_state_dict`` hooks put loaded state in host
memory). The swap is installed in place on each ``AcceleratedOptimizer``'s inner optimizer, so
schedulers, the gradient scaler and accumulation keep working. ``release`` takes back the swap
a ``prepare`` made on one optimizer (the ``transformers.Trainer`` callback calls it at the end
of ``train()``). See ``docs/accelerate.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
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
from swapopt_core.options import SwapSettings

logger = logging.getLogger(__name__)

_ATTR = "_swapopt"  # the one attribute swapopt sets on an accelerator: its _SwapState

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


class SwapOptimizerPlugin(SwapSettings):
    """Settings of the swap; each ``None`` field defaults from its ``SWAPOPT_*`` variable.

    The fields, their variables and defaults are those of ``swapopt_core.options.
    SwapSettings``: ``offload_optimizer_device`` (``"cpu"`` swaps prepared optimizers),
    ``swap_times``, ``min_numel``, ``packed_swap``, ``runtime``, ``activation_budget_mb``
    (when set, ``offload_session()`` offers an ``OffloadSession``) and ``activation_runtime``.

    Raises:
        ValueError: A field or environment variable has an invalid value; the message
            names it, shows the value and lists the accepted ones.
    """

    def refusal(self, distributed_type: str, *, fsdp_offloads_params: bool) -> str | None:
        """Why the swap cannot run under ``distributed_type`` (Accelerate's
        ``DistributedType`` value), or ``None`` when it can (or is off)."""
        if not self.enabled:
            return None
        if distributed_type in ("DEEPSPEED", "MEGATRON_LM"):
            return (
                f"swapopt cannot swap optimizer state under distributed type {distributed_type}: "
                "that engine owns its optimizer. With DeepSpeed use its own offload "
                "(deepspeed_config: offload_optimizer_device: cpu) and leave "
                "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=none; or train with DDP or FSDP2 "
                "(fsdp_version: 2) to use swapopt."
            )
        if distributed_type == "FSDP" and fsdp_offloads_params:
            return (
                "swapopt cannot swap optimizer state with FSDP cpu_offload=True: parameters and "
                "state already live on the CPU. Turn one of the two off."
            )
        return None


def _check_supported(accelerator: Accelerator, plugin: SwapOptimizerPlugin) -> None:
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    offloads = getattr(getattr(fsdp, "cpu_offload", None), "offload_params", False)
    refusal = plugin.refusal(accelerator.distributed_type.value, fsdp_offloads_params=offloads)
    if refusal is not None:
        raise ValueError(refusal)


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
                _swapped_by[obj.optimizer] = weakref.ref(self)
            self.optimizers.append(obj)

    def reoffload(self) -> None:
        moved = sum(offload_optimizer_state(opt.optimizer) for opt in self.optimizers)
        logger.debug("swapopt: %d optimizer state tensors offloaded after load_state", moved)

    def unswap(self) -> None:
        optimizers, self.optimizers, self.session = self.optimizers, [], None
        for opt in optimizers:
            _swapped_by.pop(opt.optimizer, None)
            unswap_optimizer(opt.optimizer)


# Inner optimizer -> the accelerator state whose prepare() swapped it. NOTE: weak both ways,
# so this registry never keeps an optimizer or an accelerator alive.
_swapped_by: weakref.WeakKeyDictionary[Any, weakref.ref[_SwapState]] = weakref.WeakKeyDictionary()


def release(optimizer: Any) -> bool:
    """Take back the swap an accelerator's ``prepare`` installed on ``optimizer``.

    ``optimizer`` is the torch optimizer (``accelerated_optimizer.optimizer``). Unswaps it
    (state back on the device, a plain optimizer again) and drops it from that accelerator,
    so that its next ``prepare`` swaps it again. An optimizer swapped some other way (by
    ``swap_optimizer`` or a callback) is left alone.

    Returns:
        Whether a swap made by ``prepare`` was removed.
    """
    owner = _swapped_by.pop(optimizer, None)
    state = None if owner is None else owner()
    if state is None or not is_swap_optimizer(optimizer):
        return False
    state.optimizers = [opt for opt in state.optimizers if opt.optimizer is not optimizer]
    unswap_optimizer(optimizer)
    return True


def _state(accelerator: Accelerator, plugin: SwapOptimizerPlugin | None = None) -> _SwapState:
    """The accelerator's swap state, created on first use (settings: ``plugin``, else the
    environment); an accelerator keeps the settings it was first given."""
    state = accelerator.__dict__.get(_ATTR)
    if state is None:
        state = _SwapState(SwapOptimizerPlugin() if plugin is None else plugin)
        setattr(accelerator, _ATTR, state)
    elif plugin is not None and plugin != state.plugin:
        logger.warning("swapopt: the accelerator keeps its first settings %s", state.plugin)
    return state


def _prepare_and_swap(
    state: _SwapState, accelerator: Accelerator, prepare: Any, *args: Any, **kw: Any
) -> Any:
    """``prepare(*args, **kw)`` after the refusal check, then swap what it prepared."""
    _check_supported(accelerator, state.plugin)
    prepared = prepare(*args, **kw)
    state.install(prepared)
    return prepared


def prepare(
    accelerator: Accelerator,
    *objects: Any,
    plugin: SwapOptimizerPlugin | None = None,
    **kwargs: Any,
) -> Any:
    """``accelerator.prepare(*objects, **kwargs)``, then swap every optimizer it prepared.

    ``plugin`` gives the accelerator its settings on first use (default: from the
    environment); later calls keep them.

    Raises:
        ValueError: The swap is on and the distributed type manages optimizer state itself
            (DeepSpeed, Megatron-LM, FSDP with CPU offload).
    """
    state = _state(accelerator, plugin)
    return _prepare_and_swap(state, accelerator, accelerator.prepare, *objects, **kwargs)


def load_state(accelerator: Accelerator, input_dir: str | None = None, **kwargs: Any) -> None:
    """``accelerator.load_state(...)``, then the loaded optimizer state back to host memory."""
    accelerator.load_state(input_dir, **kwargs)
    if _ATTR in accelerator.__dict__:
        _state(accelerator).reoffload()


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


def free_memory(accelerator: Accelerator, *objects: Any) -> Any:
    """Unswap the optimizers swapped through ``accelerator`` (a reference still held keeps
    working, state back on the device), then ``accelerator.free_memory(*objects)``."""
    if _ATTR in accelerator.__dict__:
        _state(accelerator).unswap()
    return accelerator.free_memory(*objects)


class SwapAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare`` swaps the optimizers' state to host memory.

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

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """``Accelerator.prepare``, then swap each prepared optimizer (once)."""
        return _prepare_and_swap(
            _state(self), self, super().prepare, *args, device_placement=device_placement
        )

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        """``Accelerator.load_state``, then the loaded optimizer state back to host memory."""
        super().load_state(input_dir, load_kwargs, **kwargs)
        _state(self).reoffload()

    def offload_session(self) -> OffloadSession:
        """The ``OffloadSession`` for the activation budget; see :func:`offload_session`."""
        return offload_session(self)

    def free_memory(self, *objects: Any) -> Any:
        """Unswap the optimizers swapped by this accelerator, then ``Accelerator.free_memory``."""
        _state(self).unswap()
        return super().free_memory(*objects)


_originals: dict[str, Any] = {}  # Accelerator method name -> the method install_globally replaced
_installed: SwapOptimizerPlugin | None = None  # the settings read by install_globally


def _patched_prepare(
    self: Accelerator, *args: Any, device_placement: list[bool] | None = None
) -> Any:
    original = _originals["prepare"]
    if isinstance(self, SwapAccelerator) or _installed is None:
        return original(self, *args, device_placement=device_placement)
    state = self.__dict__.get(_ATTR) or _state(self, dataclasses.replace(_installed))
    if any(isinstance(obj, torch.optim.Optimizer) for obj in args):
        _check_supported(self, state.plugin)
    prepared = original(self, *args, device_placement=device_placement)
    state.install(prepared)
    return prepared


def _patched_free_memory(self: Accelerator, *objects: Any) -> Any:
    if not isinstance(self, SwapAccelerator) and _ATTR in self.__dict__:
        self.__dict__[_ATTR].unswap()
    return _originals["free_memory"](self, *objects)


def install_globally() -> bool:
    """Make every ``Accelerator`` swap the optimizers it prepares, when the environment asks.

    Reads the ``SWAPOPT_*`` variables as ``SwapAccelerator()`` does. With
    ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu`` it replaces ``Accelerator.prepare`` (Accelerate's,
    then each prepared optimizer is swapped) and ``Accelerator.free_memory`` (unswap first), so
    existing and future instances behave like ``SwapAccelerator`` (``swapopt run`` calls it);
    otherwise it changes nothing. Calling it again does nothing more.

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
    for name, replacement in (("prepare", _patched_prepare), ("free_memory", _patched_free_memory)):
        _originals[name] = Accelerator.__dict__[name]
        setattr(Accelerator, name, replacement)
    _installed = plugin
    logger.info("swapopt: every Accelerator swaps the optimizers it prepares (%s)", plugin)
    return True


def uninstall_globally() -> bool:
    """Put ``Accelerator``'s own methods back; returns whether a patch was removed.
    Optimizers swapped meanwhile stay swapped (``free_memory(accelerator)`` unswaps them)."""
    global _installed
    if _installed is None:
        return False
    for name in ("prepare", "free_memory"):
        setattr(Accelerator, name, _originals.pop(name))
    _installed = None
    return True


def installed_plugin() -> SwapOptimizerPlugin | None:
    """The settings ``install_globally`` put in place, or ``None`` when it is not installed."""
    return _installed
