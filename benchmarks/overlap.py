"""How much of the swap the pipeline hides, on a CPU with an emulated link.

On ``runtime="loopback-async"`` each copy direction is a worker thread paced to
``SWAPOPT_LOOPBACK_GBPS``, so a link slower than the update can be emulated without an
accelerator. For each model size (a stack of equal bias-free ``nn.Linear`` layers, fp32,
AdamW with its state swapped) the script measures, side by side in one process:

* ``U``: the plain AdamW step (gradients set directly, no forward or backward),
* ``S``: the swapped step, with the bandwidth chosen so that the link time
  ``L = state bytes / bandwidth`` (each direction moves the whole state once, the two
  directions overlap) is ``--link`` times ``U``,
* the fully serialised sum ``U + 2 L`` (update, then every copy in, then every copy out),
* ``U‖L``: the plain step while the same paced lanes move the state's bytes both ways, with
  no pipeline at all: on a CPU the copies are memcpys that share cores and the memory bus
  with the update, and this is the floor that leaves for any overlap,
* a whole training step (forward, backward, step) plain, swapped with prefetch during
  backward and swapped without it; the visible swap time is swapped minus plain,
* the swapped step for ``swap_times`` 2, 4, 8, 16 with the peak device-resident state.

Targets (issue 11): ``S <= 1.15 max(U, L)`` and, with prefetch during backward, visible swap
time ``<= 0.5 L``. Steps run back to back (the next step's copies wait for the last one's
copies out, as in training) and the timed block ends with ``swap_stats``, which waits for
every copy. Swapped runs are checked bitwise against their plain twins.

Run::

    python benchmarks/overlap.py                          # 10M, 50M, 100M; link 1x and 2x
    python benchmarks/overlap.py --sizes 10M --link 2 --markdown out.md
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

SWEEP = (2, 4, 8, 16)
_SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9}


def _import_swapopt() -> ModuleType:
    try:
        return importlib.import_module("swapopt_core")
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        return importlib.import_module("swapopt_core")


swapopt = _import_swapopt()


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIX.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def build(params: int, seed: int = 0) -> nn.Sequential:
    """Sixteen equal square layers with about ``params`` parameters (so every swap_times of
    the sweep splits the state into equal batches)."""
    width = round((params / 16) ** 0.5)
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(16)])


def set_grads(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3


def swapped(model: nn.Module, swap_times: int, prefetch: bool, gbps: float) -> Any:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    os.environ["SWAPOPT_LOOPBACK_GBPS"] = f"{gbps:.6f}"  # read when the runtime is built
    config = swapopt.SwapOptimizerConfig(
        swap_times=swap_times,
        runtime="loopback-async",
        packed_swap=True,
        prefetch_during_backward=prefetch,
    )
    return swapopt.swap_optimizer(opt, config)


def _finish(opt: torch.optim.Optimizer) -> None:
    if swapopt.is_swap_optimizer(opt):
        swapopt.swap_stats(opt)  # waits for the copies still queued


def timed(run: Callable[[], None], opt: torch.optim.Optimizer, steps: int) -> float:
    """Seconds per step over ``steps`` back-to-back steps, the last copies included."""
    start = time.perf_counter()
    for _ in range(steps):
        run()
    _finish(opt)
    return (time.perf_counter() - start) / steps


def same(a: nn.Module, oa: torch.optim.Optimizer, b: nn.Module, ob: torch.optim.Optimizer) -> bool:
    _finish(ob)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        if not torch.equal(pa, pb):
            return False
        for key, value in oa.state[pa].items():
            if not torch.equal(value, ob.state[pb][key]):
                return False
    return True


class _RawLink:
    """The floor of this machine: the plain step while both lanes move the state's bytes.

    No pipeline logic, only the same work at once: ``swap_times`` copies of equal size per
    direction on two paced lanes, and the plain AdamW step on the calling thread. On a CPU
    the copies are memcpys sharing cores and the memory bus with the update, which a real
    link does not; this measures that cost.
    """

    def __init__(self, state_bytes: int, pieces: int, gbps: float, plain: Any) -> None:
        lanes = importlib.import_module("swapopt_core._device.lanes")
        settings = lanes.LaneSettings(gbps=gbps)
        self.h2d, self.d2h = lanes.Lane("h2d", settings), lanes.Lane("d2h", settings)
        size = state_bytes // pieces
        self.host = [torch.ones(size, dtype=torch.uint8) for _ in range(pieces)]
        self.device = [torch.ones(size, dtype=torch.uint8) for _ in range(pieces)]
        self.plain = plain
        self.last: Any = None

    def step(self) -> None:
        tickets = []
        for host, device in zip(self.host, self.device, strict=True):
            tickets.append(self.h2d.submit(lambda d=device, h=host: d.copy_(h).numel()))
            tickets.append(self.d2h.submit(lambda d=device, h=host: h.copy_(d).numel()))
        self.plain.step()
        for ticket in tickets:
            ticket.wait()


def _side_by_side(
    plain_model: nn.Module,
    gbps: float,
    state_bytes: int,
    steps: int,
    rounds: int,
    batch: int,
    swap_times: int,
) -> tuple[dict[str, float], bool]:
    """Median seconds per step of each configuration, measured round robin, and whether
    every swapped run ended bitwise equal to its plain twin. Everything built here is
    freed on return (the sweep needs the memory)."""
    # The step alone, and the step inside training, plain and swapped side by side.
    step_model = copy.deepcopy(plain_model)
    step_opt = swapped(step_model, swap_times, True, gbps)
    step_model_plain = copy.deepcopy(plain_model)
    step_plain = torch.optim.AdamW(step_model_plain.parameters(), lr=1e-3)
    x = torch.randn(batch, plain_model[0].in_features, generator=torch.Generator().manual_seed(1))
    names = ("plain", "prefetch", "no-prefetch")
    train_models = {name: copy.deepcopy(plain_model) for name in names}
    train_opts = {
        "plain": torch.optim.AdamW(train_models["plain"].parameters(), lr=1e-3),
        "prefetch": swapped(train_models["prefetch"], swap_times, True, gbps),
        "no-prefetch": swapped(train_models["no-prefetch"], swap_times, False, gbps),
    }

    def train_step(name: str) -> Callable[[], None]:
        model, opt = train_models[name], train_opts[name]

        def run() -> None:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        return run

    floor_model = copy.deepcopy(plain_model)
    floor_plain = torch.optim.AdamW(floor_model.parameters(), lr=1e-3)
    raw = _RawLink(state_bytes, swap_times, gbps, floor_plain)
    blocks: dict[str, tuple[Callable[[], None], torch.optim.Optimizer]] = {
        "U": (step_plain.step, step_plain),
        "floor": (raw.step, floor_plain),
        "S": (step_opt.step, step_opt),
        **{f"train:{name}": (train_step(name), train_opts[name]) for name in train_opts},
    }
    for model in (step_model, step_model_plain, floor_model):
        set_grads(model, 0)
    for run, opt in blocks.values():  # warm up: lazy state, layouts, the prefetch plan
        for _ in range(2):
            run()
        _finish(opt)
    times: dict[str, list[float]] = {name: [] for name in blocks}
    order = list(blocks)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            run, opt = blocks[name]
            times[name].append(timed(run, opt, steps))
    t = {name: statistics.median(values) for name, values in times.items()}
    exact = same(step_model_plain, step_plain, step_model, step_opt) and all(
        same(train_models["plain"], train_opts["plain"], train_models[k], train_opts[k])
        for k in ("prefetch", "no-prefetch")
    )

    return t, exact


def measure(
    params: int, link: float, steps: int, rounds: int, batch: int, swap_times: int
) -> dict[str, Any]:
    """Every figure for one model size."""
    plain_model = build(params)
    n = sum(p.numel() for p in plain_model.parameters())
    state_bytes = 2 * 4 * n
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    set_grads(plain_model, 0)
    for _ in range(3):
        plain.step()
    update = statistics.median(timed(plain.step, plain, steps) for _ in range(rounds))
    gbps = state_bytes / (link * update) / 1e9
    link_s = state_bytes / (gbps * 1e9)

    t, exact = _side_by_side(plain_model, gbps, state_bytes, steps, rounds, batch, swap_times)
    gc.collect()

    # swap_times sweep: each swapped step next to a plain one, one config at a time.
    sweep = {}
    sweep_model = copy.deepcopy(plain_model)
    set_grads(sweep_model, 0)
    for swap_times in SWEEP:
        opt = swapped(sweep_model, swap_times, True, gbps)
        for _ in range(2):
            opt.step()
        pairs = [
            (timed(opt.step, opt, steps), timed(plain.step, plain, steps)) for _ in range(rounds)
        ]
        s = statistics.median(a for a, _ in pairs)
        u = statistics.median(b for _, b in pairs)
        stats = swapopt.swap_stats(opt)
        sweep[swap_times] = {
            "step_ms": s * 1e3,
            "plain_ms": u * 1e3,
            "x_bound": s / max(u, link_s),
            "peak_share": stats.peak_resident_state_bytes / stats.total_state_bytes,
        }
        swapopt.unswap_optimizer(opt)
    visible = t["train:prefetch"] - t["train:plain"]
    return {
        "link": link,
        "params": n,
        "state_mb": state_bytes / 1e6,
        "gbps": gbps,
        "update_ms": t["U"] * 1e3,
        "link_ms": link_s * 1e3,
        "serial_ms": (t["U"] + 2 * link_s) * 1e3,
        "swapped_ms": t["S"] * 1e3,
        "x_plain": t["S"] / t["U"],
        "x_bound": t["S"] / max(t["U"], link_s),
        "x_serial": t["S"] / (t["U"] + 2 * link_s),
        "floor_ms": t["floor"] * 1e3,
        "x_floor": t["S"] / t["floor"],
        "train_plain_ms": t["train:plain"] * 1e3,
        "train_prefetch_ms": t["train:prefetch"] * 1e3,
        "train_no_prefetch_ms": t["train:no-prefetch"] * 1e3,
        "visible_over_link": visible / link_s,
        "visible_no_prefetch_over_link": (t["train:no-prefetch"] - t["train:plain"]) / link_s,
        "bit_exact": exact,
        "sweep": sweep,
    }


def tables(results: list[dict[str, Any]], swap_times: int) -> tuple[str, list[Table]]:
    """Markdown and rich renderings of the two tables."""
    head = (
        "| params | L/U set | L/U | state MB | link GB/s | U ms | L ms | U+2L ms | S ms | S/U "
        "| S/max(U,L) | S/(U+2L) | U‖L ms | S/(U‖L) | train plain ms | +prefetch ms "
        "| no prefetch ms | visible/L "
        "| visible/L no prefetch | bit-exact |"
    )
    rows = [head, "|" + "---|" * 20]
    main = Table(title=f"swapped step (swap_times={swap_times}, packed, loopback-async)")
    for column in head.strip("|").split("|"):
        main.add_column(column.strip())
    for r in results:
        cells = [
            f"{r['params'] / 1e6:.1f}M",
            f"{r['link']:g}",
            f"{r['link_ms'] / r['update_ms']:.2f}",
            f"{r['state_mb']:.0f}",
            f"{r['gbps']:.2f}",
            f"{r['update_ms']:.1f}",
            f"{r['link_ms']:.1f}",
            f"{r['serial_ms']:.1f}",
            f"{r['swapped_ms']:.1f}",
            f"{r['x_plain']:.2f}",
            f"{r['x_bound']:.2f}",
            f"{r['x_serial']:.2f}",
            f"{r['floor_ms']:.1f}",
            f"{r['x_floor']:.2f}",
            f"{r['train_plain_ms']:.1f}",
            f"{r['train_prefetch_ms']:.1f}",
            f"{r['train_no_prefetch_ms']:.1f}",
            f"{r['visible_over_link']:.2f}",
            f"{r['visible_no_prefetch_over_link']:.2f}",
            "yes" if r["bit_exact"] else "NO",
        ]
        rows.append("| " + " | ".join(cells) + " |")
        main.add_row(*cells)
    head2 = (
        "| params | L/U set | swap_times | S ms | U ms | S/max(U,L) | peak device state / total |"
    )
    rows += ["", head2, "|" + "---|" * 7]
    sweep = Table(title="swap_times sweep (prefetch on, packed)")
    for column in head2.strip("|").split("|"):
        sweep.add_column(column.strip())
    for r in results:
        for st, s in r["sweep"].items():
            cells = [
                f"{r['params'] / 1e6:.1f}M",
                f"{r['link']:g}",
                str(st),
                f"{s['step_ms']:.1f}",
                f"{s['plain_ms']:.1f}",
                f"{s['x_bound']:.2f}",
                f"{s['peak_share']:.3f}",
            ]
            rows.append("| " + " | ".join(cells) + " |")
            sweep.add_row(*cells)
    return "\n".join(rows) + "\n", [main, sweep]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,50M,100M")
    parser.add_argument(
        "--link", default="1,2", help="link time / plain update, one or more (comma-separated)"
    )
    parser.add_argument("--swap-times", type=int, default=8, help="for the main table")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=5, help="timed blocks per config")
    parser.add_argument("--batch", type=int, default=16, help="rows of the training input")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    links = [float(v) for v in args.link.split(",")]
    if not all(0.5 <= link <= 2.0 for link in links):
        parser.error(f"--link={args.link}: the issue asks for link times of 0.5x to 2x")
    torch.set_num_threads(args.threads)
    os.environ.pop("SWAPOPT_LOOPBACK_JITTER_US", None)
    console = Console(stderr=True)
    results = []
    started = time.perf_counter()
    for size in args.sizes.split(","):
        for link in links:
            console.print(f"measuring {size} at link = {link} x update ...")
            params = parse_size(size)
            results.append(
                measure(params, link, args.steps, args.rounds, args.batch, args.swap_times)
            )
            gc.collect()
            # Written after every measurement, so a run stopped early keeps what it had.
            markdown = tables(results, args.swap_times)[0]
            if args.markdown:
                args.markdown.write_text(markdown)
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
    for table in tables(results, args.swap_times)[1]:
        Console().print(table)
    console.print(
        f"{os.cpu_count()} CPUs, {args.threads} intra-op thread(s), torch {torch.__version__}, "
        f"wall {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
