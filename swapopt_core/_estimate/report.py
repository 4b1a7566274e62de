"""Show an :class:`~swapopt_core._estimate.breakdown.Estimate`: a table, and its JSON."""

from __future__ import annotations

import json

from rich.table import Table

from swapopt_core._estimate.breakdown import Breakdown, Estimate

__all__ = ["estimate_json", "render_estimate"]

_GIB = 2**30


def _gib(nbytes: int | None) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    if nbytes is None:
        return "-"
    for unit, size in (("GiB", _GIB), ("MiB", 2**20)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{nbytes / 1024:,.1f} KiB"


def render_estimate(found: Estimate) -> Table:
    """The memory breakdown and step times of plain training and of the plan."""
    details = found.details
    title = (
        f"{details.get('model')}: batch {details.get('batch')}, sequence {details.get('seq')}, "
        f"{details.get('optimizer')}, on {found.profile.name}"
    )
    table = Table(title=title, caption=f"{details.get('ops')} ops traced on fake tensors")
    table.add_column("")
    table.add_column("plain", justify="right")
    plan = found.plan
    if found.budget_bytes is not None:
        table.add_column(f"plan at {found.budget_bytes / 2**20:,.0f} MiB", justify="right")

    def row(label: str, value: object) -> None:
        cells = [label, str(value(found.plain))]  # type: ignore[operator]
        if found.budget_bytes is not None:
            cells.append("-" if plan is None else str(value(plan)))  # type: ignore[operator]
        table.add_row(*cells)

    row("parameters", lambda b: _gib(b.params_bytes))
    row("gradients", lambda b: _gib(b.grads_bytes))
    row("optimizer state on the device", lambda b: _gib(b.optimizer_state_bytes))
    row("activations, peak", lambda b: _gib(b.activations_peak_bytes))
    row("[bold]whole step, peak[/]", lambda b: f"[bold]{_gib(b.peak_bytes)}[/]")
    row("[bold]step time[/]", lambda b: f"[bold]{b.step_ms:,.1f} ms[/]")
    if plan is not None and plan.knobs is not None:
        table.add_section()
        for key, label in (
            ("resident_state_fraction", "resident optimizer state"),
            ("swap_times", "swap_times"),
            ("prefetch_batches", "batches prefetched in backward"),
            ("activation_budget_bytes", "activation budget"),
        ):
            table.add_row(label, "", _knob(key, plan))
    return table


def _knob(key: str, plan: Breakdown) -> str:
    value = (plan.knobs or {}).get(key)
    if key == "resident_state_fraction":
        return f"{100 * float(value or 0):.0f} %"
    if key == "activation_budget_bytes":
        return "not moved" if value is None else _gib(int(value))
    return str(value)


def estimate_json(found: Estimate) -> str:
    """The JSON that ``--json`` writes: ``plain`` and ``plan``, and how they were made."""
    return json.dumps(found.to_dict(), indent=2) + "\n"
