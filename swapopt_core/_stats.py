"""Counters of what the swap holds and moves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swapopt_core._swap.engine import EngineBase

__all__ = ["SwapStats", "engine_stats"]


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
        peak_reserved_state_bytes: The most device memory the swap held reserved during a
            step since install, blocks the allocator could not reuse yet included: the
            state staged at once, or the growth of reserved memory during the step on top
            of what the swap held at its start, whichever is larger (an accelerator's
            allocator; on ``loopback-async`` the emulated one, whose blocks are handed out,
            cached, or held back for a copy). Next to
            ``peak_resident_state_bytes`` (what the books say was staged), it shows memory
            the allocator kept besides.
        pinned_fallback_buffers: Host buffers of the swapped state left pageable because
            page-locking them failed (their copies do not overlap compute).
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
    peak_reserved_state_bytes: int = 0
    pinned_fallback_buffers: int = 0

    @property
    def kept_off_device_bytes(self) -> int:
        """Swappable state bytes the swap kept off the device: the total less its peak there."""
        return max(self.total_state_bytes - self.peak_resident_state_bytes, 0)

    @property
    def h2d_bytes_per_step(self) -> float:
        """Bytes copied host to device per swapped step, on average (0 before the first)."""
        return self.h2d_bytes / self.steps if self.steps else 0.0

    @property
    def d2h_bytes_per_step(self) -> float:
        """Bytes copied device to host per swapped step, on average (0 before the first)."""
        return self.d2h_bytes / self.steps if self.steps else 0.0

    def format(self) -> str:
        """One line for people: what was kept off the device (MiB and share), host bytes,
        bytes moved per step each way, steps, runtime (``str()`` gives the same)."""
        # Here, not at the top: the figures module types its arguments with this one.
        from swapopt_core._figures import format_swap_stats

        return format_swap_stats(self)

    __str__ = format


def engine_stats(engine: EngineBase) -> SwapStats:
    """A snapshot of ``engine``'s memory and traffic."""
    # Here, not at the top: the engine module imports this one.
    from swapopt_core._swap.staging import PackedStaging

    slots = list(engine.slots.values())
    swapped = sum(slot.nbytes for slot in slots)
    staging = engine.staging
    packed = isinstance(staging, PackedStaging) and staging.buffers
    # Packed buffers may hold more than the slots.
    host = staging.host_bytes if isinstance(staging, PackedStaging) and packed else swapped
    return SwapStats(
        total_state_bytes=swapped + engine.ledger.held,
        resident_state_bytes=engine.ledger.current,
        peak_resident_state_bytes=engine.ledger.peak,
        host_state_bytes=host,
        pinned_host_bytes=engine.runtime.pinned_nbytes(s.host for s in slots),
        h2d_bytes=engine.h2d_bytes,
        d2h_bytes=engine.d2h_bytes,
        steps=engine.steps,
        swapped_tensors=len(slots),
        batches=engine.last_batches,
        packed=staging.packed,
        runtime=engine.runtime.name,
        resident_for_good_bytes=engine.ledger.held,
        resident_state_fraction=engine.config.resident_state_fraction,
        prefetch_batches=engine.config.effective_prefetch_batches if engine.prefetches else 0,
        peak_reserved_state_bytes=engine.ledger.reserved_peak,
        pinned_fallback_buffers=engine.runtime.pageable_buffers(s.host for s in slots),
    )
