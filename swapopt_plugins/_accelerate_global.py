"""Make every ``Accelerator`` swap the way ``SwapAccelerator`` does, process-wide.

``swapopt run`` switches this on through the ``swapopt_install_integrations`` hook; a script
may call ``swapopt_plugins.accelerate.install_globally()`` itself before it builds its
``Accelerator`` (or before ``transformers.Trainer`` builds one). When the ``SWAPOPT_*``
variables ask for the swap, two methods are replaced on the class, so existing and future
instances alike behave like ``SwapAccelerator``:

- ``Accelerator.prepare``: Accelerate's ``prepare``, then each prepared optimizer is swapped
  (``transformers.Trainer`` prepares its model and optimizer through it);
- ``Accelerator.free_memory`` (``clear`` and the Trainer's ``train`` call it): unswap first,
  as ``SwapAccelerator`` does.

Loading needs no patch: ``Accelerator.load_state`` and the Trainer's resume both go through
the optimizer's ``load_state_dict``, whose swap hooks put the loaded state in host memory.

``SwapAccelerator`` instances already do all of this and are passed straight through. Each
accelerator's state is the same ``_SwapState`` the module functions of
``swapopt_plugins.accelerate`` use, created on first ``prepare`` with the settings read here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from accelerate import Accelerator

from swapopt_plugins.accelerate import (
    _ATTR,
    SwapAccelerator,
    SwapOptimizerPlugin,
    _check_supported,
    _state,
)

logger = logging.getLogger(__name__)

__all__ = ["install_globally", "installed_plugin", "uninstall_globally"]

_originals: dict[tuple[type, str], Any] = {}  # (class, method name) -> the method replaced
_plugin: SwapOptimizerPlugin | None = None  # the settings read by install_globally


def _original(cls: type, name: str) -> Any:
    return _originals[(cls, name)]


def _prepare(self: Accelerator, *args: Any, device_placement: list[bool] | None = None) -> Any:
    original = _original(Accelerator, "prepare")
    if isinstance(self, SwapAccelerator) or _plugin is None:
        return original(self, *args, device_placement=device_placement)
    existing = self.__dict__.get(_ATTR)
    state = existing if existing is not None else _state(self, dataclasses.replace(_plugin))
    if any(isinstance(obj, torch.optim.Optimizer) for obj in args):
        _check_supported(self, state.plugin)
    prepared = original(self, *args, device_placement=device_placement)
    state.install(prepared)
    return prepared


def _free_memory(self: Accelerator, *objects: Any) -> Any:
    if not isinstance(self, SwapAccelerator) and _ATTR in self.__dict__:
        self.__dict__[_ATTR].unswap()
    return _original(Accelerator, "free_memory")(self, *objects)


_PATCHES = (
    (Accelerator, "prepare", _prepare),
    (Accelerator, "free_memory", _free_memory),
)


def install_globally() -> bool:
    """Make every ``Accelerator`` swap the optimizers it prepares, when the environment asks.

    Reads the ``SWAPOPT_*`` variables as ``SwapAccelerator()`` does. With
    ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu`` it patches ``Accelerator`` (see the module
    docstring); otherwise it changes nothing. Calling it again does nothing more.

    Returns:
        Whether the patch is in place (``False`` when the variables ask for no swap).

    Raises:
        ValueError: A ``SWAPOPT_*`` variable has an invalid value (the message names it).
    """
    global _plugin
    if _plugin is not None:
        return True
    plugin = SwapOptimizerPlugin()
    if not plugin.enabled:
        logger.debug("swapopt: SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE is not cpu; Accelerator unchanged")
        return False
    for cls, name, replacement in _PATCHES:
        _originals[(cls, name)] = cls.__dict__[name]
        setattr(cls, name, replacement)
    _plugin = plugin
    logger.info("swapopt: every Accelerator swaps the optimizers it prepares (%s)", plugin)
    return True


def uninstall_globally() -> bool:
    """Put ``Accelerator``'s own methods back. Optimizers swapped meanwhile stay swapped
    (``swapopt_plugins.accelerate.free_memory(accelerator)`` unswaps them).

    Returns:
        Whether a patch was removed.
    """
    global _plugin
    if _plugin is None:
        return False
    for cls, name, _ in _PATCHES:
        setattr(cls, name, _originals.pop((cls, name)))
    _plugin = None
    return True


def installed_plugin() -> SwapOptimizerPlugin | None:
    """The settings ``install_globally`` put in place, or ``None`` when it is not installed."""
    return _plugin
