"""The measuring half of ``device_budget.py``: this machine's rates, which parts of the API
exist, one training step, a variant's run against plain training, plain training's peak and
time, and ``swapopt estimate`` in a subprocess.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_models import Workload  # noqa: E402

MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]
RUNTIME = "loopback-async"


def import_swapopt(name: str) -> ModuleType:
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
    config_fields = {f.name for f in dataclasses.fields(swapopt.SwapOptimizerConfig)}
    session_args = inspect.signature(swapopt.OffloadSession).parameters
    offload_fields = {f.name for f in dataclasses.fields(swapopt.OffloadConfig)}
    runtime = shared_runtime()
    estimate = subprocess.run(
        [sys.executable, "-m", "swapopt_core", "estimate", "--help"],
        capture_output=True,
        cwd=ROOT,
        env=child_env(),
        timeout=120,
    )
    return Features(
        budget="optimizer" in session_args and "device_budget_mb" in offload_fields,
        engine={"prefetch_batches", "resident_state_fraction"} <= config_fields,
        meter=callable(getattr(runtime, "step_meter", None)),
        estimate=estimate.returncode == 0,
    )


def shared_runtime() -> Any:
    """The shared ``loopback-async`` runtime instance (the one the swap and session use)."""
    registry = import_swapopt("swapopt_core._device.registry")
    return registry.choose_runtime(RUNTIME, torch.device("cpu"))


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


# --------------------------------------------------------------------------- steps


def train_step(work: Workload, model: nn.Module, opt: torch.optim.Optimizer, session: Any) -> None:
    """One training step: forward and backward (inside ``session`` if any), update, zero."""
    if session is None:
        work.loss(model, work.inputs).backward()
    else:
        with session:
            work.loss(model, work.inputs).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)


def held(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
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
        self.opt = make_optimizer(self.model)
        self.times: list[float] = []
        train_step(work, self.model, self.opt, None)

    def step(self) -> float:
        start = time.perf_counter()
        train_step(self.work, self.model, self.opt, None)
        self.times.append(time.perf_counter() - start)
        return self.times[-1]


def moved(swapopt: ModuleType, opt: torch.optim.Optimizer, session: Any) -> int:
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
        ``paired`` (each timed step over its plain twin) and their median
        ``paired_ratio``, ``times`` and their median ``step_ms``, ``moved``
        (bytes copied in the timed steps), ``identical`` (parameters against plain's),
        ``meter_peak`` (with ``meter``: the highest step's peak), ``session`` and
        ``optimizer``; or ``error`` when the variant failed.
    """
    model = work.build()
    opt = make_optimizer(model)
    result: dict[str, Any] = {"paired": [], "times": [], "meter_peak": None}
    try:
        session = setup(model, opt)
        for index in range(steps[0] + steps[1]):
            timed = index >= steps[0]
            if timed and index == steps[0]:
                moved_before = moved(swapopt, opt, session)
            plain_s = pacer.step() if timed else 0.0
            if meter is not None:
                meter.begin(held(model, opt))
            start = time.perf_counter()
            train_step(work, model, opt, session)
            elapsed = time.perf_counter() - start
            if meter is not None:
                peak = int(meter.end())
                result["meter_peak"] = max(peak, result["meter_peak"] or 0)
            if timed:
                result["times"].append(elapsed)
                result["paired"].append(elapsed / plain_s)
        result["moved"] = moved(swapopt, opt, session) - moved_before if steps[1] else 0
    except Exception as error:  # reported in the table: one failed cell must not end the run
        result["error"] = f"{type(error).__name__}: {error}"
        floor = getattr(error, "floor_bytes", None)
        if floor is not None:
            result["floor_bytes"] = int(floor)
        return result
    result["step_ms"] = statistics.median(result["times"]) * 1e3
    result["paired_ratio"] = statistics.median(result["paired"])
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
        train_step(work, model, opt, None)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def natural_activation_peak(swapopt: ModuleType, work: Workload, model: nn.Module) -> int:
    """The most activation bytes resident at once in forward and backward, no budget."""
    config = swapopt.OffloadConfig(max_resident_activation_mb=1 << 20, runtime="loopback")
    session = swapopt.OffloadSession(config)
    with session:
        work.loss(model, work.inputs).backward()
    model.zero_grad(set_to_none=True)
    return int(session.stats().peak_resident_activation_bytes)


def plain_references(work: Workload, counts: Iterable[int]) -> dict[int, list[torch.Tensor]]:
    """Plain training's parameters after each number of steps in ``counts``: what every
    variant that ran as many steps must end with, bit for bit."""
    wanted = sorted(set(counts))
    model = work.build()
    opt = make_optimizer(model)
    references = {}
    for count in range(1, wanted[-1] + 1):
        train_step(work, model, opt, None)
        if count in wanted:
            references[count] = [p.detach().clone() for p in model.parameters()]
    return references


def measure_plain(
    swapopt: ModuleType, work: Workload, steps: tuple[int, int], features: Features
) -> dict[str, Any]:
    """Plain training's step time (median of ``steps[1]`` after ``steps[0]``) and its peaks:
    the whole step's (census, meter) and the activations' alone."""
    model = work.build()
    opt = make_optimizer(model)
    times = []
    for index in range(steps[0] + steps[1]):
        start = time.perf_counter()
        train_step(work, model, opt, None)
        if index >= steps[0]:
            times.append(time.perf_counter() - start)
    plain: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "step_ms": statistics.median(times) * 1e3,
        "census_peak": census_peak(work, model, opt),
        "meter_peak": None,
    }
    if features.meter:
        runtime = shared_runtime()
        meter = runtime.step_meter()
        meter.begin(held(model, opt))
        train_step(work, model, opt, None)
        plain["meter_peak"] = int(meter.end())
    plain["peak"] = plain["meter_peak"] or plain["census_peak"]
    plain["peak_source"] = "meter" if plain["meter_peak"] else "census"
    plain["activation_peak"] = natural_activation_peak(swapopt, work, model)
    return plain


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
        env = child_env()
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
