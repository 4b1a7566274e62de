"""Optimizer-state swap benchmark: step time, copy cost and device-resident state.

For each model size the script builds a stack of equal bias-free ``nn.Linear`` layers (fp32),
sets random gradients directly (no forward or backward), and measures in one process:

* the step time of a plain ``torch.optim.AdamW`` (PyTorch's default implementation choice),
* the step time of the same optimizer after ``swap_optimizer``, packed and per-tensor,
* the time of copying the same number of state bytes host -> device and back with
  ``Tensor.copy_`` between preallocated buffers (the cost the swap cannot avoid),
* the peak device-resident share of the swapped state for several ``swap_times``,
* whether the swapped runs end with parameters bitwise equal to the plain run.

The three optimizers and the raw copy are stepped round robin, in a rotating order, so the
ratios are taken under the same machine load. On CPU the swap uses the ``loopback`` runtime
(CPU tensors play the device, separate CPU buffers the host); on CUDA it uses ``auto``.

Run::

    python benchmarks/optimizer_swap.py                     # 10M, 50M, 100M parameters
    python benchmarks/optimizer_swap.py --sizes 10M --steps 5 --json out.json
    python benchmarks/optimizer_swap.py --device cuda --sizes 100M,1G
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.console import Console
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    human,
    import_swapopt,
    machine_info,
    make_grads,
    markdown_table,
    median,
    parse_size,
    ratio,
    rich_table,
    set_grads,
)

SWEEP_SWAP_TIMES = (2, 4, 8, 16)
MODES = {"packed": True, "per-tensor": False}


# --------------------------------------------------------------------------- timing


class Clock:
    """Wall-clock timing that waits for the device, so every stream's work is counted."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


class RawCopy:
    """Moves ``nbytes`` host -> device and back between two preallocated buffers.

    On CPU both buffers are ordinary CPU memory (what the loopback runtime copies between).
    On CUDA the host buffer is pinned and each direction is timed with CUDA events.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host.fill_(1)  # touch every page once so no run pays first-touch faults
        self.dev.fill_(2)
        self.h2d: list[float] = []
        self.d2h: list[float] = []
        self.fresh: list[float] = []

    def run_fresh(self) -> float:
        """CPU only: the same round trip into newly allocated "device" storage, released after.

        The loopback runtime allocates device storage during every step and releases it
        afterwards, so each step pays the operating system's first-touch page faults on top
        of the copy. This isolates that cost; a CUDA caching allocator does not have it.
        """
        t0 = time.perf_counter()
        dev = torch.empty_like(self.dev)
        dev.copy_(self.host)
        self.host.copy_(dev)
        dev.untyped_storage().resize_(0)
        elapsed = time.perf_counter() - t0
        self.fresh.append(elapsed)
        return elapsed

    def run(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
            self.dev.copy_(self.host, non_blocking=True)
            marks[1].record()
            self.host.copy_(self.dev, non_blocking=True)
            marks[2].record()
            marks[2].synchronize()
            h2d = marks[0].elapsed_time(marks[1]) / 1e3
            d2h = marks[1].elapsed_time(marks[2]) / 1e3
        else:
            t0 = time.perf_counter()
            self.dev.copy_(self.host)
            t1 = time.perf_counter()
            self.host.copy_(self.dev)
            t2 = time.perf_counter()
            h2d, d2h = t1 - t0, t2 - t1
        self.h2d.append(h2d)
        self.d2h.append(d2h)
        return h2d + d2h


# --------------------------------------------------------------------------- workload


def make_model(n_params: int, depth: int, device: torch.device, seed: int) -> nn.Sequential:
    """``depth`` square bias-free Linear layers whose total is close to ``n_params``."""
    width = max(32, round(math.sqrt(n_params / depth) / 32) * 32)
    torch.manual_seed(seed)
    layers = [nn.Linear(width, width, bias=False) for _ in range(depth)]
    return nn.Sequential(*layers).to(device)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)


def stats_dict(swapopt: ModuleType, opt: torch.optim.Optimizer) -> dict[str, Any]:
    stats = swapopt.swap_stats(opt)
    names = (
        "total_state_bytes",
        "resident_state_bytes",
        "peak_resident_state_bytes",
        "host_state_bytes",
        "pinned_host_bytes",
        "h2d_bytes",
        "d2h_bytes",
        "steps",
    )
    out: dict[str, Any] = {name: int(getattr(stats, name)) for name in names}
    if dataclasses.is_dataclass(stats):  # keep whatever extra counters the engine reports
        for f in dataclasses.fields(stats):
            out.setdefault(f.name, getattr(stats, f.name))
    return out


def bench_timing(
    swapopt: ModuleType,
    model: nn.Sequential,
    grads: list[list[torch.Tensor]],
    args: argparse.Namespace,
    device: torch.device,
    runtime: str,
) -> dict[str, Any]:
    """Plain, packed and per-tensor AdamW plus the raw copy, stepped round robin."""
    clock = Clock(device)
    runs: dict[str, dict[str, Any]] = {}
    for name in ("plain", *MODES):
        m = copy.deepcopy(model)
        opt = make_optimizer(m)
        run: dict[str, Any] = {"model": m, "opt": opt, "params": list(m.parameters())}
        if name != "plain":
            cfg = swapopt.SwapOptimizerConfig(
                swap_times=args.swap_times, packed_swap=MODES[name], runtime=runtime
            )
            try:
                if swapopt.swap_optimizer(opt, cfg) is not opt:
                    raise RuntimeError("swap_optimizer did not return the same optimizer")
            except Exception as exc:
                run["error"] = f"install: {type(exc).__name__}: {exc}"
                traceback.print_exc()
        run["times"] = []
        runs[name] = run
    live = [name for name, run in runs.items() if "error" not in run]

    state_bytes = 8 * sum(p.numel() for p in model.parameters())  # exp_avg + exp_avg_sq, fp32
    raw = RawCopy(state_bytes, device)
    order = [*live, "memcpy"] + ([] if device.type == "cuda" else ["fresh"])
    before: dict[str, dict[str, int]] = {}
    total_steps = args.warmup + args.steps
    for step in range(total_steps):
        if step == args.warmup:
            before = {n: stats_dict(swapopt, runs[n]["opt"]) for n in live if n != "plain"}
        shift = step % len(order)
        for name in order[shift:] + order[:shift]:
            if name == "memcpy":
                raw.run()
                continue
            if name == "fresh":
                raw.run_fresh()
                continue
            run = runs[name]
            if "error" in run:
                continue
            set_grads(run["params"], grads[step % 2])
            try:
                run["times"].append(clock.time(run["opt"].step))
            except Exception as exc:
                run["error"] = f"step {step}: {type(exc).__name__}: {exc}"
                traceback.print_exc()

    out: dict[str, Any] = {"state_bytes_expected": state_bytes}
    ref = runs["plain"]["params"]
    for name, run in runs.items():
        times = run["times"][args.warmup :]
        entry: dict[str, Any] = {
            "step_s_all": run["times"],
            "step_s_median": median(times),
            "error": run.get("error"),
        }
        if name != "plain" and "error" not in run:
            entry["bit_exact"] = all(
                torch.equal(a, b) for a, b in zip(ref, run["params"], strict=True)
            )
            after = stats_dict(swapopt, run["opt"])
            entry["stats"] = after
            entry["total_matches_expected"] = after["total_state_bytes"] == state_bytes
            done = after["steps"] - before.get(name, {}).get("steps", 0)
            moved = after["h2d_bytes"] - before.get(name, {}).get("h2d_bytes", 0)
            moved += after["d2h_bytes"] - before.get(name, {}).get("d2h_bytes", 0)
            entry["timed_steps_counted"] = done
            # 1.0 means every timed step moved the whole state in and out exactly once
            entry["moved_per_step_over_2x_total"] = ratio(
                moved / max(done, 1), 2 * after["total_state_bytes"]
            )
        out[name] = entry

    plain_t = out["plain"]["step_s_median"]
    memcpy_t = median([h + d for h, d in zip(raw.h2d, raw.d2h, strict=True)][args.warmup :])
    h2d_t = median(raw.h2d[args.warmup :])
    d2h_t = median(raw.d2h[args.warmup :])
    out["memcpy"] = {
        "bytes_each_way": state_bytes,
        "both_ways_s_median": memcpy_t,
        "fresh_both_ways_s_median": median(raw.fresh[args.warmup :]),
        "fresh_s_all": raw.fresh,
        "h2d_s_all": raw.h2d,
        "d2h_s_all": raw.d2h,
        "h2d_GBps": ratio(state_bytes / 1e9, h2d_t),
        "d2h_GBps": ratio(state_bytes / 1e9, d2h_t),
    }
    for name in MODES:
        entry = out[name]
        t = entry["step_s_median"]
        entry["over_plain"] = ratio(t, plain_t)
        entry["extra_over_memcpy"] = ratio(
            None if t is None or plain_t is None else t - plain_t, memcpy_t
        )
        if device.type == "cuda" and t and out["memcpy"]["h2d_GBps"]:
            link_s = 2 * state_bytes / (out["memcpy"]["h2d_GBps"] * 1e9)
            entry["link_bound_efficiency"] = link_s / t
    del runs, raw
    return out


def bench_residency(
    swapopt: ModuleType,
    model: nn.Sequential,
    grads: list[list[torch.Tensor]],
    device: torch.device,
    runtime: str,
    swapped_steps: int = 2,
) -> dict[str, Any]:
    """Peak resident share per mode and ``swap_times``, installed on an already-built state."""
    clock = Clock(device)
    out: dict[str, Any] = {}
    for mode, packed in MODES.items():
        for st in SWEEP_SWAP_TIMES:
            key = f"{mode}/{st}"
            m = copy.deepcopy(model)
            params = list(m.parameters())
            opt = make_optimizer(m)
            try:
                set_grads(params, grads[0])
                opt.step()  # builds exp_avg / exp_avg_sq on the device first
                cfg = swapopt.SwapOptimizerConfig(
                    swap_times=st, packed_swap=packed, runtime=runtime
                )
                install_s = clock.time(lambda o=opt, c=cfg: swapopt.swap_optimizer(o, c))
                after_install = stats_dict(swapopt, opt)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    base_alloc = torch.cuda.memory_allocated(device)
                for i in range(swapped_steps):
                    set_grads(params, grads[(i + 1) % 2])
                    opt.step()
                s = stats_dict(swapopt, opt)
                total = s["total_state_bytes"]
                entry: dict[str, Any] = {
                    "install_s": install_s,
                    "stats_after_install": after_install,
                    "stats": s,
                    "peak_over_total": ratio(s["peak_resident_state_bytes"], total),
                    "resident_between_steps_over_total": ratio(s["resident_state_bytes"], total),
                    "host_over_total": ratio(s["host_state_bytes"], total),
                    "pinned_over_total": ratio(s["pinned_host_bytes"], total),
                }
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device) - base_alloc
                    entry["cuda_step_peak_alloc_over_total"] = ratio(peak, total)
            except Exception as exc:
                traceback.print_exc()
                entry = {"error": f"{type(exc).__name__}: {exc}"}
            out[key] = entry
            del m, params, opt
            gc.collect()
    return out


def bench_size(
    swapopt: ModuleType, n_target: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    runtime = "loopback" if device.type == "cpu" else args.runtime
    t0 = time.perf_counter()
    model = make_model(n_target, args.layers, device, args.seed)
    grads = make_grads(model, args.seed)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    result: dict[str, Any] = {
        "target_params": n_target,
        "params": n_params,
        "tensors": len(params),
        "shape": list(params[0].shape),
        "runtime": runtime,
    }
    result["timing"] = bench_timing(swapopt, model, grads, args, device, runtime)
    result["residency"] = bench_residency(swapopt, model, grads, device, runtime)
    result["wall_s"] = time.perf_counter() - t0
    del model, grads, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def timing_rows(results: list[dict[str, Any]], cuda: bool) -> tuple[list[str], list[list[str]]]:
    """One row per size and mode: baselines on the plain row, ratios on the swapped rows."""
    head = ["params", "state MB", "mode", "step ms", "x plain", "memcpy ms"]
    head += ["H2D GB/s", "D2H GB/s"] if cuda else ["fresh memcpy ms"]
    head += ["extra/memcpy", *(["link eff."] if cuda else []), "moved/step", "bit-exact"]
    rows = []
    for r in results:
        t = r["timing"]
        mc = t["memcpy"]
        for name in ("plain", *MODES):
            e = t[name]
            row = [
                human(r["params"]),
                f"{t['state_bytes_expected'] / 2**20:.0f}",
                name if not e.get("error") else f"{name} (FAILED)",
                _ms(e["step_s_median"]),
            ]
            if name == "plain":
                row += ["1.00", _ms(mc["both_ways_s_median"])]
                if cuda:
                    row += [_fmt(mc["h2d_GBps"], ".1f"), _fmt(mc["d2h_GBps"], ".1f")]
                else:
                    row += [_ms(mc["fresh_both_ways_s_median"])]
                row += [""] * (4 if cuda else 3)
            else:
                row += [_fmt(e.get("over_plain"), ".2f"), ""]
                row += ["", ""] if cuda else [""]
                row += [_fmt(e.get("extra_over_memcpy"), ".2f")]
                if cuda:
                    row += [_fmt(e.get("link_bound_efficiency"), ".2f")]
                row += [
                    _fmt(e.get("moved_per_step_over_2x_total"), ".2f"),
                    {True: "yes", False: "NO"}.get(e.get("bit_exact"), "-"),
                ]
            rows.append(row)
    return head, rows


def residency_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["params", "mode", *(f"st={st}" for st in SWEEP_SWAP_TIMES)]
    head += ["st=8, from 1st step", "host/total", "pinned/total"]
    rows = []
    for r in results:
        for mode in MODES:
            cells = [r["residency"][f"{mode}/{st}"] for st in SWEEP_SWAP_TIMES]
            last = next((c for c in reversed(cells) if "error" not in c), {})
            timed = r["timing"][mode]
            scratch = (timed.get("stats") or {}).get("peak_resident_state_bytes")
            total = (timed.get("stats") or {}).get("total_state_bytes")
            rows.append(
                [
                    human(r["params"]),
                    mode,
                    *("ERR" if "error" in c else _fmt(c["peak_over_total"], ".3f") for c in cells),
                    _fmt(ratio(scratch, total), ".3f"),
                    _fmt(last.get("host_over_total"), ".3f"),
                    _fmt(last.get("pinned_over_total"), ".3f"),
                ]
            )
    return head, rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes",
        default="10M,50M,100M",
        help="comma-separated parameter counts, K/M/G suffixes allowed (default: 10M,50M,100M)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu runs the loopback runtime; cuda runs --runtime (default: cuda if available)",
    )
    p.add_argument("--runtime", default="auto", help="runtime on CUDA (default: auto)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (default: 2)")
    p.add_argument("--swap-times", type=int, default=8, help="swap_times when timing (default 8)")
    p.add_argument("--layers", type=int, default=40, help="Linear layers per model (default 40)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 0 keeps torch's default. Default 1: on a shared machine, "
        "ops split over threads wait for each other and the timings swing by 10x or more",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the raw numbers here")
    p.add_argument("--markdown", type=Path, help="write the two tables as Markdown here")
    args = p.parse_args(argv)
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    swapopt = import_swapopt()
    device = torch.device(args.device)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # do not squeeze the tables into 80 columns in a pipe
    info = machine_info(device)
    console.print(
        f"[bold]swapopt optimizer-state benchmark[/] on {info.get('gpu', 'CPU')}: "
        f"{info['cpu_count']} CPU cores, torch {info['torch']} ({info['torch_threads']} threads), "
        f"{args.steps} timed + {args.warmup} warmup steps, swap_times={args.swap_times}"
    )
    start = time.perf_counter()
    results = []
    for n in args.size_list:
        console.print(f"  size {human(n)} ...", end="")
        res = bench_size(swapopt, n, args, device)
        console.print(f" {res['wall_s']:.1f} s")
        results.append(res)
    wall = time.perf_counter() - start

    cuda = device.type == "cuda"
    t_head, t_rows = timing_rows(results, cuda)
    r_head, r_rows = residency_rows(results)
    console.print(rich_table("AdamW step time (median)", t_head, t_rows))
    console.print(
        rich_table("Peak device-resident swapped state / total swapped state", r_head, r_rows)
    )
    load = os.getloadavg()
    console.print(
        f"wall time {wall:.1f} s; 1-minute load average "
        f"{info['loadavg_1_5_15'][0]:.1f} at start, {load[0]:.1f} at end"
    )

    if args.markdown:
        args.markdown.write_text(
            markdown_table(t_head, t_rows) + "\n\n" + markdown_table(r_head, r_rows) + "\n"
        )
    if args.json:
        payload = {
            "machine": info,
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "markdown")},
            "wall_s": wall,
            "loadavg_at_end": list(load),
            "results": results,
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    failed = any(
        r["timing"][m].get("error") or r["timing"][m].get("bit_exact") is False
        for r in results
        for m in MODES
    ) or any("error" in cell for r in results for cell in r["residency"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
