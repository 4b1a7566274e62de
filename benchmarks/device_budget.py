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
AdamW, one fixed batch each. At ``--size default`` they have about 1 M parameters (the ResNet
0.2 M), so that a step that moves all of its optimizer state over the emulated link takes
seconds here; ``--size issue`` builds the issue's ~30 M GPT (expect hours: at the H200 ratio
this CPU moves about 3 MB/s).

**Measured per model**, each variant from the same initial parameters on the same batch:

* **plain**: the step without swapopt: its time (median of the timed steps) and its peak of
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

Parts whose API is not there yet (the budgeted session, the engine's knobs, the meter, the
estimate) are reported as missing, and the rest runs. Takes about ten minutes at the defaults
on two cores; ``--quick`` (tiny models, two targets, a four-point grid) well under a minute.

Run::

    python benchmarks/device_budget.py --json budget.json
    python benchmarks/device_budget.py --models gpt --targets 1 0.5 --steps 1 3
    python benchmarks/device_budget.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_models import Workload, workload  # noqa: E402

MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]
#: H200 SXM: dense bf16 tensor-core peak (TFLOP/s) and PCIe Gen5 x16 achieved per direction.
H200_TFLOPS, H200_LINK_GBPS = 989.0, 55.0
TARGETS = (1.0, 0.7, 0.5, 0.35)
RUNTIME = "loopback-async"


def _import(name: str) -> ModuleType:
    """Import a swapopt module, falling back to the checkout this script lives in."""
    try:
        return importlib.import_module(name)
    except ImportError:
        sys.path.insert(0, str(ROOT))
        return importlib.import_module(name)


# --------------------------------------------------------------------------- machine


def matmul_gflops(n: int = 1024, repeats: int = 7) -> float:
    """This CPU's fp32 matmul rate at the current torch thread count (median of ``repeats``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # the first call pays allocation and thread start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


@dataclasses.dataclass(frozen=True)
class Features:
    """Which parts of the issue's API this checkout has (the rest is reported as missing)."""

    budget: bool  # OffloadSession(config, optimizer=opt) with device_budget_mb
    engine: bool  # SwapOptimizerConfig.prefetch_batches and resident_state_fraction
    meter: bool  # runtime.step_meter()
    estimate: bool  # python -m swapopt_core estimate


def detect(swapopt: ModuleType) -> Features:
    import inspect

    config_fields = {f.name for f in dataclasses.fields(swapopt.SwapOptimizerConfig)}
    session_args = inspect.signature(swapopt.OffloadSession).parameters
    offload_fields = {f.name for f in dataclasses.fields(swapopt.OffloadConfig)}
    runtime = _runtime()
    estimate = subprocess.run(
        [sys.executable, "-m", "swapopt_core", "estimate", "--help"],
        capture_output=True,
        cwd=ROOT,
        env=_child_env(),
        timeout=120,
    )
    return Features(
        budget="optimizer" in session_args and "device_budget_mb" in offload_fields,
        engine={"prefetch_batches", "resident_state_fraction"} <= config_fields,
        meter=callable(getattr(runtime, "step_meter", None)),
        estimate=estimate.returncode == 0,
    )


def _runtime() -> Any:
    """The shared ``loopback-async`` runtime instance (the one the swap and session use)."""
    registry = _import("swapopt_core._device.registry")
    return registry.choose_runtime(RUNTIME, torch.device("cpu"))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


# --------------------------------------------------------------------------- steps


def _step(work: Workload, model: nn.Module, opt: torch.optim.Optimizer, session: Any) -> None:
    """One training step: forward and backward (inside ``session`` if any), update, zero."""
    if session is None:
        work.loss(model, work.inputs).backward()
    else:
        with session:
            work.loss(model, work.inputs).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)


def _held(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a step holds on the device at its start: parameters, gradients, state."""
    held = [p for p in model.parameters()] + [
        p.grad for p in model.parameters() if p.grad is not None
    ]
    for state in opt.state.values():
        held += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return held


class Pacer:
    """A plain model stepped right before each timed step of a variant: the pair sees the
    same machine load, and the variant's figure is its time over its plain twin's."""

    def __init__(self, work: Workload) -> None:
        self.work = work
        self.model = work.build()
        self.opt = _optimizer(self.model)
        self.times: list[float] = []
        _step(work, self.model, self.opt, None)

    def step(self) -> float:
        start = time.perf_counter()
        _step(self.work, self.model, self.opt, None)
        self.times.append(time.perf_counter() - start)
        return self.times[-1]


def _moved(swapopt: ModuleType, opt: torch.optim.Optimizer, session: Any) -> int:
    """Bytes copied so far by the swap of ``opt`` and by ``session``, both directions."""
    total = 0
    if session is not None:
        stats = session.stats()
        total += getattr(stats, "d2h_bytes", 0) + getattr(stats, "h2d_bytes", 0)
    if swapopt.is_swap_optimizer(opt):
        stats = swapopt.swap_stats(opt)
        total += stats.d2h_bytes + stats.h2d_bytes
    return int(total)


def run_variant(
    swapopt: ModuleType,
    work: Workload,
    setup: Callable[[nn.Module, torch.optim.Optimizer], Any],
    steps: tuple[int, int],
    pacer: Pacer,
    reference: list[torch.Tensor],
    meter: Any = None,
) -> dict[str, Any]:
    """``steps[0]`` untimed then ``steps[1]`` timed steps of a fresh model after ``setup``.

    Returns:
        ``ratios`` (each timed step over its plain twin), ``step_ms`` (median), ``moved``
        (bytes copied in the timed steps), ``identical`` (parameters against plain's),
        ``meter_peak`` (with ``meter``: the highest step's peak), ``session`` and
        ``optimizer``; or ``error`` when the variant failed.
    """
    model = work.build()
    opt = _optimizer(model)
    result: dict[str, Any] = {"ratios": [], "times": [], "meter_peak": None}
    try:
        session = setup(model, opt)
        for index in range(steps[0] + steps[1]):
            timed = index >= steps[0]
            if timed and index == steps[0]:
                moved_before = _moved(swapopt, opt, session)
            plain_s = pacer.step() if timed else 0.0
            if meter is not None:
                meter.begin(_held(model, opt))
            start = time.perf_counter()
            _step(work, model, opt, session)
            elapsed = time.perf_counter() - start
            if meter is not None:
                peak = int(meter.end())
                result["meter_peak"] = max(peak, result["meter_peak"] or 0)
            if timed:
                result["times"].append(elapsed)
                result["ratios"].append(elapsed / plain_s)
        result["moved"] = _moved(swapopt, opt, session) - moved_before if steps[1] else 0
    except Exception as error:  # reported in the table: one failed cell must not end the run
        result["error"] = f"{type(error).__name__}: {error}"
        floor = getattr(error, "floor_bytes", None)
        if floor is not None:
            result["floor_bytes"] = int(floor)
        return result
    result["step_ms"] = statistics.median(result["times"]) * 1e3
    result["ratio"] = statistics.median(result["ratios"])
    params = [p.detach() for p in model.parameters()]
    result["identical"] = all(torch.equal(a, b) for a, b in zip(reference, params, strict=True))
    result["session"], result["optimizer"] = session, opt
    return result


# --------------------------------------------------------------------------- plain


def census_peak(work: Workload, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The whole step's peak of CPU bytes by ``MemTracker`` (parameters, gradients, state,
    activations, temporaries), with the model and optimizer registered before it starts."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        _step(work, model, opt, None)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def natural_activation_peak(swapopt: ModuleType, work: Workload, model: nn.Module) -> int:
    """The most activation bytes resident at once in forward and backward, no budget."""
    config = swapopt.OffloadConfig(max_resident_activation_mb=1 << 20, runtime="loopback")
    session = swapopt.OffloadSession(config)
    with session:
        work.loss(model, work.inputs).backward()
    model.zero_grad(set_to_none=True)
    return int(session.stats().peak_resident_activation_bytes)


def measure_plain(
    swapopt: ModuleType, work: Workload, steps: tuple[int, int], features: Features
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Plain training's time, peaks and final parameters (the reference of every variant)."""
    model = work.build()
    opt = _optimizer(model)
    times = []
    for index in range(steps[0] + steps[1]):
        start = time.perf_counter()
        _step(work, model, opt, None)
        if index >= steps[0]:
            times.append(time.perf_counter() - start)
    reference = [p.detach().clone() for p in model.parameters()]
    plain: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "step_ms": statistics.median(times) * 1e3 if times else None,
        "census_peak": census_peak(work, model, opt),
        "meter_peak": None,
    }
    if features.meter:
        runtime = _runtime()
        meter = runtime.step_meter()
        meter.begin(_held(model, opt))
        _step(work, model, opt, None)
        plain["meter_peak"] = int(meter.end())
    plain["peak"] = plain["meter_peak"] or plain["census_peak"]
    plain["peak_source"] = "meter" if plain["meter_peak"] else "census"
    plain["activation_peak"] = natural_activation_peak(swapopt, work, model)
    return plain, reference


# --------------------------------------------------------------------------- estimate


def run_estimate(work: Workload, size: str) -> dict[str, Any]:
    """``swapopt estimate`` of the plain step (``--device cpu``), in a subprocess."""
    factory = f"budget_models:estimate_{work.name}"
    batch, seq = work.inputs[0].shape[0], work.inputs[0].shape[-1]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "estimate.json"
        command = [
            sys.executable,
            "-m",
            "swapopt_core",
            "estimate",
            "--model",
            factory,
            "--batch",
            str(batch),
            "--seq",
            str(seq),
            "--device",
            "cpu",
            "--json",
            str(out),
        ]
        env = _child_env()
        env["BUDGET_MODELS_SIZE"] = size
        start = time.perf_counter()
        proc = subprocess.run(
            command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
        )
        seconds = time.perf_counter() - start
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"error": tail[0], "seconds": seconds}
        plain = json.loads(out.read_text())["plain"]
    return {"peak": plain["peak_bytes"], "step_ms": plain["step_ms"], "seconds": seconds}


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

    runtime = _runtime() if features.meter else None  # held: the shared instance stays alive
    meter = runtime.step_meter() if runtime is not None else None
    result = run_variant(swapopt, work, setup, steps, pacer, reference, meter)
    result.pop("session", None)
    opt = result.pop("optimizer", None)
    if opt is not None:
        swapopt.unswap_optimizer(opt)
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


def measure_model(
    swapopt: ModuleType,
    work: Workload,
    args: argparse.Namespace,
    features: Features,
    console: Console,
) -> dict[str, Any]:
    """Plain, estimate, every target and every grid point of one workload."""
    start = time.perf_counter()
    plain, reference = measure_plain(swapopt, work, tuple(args.steps), features)
    console.log(
        f"{work.name}: {plain['params'] / 1e6:.2f} M parameters, plain peak "
        f"{plain['peak'] / MIB:.1f} MiB ({plain['peak_source']}), step {plain['step_ms']:.0f} ms"
    )
    result: dict[str, Any] = {"description": work.description, "plain": plain}
    if features.estimate and not args.no_estimate:
        result["estimate"] = run_estimate(work, args.size)
    pacer = Pacer(work)
    result["cells"] = {}
    for fraction in args.targets:
        target = int(fraction * plain["peak"])
        if features.budget:
            cell = measure_ours(swapopt, work, target, tuple(args.steps), pacer, reference)
        else:
            cell = {"error": "OffloadSession(config, optimizer=opt) is not there yet"}
        cell["target"] = target
        result["cells"][f"{fraction:g}"] = cell
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
            reference,
            features,
        )
        console.log(f"{work.name} grid {point.label}: {_brief(grid[point.label])}")
    result["grid"] = grid
    for cell in result["cells"].values():
        best = best_within(grid, cell["target"])
        cell["best_grid"] = best[0] if best else None
        if best and "ratio" in cell:
            cell["ours_over_best"] = cell["ratio"] / best[1]["ratio"]
    result["plain"]["pacer_ms"] = statistics.median(pacer.times) * 1e3 if pacer.times else None
    result["seconds"] = time.perf_counter() - start
    return result


def _brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return row["error"][:160]
    peak = row.get("step_peak_device_bytes", row.get("peak"))
    peak_text = f"peak {peak / MIB:.1f} MiB, " if peak else ""
    return f"{peak_text}step {row['step_ms']:.0f} ms ({row['ratio']:.2f} x plain)"


# --------------------------------------------------------------------------- report


def _goal(value: float | None, limit: float, digits: int = 2) -> str:
    if value is None:
        return ""
    text = f"{value:.{digits}f}"
    return text if value <= limit else f"[red]{text}[/red]"


def render(report: dict[str, Any], console: Console) -> None:
    meta = report["meta"]
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
            _goal(abs(peak_ratio - 1) + 1, 1.05, 3) if peak_ratio else est.get("error", "")[:40],
            _goal(abs(step_ratio - 1) + 1, 1.25) if step_ratio else "",
            f"{est['seconds']:.0f}" if "seconds" in est else "",
        )
    console.print(plain)
    cells = Table(
        title="Whole-step budget (device_budget_mb) on loopback-async; step / plain: median over "
        "the timed steps of each over the plain step run right before it; red: a goal missed"
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
                cells.add_row(*row, f"[yellow]{note}{cell['error'][:60]}[/yellow]", *[""] * 7)
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
            knob_text = ", ".join(
                "?" if k is None else f"{k / MIB:.1f}" if i == 3 else f"{k:g}"
                for i, k in enumerate(knobs)
            )
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
                grid.add_row(name, label, "", f"[yellow]{row['error'][:70]}[/yellow]", "", "", "")
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


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return str(value)


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet", "llama"])
    parser.add_argument("--size", choices=["quick", "default", "issue"], default="default")
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
        default=[1.0, 0.5, 0.25],
        help="activation budgets, fractions of the natural activation peak (default 1 0.5 0.25)",
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
        help="smoke run: tiny models, targets 100 and 50 %%, one warm and one timed step, a "
        "four-point grid",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.targets, args.steps, args.grid_steps = "quick", [1.0, 0.5], [1, 1], [1, 1]
        args.grid_swap_times, args.grid_prefetch, args.grid_activation = [2], [0, 2], [1.0, 0.5]
    if any(not 0 < t <= 1 for t in args.targets):
        parser.error(f"--targets must be fractions in (0, 1], got {args.targets}")
    if args.steps[1] < 1 or args.grid_steps[1] < 1 or min(args.steps + args.grid_steps) < 0:
        parser.error("--steps and --grid-steps need at least one timed step and no negative count")
    return args


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
    swapopt = _import("swapopt_core")
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
            "features": dataclasses.asdict(features),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "models": {},
    }
    for name in args.models:
        report["models"][name] = measure_model(
            swapopt, workload(name, args.size), args, features, console
        )
    report["meta"]["seconds"] = time.perf_counter() - start
    render(report, console)
    console.print(f"ran in {report['meta']['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(_jsonable(report), indent=2))
    rows = [
        row
        for model in report["models"].values()
        for row in (*model["cells"].values(), *model["grid"].values())
    ]
    return 0 if all(row.get("identical", True) for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
