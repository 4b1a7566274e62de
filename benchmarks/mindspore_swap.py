"""MindSpore optimizer-state swap benchmark on CPU (loopback runtimes, PyNative).

For each optimizer family and model size the script builds equal fp32 weight matrices,
draws fixed random gradients, and measures in one process:

* the step time ``opt(grads)`` of the plain optimizer,
* the step time of the same optimizer after ``swap_optimizer``, packed and per-tensor, on
  each CPU runtime (``loopback``: CPU buffers play the device, every byte is copied for
  real; ``loopback-async``: the same copies on two worker threads, with tickets),
* the copy floor: the plain step plus one memcpy of the whole state each way, which is
  what the synchronous loopback runtime adds however fast the update is,
* the peak device-resident share of the swapped state for several ``swap_times``,
* whether the swapped runs end with parameters bitwise equal to the plain run.

The plain and the swapped optimizers are stepped round robin in a rotating order, so the
ratios are taken under the same machine load; each figure is the median over the timed
steps. The first step
(kernels, compiled graphs, lazy state) is not timed. The title gives the load average.

Run::

    python benchmarks/mindspore_swap.py                  # 4M and 16M parameters
    python benchmarks/mindspore_swap.py --sizes 1M --steps 5
    python benchmarks/mindspore_swap.py --runtimes loopback   # one runtime only
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn
from rich.console import Console
from rich.table import Table

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats

SWEEP = (2, 4, 8, 16)
WIDTH = 1024  # each layer is WIDTH x WIDTH fp32


def _families() -> dict[str, Callable[[list[Parameter]], nn.Optimizer]]:
    found = {
        "nn.Adam": lambda ps: nn.Adam(ps, learning_rate=1e-3),
        "nn.AdamWeightDecay": lambda ps: nn.AdamWeightDecay(
            ps, learning_rate=1e-3, weight_decay=0.01
        ),
        "nn.Momentum": lambda ps: nn.Momentum(ps, learning_rate=1e-3, momentum=0.9),
    }
    try:
        from mindformers.core.optim.adamw import AdamW
    except ImportError:
        return found
    found["mindformers AdamW"] = lambda ps: AdamW(ps, learning_rate=1e-3, weight_decay=0.01)
    return found


def _params(layers: int) -> list[Parameter]:
    rng = np.random.default_rng(0)
    return [
        Parameter(
            Tensor(rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * 0.02),
            name=f"layer{i}.weight",
        )
        for i in range(layers)
    ]


def _grads(layers: int) -> tuple[Tensor, ...]:
    rng = np.random.default_rng(1)
    return tuple(
        Tensor(rng.standard_normal((WIDTH, WIDTH), dtype=np.float32)) for _ in range(layers)
    )


def _timed(opt: nn.Optimizer, grads: tuple[Tensor, ...]) -> float:
    start = time.perf_counter()
    opt(grads)
    opt.global_step.asnumpy()  # wait for the queued kernels
    return time.perf_counter() - start


def _memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Median time of one memcpy of ``nbytes`` each way between two host buffers."""
    host = np.ones(nbytes // 4, dtype=np.float32)
    device = np.empty_like(host)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(device, host)
        np.copyto(host, device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    make: Callable, layers: int, steps: int, swap_times: int, runtimes: list[str]
) -> dict[str, float]:
    """Swapped / plain step time per ``runtime/mode``, the copy floor and bit-exactness."""
    grads = _grads(layers)
    runs = {"plain": make(_params(layers))}
    for runtime in runtimes:
        for mode, packed in (("packed", True), ("per-tensor", False)):
            opt = make(_params(layers))
            config = SwapOptimizerConfig(runtime=runtime, swap_times=swap_times, packed_swap=packed)
            swap_optimizer(opt, config)
            runs[f"{runtime}/{mode}"] = opt
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for step in range(steps + 1):
        turn = step % len(order)
        for name in order[turn:] + order[:turn]:
            elapsed = _timed(runs[name], grads)
            if step:  # the first step builds kernels and lazy state
                times[name].append(elapsed)
    plain = statistics.median(times["plain"])
    reference = [p.asnumpy() for p in runs.pop("plain")._parameters]
    result = {name: statistics.median(times[name]) / plain for name in runs}
    state_bytes = swap_stats(next(iter(runs.values()))).total_state_bytes
    result["floor"] = (plain + _memcpy_seconds(state_bytes)) / plain
    result["plain_ms"] = plain * 1e3
    result["exact"] = float(
        all(
            np.array_equal(a, b.asnumpy())
            for opt in runs.values()
            for a, b in zip(reference, opt._parameters, strict=True)
        )
    )
    return result


def peak_share(
    make: Callable, layers: int, swap_times: int, packed: bool, runtime: str = "loopback"
) -> float:
    opt = make(_params(layers))
    swap_optimizer(
        opt, SwapOptimizerConfig(runtime=runtime, swap_times=swap_times, packed_swap=packed)
    )
    opt(_grads(layers))
    stats = swap_stats(opt)
    return stats.peak_resident_state_bytes / stats.total_state_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4M,16M", help="parameter counts, e.g. 1M,4M")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per optimizer")
    parser.add_argument("--swap-times", type=int, default=4)
    parser.add_argument(
        "--runtimes", default="loopback,loopback-async", help="MindSpore CPU runtimes"
    )
    parser.add_argument("--families", default="", help="only families whose name has this")
    parser.add_argument("--no-sweep", action="store_true", help="skip the peak sweep")
    args = parser.parse_args()
    runtimes = args.runtimes.split(",")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    console = Console(width=200)
    table = Table(
        title=f"MindSpore swap on CPU, swap_times={args.swap_times}: swapped step time / plain "
        f"step time (load average {os.getloadavg()[0]:.1f})"
    )
    columns = [f"{r} {m}" for r in runtimes for m in ("packed", "per-tensor")]
    for column in ("optimizer", "params", "plain ms", *columns, "copy floor", "bit-exact"):
        table.add_column(column)
    for family, make in _families().items():
        if args.families not in family:
            continue
        for size in args.sizes.split(","):
            layers = max(1, round(float(size.rstrip("M")) * 1e6 / WIDTH**2))
            result = measure(make, layers, args.steps, args.swap_times, runtimes)
            table.add_row(
                family,
                f"{layers * WIDTH**2 / 1e6:.1f}M",
                f"{result['plain_ms']:.1f}",
                *(f"{result[f'{r}/{m}']:.2f}" for r in runtimes for m in ("packed", "per-tensor")),
                f"{result['floor']:.2f}",
                "yes" if result["exact"] else "NO",
            )
    console.print(table)
    if args.no_sweep:
        return
    sweep = Table(title="Peak device-resident state / total state (16 equal layers)")
    sweep.add_column("mode")
    for swap_times in SWEEP:
        sweep.add_column(f"swap_times={swap_times}")
    make = _families()["nn.Adam"]
    for mode, packed in (("packed", True), ("per-tensor", False)):
        shares = (peak_share(make, 16, t, packed, runtimes[0]) for t in SWEEP)
        sweep.add_row(mode, *(f"{share:.3f}" for share in shares))
    console.print(sweep)


if __name__ == "__main__":
    main()
