"""The GPT part of ``activation_budget.py``: the session against activation checkpointing on
an emulated slow link (see that script's docstring for what is measured and how).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.table import Table
from torch.utils.checkpoint import checkpoint

MIB = 2**20
#: Budgets as fractions of the natural activation peak.
FRACTIONS = (0.7, 0.5, 0.35)
#: The GPT: demo model, 6 layers.
VOCAB, WIDTH, LAYERS, SEQ, BATCH = 2048, 512, 6, 128, 8  # heads of 64


def _import(name: str) -> ModuleType:
    """Import a swapopt module, falling back to the checkout this script lives in."""
    try:
        return importlib.import_module(name)
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        return importlib.import_module(name)


def link_ratio() -> float:
    """Time to move the natural activation peak once over one direction, over the compute
    time, on the synthetic 1b Llama step on an H200-class device (``synthetic.py``)."""
    synthetic = _import("swapopt_core._planning.synthetic")
    index = _import("swapopt_core._planning.index")
    trace = synthetic.llama_training_trace(synthetic.SHAPES["1b"])
    ix = index.TraceIndex(trace)
    return ix.natural_peak / (trace.d2h_bandwidth_gbps * 1e6) / ix.total_ms


def _model(every: int, width: int = WIDTH) -> torch.nn.Module:
    """The GPT; with ``every`` > 0, every ``every``-th block runs under checkpointing."""
    demo = _import("swapopt_core._cli.demo")

    class Checkpointed(demo._TinyGPT):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
            for index, block in enumerate(self.blocks):
                if every and index % every == 0:
                    x = checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return Checkpointed(vocab=VOCAB, width=width, layers=LAYERS, heads=width // 64, max_len=SEQ)


def _step(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])  # held through backward, as a training loop's outputs are
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def _run(model: torch.nn.Module, tokens: torch.Tensor, session: Any = None) -> torch.Tensor:
    if session is None:
        return _step(model, tokens)
    with session:
        return _step(model, tokens)


def _recorded(swapopt: ModuleType, model: torch.nn.Module, tokens: torch.Tensor, runtime: str):
    session = swapopt.OffloadSession(
        swapopt.OffloadConfig(max_resident_activation_mb=1 << 20, runtime=runtime)
    )
    _run(model, tokens, session)
    return session.trace


def _median_trace(traces: list[Any]) -> Any:
    """The first trace with each op's median duration over ``traces``."""
    names = [[op.name for op in t.ops] for t in traces]
    if any(n != names[0] for n in names):
        raise RuntimeError("the recorded steps ran different ops; run the benchmark again")
    durations = [[op.duration_ms for op in t.ops] for t in traces]
    medians = [statistics.median(each) for each in zip(*durations, strict=True)]
    ops = tuple(
        dataclasses.replace(op, duration_ms=d) for op, d in zip(traces[0].ops, medians, strict=True)
    )
    return dataclasses.replace(traces[0], ops=ops)


def compare(rounds: int = 7, ratio: float | None = None, width: int = WIDTH) -> dict[str, Any]:
    """Measure every variant (``activation_budget.py``'s docstring)."""
    swapopt = _import("swapopt_core")
    index = _import("swapopt_core._planning.index")
    simulate = _import("swapopt_core._planning.simulate").simulate
    timed = _import("swapopt_core._planning.timed")
    ratio = link_ratio() if ratio is None else ratio
    torch.set_num_threads(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    plain = _model(0, width)
    for _ in range(2):
        _run(plain, tokens)
    ref_loss = _run(plain, tokens)
    reference = [p.grad.clone() for p in plain.parameters()]
    median = _median_trace([_recorded(swapopt, plain, tokens, "loopback") for _ in range(3)])
    ix = index.TraceIndex(median)
    natural, compute_ms = ix.natural_peak, ix.total_ms
    gbps = natural / (ratio * compute_ms) / 1e6
    os.environ["SWAPOPT_LOOPBACK_GBPS"] = f"{gbps:.6f}"
    linked = _recorded(swapopt, plain, tokens, "loopback-async")  # the lanes' bandwidth
    trace = dataclasses.replace(
        median,
        d2h_bandwidth_gbps=linked.d2h_bandwidth_gbps,
        h2d_bandwidth_gbps=linked.h2d_bandwidth_gbps,
    )
    variants: dict[str, dict[str, Any]] = {"plain": {"model": plain, "peak": natural}}
    for every, label in ((1, "per-block checkpointing"), (2, "every-other-block checkpointing")):
        model = _model(every, width)
        peak = index.TraceIndex(_recorded(swapopt, model, tokens, "loopback")).natural_peak
        variants[label] = {"model": model, "peak": peak}
    budgets = {f"session at {f:.0%}": f * natural for f in FRACTIONS}
    budgets["session at per-block checkpointing's peak"] = variants["per-block checkpointing"][
        "peak"
    ]
    budgets["session at every-other-block checkpointing's peak"] = variants[
        "every-other-block checkpointing"
    ]["peak"]
    for label, budget in budgets.items():
        limited = trace.with_limit(int(budget))
        start = time.perf_counter()
        schedule = timed.TimedPlanner().plan(limited)
        plan_s = time.perf_counter() - start
        simulated = simulate(limited, schedule, record=False)
        config = swapopt.OffloadConfig(
            max_resident_activation_mb=budget / MIB, runtime="loopback-async"
        )
        session = swapopt.OffloadSession(config)
        session.load_plan(limited, schedule)
        variants[label] = {
            "model": plain,
            "session": session,
            "budget": budget,
            "plan_s": plan_s,
            "simulated": simulated.overhead,
            "recomputes": simulated.recomputes,
            "d2h": simulated.d2h_bytes,
            "peak": 0,
        }
    for row in variants.values():
        row["ratios"], row["identical"] = [], True
    order = random.Random(0)
    plain_times = []
    for round_ in range(rounds + 1):  # the first round is not timed (allocator, variants)
        labels = [label for label in variants if label != "plain"]
        order.shuffle(labels)  # no variant always runs right after another
        for label in labels:
            row = variants[label]
            # Each variant runs right after a plain step: the pair sees the same load.
            paired = []
            session = row.get("session")
            for model, runs, owner in ((plain, None, "plain"), (row["model"], session, label)):
                start = time.perf_counter()
                loss = _run(model, tokens, runs)
                paired.append(time.perf_counter() - start)
                grads = [p.grad for p in model.parameters()]
                variants[owner]["identical"] &= torch.equal(loss, ref_loss) and all(
                    torch.equal(a, b) for a, b in zip(reference, grads, strict=True)
                )
            if session is not None:
                stats = session.stats()
                row["peak"] = max(row["peak"], stats.last_peak_resident_activation_bytes)
                row["replays"] = stats.replays
            if round_:
                plain_times.append(paired[0])
                row["ratios"].append(paired[1] / paired[0])
    variants["plain"]["ratios"] = [1.0]
    for row in variants.values():
        row["time_ratio"] = statistics.median(row["ratios"])
        row["peak_ratio"] = row["peak"] / natural
        row.pop("model")
        row.pop("session", None)
    base = statistics.median(plain_times)
    return {
        "natural_mib": natural / MIB,
        "plain_ms": base * 1e3,
        "compute_ms": compute_ms,
        "width": width,
        "ratio": ratio,
        "gbps": gbps,
        "measured_gbps": linked.d2h_bandwidth_gbps,
        "rounds": rounds,
        "ops": len(trace.ops),
        "variants": variants,
    }


def render(result: dict[str, Any]) -> Table:
    table = Table(
        title=(
            f"GPT, {LAYERS} layers, width {result['width']}, batch {BATCH} x {SEQ}: natural "
            f"activation peak {result['natural_mib']:.1f} MiB, plain step "
            f"{result['plain_ms']:.0f} ms ({result['compute_ms']:.0f} ms in its ops); "
            f"loopback-async at {result['gbps'] * 1e3:.1f} MB/s per direction (link/compute "
            f"{result['ratio']:.2f}); step / plain: median over {result['rounds']} rounds of "
            "each step over the plain step run right before it"
        )
    )
    for column in (
        "variant",
        "peak / natural",
        "step / plain",
        "same bits",
        "plan s",
        "simulated +",
    ):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for label, row in result["variants"].items():
        replayed = row.get("replays", result["rounds"] + 1) == result["rounds"] + 1
        table.add_row(
            label,
            f"{row['peak_ratio']:.3f}",
            f"{row['time_ratio']:.3f}",
            "yes" if row["identical"] and replayed else "NO",
            f"{row['plan_s']:.1f}" if "plan_s" in row else "",
            f"{row['simulated']:.1%}" if "simulated" in row else "",
        )
    return table
