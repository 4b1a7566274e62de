"""Which optimizer state stays on the device for good under a resident fraction."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["resident_count"]


def resident_count(costs: Sequence[int], fraction: float) -> int:
    """How many leading units keep their state on the device.

    The resident units are a prefix of the step order: the step updates them first, while
    the copy of the first swapped batch is in flight, so their update hides that copy.

    Args:
        costs: Swappable state bytes of each unit, in step order.
        fraction: Share of the total bytes that may stay resident, in ``[0, 1]``.

    Returns:
        The longest prefix whose bytes are at most ``fraction`` of the total (all of them at
        ``1.0``, none at ``0.0``).
    """
    total = sum(costs)
    if fraction >= 1.0:
        return len(costs)
    allowed = fraction * total
    held = 0
    for k, cost in enumerate(costs):
        if held + cost > allowed:
            return k
        held += cost
    return len(costs)
