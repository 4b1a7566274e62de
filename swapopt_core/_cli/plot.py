"""A picture of one simulated step: resident activation memory over time, and the copies.

The top panel shows the activation bytes on the device over time without a plan (natural: every
storage stays until its last access) and with the plan, and the budget as a horizontal line. A
budget no plan keeps (below the floor, the least any plan needs, or under the plan's peak) is
drawn dotted, with the floor as a line of its own and a note giving both. The panel below has
one lane per copy direction with a bar for every copy the simulator ran, and a compute lane with
the ops (grey) and the recomputes (purple, hatched, in the legend; ``RECOMPUTE`` actions and
recomputes on demand), each at least ``MIN_RECOMPUTE_WIDTH`` of the time axis wide so that one
of a few microseconds still shows. One can see where the copies overlap compute, where compute
waits and what recomputation costs.

matplotlib is an optional dependency (``pip install swapopt[plot]``); it is imported only here,
and drawn with the Agg canvas so no display is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from swapopt_core._planning.floor import min_feasible_budget
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule
from swapopt_core._planning.simulate import SimulationResult, simulate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.container import BarContainer
    from matplotlib.figure import Figure

__all__ = ["MIN_RECOMPUTE_WIDTH", "draw_timeline", "plot_timeline"]

MIB = 1 << 20
_NATURAL, _PLANNED, _BUDGET, _FLOOR = "#9e9e9e", "#1f77b4", "#d62728", "#000000"
_LANES = (("D2H", "#ff7f0e"), ("H2D", "#2ca02c"))
_OPS, _RECOMPUTE, _RECOMPUTE_HATCH = "#bdbdbd", "#9467bd", "////"

#: The narrowest a recompute bar is drawn, as a share of the time axis (its true span may be
#: far shorter: a few microseconds in a step of milliseconds would be no wider than a hair).
MIN_RECOMPUTE_WIDTH = 0.006


def _steps(timeline: Sequence[tuple[float, int]]) -> tuple[list[float], list[float]]:
    """Points of a step line through ``timeline``, in ms and MiB.

    Several changes can happen at one instant (a storage freed after an op and the next op's
    output allocated): of those, the line shows the highest level, then the level it settles
    at, so no instant peak is hidden and no instant dip draws a spike.
    """
    times: list[float] = [0.0]
    mib: list[float] = [0.0]
    i = 0
    while i < len(timeline):
        at, top = timeline[i][0], timeline[i][1]
        j = i
        while j + 1 < len(timeline) and timeline[j + 1][0] == at:
            j += 1
            top = max(top, timeline[j][1])
        for level in (top, timeline[j][1]) if top != timeline[j][1] else (top,):
            times.append(float(at))
            mib.append(level / MIB)
        i = j + 1
    return times, mib


def _memory_line(
    memory: Axes, run: SimulationResult, name: str, color: str, width: float, alpha: float
) -> None:
    """Draw the resident bytes of ``run`` over time as a filled step line."""
    times, mib = _steps(run.timeline)
    label = f"{name} (peak {run.peak_bytes / MIB:,.1f} MiB)"
    memory.step(times, mib, where="post", color=color, linewidth=width, label=label)
    memory.fill_between(times, mib, step="post", color=color, alpha=alpha)


def _compute_lane(
    lanes: Axes, trace: ActivationTrace, planned: SimulationResult, axis_ms: float
) -> tuple[str, BarContainer | None]:
    """Draw the ops and the recomputes on lane 0 (the bottom one); return its label and the
    recompute bars (for the legend; None when nothing was recomputed).

    Each recompute is one hatched rectangle (``gid="recompute"``), centred on its true span
    and at least ``MIN_RECOMPUTE_WIDTH * axis_ms`` wide.
    """
    ops = [
        (start, op.duration_ms)
        for start, op in zip(planned.op_start_ms, trace.ops, strict=False)
        if op.duration_ms > 0
    ]
    if ops:
        lanes.broken_barh(ops, (-0.35, 0.7), facecolors=_OPS, edgecolors="none")
    least = MIN_RECOMPUTE_WIDTH * axis_ms
    widths = [max(r.end_ms - r.start_ms, least) for r in planned.recomputed]
    lefts = [
        max(0.0, (r.start_ms + r.end_ms - width) / 2)
        for r, width in zip(planned.recomputed, widths, strict=True)
    ]
    bars = None
    if widths:
        bars = lanes.barh(
            0,
            widths,
            left=lefts,
            height=0.7,
            color=_RECOMPUTE,
            edgecolor="black",
            linewidth=0.5,
            hatch=_RECOMPUTE_HATCH,
            label=f"recompute (drawn at least {100 * MIN_RECOMPUTE_WIDTH:g} % of the axis wide)",
        )
        for bar in bars:
            bar.set_gid("recompute")
    count = len(planned.recomputed)
    return (
        f"compute: {count} recompute{'' if count == 1 else 's'}\n{planned.recompute_ms:,.3f} ms",
        bars,
    )


def _budget_lines(
    memory: Axes,
    trace: ActivationTrace,
    schedule: ResidencySchedule | None,
    planned: SimulationResult,
    natural: SimulationResult,
) -> None:
    """Draw the budget line; a budget no plan keeps is dotted, with the floor and a note."""
    budget = trace.memory_limit_bytes
    if budget is None:
        return
    floor = min_feasible_budget(trace)
    below_floor = budget < floor
    over = schedule is not None and planned.peak_bytes > budget
    label = f"budget ({budget / MIB:,.1f} MiB)"
    if not (below_floor or over):
        memory.axhline(
            budget / MIB, color=_BUDGET, linestyle="--", linewidth=1.2, label=label, gid="budget"
        )
        return
    memory.axhline(
        budget / MIB,
        color=_BUDGET,
        linestyle=":",
        linewidth=2.0,
        label=label + (", below the floor" if below_floor else ", plan over it"),
        gid="budget",
    )
    memory.axhline(
        floor / MIB,
        color=_FLOOR,
        linestyle="-.",
        linewidth=1.0,
        label=f"floor, the least any plan needs ({floor / MIB:,.1f} MiB)",
        gid="floor",
    )
    if below_floor:
        note = (
            f"No plan fits: the budget of {budget / MIB:,.2f} MiB\nis below the floor of "
            f"{floor / MIB:,.2f} MiB.\nRaise the budget to the floor or more."
        )
    else:
        note = (
            f"The plan peaks at {planned.peak_bytes / MIB:,.2f} MiB,\nover the budget of "
            f"{budget / MIB:,.2f} MiB\n(floor {floor / MIB:,.2f} MiB)."
        )
    top = max(planned.peak_bytes, natural.peak_bytes, budget, floor) / MIB
    memory.set_ylim(top=1.45 * top)  # room above the lines for the note and the legend
    memory.annotate(
        note,
        xy=(0.01, 0.97),
        xycoords="axes fraction",
        va="top",
        fontsize="small",
        color=_BUDGET,
        bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": _BUDGET},
        gid="infeasible",
    )


def draw_timeline(
    trace: ActivationTrace, schedule: ResidencySchedule | None
) -> tuple[Figure, SimulationResult]:
    """Simulate ``trace`` with ``schedule`` and draw its memory timeline on a new figure.

    Args:
        trace: The step, with ``memory_limit_bytes`` as the budget line (``None``: no line).
        schedule: The plan to draw; ``None`` draws only the run without a plan.

    Returns:
        The figure (Agg canvas, no display needed) and the simulation of ``trace`` under
        ``schedule``, as drawn.

    Raises:
        ModuleNotFoundError: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "Plotting a memory timeline needs matplotlib: pip install 'swapopt[plot]'."
        ) from error

    natural = simulate(trace)
    planned = simulate(trace, schedule)
    axis_ms = max(planned.total_ms, natural.total_ms) * 1.01 or 1.0
    figure = Figure(figsize=(10, 6), layout="constrained")
    memory, lanes = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1.4))

    _memory_line(memory, natural, "no plan, natural", _NATURAL, 1.2, 0.15)
    if schedule is not None:
        _memory_line(memory, planned, "with plan", _PLANNED, 1.6, 0.2)
    _budget_lines(memory, trace, schedule, planned, natural)
    memory.set_ylabel("resident activations (MiB)")
    memory.set_ylim(bottom=0)
    memory.grid(True, alpha=0.3)
    compute, recomputes = _compute_lane(lanes, trace, planned, axis_ms)
    handles = memory.get_legend_handles_labels()[0]
    # The recomputes' entry joins the top legend: one on the lanes would cover their bars.
    memory.legend(
        handles=[*handles, *([recomputes] if recomputes is not None else [])],
        loc="upper right",
        fontsize="small",
    )

    labels = [compute]
    for lane, (direction, color) in enumerate(reversed(_LANES), start=1):
        spans = [
            (c.start_ms, c.end_ms - c.start_ms) for c in planned.copies if c.direction == direction
        ]
        if spans:
            lanes.broken_barh(
                spans, (lane - 0.35, 0.7), facecolors=color, edgecolors="black", linewidth=0.3
            )
        moved = planned.d2h_bytes if direction == "D2H" else planned.h2d_bytes
        copies = f"{len(spans)} cop{'y' if len(spans) == 1 else 'ies'}"
        labels.append(f"{direction}: {copies}\n{moved / MIB:,.1f} MiB")
    lanes.set_yticks(range(len(_LANES) + 1), labels, fontsize="small")
    lanes.set_ylim(-0.6, len(_LANES) + 0.6)
    lanes.set_xlabel("time (ms)")
    lanes.grid(True, axis="x", alpha=0.3)
    lanes.set_xlim(left=0, right=axis_ms)

    title = (
        f"Activation memory over one step: {len(trace.ops)} ops, "
        f"overhead {100 * planned.overhead:.1f} %"
    )
    recomputed = len(planned.recomputed)
    if recomputed:
        title += f", {recomputed} recompute{'' if recomputed == 1 else 's'}"
    if planned.demand_fetches:
        title += f", {planned.demand_fetches} demand fetches"
    figure.suptitle(title)
    return figure, planned


def plot_timeline(
    trace: ActivationTrace, schedule: ResidencySchedule | None, out: str | Path, *, dpi: int = 150
) -> SimulationResult:
    """Draw the memory timeline of ``trace`` under ``schedule`` (:func:`draw_timeline`) to
    ``out``.

    Args:
        trace: The step, with ``memory_limit_bytes`` as the budget line (``None``: no line).
        schedule: The plan to draw; ``None`` draws only the run without a plan.
        out: The image file; its suffix picks the format (``.png``, ``.svg``, ``.pdf``).
        dpi: Resolution of raster formats.

    Returns:
        The simulation of ``trace`` under ``schedule``, as drawn.

    Raises:
        ModuleNotFoundError: matplotlib is not installed.
    """
    figure, planned = draw_timeline(trace, schedule)
    suffix = Path(out).suffix.lstrip(".").lower() or None
    figure.savefig(out, dpi=dpi, format=suffix)  # the format from ``out``, not a temporary name
    return planned
