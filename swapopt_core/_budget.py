"""The whole step's device budget as the integrations take it: its checks and its session.

A device budget (``device_budget_mb``, ``SWAPOPT_DEVICE_BUDGET_MB``) is one target for the
whole training step: ``OffloadSession(config, optimizer=opt)`` plans the optimizer swap and
the activation offload under it. It excludes an activation budget of its own and needs
exactly one optimizer. ``options``, ``callbacks`` and ``swaps`` share these functions, so
every way in refuses the same things with the same words. Nothing here imports a training
framework.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from swapopt_core import OffloadConfig, OffloadSession

__all__ = ["budget_session", "check_device_budget", "check_one_optimizer", "with_device_budget"]


def check_device_budget(
    budget: object, device: object, device_budget: object, labels: Mapping[str, str]
) -> None:
    """Refuse what contradicts a device budget: an activation budget, or no swap."""
    where = f"{labels['device_budget_mb']}={device_budget:g}"
    if budget is not None:
        raise ValueError(
            f"{labels['activation_budget_mb']}={budget:g} and {where} are both set (MiB). "
            "Give one: the device "
            "budget is the whole step's target and plans the activation budget itself; the "
            "activation budget limits activations alone."
        )
    if device == "none":
        raise ValueError(
            f"{labels['offload_optimizer_device']}='none' contradicts {where}: a device "
            "budget plans the optimizer swap (it keeps on the device the state that fits). "
            "Drop the offload device setting, or the budget."
        )


def with_device_budget(
    owner: str, activation_offload: OffloadConfig | None, device_budget_mb: object
) -> OffloadConfig | None:
    """``activation_offload`` with the whole step's ``device_budget_mb`` set in it.

    Args:
        owner: How errors name the callback, e.g. ``"SwapOptimizerCallback"``.
        activation_offload: The config given beside the budget (its runtime and planner are
            kept); it must not set an activation budget of its own.
        device_budget_mb: MiB (a number or its text), or None for no device budget.

    Returns:
        ``activation_offload`` unchanged without a budget; else a config with the budget.

    Raises:
        ValueError: The budget is not a size, or ``activation_offload`` sets an activation
            budget (or another device budget) too.
    """
    if device_budget_mb is None:
        return activation_offload
    base = OffloadConfig() if activation_offload is None else activation_offload
    if base.max_resident_activation_mb is not None or base.device_budget_mb is not None:
        given = base.max_resident_activation_mb, base.device_budget_mb
        raise ValueError(
            f"{owner} got device_budget_mb={device_budget_mb!r} and activation_offload with "
            f"(max_resident_activation_mb, device_budget_mb)={given!r}. Give one budget: "
            "device_budget_mb is the whole step's target and plans the activation budget "
            "itself; activation_offload=OffloadConfig(max_resident_activation_mb=...) budgets "
            "activations alone."
        )
    return OffloadConfig.from_options(
        {"device_budget_mb": device_budget_mb}, source=owner, base=base
    )


def check_one_optimizer(owner: str, device_budget_mb: float | None, count: int) -> None:
    """Refuse a callback's fit of ``count`` optimizers under a device budget (not one)."""
    if device_budget_mb is not None and count != 1:
        raise ValueError(
            f"{owner}(device_budget_mb={device_budget_mb:g}) plans one "
            f"optimizer's step, but this fit has {count} optimizers. "
            "Train with one optimizer, or use activation_offload=OffloadConfig("
            "max_resident_activation_mb=...) with a swap config instead of the budget."
        )


def budget_session(
    config: OffloadConfig,
    optimizers: Sequence[torch.optim.Optimizer],
    refuse: Callable[[float, int], str],
) -> OffloadSession:
    """``OffloadSession(config)``; with a device budget, the session of the whole step of
    the one optimizer in ``optimizers`` (``OffloadSession(config, optimizer=opt)``).

    Raises:
        ValueError: A device budget and not exactly one optimizer; ``refuse(budget, count)``
            is the message.
    """
    if config.device_budget_mb is None:
        return OffloadSession(config)
    if len(optimizers) != 1:
        raise ValueError(refuse(config.device_budget_mb, len(optimizers)))
    # The session plans the whole step: the update after the window too.
    return OffloadSession(config, optimizer=optimizers[0])
