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
import json
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_cells import measure_budget_part, measure_plain_part  # noqa: E402
from budget_models import workload  # noqa: E402
from budget_report import jsonable, render  # noqa: E402
from budget_steps import Features, detect, import_swapopt, matmul_gflops  # noqa: E402

#: H200 SXM: dense bf16 tensor-core peak (TFLOP/s) and PCIe Gen5 x16 achieved per direction.
H200_TFLOPS, H200_LINK_GBPS = 989.0, 55.0
TARGETS = (1.0, 0.7, 0.5, 0.35)
#: The link of ``--quick`` (GB/s per direction): a smoke run checks that every part runs.
QUICK_LINK_GBPS = 0.05


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
        default=[3, 2],
        metavar=("WARM", "TIMED"),
        help=(
            "untimed and timed steps of plain and of every budgeted cell (default 3 2: the "
            "first step traces, the two after the plan are metered)"
        ),
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
