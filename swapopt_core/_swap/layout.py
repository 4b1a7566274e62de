"""Where each swapped state sits in the packed host buffers (one buffer per dtype)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from swapopt_core._errors import SwapOptError

__all__ = ["LayoutPlan", "plan_layout"]

#: The signature of a new layout (the slots' ids, in order) and its elements per dtype.
LayoutPlan = tuple[tuple[int, ...], dict[Any, int]]


def plan_layout(
    slots: Sequence[Any], previous: tuple[int, ...], size: Callable[[Any], tuple[Any, int]]
) -> LayoutPlan | None:
    """Whether packed ``slots`` need a new host layout, and its elements per dtype.

    Args:
        slots: The slots in layout order (each with ``offset`` and ``device``).
        previous: The signature of the current layout.
        size: ``(dtype, numel)`` of a slot.

    Returns:
        ``None`` when ``slots`` are laid out already; else the new signature and the number
        of elements of each dtype.

    Raises:
        SwapOptError: The slots live on more than one device.
    """
    signature = tuple(id(slot) for slot in slots)
    if signature == previous and all(s.offset >= 0 for s in slots):
        return None
    devices = {str(slot.device) for slot in slots}
    if len(devices) > 1:
        raise SwapOptError(
            "packed_swap=True needs every swapped state on one device, but they live on "
            f"{sorted(devices)}. Set SwapOptimizerConfig(packed_swap=False) to give each state "
            "tensor its own storage."
        )
    totals: dict[Any, int] = {}
    for slot in slots:
        dtype, numel = size(slot)
        totals[dtype] = totals.get(dtype, 0) + numel
    return signature, totals
