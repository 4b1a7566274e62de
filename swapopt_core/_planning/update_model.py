"""The optimizer's update in predicted time and memory, for a choice of knobs.

The update runs the resident units first (no copies), then the swapped rest as a pipeline
of ``swap_times`` byte-balanced batches on three queues: copies in, compute, copies out. A
batch's copy in may start once the copy in before it is done and the device holds fewer
than three batches (the batch three back has been copied out); the first
``prefetch_batches`` were copied in during backward. A batch computes after its copy in and
the compute before it; its copy out follows its compute. The step ends with its last
compute: the copies out still running overlap the next forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swapopt_core._planning.partition import partition
from swapopt_core._planning.resident import resident_count

__all__ = ["UpdateCosts", "UpdateShape", "update_shape"]

#: Batches the step holds on the device at most (one computing, one coming in, one going out).
HELD_BATCHES = 3


@dataclass(frozen=True)
class UpdateCosts:
    """Per-byte prices of the update: compute, both link directions, per-batch overhead."""

    ms_per_byte: float
    h2d_bytes_per_ms: float
    d2h_bytes_per_ms: float
    batch_overhead_ms: float = 0.0


@dataclass(frozen=True)
class UpdateShape:
    """What one choice of knobs makes of the update.

    Attributes:
        resident_bytes: State bytes that never move.
        batch_bytes: State bytes of each swapped batch.
        prefetch_batches: Batches copied in during backward (clamped to the batches).
        step_ms: Predicted time from the step's start to its last compute.
        tail_ms: Copies out still running after that.
        prefetch_bytes: Bytes copied in during backward.
        resident_batch_bytes: State bytes of each batch of resident units (they are updated
            in batches about the size of one batch of all the state, so that the undo copy
            and the update's temporaries stay one batch's).
    """

    resident_bytes: int
    batch_bytes: tuple[int, ...]
    prefetch_batches: int
    step_ms: float
    tail_ms: float
    prefetch_bytes: int
    resident_batch_bytes: tuple[int, ...] = ()

    def extra_bytes(self, staging_factor: float, resident_factor: float | None = None) -> int:
        """Device bytes the update holds beyond the resident state: ``staging_factor`` times
        a swapped batch being updated, or ``resident_factor`` (default: the same) times a
        resident one plus the swapped batches whose copies in run meanwhile (up to two: the
        pipeline keeps three batches)."""
        swapped = max(self.batch_bytes, default=0)
        resident = max(self.resident_batch_bytes, default=0)
        per_resident = staging_factor if resident_factor is None else resident_factor
        arriving = sum(self.batch_bytes[: HELD_BATCHES - 1]) if resident else 0
        return int(max(staging_factor * swapped, per_resident * resident + arriving))

    @property
    def largest_batch(self) -> int:
        """The most state one batch of the update holds, resident or swapped."""
        return max((*self.batch_bytes, *self.resident_batch_bytes), default=0)


def update_shape(
    unit_bytes: tuple[int, ...],
    fraction: float,
    swap_times: int,
    prefetch: int,
    costs: UpdateCosts,
) -> UpdateShape:
    """Cut the update for the knobs and predict its time (the module docstring's model)."""
    keep = resident_count(unit_bytes, fraction)
    resident = sum(unit_bytes[:keep])
    rest = unit_bytes[keep:]
    batches = tuple(sum(rest[k] for k in run) for run in partition(rest, swap_times))
    total = resident + sum(rest)
    parts = max(1, math.ceil(resident * swap_times / total)) if total else 1
    lead = unit_bytes[:keep]
    resident_batches = tuple(sum(lead[k] for k in run) for run in partition(lead, parts))
    prefetch = min(prefetch, len(batches), HELD_BATCHES - 1)
    clock = resident * costs.ms_per_byte + (costs.batch_overhead_ms if resident else 0.0)
    in_free = 0.0
    out_free = 0.0
    outs: list[float] = []
    for i, nbytes in enumerate(batches):
        if i < prefetch:
            arrived = 0.0
        else:
            room = outs[i - HELD_BATCHES] if i >= HELD_BATCHES else 0.0
            in_free = max(in_free, room) + nbytes / costs.h2d_bytes_per_ms
            arrived = in_free
        clock = max(clock, arrived) + nbytes * costs.ms_per_byte + costs.batch_overhead_ms
        out_free = max(out_free, clock) + nbytes / costs.d2h_bytes_per_ms
        outs.append(out_free)
    return UpdateShape(
        resident_bytes=resident,
        batch_bytes=batches,
        prefetch_batches=prefetch,
        step_ms=clock,
        tail_ms=max(0.0, out_free - clock),
        prefetch_bytes=sum(batches[:prefetch]),
        resident_batch_bytes=resident_batches,
    )
