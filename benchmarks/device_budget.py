"""Device budget benchmark: one memory target for the whole training step, on three models,
against plain training and against a grid of hand-set knobs measured in the same run.

**The link.** Everything runs on the CPU with ``runtime="loopback-async"`` (CPU tensors play
the device, other CPU buffers the host, a paced worker thread per copy direction). The link is
emulated (``SWAPOPT_LOOPBACK_GBPS``) as slow, relative to this CPU's matmul rate, as an H200's
PCIe link relative to its compute: the script measures this CPU's fp32 matmul rate first (a
1024 x 1024 matmul, median of seven, at the torch thread count the run uses) and sets
``link GB/s = cpu GFLOP/s x 55 / 989 000`` (H200: 989 TFLOP/s dense bf16, about 55 GB/s
achieved per direction over PCIe Gen5). ``--link-gbps`` sets the rate instead. The figures
used are printed and written to the JSON.

**The models** (``budget_models.py``; ``--size``): a GPT-style decoder (``swapopt demo``'s
model), a CIFAR-style ResNet and a small Llama built from a transformers ``LlamaConfig``, fp32,
AdamW, one fixed batch each. At the H200's ratio every byte moved costs the time of about
18 000 FLOPs, so this CPU moves about 3 MB/s and a plain step of a tenth of a second can hide
only a few hundred KB; every budgeted variant also pays a traced and planned first step.
``--size default`` (GPT and Llama about 0.25 M parameters, 9 to 10 MiB a step; ResNet 0.04 M,
5 MiB) keeps the whole run near ten minutes; ``medium`` (about 1 M parameters, 40 to 75 MiB)
takes half an hour or more; ``issue`` builds the issue's ~30 M GPT, where moving the optimizer state
once takes minutes.

**Measured per model**, each variant from the same initial parameters on the same batch:

* **plain**: the step without swapopt: its time (median of ``--plain-steps``) and its peak of
  device bytes over one whole step (forward, backward, ``opt.step()``, ``zero_grad()``):
  parameters, gradients, optimizer state, activations and temporaries. The peak comes from
  ``torch.distributed._tools.mem_tracker.MemTracker`` (``census``) and, once the runtime has
  one, from the whole-step meter (``runtime.step_meter()``); the targets are taken from the
  meter when it exists (the same count the budgeted steps are measured with), else from the
  census.
* **ours**, per target (100, 70, 50, 35 % of the plain peak):
  ``OffloadSession(OffloadConfig(device_budget_mb=target, runtime="loopback-async"),
  optimizer=opt)``: *peak / target* (``stats().step_peak_device_bytes``, warmup included;
  goal <= 1.02), *step / plain* (each timed step runs right after a plain step of a separate
  pacing model, and the figure is the median of the ratios), *step / planned*
  (``planned_step_ms``; goal <= 1.15), the knobs the plan chose, and at 100 % the bytes moved
  in the timed steps (goal: none, and step / plain <= 1.03).
* **grid**: hand-set points ``swap_optimizer(opt, SwapOptimizerConfig(swap_times=T,
  prefetch_batches=K, resident_state_fraction=0.0))`` plus
  ``OffloadSession(OffloadConfig(max_resident_activation_mb=A))``, for every T in
  ``--grid-swap-times``, K in ``--grid-prefetch`` and A in ``--grid-activation`` (fractions of
  the plain step's natural activation peak); the whole-step peak from the meter of the shared
  runtime (``begin(held)`` / ``end()`` around each step, the highest step, warmup included).
  The best grid point within a target is the fastest (step / plain) whose peak is at most the
  target; *ours / best* is the ratio of the two step / plain figures (goal <= 1.05).
* **estimate** (when ``python -m swapopt_core estimate`` exists): its plain peak and step time
  (``--device cpu``) over the measured ones (goals: within 5 % and 25 %).
* **same bits**: every variant ends with parameters ``torch.equal`` to plain's after as many
  steps.

Order: plain training and the estimate of every model first, alone on the machine; then
the budgeted cells and the grid, the models in parallel processes (``--jobs``, default 3:
the steps mostly wait on the emulated link; ``--jobs 1`` for the quietest timing). Parts
whose API is not there (the budgeted session, the engine's knobs, the meter, the estimate)
are reported as missing and the rest runs. About ten minutes at the defaults on two cores;
``--quick`` (tiny models, two targets, a two-point grid, a fast link) about half a minute
a model.

Run::

    python benchmarks/device_budget.py --json budget.json
    python benchmarks/device_budget.py --models gpt --targets 1 0.5 --steps 1 3
    python benchmarks/device_budget.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.console import Console
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_models import Workload, workload  # noqa: E402
from budget_report import jsonable, render  # noqa: E402
from budget_steps import (  # noqa: E402
    MIB,
    RUNTIME,
    Features,
    Pacer,
    detect,
    import_swapopt,
    matmul_gflops,
    measure_plain,
    plain_references,
    run_estimate,
    run_variant,
    shared_runtime,
)

#: H200 SXM: dense bf16 tensor-core peak (TFLOP/s) and PCIe Gen5 x16 achieved per direction.
H200_TFLOPS, H200_LINK_GBPS = 989.0, 55.0
TARGETS = (1.0, 0.7, 0.5, 0.35)
#: The link of ``--quick`` (GB/s per direction): a smoke run checks that every part runs.
QUICK_LINK_GBPS = 0.05


# --------------------------------------------------------------------------- the cells


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


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["gpt", "resnet", "llama"],
        default=["gpt", "resnet", "llama"],
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=3,
        help="models measured at once, each in its own process (default 3; 1 for the quietest "
        "timing: the steps mostly wait on the emulated link, so they share the cores well)",
    )
    parser.add_argument(
        "--size", choices=["quick", "default", "medium", "issue"], default="default"
    )
    parser.add_argument(
        "--targets",
        type=float,
        nargs="+",
        default=list(TARGETS),
        help="fractions of the plain step's measured peak (default 1 0.7 0.5 0.35)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        nargs=2,
        default=[2, 2],
        metavar=("WARM", "TIMED"),
        help="untimed and timed steps of plain and of every budgeted cell (default 2 2)",
    )
    parser.add_argument(
        "--plain-steps",
        type=int,
        default=10,
        help="timed steps of plain training, alone on the machine (default 10: they are short)",
    )
    parser.add_argument(
        "--grid-steps",
        type=int,
        nargs=2,
        default=[1, 1],
        metavar=("WARM", "TIMED"),
        help="the same for every grid point (default 1 1: the warmup, then one replay)",
    )
    parser.add_argument("--grid-swap-times", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--grid-prefetch", type=int, nargs="+", default=[0, 2])
    parser.add_argument(
        "--grid-activation",
        type=float,
        nargs="+",
        default=[0.6, 0.3],
        help="activation budgets, fractions of the natural activation peak (default 0.6 0.3; "
        "at 1 a point's peak is above every target below 100 %%)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--link-gbps",
        type=float,
        help="emulated link per direction, GB/s (default: the H200's link/compute ratio)",
    )
    parser.add_argument("--no-estimate", action="store_true", help="skip swapopt estimate")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny models, targets 100 and 70 %%, one warm and one timed step, a "
        f"two-point grid, a {QUICK_LINK_GBPS:g} GB/s link unless --link-gbps says otherwise",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.targets, args.steps, args.grid_steps = "quick", [1.0, 0.7], [1, 1], [1, 1]
        args.plain_steps = 3
        args.grid_swap_times, args.grid_prefetch, args.grid_activation = [2], [2], [1.0, 0.5]
        if args.link_gbps is None:
            args.link_gbps = QUICK_LINK_GBPS
    if any(not 0 < t <= 1 for t in args.targets):
        parser.error(f"--targets must be fractions in (0, 1], got {args.targets}")
    if (
        min(args.steps[1], args.grid_steps[1], args.plain_steps) < 1
        or min(args.steps + args.grid_steps) < 0
    ):
        parser.error(
            "--steps, --grid-steps and --plain-steps need at least one timed step and no "
            "negative count"
        )
    return args


def _measure_elsewhere(
    name: str, plain: dict[str, Any], args: argparse.Namespace, features: Features
) -> dict[str, Any]:
    """``measure_budget_part`` in a worker process (``--jobs``), as plain JSON values."""
    torch.set_num_threads(args.threads)
    swapopt = import_swapopt("swapopt_core")
    console = Console(stderr=True, width=150)
    work = workload(name, args.size)
    return dict(jsonable(measure_budget_part(swapopt, work, plain, args, features, console)))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    console = Console(width=max(150, Console().width))
    start = time.perf_counter()
    gflops = matmul_gflops()
    if args.link_gbps is not None:
        gbps, rule = args.link_gbps, "--link-gbps"
    else:
        gbps = gflops * H200_LINK_GBPS / (H200_TFLOPS * 1e3)
        rule = (
            f"= {gflops:.1f} GFLOP/s x {H200_LINK_GBPS:g} GB/s / {H200_TFLOPS:g} TFLOP/s, "
            "the H200's link over its compute"
        )
    # Read when the shared loopback-async runtime is made, so set before anything makes it.
    os.environ["SWAPOPT_LOOPBACK_GBPS"] = f"{gbps:.9f}"
    os.environ.pop("SWAPOPT_LOOPBACK_JITTER_US", None)
    swapopt = import_swapopt("swapopt_core")
    features = detect(swapopt)
    report: dict[str, Any] = {
        "meta": {
            "cpu_gflops": gflops,
            "threads": args.threads,
            "link_gbps": gbps,
            "link_rule": rule,
            "h200_tflops": H200_TFLOPS,
            "h200_link_gbps": H200_LINK_GBPS,
            "size": args.size,
            "steps": args.steps,
            "grid_steps": args.grid_steps,
            "plain_steps": args.plain_steps,
            "jobs": min(args.jobs, len(args.models)),
            "features": dataclasses.asdict(features),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "models": {},
    }
    for name in args.models:
        work = workload(name, args.size)
        report["models"][name] = measure_plain_part(swapopt, work, args, features, console)
    plains = {name: report["models"][name]["plain"] for name in args.models}
    jobs = min(args.jobs, len(args.models))
    if jobs > 1:
        # Mostly the steps wait on the emulated link, so the models share the cores well; a
        # fresh interpreter each, so no runtime or allocator state crosses between them.
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=spawn) as pool:
            futures = {
                name: pool.submit(_measure_elsewhere, name, plains[name], args, features)
                for name in args.models
            }
            parts = {name: future.result() for name, future in futures.items()}
    else:
        parts = {
            name: measure_budget_part(
                swapopt, workload(name, args.size), plains[name], args, features, console
            )
            for name in args.models
        }
    for name, part in parts.items():
        report["models"][name].update(part)
    report["meta"]["seconds"] = time.perf_counter() - start
    render(report, console)
    console.print(f"ran in {report['meta']['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(jsonable(report), indent=2))
    rows = [
        row
        for model in report["models"].values()
        for row in (*model["cells"].values(), *model["grid"].values())
    ]
    return 0 if all(row.get("identical", True) for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
