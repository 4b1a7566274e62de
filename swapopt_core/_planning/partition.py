"""Contiguous, order-preserving partition of the step into byte-balanced batches."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["partition"]


def partition(costs: Sequence[int], parts: int) -> list[range]:
    """Split ``costs`` into at most ``parts`` contiguous runs of about equal sum.

    Each run keeps its input order; every run is non-empty. Batch ``b`` grows while adding
    the next item brings its sum closer to the average of what is still to be placed, so a
    large item early does not starve the batches after it.

    Args:
        costs: Non-negative cost of each item (bytes moved). Zero-cost items still count as
            one unit so they spread over batches instead of piling into one.
        parts: Requested number of batches (>= 1); clamped to ``len(costs)``.

    Returns:
        The batches as ranges of indices into ``costs``.
    """
    n = len(costs)
    if n == 0:
        return []
    parts = max(1, min(parts, n))
    weights = [max(1, int(c)) for c in costs]
    remaining = sum(weights)
    runs: list[range] = []
    start = 0
    for batch in range(parts - 1):
        left = parts - batch  # batches still to fill, this one included
        last_start = n - (left - 1)  # leave one item for every later batch
        end, total = start + 1, weights[start]
        # Integer form of |remaining/left - total| > |remaining/left - (total + next)|.
        while end < last_start and abs(remaining - (total + weights[end]) * left) < abs(
            remaining - total * left
        ):
            total += weights[end]
            end += 1
        runs.append(range(start, end))
        remaining -= total
        start = end
    runs.append(range(start, n))
    return runs
