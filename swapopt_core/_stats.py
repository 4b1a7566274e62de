"""Counters of what the swap holds and moves."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SwapStats"]


@dataclass(frozen=True)
class SwapStats:
    """A snapshot of one swapped optimizer's memory and traffic.

    Attributes:
        total_state_bytes: Bytes of the swappable state tensors (their device footprint if
            they were all resident), the part kept resident for good included.
        resident_state_bytes: Device bytes of swappable state right now: the part kept
            resident for good (``resident_for_good_bytes``) plus the staging of swapped
            batches; between steps only the former (and batches kept by a failed copy).
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
        resident_for_good_bytes: Device bytes of the state kept resident for good under
            ``resident_state_fraction`` (never copied).
        resident_state_fraction: The configured share of the state kept resident.
        prefetch_batches: Batches prefetched during backward (0 when switched off or the
            backend has no prefetch).
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
    resident_for_good_bytes: int = 0
    resident_state_fraction: float = 0.0
    prefetch_batches: int = 0
