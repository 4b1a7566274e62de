"""Figures for people: byte counts in binary units, the stats' one-line summaries, and the
flat ``swapopt/...`` figures every framework's logger gets (``docs/figures.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swapopt_core._activations.session_stats import OffloadStats
    from swapopt_core._stats import SwapStats

__all__ = [
    "OFFLOAD_KEYS",
    "SWAP_KEYS",
    "format_bytes",
    "format_offload_stats",
    "format_swap_stats",
    "offload_figures",
    "summary_line",
    "swap_figures",
]

_UNITS = ("KiB", "MiB", "GiB", "TiB")
_MIB = float(2**20)

#: The keys ``swap_figures`` returns, each with what it means (docs/figures.md shows them).
SWAP_KEYS = {
    "swapopt/state_mib": "optimizer state swapopt manages (MiB, as if all on the device)",
    "swapopt/state_off_device_mib": "of it, device memory kept free at the step's peak (MiB)",
    "swapopt/state_device_peak_mib": "highest device MiB of that state, arenas included",
    "swapopt/state_host_mib": "host MiB holding the swapped state",
    "swapopt/h2d_mib_per_step": "MiB copied host to device per optimizer step (average)",
    "swapopt/d2h_mib_per_step": "MiB copied device to host per optimizer step (average)",
    "swapopt/optimizer_steps": "swapped optimizer steps run (the first optimizer's)",
}

#: The keys ``offload_figures`` returns, each with what it means.
OFFLOAD_KEYS = {
    "swapopt/activation_peak_mib": "highest device MiB of tracked activations in a step",
    "swapopt/activation_budget_mib": "the activation budget in use (MiB; 0: none binds)",
    "swapopt/activation_offloaded_mib_per_step": "activation MiB copied out per step",
    "swapopt/activation_recomputes_per_step": "activations regenerated instead of copied back",
    "swapopt/activation_steps": "steps the session ran (warmups and replays)",
}


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps the number at 1 or above.

    Example:
        >>> format_bytes(3 * 2**20), format_bytes(512), format_bytes(1536)
        ('3.00 MiB', '512 B', '1.50 KiB')
    """
    if abs(nbytes) < 1024:
        return f"{nbytes:.0f} B"
    value = float(nbytes)
    for unit in _UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f} %" if whole > 0 else "0 %"


def _per(total: int, count: int) -> float:
    return total / count if count > 0 else 0.0


def _entries(stats: OffloadStats) -> int:
    """Steps one session ran: warmups (re-traces included) and replays."""
    return stats.warmups + stats.replays


def format_swap_stats(stats: SwapStats) -> str:
    """``str(SwapStats)``: one line with what the swap kept off the device and what it moved.

    Example:
        "optimizer state kept off the device: 92 % of 12.00 MiB (device peak 0.96 MiB),
        host 11.04 MiB (pinned 11.04 MiB); per step 11.04 MiB in, 11.04 MiB out; 6 steps,
        24 tensors in 8 batches, runtime cuda" (one line)
    """
    total, peak = stats.total_state_bytes, stats.peak_resident_state_bytes
    layout = "packed" if stats.packed else "per tensor"
    resident = (
        f", {stats.resident_state_fraction:.0%} resident for good"
        if stats.resident_for_good_bytes
        else ""
    )
    return (
        f"optimizer state kept off the device: {_percent(stats.kept_off_device_bytes, total)} of "
        f"{format_bytes(total)} (device peak {format_bytes(peak)}{resident}), "
        f"host {format_bytes(stats.host_state_bytes)} "
        f"(pinned {format_bytes(stats.pinned_host_bytes)}); per step "
        f"{format_bytes(stats.h2d_bytes_per_step)} in, "
        f"{format_bytes(stats.d2h_bytes_per_step)} out; {stats.steps} steps, "
        f"{stats.swapped_tensors} tensors in {stats.batches} batches ({layout}), "
        f"runtime {stats.runtime}"
    )


def format_offload_stats(stats: OffloadStats) -> str:
    """``str(OffloadStats)``: one line with the activations' peak against the budget, what
    was offloaded or recomputed, and how the steps ran (warmups, replays).

    Example:
        "activations: peak 0.50 MiB on the device against a 1.00 MiB budget (50 %);
        per step 3.00 MiB offloaded, 3.00 MiB fetched back, 5 recomputed; host peak
        1.20 MiB; warmups 1, replays 5, re-traces 0" (one line)
    """
    budget = stats.activation_budget_bytes
    peak = stats.peak_resident_activation_bytes
    against = (
        f" against a {format_bytes(budget)} budget ({_percent(peak, budget)})"
        if budget is not None
        else " (the plan keeps every activation on the device)"
    )
    entries = _entries(stats)
    step = ""
    if stats.step_peak_device_bytes or stats.planned_step_peak_device_bytes is not None:
        planned = stats.planned_step_peak_device_bytes
        step = f"; whole step peak {format_bytes(stats.step_peak_device_bytes)}"
        step += "" if planned is None else f" (planned {format_bytes(planned)})"
    return (
        f"activations: peak {format_bytes(peak)} on the device{against}; per step "
        f"{format_bytes(_per(stats.d2h_bytes, entries))} offloaded, "
        f"{format_bytes(_per(stats.h2d_bytes, entries))} fetched back, "
        f"{_per(stats.recomputes, entries):.3g} recomputed; host peak "
        f"{format_bytes(stats.host_peak_bytes)}; warmups {stats.warmups}, "
        f"replays {stats.replays}, re-traces {stats.retraces}{step}"
    )


def swap_figures(stats: Sequence[SwapStats]) -> dict[str, float]:
    """The optimizer-swap figures of ``stats`` (one per swapped optimizer), added up.

    Returns:
        ``SWAP_KEYS`` (MiB and counts as floats); ``{}`` when ``stats`` is empty. The
        per-step figures add each optimizer's average; ``swapopt/optimizer_steps`` is the
        first optimizer's.
    """
    if not stats:
        return {}
    total = sum(s.total_state_bytes for s in stats)
    peak = sum(s.peak_resident_state_bytes for s in stats)
    return {
        "swapopt/state_mib": total / _MIB,
        "swapopt/state_off_device_mib": max(total - peak, 0) / _MIB,
        "swapopt/state_device_peak_mib": peak / _MIB,
        "swapopt/state_host_mib": sum(s.host_state_bytes for s in stats) / _MIB,
        "swapopt/h2d_mib_per_step": sum(s.h2d_bytes_per_step for s in stats) / _MIB,
        "swapopt/d2h_mib_per_step": sum(s.d2h_bytes_per_step for s in stats) / _MIB,
        "swapopt/optimizer_steps": float(stats[0].steps),
    }


def offload_figures(stats: Sequence[OffloadStats]) -> dict[str, float]:
    """The activation-offload figures of ``stats`` (one per session: a training loop opens
    one per kind of window, each entered once per step).

    Returns:
        ``OFFLOAD_KEYS`` (MiB and counts as floats); ``{}`` when ``stats`` is empty. The
        peak and budget are the highest of the sessions; per-step figures add the sessions'.
    """
    if not stats:
        return {}
    budget = max(s.activation_budget_bytes or 0 for s in stats)
    offloaded = sum(_per(s.d2h_bytes, _entries(s)) for s in stats)
    return {
        "swapopt/activation_peak_mib": max(s.peak_resident_activation_bytes for s in stats) / _MIB,
        "swapopt/activation_budget_mib": budget / _MIB,
        "swapopt/activation_offloaded_mib_per_step": offloaded / _MIB,
        "swapopt/activation_recomputes_per_step": sum(
            _per(s.recomputes, _entries(s)) for s in stats
        ),
        "swapopt/activation_steps": float(max(_entries(s) for s in stats)),
    }


def summary_line(swap: Sequence[SwapStats], offload: Sequence[OffloadStats] = ()) -> str | None:
    """One line for the end of a run: each swapped optimizer's and session's summary,
    ``"swapopt: "`` first; None when there is neither."""
    parts = [format_swap_stats(s) for s in swap] + [format_offload_stats(s) for s in offload]
    return "swapopt: " + "; ".join(parts) if parts else None
