"""Framework-neutral bookkeeping of staged state: packed host layouts and device bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from swapopt_core._errors import SwapOptError

__all__ = ["DeviceLedger", "plan_layout"]


def plan_layout(
    slots: Sequence[Any], previous: tuple[int, ...], size: Callable[[Any], tuple[Any, int]]
) -> tuple[tuple[int, ...], dict[Any, int]] | None:
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


@dataclass
class DeviceLedger:
    """Device bytes of swapped state held right now, and the peak since install."""

    current: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        self.current -= nbytes
