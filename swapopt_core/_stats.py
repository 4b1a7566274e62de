"""Counters of what the swap holds and moves."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SwapStats"]


@dataclass(frozen=True)
class SwapStats:
    """A snapshot of one swapped optimizer's memory and traffic.

    Attributes:
        total_state_bytes: Bytes of the swapped state tensors (their device footprint if
            they were resident).
        resident_state_bytes: Device bytes of swapped state right now, staging included;
            zero between steps.
        peak_resident_state_bytes: Highest ``resident_state_bytes`` seen since install.
        host_state_bytes: Host bytes holding swapped state.
        pinned_host_bytes: Host bytes the runtime holds page-locked for it.
        h2d_bytes: Bytes copied host to device since install.
        d2h_bytes: Bytes copied device to host since install.
        steps: Swapped steps run since install.
        swapped_tensors: Number of swapped state tensors.
        batches: Pipeline batches of the last step.
        packed: Whether the packed layout is in use.
        runtime: Name of the transfer runtime.
    """

    total_state_bytes: int
    resident_state_bytes: int
    peak_resident_state_bytes: int
    host_state_bytes: int
    pinned_host_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    steps: int
    swapped_tensors: int
    batches: int
    packed: bool
    runtime: str
