"""Device memory the swapped step reserves, by how staged batches are released (issue 30).

On ``loopback-async`` with an emulated slow link (the host always meets copies still
running, as a host that queues a step in one go does on a GPU), the same swapped AdamW
trains three ways, side by side in one run:

* ``ordered``: what swapopt does: each batch freed in compute order once the next update
  is queued (``release_ordered``);
* ``record_stream``: each batch freed the old way, the allocator holding its block until the
  host saw its copy finish (``release_device``);
* ``plain``: AdamW without swapopt, for the step time.

It prints, for each, the reserved staging over the state (``peak_reserved_state_bytes``),
the ledger's staged peak over the state, and the median step time over plain's, and checks
that the swapped runs' parameters equal plain's. Ratios only; the CPU plays the device.

Run::

    python benchmarks/reserved_state.py [--swap-times 16] [--gbps 0.5] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats
from swapopt_core._device.loopback_async import LoopbackAsyncRuntime
from swapopt_core._device.registry import forget_shared_runtimes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(32)])


def _run(way: str, swap_times: int, steps: int) -> dict[str, Any]:
    forget_shared_runtimes()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    original = LoopbackAsyncRuntime.release_ordered
    if way != "plain":
        config = SwapOptimizerConfig(runtime="loopback-async", swap_times=swap_times, min_numel=0)
        swap_optimizer(opt, config)
    if way == "record_stream":
        LoopbackAsyncRuntime.release_ordered = LoopbackAsyncRuntime.release_device  # type: ignore[method-assign]
    times = []
    try:
        for step in range(steps):
            opt.zero_grad()
            x = torch.randn(16, 256, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        result: dict[str, Any] = {"step_s": statistics.median(times[1:])}
        if way != "plain":
            stats = swap_stats(opt)
            result["reserved_over_state"] = (
                stats.peak_reserved_state_bytes / stats.total_state_bytes
            )
            result["staged_over_state"] = stats.peak_resident_state_bytes / stats.total_state_bytes
        result["params"] = [p.detach().clone() for p in model.parameters()]
    finally:
        LoopbackAsyncRuntime.release_ordered = original  # type: ignore[method-assign]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--swap-times", type=int, default=16)
    parser.add_argument("--gbps", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ["SWAPOPT_LOOPBACK_GBPS"] = str(args.gbps)
    torch.set_num_threads(1)
    runs = {
        way: _run(way, args.swap_times, args.steps) for way in ("plain", "ordered", "record_stream")
    }
    plain = runs["plain"]
    print(f"swap_times={args.swap_times}, {args.gbps} GB/s emulated, {args.steps} steps")
    print("| release | reserved / state | staged / state | step / plain | bit-exact |")
    print("|---|---|---|---|---|")
    for way in ("ordered", "record_stream"):
        run = runs[way]
        exact = all(torch.equal(a, b) for a, b in zip(plain["params"], run["params"], strict=True))
        print(
            f"| {way} | {run['reserved_over_state']:.3f} | {run['staged_over_state']:.3f} | "
            f"{run['step_s'] / plain['step_s']:.2f} | {exact} |"
        )


if __name__ == "__main__":
    main()
