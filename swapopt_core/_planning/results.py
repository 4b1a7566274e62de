"""What a simulated replay of a schedule produced: its cost, its memory and every copy and
recompute it ran (``simulate.simulate``, ``simulate.Machine.result``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CopySpan", "RecomputeSpan", "SimulationResult"]


@dataclass(frozen=True)
class CopySpan:
    """One copy as it ran: direction ``"D2H"`` or ``"H2D"``, storage, times in ms, bytes."""

    direction: str
    storage_id: int
    start_ms: float
    end_ms: float
    nbytes: int


@dataclass(frozen=True)
class RecomputeSpan:
    """One recompute as it ran: the storage, the op that made it, times in ms."""

    storage_id: int
    op: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class SimulationResult:
    """What replaying a schedule costs.

    Attributes:
        total_ms: When the last op finishes.
        compute_ms: Sum of op durations (the time with no stall).
        overhead: ``(total_ms - compute_ms) / compute_ms``.
        peak_bytes: Peak resident activation bytes, in-flight copies in.
        natural_peak_bytes: Peak with no actions at all.
        demand_fetches: Storages fetched on demand because no reload was issued.
        stall_ms: ``total_ms - compute_ms``.
        release_wait_ms: Part of the stall spent in releases waiting for copies.
        reload_wait_ms: Part spent by ops waiting for planned copies.
        demand_fetch_ms: Part spent by ops waiting for demand fetches.
        recomputes: Planned recomputes that ran.
        demand_recomputes: Recomputes an access forced because nothing brought the storage
            back.
        recompute_ms: Part of the stall spent recomputing (planned and on demand).
        peak_host_bytes: Peak bytes of host copies.
        d2h_bytes: Bytes copied device to host.
        h2d_bytes: Bytes copied host to device (demand fetches included).
        ignored_actions: Actions that had no effect (see the module docstring).
        timeline: ``(time_ms, resident_bytes)`` after every change of residency.
        copies: Every copy that ran.
        op_start_ms: When each op started.
        recomputed: Every recompute that ran (drawn on the compute lane).
    """

    total_ms: float
    compute_ms: float
    overhead: float
    peak_bytes: int
    natural_peak_bytes: int
    demand_fetches: int
    stall_ms: float
    release_wait_ms: float
    reload_wait_ms: float
    demand_fetch_ms: float
    peak_host_bytes: int
    d2h_bytes: int
    h2d_bytes: int
    ignored_actions: int
    timeline: tuple[tuple[float, int], ...]
    copies: tuple[CopySpan, ...]
    op_start_ms: tuple[float, ...]
    recomputes: int = 0
    demand_recomputes: int = 0
    recompute_ms: float = 0.0
    recomputed: tuple[RecomputeSpan, ...] = ()
