"""How much MindSpore optimizer state stays resident under a device budget.

MindFormers' ``swap_optimizer:`` section (``device_budget_mb``) budgets the optimizer state
alone: its resident share plus the staging of the swapped rest. ``resident_fraction`` is the
rule; ``fit_device_budget`` applies it to a swapped optimizer. Imports no MindSpore.
"""

from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger(__name__)

__all__ = ["BUDGET_KEY", "fit_device_budget", "resident_fraction"]

BUDGET_KEY = "device_budget_mb"


def resident_fraction(
    budget_mb: float, state_bytes: int, swap_times: int, *, where: str = "swap_optimizer"
) -> float:
    """The largest resident share ``r`` of the state whose device bytes fit the budget.

    The optimizer state's device bytes are its resident part plus the staging of the
    swapped part: ``r * S + 3 * (1 - r) * S / swap_times`` (three batches in flight: one
    coming in, one updated, one going out). All of it resident (``r = 1``) needs ``S``.

    Args:
        budget_mb: What the optimizer state may hold on the device, in MiB.
        state_bytes: ``S``, the swappable state bytes.
        swap_times: Pipeline batches per step.
        where: The section or callback named in the error.

    Raises:
        ValueError: The budget is below the floor, ``min(S, 3 * S / swap_times)``; the
            message names the key, the value and the floor.
    """
    budget_bytes, total = budget_mb * 2**20, float(state_bytes)
    staging = 3.0 * total / swap_times  # the staging with nothing resident
    if budget_bytes >= total:
        return 1.0
    if staging >= total or budget_bytes < staging:
        floor = min(total, staging)
        raise ValueError(
            f"{where}.{BUDGET_KEY}={budget_mb:g} is below the floor of "
            f"{floor / 2**20:.3f} MiB for {total / 2**20:.3f} MiB of optimizer state at "
            f"swap_times={swap_times} (the staging of three batches, 3 * state / "
            "swap_times, or all the state when that is less). Raise the budget, or raise "
            "swap_times to lower the floor."
        )
    return min(1.0, max(0.0, (budget_bytes - staging) / (total - staging)))


def fit_device_budget(
    optimizer: object, budget_mb: float, *, where: str = "swap_optimizer"
) -> float:
    """Keep as much of a swapped MindSpore optimizer's state resident as ``budget_mb`` allows.

    Measures the swappable state bytes of ``optimizer`` (swapped already, all of its state
    in host memory), picks ``resident_fraction`` and re-configures the swap in place: the
    leading parameters' state is copied onto the device, one at a time.

    Returns:
        The resident share chosen.

    Raises:
        ValueError: The budget is below the floor (see ``resident_fraction``).
        SwapOptError: ``optimizer`` is not swapped by the MindSpore engine.
    """
    from swapopt_core._errors import SwapOptError
    from swapopt_core._mindspore.engine import MindSporeSwapEngine
    from swapopt_core._swap.engine import engine_of

    engine = engine_of(optimizer)
    if not isinstance(engine, MindSporeSwapEngine):
        raise SwapOptError(f"{where}.{BUDGET_KEY} needs an optimizer swapped by swapopt.")
    state = sum(nbytes for _, nbytes in engine.unit_state_bytes())
    config = engine.config
    fraction = resident_fraction(budget_mb, state, config.swap_times, where=where)
    engine.reconfigure(dataclasses.replace(config, resident_state_fraction=fraction))
    logger.info(
        "swapopt: %s=%g keeps %.3f of %d bytes of optimizer state resident",
        BUDGET_KEY,
        budget_mb,
        fraction,
        state,
    )
    return fraction
