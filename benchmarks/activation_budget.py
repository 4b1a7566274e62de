"""Activation budget benchmark: a ResNet-18 step on the CPU loopback runtime under 50 % and
25 % of its natural activation peak, and a 6-layer GPT on an emulated slow link, the session
against activation checkpointing.

**ResNet-18** (``--only resnet``). The model is defined here (no torchvision): a 7x7 stride-2
stem with batch norm, ReLU and a 3x3 max pool, four stages of two basic blocks (two 3x3
convolutions with batch norm, an identity shortcut or a 1x1 projection where the shape
changes) at 64, 128, 256 and 512 channels, global average pooling and a 1000-way linear head:
about 11.7 M parameters. For each batch (default 2 and 8 images) and budget the script runs
one warmup and one replay of forward + backward inside an ``OffloadSession``
(``runtime="loopback"``, default ``min_offload_kib``) and reports:

* the **natural peak**: the most activation bytes resident at once with no budget (the trace
  of an unbounded warmup, ``TraceIndex.natural_peak``), and the **floor**
  (``min_feasible_budget``): what the ops need on the device by themselves;
* the **gradient bytes** (``stats().gradient_bytes``): the parameter gradients autograd made,
  reported apart and outside the budget;
* the **warmup** and **replay** peaks of activations over the budget
  (``last_peak_resident_activation_bytes``), and the replay's over the feasible budget
  (the larger of the budget and the floor);
* whether the loss and every gradient are **bit-identical** to the same step without a session.

**GPT against checkpointing** (``--only gpt``). The demo's GPT (``swapopt demo``'s model:
pre-norm blocks with hand-written causal attention and a GELU MLP) with 6 layers, width 512
(``--width``), heads of 64, sequence 128, batch 8, vocabulary 2048, fp32, one torch thread.
Variants, stepped round by round (forward + backward, ``--rounds`` timed rounds after one
untimed one):

* **plain**; **per-block checkpointing** (every block through ``torch.utils.checkpoint``,
  ``use_reentrant=False``) and **every-other-block checkpointing**;
* the **session** on ``runtime="loopback-async"`` at 70 / 50 / 35 % of the natural
  activation peak and at each checkpointing variant's own measured peak, replaying the default
  planner's plan (``TimedPlanner()``) for the step's trace (``load_plan``).

Every step of a variant runs right after a plain step, variants in a shuffled order each
round, so each ratio compares two steps under the same machine load.

The link is emulated (``SWAPOPT_LOOPBACK_GBPS``) as slow, relative to compute, as an H200's:
on the synthetic 1b Llama step of ``activation_planner.py`` (650 TFLOP/s, 50 GB/s per
direction), moving the step's natural activation peak once over one direction takes
2.6 times the step's compute; the script sets the rate so that the same holds for this GPT,
its compute being the time its ops take (``--link-ratio`` overrides). On a GPU the step time
is that sum (kernels queue ahead of the Python that launches them); on this CPU the step also
pays Python and autograd between ops, so the link is a little faster relative to the whole
step than on an H200. On a shared machine the warmup's op durations swing with the load: the
planned trace takes the median duration of each op over three recorded steps.

Reported per variant: the **peak** of activation bytes over the natural peak (for
checkpointing: the natural peak of its own recorded step; for the session: the replays'
``last_peak_resident_activation_bytes``), the **step time** over plain (the median over the
timed rounds of each step's time over its plain twin's), whether every loss and gradient
was **bit-identical** to plain, and for the session the plan time and the simulated overhead
of its plan.

Each ratio comes from one run. The whole script takes about five minutes on two cores, most
of it the GPT comparison (a minute and a half at ``--width 256``).

Run::

    python benchmarks/activation_budget.py
    python benchmarks/activation_budget.py --only gpt --rounds 9 --width 256
    python benchmarks/activation_budget.py --only resnet --batch 4 --budgets 0.5
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

MIB = 2**20


def _import(name: str) -> ModuleType:
    """Import a swapopt module, falling back to the checkout this script lives in."""
    try:
        return importlib.import_module(name)
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        return importlib.import_module(name)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm; the input is added back before the last ReLU
    (through a strided 1x1 convolution when the channels or the resolution change)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """Stem, four stages of two ``BasicBlock``s (64, 128, 256, 512 channels), pooled head."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks, channels = [], 64
        for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(channels, width, stride), BasicBlock(width, width, 1)]
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x)).mean(dim=(2, 3))
        return self.head(features)


def _step(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), labels)
    loss.backward()
    return loss.detach()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def run(batch: int, budgets: tuple[float, ...]) -> dict[str, Any]:
    """Measure the natural peak, then a warmup and a replay under each budget fraction."""
    swapopt = _import("swapopt_core")
    bounds = _import("swapopt_core._planning.bounds")
    simulate = _import("swapopt_core._planning.simulate")
    torch.manual_seed(0)
    model = ResNet18()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, 224, 224, generator=generator)
    labels = torch.randint(0, 1000, (batch,), generator=generator)
    ref_loss = _step(model, x, labels)  # batch norm in training mode: the same grads each step
    reference = _grads(model)

    def session_for(budget_bytes: float) -> Any:
        config = swapopt.OffloadConfig(
            max_resident_activation_mb=budget_bytes / MIB, runtime="loopback"
        )
        return swapopt.OffloadSession(config)

    unbounded = session_for(1 << 50)
    with unbounded:
        _step(model, x, labels)
    trace = unbounded.trace
    natural = simulate.TraceIndex(trace).natural_peak
    result: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "batch": batch,
        "ops": len(trace.ops),
        "recompute_ops": sum(op.recompute for op in trace.ops),
        "natural": natural,
        "floor": bounds.min_feasible_budget(trace),
        "gradients": getattr(unbounded.stats(), "gradient_bytes", 0),
        "rows": [],
    }
    for fraction in budgets:
        budget = fraction * natural
        session = session_for(budget)
        peaks, identical = [], True
        for _ in range(2):  # the warmup, then a replay of its plan
            with session:
                loss = _step(model, x, labels)
            identical &= torch.equal(loss, ref_loss)
            grads = zip(reference, _grads(model), strict=True)
            identical &= all(torch.equal(a, b) for a, b in grads)
            peaks.append(session.stats().last_peak_resident_activation_bytes)
        stats = session.stats()
        result["rows"].append(
            {
                "fraction": fraction,
                "budget": budget,
                "floor": bounds.min_feasible_budget(session.trace),
                "gradients": getattr(stats, "gradient_bytes", 0),  # 0 before it existed
                "warmup_peak": peaks[0],
                "replay_peak": peaks[1],
                "replays": stats.replays,
                "identical": identical,
            }
        )
    return result


def render(results: list[dict[str, Any]], console: Console) -> None:
    first = results[0]
    table = Table(
        title=(
            f"ResNet-18 ({first['params'] / 1e6:.1f} M parameters), N x 3 x 224 x 224, CPU "
            f"loopback: {first['ops']} ops, {first['recompute_ops']} marked recompute"
        )
    )
    for column in (
        "batch",
        "budget",
        "natural MiB",
        "budget MiB",
        "floor MiB",
        "grads MiB",
        "warmup / budget",
        "replay / budget",
        "replay / feasible",
        "same bits",
    ):
        table.add_column(column, justify="right")
    for result in results:
        for row in result["rows"]:
            table.add_row(
                str(result["batch"]),
                f"{row['fraction']:.0%}",
                f"{result['natural'] / MIB:.1f}",
                f"{row['budget'] / MIB:.1f}",
                f"{row['floor'] / MIB:.1f}",
                f"{row['gradients'] / MIB:.1f}",
                f"{row['warmup_peak'] / row['budget']:.2f}",
                f"{row['replay_peak'] / row['budget']:.2f}",
                f"{row['replay_peak'] / max(row['budget'], row['floor']):.2f}",
                "yes" if row["identical"] and row["replays"] == 1 else "NO",
            )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[2, 8],
        help="images per step, one run each (default 2 8: gradients or activations set the floor)",
    )
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[0.5, 0.25],
        help="budgets as fractions of the natural activation peak (default 0.5 0.25)",
    )
    parser.add_argument(
        "--only", choices=["resnet", "gpt"], help="run one part (default: both, ResNet first)"
    )
    parser.add_argument(
        "--rounds", type=int, default=7, help="timed rounds of the GPT comparison (default 7)"
    )
    parser.add_argument(
        "--link-ratio",
        type=float,
        help="time to move the GPT's natural activation peak one way / its plain step time "
        "(default: the H200's, from the synthetic 1b Llama step, about 2.6)",
    )
    parser.add_argument(
        "--width", type=int, default=512, help="the GPT's width (default 512; heads of 64)"
    )
    parser.add_argument("--json", type=Path, help="write the GPT comparison's raw numbers here")
    args = parser.parse_args(argv)
    console = Console(width=max(110, Console().width))
    start = time.perf_counter()
    ok = True
    if args.only in (None, "resnet"):
        results = [run(batch, tuple(args.budgets)) for batch in args.batch]
        render(results, console)
        ok &= all(row["identical"] for r in results for row in r["rows"])
    if args.only in (None, "gpt"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from checkpoint_comparison import compare
        from checkpoint_comparison import render as render_gpt

        result = compare(args.rounds, args.link_ratio, args.width)
        console.print(render_gpt(result))
        ok &= all(row["identical"] for row in result["variants"].values())
        if args.json:
            args.json.write_text(json.dumps(result, indent=2, default=str))
    console.print(f"ran in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
