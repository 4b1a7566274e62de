"""The budgeted cells and the hand-set grid of ``device_budget.py``, for one workload."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.console import Console
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_models import Workload  # noqa: E402
from budget_steps import (  # noqa: E402
    MIB,
    RUNTIME,
    Features,
    Pacer,
    measure_plain,
    plain_references,
    run_estimate,
    run_variant,
    shared_runtime,
)


def _stat(stats: Any, name: str) -> Any:
    return getattr(stats, name, None)


def measure_ours(
    swapopt: ModuleType,
    work: Workload,
    target: int,
    steps: tuple[int, int],
    pacer: Pacer,
    reference: list[torch.Tensor],
) -> dict[str, Any]:
    """One budgeted cell: the session plans the whole step under ``target`` bytes."""

    def setup(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        config = swapopt.OffloadConfig(device_budget_mb=target / MIB, runtime=RUNTIME)
        return swapopt.OffloadSession(config, optimizer=opt)

    result = run_variant(swapopt, work, setup, steps, pacer, reference)
    session = result.pop("session", None)
    result.pop("optimizer", None)
    if session is not None:
        stats = session.stats()
        for name in (
            "step_peak_device_bytes",
            "planned_step_peak_device_bytes",
            "planned_step_ms",
            "plain_step_ms",
            "resident_state_fraction",
            "swap_times",
            "prefetch_batches",
            "activation_budget_bytes",
            "replays",
            "retraces",
        ):
            result[name] = _stat(stats, name)
    return result


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """A hand-set combination: ``swap_times``, batches prefetched during backward, and the
    activation budget as a fraction of the plain step's natural activation peak."""

    swap_times: int
    prefetch: int
    activation: float

    @property
    def label(self) -> str:
        return f"T={self.swap_times} K={self.prefetch} A={self.activation:.0%}"


def measure_grid_point(
    swapopt: ModuleType,
    work: Workload,
    point: GridPoint,
    activation_peak: int,
    steps: tuple[int, int],
    pacer: Pacer,
    reference: list[torch.Tensor],
    features: Features,
) -> dict[str, Any]:
    """One hand-set point, its whole-step peak from the shared runtime's meter."""
    if not features.engine and point.prefetch not in (0, 2):
        return {"error": "prefetch_batches is not in SwapOptimizerConfig yet (only 0 or 2)"}
    budget = max(1.0, point.activation * activation_peak)

    def setup(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        knobs: dict[str, Any] = {"swap_times": point.swap_times, "runtime": RUNTIME}
        if features.engine:
            knobs.update(prefetch_batches=point.prefetch, resident_state_fraction=0.0)
        else:  # before the engine's knobs: the default depth (2) on or off
            knobs.update(prefetch_during_backward=point.prefetch > 0)
        swapopt.swap_optimizer(opt, swapopt.SwapOptimizerConfig(**knobs))
        config = swapopt.OffloadConfig(max_resident_activation_mb=budget / MIB, runtime=RUNTIME)
        return swapopt.OffloadSession(config)

    runtime = shared_runtime() if features.meter else None  # held: the shared instance stays alive
    meter = runtime.step_meter() if runtime is not None else None
    result = run_variant(swapopt, work, setup, steps, pacer, reference, meter)
    result.pop("session", None)
    result.pop("optimizer", None)  # dropped swapped: unswapping would copy over the slow link
    result["activation_budget_bytes"] = int(budget)
    result["peak"] = result.pop("meter_peak")
    return result


def best_within(grid: dict[str, dict[str, Any]], target: int) -> tuple[str, dict[str, Any]] | None:
    """The fastest grid point whose measured peak is at most ``target``."""
    fitting = [
        (row["ratio"], label, row)
        for label, row in grid.items()
        if "error" not in row and row.get("peak") is not None and row["peak"] <= target
    ]
    if not fitting:
        return None
    _, label, row = min(fitting, key=lambda item: item[0])
    return label, row


def measure_plain_part(
    swapopt: ModuleType,
    work: Workload,
    args: argparse.Namespace,
    features: Features,
    console: Console,
) -> dict[str, Any]:
    """Plain training's figures and ``swapopt estimate``'s, measured before any budgeted run
    so that nothing else runs on the machine meanwhile."""
    plain = measure_plain(swapopt, work, (args.steps[0], args.plain_steps), features)
    console.log(
        f"{work.name}: {plain['params'] / 1e6:.2f} M parameters, plain peak "
        f"{plain['peak'] / MIB:.1f} MiB ({plain['peak_source']}), step {plain['step_ms']:.0f} ms"
    )
    result: dict[str, Any] = {"description": work.description, "plain": plain}
    if features.estimate and not args.no_estimate:
        result["estimate"] = run_estimate(work, args.size)
        console.log(f"{work.name} estimate: {result['estimate']}")
    return result


def measure_budget_part(
    swapopt: ModuleType,
    work: Workload,
    plain: dict[str, Any],
    args: argparse.Namespace,
    features: Features,
    console: Console,
) -> dict[str, Any]:
    """Every target and every grid point of one workload, against ``plain``'s peak.

    *step / plain* (``ratio``) is each variant's median step over the median of every plain
    step the pacer ran for this workload (the many plain steps make it steady on a shared
    machine); ``paired_ratio`` is the median of each timed step over the plain step run
    right before it.
    """
    start = time.perf_counter()
    counts = (sum(args.steps), sum(args.grid_steps))
    references = plain_references(work, counts)
    pacer = Pacer(work)
    cells: dict[str, dict[str, Any]] = {}
    for fraction in args.targets:
        target = int(fraction * plain["peak"])
        if features.budget:
            reference = references[counts[0]]
            cell = measure_ours(swapopt, work, target, tuple(args.steps), pacer, reference)
        else:
            cell = {"error": "OffloadSession(config, optimizer=opt) is not there yet"}
        cell["target"] = target
        cells[f"{fraction:g}"] = cell
        console.log(f"{work.name} at {fraction:.0%}: {_brief(cell)}")
    grid: dict[str, dict[str, Any]] = {}
    points = itertools.product(args.grid_swap_times, args.grid_prefetch, args.grid_activation)
    for swap_times, prefetch, activation in points:
        point = GridPoint(swap_times, prefetch, activation)
        grid[point.label] = measure_grid_point(
            swapopt,
            work,
            point,
            plain["activation_peak"],
            tuple(args.grid_steps),
            pacer,
            references[counts[1]],
            features,
        )
        console.log(f"{work.name} grid {point.label}: {_brief(grid[point.label])}")
    pacer_ms = statistics.median(pacer.times) * 1e3 if pacer.times else None
    for row in (*cells.values(), *grid.values()):
        if "step_ms" in row and pacer_ms:
            row["ratio"] = row["step_ms"] / pacer_ms
    for cell in cells.values():
        best = best_within(grid, cell["target"])
        cell["best_grid"] = best[0] if best else None
        if best and "ratio" in cell:
            cell["ours_over_best"] = cell["ratio"] / best[1]["ratio"]
    return {
        "cells": cells,
        "grid": grid,
        "pacer_ms": pacer_ms,
        "pacer_steps": len(pacer.times),
        "seconds": time.perf_counter() - start,
    }


def _brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return row["error"][:160]
    peak = row.get("step_peak_device_bytes", row.get("peak"))
    peak_text = f"peak {peak / MIB:.1f} MiB, " if peak else ""
    return f"{peak_text}step {row['step_ms']:.0f} ms ({row['paired_ratio']:.2f} x plain)"
