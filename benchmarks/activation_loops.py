"""Activation offload in the loops real training runs: gradient accumulation with one session
entry per micro-batch, and dynamic padding (a sequence length that changes every step).

The model is a 4-layer GPT-style decoder (``swapopt_core._cli.demo._TinyGPT``: width 128,
4 heads, vocabulary 512, batch 8), forward and backward inside an ``OffloadSession`` whose
budget is a fraction (default 20 %) of the natural activation peak at sequence 128, so it
binds. Two loops, each on ``loopback`` and on ``loopback-async`` with an emulated link
(``SWAPOPT_LOOPBACK_GBPS``, default 0.5 GB/s per direction: the copies of one step take about
as long as its compute on this CPU, as on an accelerator whose link is the limit):

* **accumulation**: 6 optimizer steps of 2 micro-batches, one session entry per micro-batch
  (12 entries; the first micro-batch of a step creates the gradients, the second adds into
  them, so two op sequences alternate);
* **padding**: 20 steps, each of a length drawn from 64..128 (seeded).

Each entry runs next to the same step without the session (a second copy of the model, the
same SGD updates), alternating, so both see the same machine load. Reported per loop:

* **warmups / retraces / replays** (``OffloadStats``) and the share of entries after the
  first few (2 for accumulation, 3 for padding) that **replayed**;
* the highest **peak / budget** of any entry (``last_peak_resident_activation_bytes``), the
  warmup's included, and after the first few;
* the **step time over plain**: the median of the session's entries after the first few
  over the median of the plain steps;
* whether every loss and gradient is **bit-identical** to the plain run.

Each ratio comes from one run. The whole script takes about a minute on two cores.

Run::

    python benchmarks/activation_loops.py
    python benchmarks/activation_loops.py --gbps 0.25 --fraction 0.3
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emulated_link  # noqa: E402

MIB = 2**20
VOCAB, WIDTH, LAYERS, HEADS, BATCH, MAX_LEN = 512, 128, 4, 4, 8, 160


def _import(name: str) -> ModuleType:
    """Import a swapopt module, falling back to the checkout this script lives in."""
    try:
        return importlib.import_module(name)
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        return importlib.import_module(name)


def _model() -> torch.nn.Module:
    demo = _import("swapopt_core._cli.demo")
    torch.manual_seed(0)
    return demo._TinyGPT(vocab=VOCAB, width=WIDTH, layers=LAYERS, heads=HEADS, max_len=MAX_LEN)


def _tokens(seed: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, length + 1), generator=generator)


def _backward(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return all(torch.equal(p.grad, q.grad) for p, q in pairs)


def natural_peak(length: int = 128) -> int:
    """The activation peak of one step at ``length`` with no budget."""
    swapopt = _import("swapopt_core")
    simulate = _import("swapopt_core._planning.simulate")
    probe = swapopt.OffloadSession(
        swapopt.OffloadConfig(max_resident_activation_mb=1 << 20, runtime="loopback")
    )
    with probe:
        _backward(_model(), _tokens(0, length))
    return simulate.TraceIndex(probe.trace).natural_peak


def run_loop(
    loop: str, runtime: str, budget: float, gbps: float, steps: int, seed: int = 0
) -> dict[str, Any]:
    """One loop (``"accumulation"`` or ``"padding"``) on one runtime; see the module doc."""
    swapopt = _import("swapopt_core")
    # The link is read at the session's first entry, inside the block.
    with emulated_link(gbps if runtime == "loopback-async" else None):
        session = swapopt.OffloadSession(
            swapopt.OffloadConfig(
                max_resident_activation_mb=budget / MIB, runtime=runtime, min_offload_kib=64
            )
        )
        reference, model = _model(), _model()
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, model)]
        rng = random.Random(seed)
        if loop == "accumulation":
            plan = [[128, 128] for _ in range(steps)]  # micro-batches per optimizer step
        else:
            plan = [[rng.randrange(64, 129)] for _ in range(steps)]
        plain_s, session_s, peaks, replayed, identical = [], [], [], [], True
        entry = 0
        for lengths in plan:
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            for length in lengths:
                batch = _tokens(entry, length)
                start = time.perf_counter()
                ref_loss = _backward(reference, batch)
                plain_s.append(time.perf_counter() - start)
                before = session.stats().replays
                start = time.perf_counter()
                with session:
                    loss = _backward(model, batch)
                session_s.append(time.perf_counter() - start)
                stats = session.stats()
                identical &= bool(torch.equal(loss, ref_loss)) and _same(reference, model)
                peaks.append(stats.last_peak_resident_activation_bytes / budget)
                replayed.append(stats.replays > before)
                entry += 1
            for optimizer in optimizers:
                optimizer.step()
    first = 2 if loop == "accumulation" else 3
    stats = session.stats()
    return {
        "loop": loop,
        "runtime": runtime if runtime == "loopback" else f"async {gbps:g} GB/s",
        "entries": entry,
        "warmups": stats.warmups,
        "retraces": stats.retraces,
        "replays": stats.replays,
        "replans": getattr(stats, "replans", 0),  # 0 before the counter existed
        "first": first,
        "replayed_later": sum(replayed[first:]) / len(replayed[first:]),
        "peak_max": max(peaks),
        "peak_later": max(peaks[first:]),
        "time_ratio": statistics.median(session_s[first:]) / statistics.median(plain_s),
        "identical": identical,
    }


def render(rows: list[dict[str, Any]], budget: float, natural: int, console: Console) -> None:
    table = Table(
        title=(
            f"{LAYERS}-layer GPT (width {WIDTH}, batch {BATCH}), budget {budget / MIB:.1f} MiB "
            f"= {budget / natural:.0%} of the natural peak at sequence 128 ({natural / MIB:.1f} "
            "MiB)"
        )
    )
    for column in (
        "loop",
        "runtime",
        "entries",
        "warmups",
        "retraces",
        "replays",
        "re-plans",
        "replayed later",
        "peak/budget",
        "later",
        "step/plain",
        "same bits",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["loop"],
            row["runtime"],
            str(row["entries"]),
            str(row["warmups"]),
            str(row["retraces"]),
            str(row["replays"]),
            str(row["replans"]),
            f"{row['replayed_later']:.0%} of {row['entries'] - row['first']}",
            f"{row['peak_max']:.3f}",
            f"{row['peak_later']:.3f}",
            f"{row['time_ratio']:.2f}",
            "yes" if row["identical"] else "NO",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--fraction",
        type=float,
        default=0.2,
        help="budget as a fraction of the natural activation peak at sequence 128 (0.2)",
    )
    parser.add_argument(
        "--gbps",
        type=float,
        default=0.5,
        help="emulated link of loopback-async, GB/s per direction (0.5)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(width=max(150, Console().width))
    start = time.perf_counter()
    natural = natural_peak()
    budget = args.fraction * natural
    rows = [
        run_loop(loop, runtime, budget, args.gbps, steps)
        for loop, steps in (("accumulation", 6), ("padding", 20))
        for runtime in ("loopback", "loopback-async")
    ]
    render(rows, budget, natural, console)
    console.print(f"ran in {time.perf_counter() - start:.0f} s")
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
