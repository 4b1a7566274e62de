"""The tables and the JSON of ``device_budget.py``."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

MIB = 2**20


def _goal(value: float | None, limit: float, digits: int = 2) -> str:
    if value is None:
        return ""
    text = f"{value:.{digits}f}"
    return text if value <= limit else f"[red]{text}[/red]"


def _band(value: float | None, tolerance: float, digits: int = 2) -> str:
    """``value`` (a ratio), red when it is more than ``tolerance`` away from 1."""
    if value is None:
        return ""
    text = f"{value:.{digits}f}"
    return text if abs(value - 1) <= tolerance else f"[red]{text}[/red]"


def _knob(index: int, value: float | None, target: int) -> str:
    """A chosen knob; the activation budget (index 3) in MiB, "all" when it is no limit."""
    if value is None:
        return "-"
    if index != 3:
        return f"{value:g}"
    return "all" if value > target else f"{value / MIB:.1f}"


class _Notes:
    """Failures, listed under the tables and referred to by number in the cells."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, where: str, text: str) -> str:
        self.lines.append(f"({len(self.lines) + 1}) {where}: {text}")
        return f"[yellow]see ({len(self.lines)})[/yellow]"


def render(report: dict[str, Any], console: Console) -> None:
    meta = report["meta"]
    notes = _Notes()
    console.print(
        f"CPU fp32 matmul {meta['cpu_gflops']:.1f} GFLOP/s ({meta['threads']} torch threads); "
        f"emulated link {meta['link_gbps'] * 1e3:.2f} MB/s per direction "
        f"({meta['link_rule']}); features: "
        + ", ".join(f"{k} {'yes' if v else 'missing'}" for k, v in meta["features"].items())
    )
    plain = Table(title="Plain step (no swapopt) and swapopt estimate --device cpu")
    for column in (
        "model",
        "params M",
        "peak MiB census",
        "peak MiB meter",
        "act. peak MiB",
        "step ms",
        "estimate peak / measured",
        "estimate step / measured",
        "estimate s",
    ):
        plain.add_column(column, justify="left" if column == "model" else "right")
    for name, model in report["models"].items():
        p, est = model["plain"], model.get("estimate") or {}
        peak_ratio = est["peak"] / p["peak"] if "peak" in est else None
        step_ratio = est["step_ms"] / p["step_ms"] if "step_ms" in est else None
        plain.add_row(
            name,
            f"{p['params'] / 1e6:.2f}",
            f"{p['census_peak'] / MIB:.1f}",
            f"{p['meter_peak'] / MIB:.1f}" if p["meter_peak"] else "missing",
            f"{p['activation_peak'] / MIB:.1f}",
            f"{p['step_ms']:.0f}",
            _band(peak_ratio, 0.05, 3)
            if peak_ratio
            else notes.add(f"{name} estimate", est["error"])
            if "error" in est
            else "",
            _band(step_ratio, 0.25),
            f"{est['seconds']:.0f}" if "seconds" in est else "",
        )
    console.print(plain)
    cells = Table(
        title="Whole-step budget (device_budget_mb) on loopback-async; step / plain: the median "
        "step over the median of the plain steps run between the timed ones; red: a goal missed"
    )
    for column in (
        "model",
        "target",
        "MiB",
        "peak / target",
        "step / plain",
        "step / planned",
        "resident, T, K, act. MiB",
        "best grid point",
        "ours / best",
        "moved MiB",
        "same bits",
    ):
        cells.add_column(
            column, justify="left" if column in ("model", "best grid point") else "right"
        )
    for name, model in report["models"].items():
        for fraction, cell in model["cells"].items():
            row = [name, f"{float(fraction):.0%}", f"{cell['target'] / MIB:.1f}"]
            if "error" in cell:
                floor = cell.get("floor_bytes")
                note = f"floor {floor / MIB:.1f} MiB: " if floor else ""
                where = f"{name} at {float(fraction):.0%}"
                cells.add_row(*row, notes.add(where, note + cell["error"]), *[""] * 7)
                continue
            full = float(fraction) >= 1.0
            peak = cell.get("step_peak_device_bytes")
            planned = cell.get("planned_step_ms")
            knobs = [
                cell.get("resident_state_fraction"),
                cell.get("swap_times"),
                cell.get("prefetch_batches"),
                cell.get("activation_budget_bytes"),
            ]
            knob_text = ", ".join(_knob(i, k, cell["target"]) for i, k in enumerate(knobs))
            cells.add_row(
                *row,
                _goal(peak / cell["target"], 1.02, 3) if peak else "missing",
                _goal(cell["ratio"], 1.03 if full else float("inf")),
                _goal(cell["step_ms"] / planned, 1.15) if planned else "missing",
                knob_text,
                cell.get("best_grid") or "none fits",
                _goal(cell.get("ours_over_best"), 1.05),
                (
                    f"{cell['moved'] / MIB:.1f}"
                    if not cell["moved"]
                    else f"[red]{cell['moved'] / MIB:.1f}[/red]"
                )
                if full
                else f"{cell['moved'] / MIB:.1f}",
                "yes" if cell["identical"] else "[red]NO[/red]",
            )
    console.print(cells)
    grid = Table(title="Hand-set grid (resident_state_fraction=0, all state swapped); peak: meter")
    for column in (
        "model",
        "point",
        "act. MiB",
        "peak MiB",
        "peak / plain",
        "step / plain",
        "same bits",
    ):
        grid.add_column(column, justify="left" if column in ("model", "point") else "right")
    for name, model in report["models"].items():
        for label, row in model["grid"].items():
            if "error" in row:
                failed = notes.add(f"{name} grid {label}", row["error"])
                grid.add_row(name, label, "", failed, "", "", "")
                continue
            peak = row.get("peak")
            grid.add_row(
                name,
                label,
                f"{row['activation_budget_bytes'] / MIB:.1f}",
                f"{peak / MIB:.1f}" if peak else "missing",
                f"{peak / model['plain']['peak']:.3f}" if peak else "",
                f"{row['ratio']:.2f}",
                "yes" if row["identical"] else "[red]NO[/red]",
            )
    console.print(grid)
    for line in notes.lines:
        console.print(line, highlight=False)


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return str(value)
