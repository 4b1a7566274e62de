"""What ``swapopt run`` says about a run: the line on what the settings ask for, before the
script starts, and the summary of what was swapped, after it ends.

Figures come from the process-wide record (``swapopt_core._record``) and are computed here
from the ``SwapStats`` and ``OffloadStats`` fields, in binary units (``format_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from swapopt_core._figures import format_bytes
from swapopt_core._record import SwapEntry

if TYPE_CHECKING:
    from swapopt_core._activations.session_stats import OffloadStats
    from swapopt_core.options import Settings

__all__ = ["PREFIX", "asked_for", "integrations_line", "summary_lines"]

#: The start of every line ``swapopt run`` prints itself.
PREFIX = "swapopt run: "
#: Optimizers (and sessions) given a line each; the total counts them all (a script that
#: builds a new optimizer per trial may swap hundreds).
MAX_LINES = 8


def _mib(value: float) -> str:
    return f"{value:g} MiB"


def asked_for(settings: Settings) -> list[str]:
    """What the settings ask for, in words (empty when they ask for nothing)."""
    values = settings.values
    asked = []
    if values["device_budget_mb"] is not None:
        asked.append(
            f"whole-step device budget {_mib(values['device_budget_mb'])} (optimizer state "
            "to host memory as the plan needs)"
        )
    elif settings.enabled:
        asked.append(f"optimizer state to host memory (swap_times={settings.swap.swap_times})")
    if values["activation_budget_mb"] is not None:
        asked.append(f"activation budget {_mib(values['activation_budget_mb'])}")
    return asked


def integrations_line(settings: Settings, names: Sequence[str]) -> str:
    """The line printed before the script starts: what is on, and what was asked for."""
    asked = asked_for(settings)
    if not asked:  # SWAPOPT_LIGHTNING_AUTO=1 alone still adds the (idle) Lightning callback
        return (
            f"{PREFIX}integrations on: {', '.join(names) or 'none'}; no SWAPOPT_* setting "
            "asks for anything, so the script runs plain (but for optimizers it swaps itself)"
        )
    if not names:
        return (
            f"{PREFIX}integrations on: none (no Accelerate, Lightning or Transformers "
            f"installed); asked for {', '.join(asked)}: only optimizers the script swaps "
            "itself are swapped"
        )
    return f"{PREFIX}integrations on: {', '.join(names)}; asked for {', '.join(asked)}"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _optimizer_line(entry: SwapEntry) -> str:
    stats = entry.stats
    facts = [
        _plural(stats.swapped_tensors, "state tensor") + " swapped",
        _plural(stats.steps, "step"),
    ]
    if entry.param_groups is not None:
        facts.insert(0, _plural(entry.param_groups, "param group"))
    what = f"{entry.name} ({', '.join(facts)})"
    moved = (
        f"per step {format_bytes(stats.h2d_bytes_per_step)} in, "
        f"{format_bytes(stats.d2h_bytes_per_step)} out"
        if stats.steps
        else "no swapped step"
    )
    return (
        f"  optimizer {what}: {format_bytes(stats.kept_off_device_bytes)} of "
        f"{format_bytes(stats.total_state_bytes)} state kept off the device (peak resident "
        f"{format_bytes(stats.peak_resident_state_bytes)}), "
        f"{format_bytes(stats.host_state_bytes)} in host memory, {moved}"
    )


def _session_line(number: int, stats: OffloadStats) -> str:
    budget = stats.activation_budget_bytes
    under = "the plan keeps them all" if budget is None else f"budget {format_bytes(budget)}"
    line = (
        f"  activations (OffloadSession {number}): device peak "
        f"{format_bytes(stats.peak_resident_activation_bytes)} ({under}), host peak "
        f"{format_bytes(stats.host_peak_bytes)}, {format_bytes(stats.d2h_bytes)} out and "
        f"{format_bytes(stats.h2d_bytes)} in, {_plural(stats.recomputes, 'recompute')}"
    )
    if stats.step_peak_device_bytes:
        line += f", whole-step device peak {format_bytes(stats.step_peak_device_bytes)}"
    return line


def summary_lines(
    swaps: Sequence[SwapEntry],
    sessions: Sequence[OffloadStats],
    budget_not_applied: Sequence[str] = (),
) -> list[str]:
    """The summary: a line per swapped optimizer and per offload session, then the total,
    then a line per reason a device budget was not applied (``budget_not_applied``).

    Kept off the device is the swappable state minus its peak on the device; bytes moved per
    step are the copies in (host to device) and out since the swap was installed, divided by
    its steps. The first ``MAX_LINES`` optimizers and sessions get a line; the total counts
    all. Empty when nothing was swapped or offloaded and no budget went unapplied.
    """
    not_applied = [f"  device budget NOT applied, {why}" for why in budget_not_applied]
    if not swaps and not sessions:
        return [f"{PREFIX}what swapopt did in this process:", *not_applied] if not_applied else []
    lines = [f"{PREFIX}what swapopt did in this process:"]
    lines += [_optimizer_line(entry) for entry in swaps[:MAX_LINES]]
    if len(swaps) > MAX_LINES:
        lines.append(f"  ... and {_plural(len(swaps) - MAX_LINES, 'optimizer')} more")
    lines += [_session_line(n, stats) for n, stats in enumerate(sessions[:MAX_LINES], 1)]
    if len(sessions) > MAX_LINES:
        lines.append(f"  ... and {_plural(len(sessions) - MAX_LINES, 'session')} more")
    kept_off = sum(e.stats.kept_off_device_bytes for e in swaps)
    host = sum(e.stats.host_state_bytes for e in swaps)
    host += sum(stats.host_peak_bytes for stats in sessions)
    h2d = sum(e.stats.h2d_bytes_per_step for e in swaps)
    d2h = sum(e.stats.d2h_bytes_per_step for e in swaps)
    total = [f"{format_bytes(host)} in host memory"]
    if swaps:
        total.insert(0, f"{format_bytes(kept_off)} of optimizer state kept off the device")
        total.append(f"per optimizer step {format_bytes(h2d)} in, {format_bytes(d2h)} out")
    lines.append(f"  total: {', '.join(total)}")
    return lines + not_applied
