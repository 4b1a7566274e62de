"""The whole step's device budget as the integrations take it: its checks and its session.

A device budget (``device_budget_mb``, ``SWAPOPT_DEVICE_BUDGET_MB``) is one target for the
whole training step: ``OffloadSession(config, optimizer=opt)`` plans the optimizer swap and
the activation offload under it. It excludes an activation budget of its own and needs
exactly one optimizer. ``options``, ``callbacks`` and ``swaps`` share these functions, so
every way in refuses the same things with the same words. A step with no optimizer at all
keeps its activations under what the budget leaves beside the parameters and their gradients
(``activations_alone``); a way in that cannot apply the budget says so
(``budget_not_applied``: a warning, and a line of ``swapopt run``'s summary). Nothing here
imports a training framework.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._figures import format_bytes
from swapopt_core._launch import BUDGET_ENV, note_budget_not_applied
from swapopt_core._options import Invalid, parse_mib

logger = logging.getLogger(__name__)

__all__ = [
    "activations_alone",
    "budget_not_applied",
    "budget_session",
    "budget_setting",
    "check_device_budget",
    "check_one_optimizer",
    "name_budget_variable",
    "with_device_budget",
]


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
    try:
        return OffloadSession(config, optimizer=optimizers[0])
    except ValueError as error:  # a budget too small for the step names where it was set
        name_budget_variable(error, config.device_budget_mb)
        raise


def _from_environment(device_budget_mb: float | None) -> str | None:
    """``SWAPOPT_DEVICE_BUDGET_MB=<text>`` when that variable is set (to ``device_budget_mb``,
    when given), else None."""
    raw = os.environ.get(BUDGET_ENV)
    try:
        value = parse_mib(allow_none=True)(raw)
    except Invalid:
        return None
    if value is None or (device_budget_mb is not None and value != device_budget_mb):
        return None
    return f"{BUDGET_ENV}={raw}"


def budget_setting(device_budget_mb: float) -> str:
    """How messages name the budget: ``SWAPOPT_DEVICE_BUDGET_MB=<text>`` when the variable set
    it, else ``device_budget_mb=<MiB>``."""
    return _from_environment(device_budget_mb) or f"device_budget_mb={device_budget_mb:g}"


def name_budget_variable(error: BaseException, device_budget_mb: float | None = None) -> None:
    """Add a note to ``error`` (a budget refused as too small) naming the variable that set
    the budget, when ``SWAPOPT_DEVICE_BUDGET_MB`` did (and holds ``device_budget_mb``, when
    given); the message itself already says the floor and how far to raise the budget."""
    setting = _from_environment(device_budget_mb)
    notes = getattr(error, "__notes__", [])
    if setting is None or any(BUDGET_ENV in note for note in notes):
        return
    error.add_note(
        f"swapopt: device_budget_mb is {setting} (MiB) here: raise that variable as said "
        f"above, or unset it to train without a device budget."
    )


def budget_not_applied(device_budget_mb: float, why: str) -> None:
    """Say that a way in trains without the device budget, and why: a logged warning now and
    the line ``swapopt run`` adds to its summary at exit."""
    setting = budget_setting(device_budget_mb)
    note_budget_not_applied(f"{setting}: {why}")
    # logging, not warnings: a filter the script installed must not make this an error.
    logger.warning(
        "swapopt: the device budget %s is not applied: %s. The script trains on without it "
        "(the step's memory is not planned).",
        setting,
        why,
    )


def _unique_storages(parameters: Iterable[object]) -> list[torch.Tensor]:
    """One tensor per storage (tied weights share one), meta tensors left out."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in parameters:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            # NOTE: every tensor is alive during the call, so the address names its storage.
            seen.setdefault(tensor.untyped_storage()._cdata, tensor)
    return list(seen.values())


def activations_alone(
    config: OffloadConfig, parameters: Iterable[object], owner: str
) -> tuple[OffloadConfig, str]:
    """The session config of a step with no optimizer under ``config``'s device budget.

    With no optimizer nothing is planned beside the activations: the budget minus the
    parameters and their gradients (those that require one) becomes the activation budget,
    ``max_resident_activation_mb``; the runtime, planner and caps of ``config`` are kept.

    Args:
        config: A config with ``device_budget_mb`` set.
        parameters: The model's parameters (and frozen weights) the step holds.
        owner: How the error names the budget's setting, e.g. ``"SwapOptimizerCallback"``.

    Returns:
        The activation-only config, and one sentence saying what was chosen (to log).

    Raises:
        ValueError: The budget cannot hold the parameters and their gradients; the message
            names the budget, what they need and how far to raise it.
    """
    budget_mb = config.device_budget_mb
    assert budget_mb is not None
    held = _unique_storages(parameters)
    params = sum(t.untyped_storage().nbytes() for t in held)
    grads = sum(t.untyped_storage().nbytes() for t in held if t.requires_grad)
    budget = int(budget_mb * 2**20)
    left = budget - params - grads
    setting = budget_setting(budget_mb)
    if left <= 0:
        raise ValueError(
            f"{owner}: the device budget {setting} ({format_bytes(budget)}) cannot hold a "
            f"step with no optimizer: parameters {format_bytes(params)} + gradients "
            f"{format_bytes(grads)} need {format_bytes(params + grads)}, and activations need "
            f"room beside them. Raise the budget above {-(-(params + grads) // 2**20)} MiB."
        )
    alone = dataclasses.replace(
        config, device_budget_mb=None, max_resident_activation_mb=left / 2**20
    )
    said = (
        f"swapopt: no optimizer, so the device budget {setting} keeps activations alone: "
        f"{format_bytes(budget)} minus parameters {format_bytes(params)} and gradients "
        f"{format_bytes(grads)} leaves activations {format_bytes(left)} "
        f"(max_resident_activation_mb={left / 2**20:.6g})"
    )
    logger.debug(said)
    return alone, said
