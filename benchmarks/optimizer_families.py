"""Optimizer families: the generic per-parameter path beside AdamW's dedicated one.

Every torch.optim family but LBFGS is swapped by ``PerParameterAdapter``: a batch's update
runs the optimizer's own ``step`` on one batch of parameters at a time. Adam and AdamW keep a
dedicated adapter (the functional ``adam`` per batch). For each model size the script builds
a stack of square bias-free ``nn.Linear`` layers of ``--width`` (fp32, 2-D weights, so Muon
applies to every one), sets random gradients directly (no forward or backward), and measures
for each optimizer, side by side in one process:

* the plain optimizer's step,
* the same optimizer swapped on ``loopback`` (synchronous copies) and on ``loopback-async``
  (copies on two worker threads paced to an emulated link of ``--gbps`` GB/s per direction),
  each step timed until its copies are done (``swap_stats`` waits for them),
* the peak device bytes of optimizer state during the swapped steps over the plain
  optimizer's state bytes: ``SwapStats.peak_resident_state_bytes`` (swapped state on the
  device, staging included, and state kept resident for good) plus the state the engine
  leaves alone (step counters, tensors under ``min_numel``: plain state bytes minus
  ``SwapStats.total_state_bytes``),
* whether parameters and state end ``torch.equal`` to the plain run.

The optimizers: SGD with momentum, Adagrad, RMSprop, Adafactor and Muon (the generic path),
and AdamW both through its dedicated adapter and through the generic path (a fresh plugin
manager with ``PerParameterAdapter(classes=(torch.optim.AdamW,))`` registered last, so it is
asked before the built-in Adam adapter); ``x dedicated`` is the generic AdamW step over the
dedicated one on the same runtime. A family's plain run and all its swapped twins (both
runtimes; for AdamW both paths too) are stepped round robin in a rotating order, so each
ratio is taken under the same machine load; step times are medians of the timed steps.

Run::

    python benchmarks/optimizer_families.py                  # 10M and 50M parameters
    python benchmarks/optimizer_families.py --sizes 10M --families "SGD momentum,AdamW" --gbps 1
    python benchmarks/optimizer_families.py --quick          # seconds: every row runs
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
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
    emulated_link,
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

Params = list[nn.Parameter]

#: Family -> how to build it on the parameters.
FAMILIES: dict[str, Callable[[Params], torch.optim.Optimizer]] = {
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "Muon": lambda ps: torch.optim.Muon(ps, lr=1e-3),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2),
}
#: Families swapped two ways, side by side against one plain run: the dedicated adapter
#: (the built-in choice) and the generic path.
PATHS: dict[str, tuple[str, ...]] = {"AdamW": ("dedicated", "generic")}
RUNTIMES = ("loopback", "loopback-async")


def row_names(families: list[str] | None = None) -> list[str]:
    """The optimizer column of the table, in order: one name per family and path."""
    names = []
    for family in FAMILIES if families is None else families:
        paths = PATHS.get(family, ("",))
        names += [f"{family} {path}".strip() for path in paths]
    return names


QUICK = {"sizes": "0.25M", "width": 128, "steps": 2, "warmup": 1}


hookimpl = import_swapopt().hookimpl


class GenericAdamW:
    """A plugin serving AdamW through the generic path (asked before the built-in Adam
    adapter, because pluggy asks the plugins registered last first)."""

    def __init__(self, swapopt: ModuleType) -> None:
        self.adapter = swapopt.PerParameterAdapter(classes=(torch.optim.AdamW,))

    @hookimpl
    def swapopt_register_optimizer_adapters(self) -> list[Any]:
        return [self.adapter]


def generic_adamw_manager(swapopt: ModuleType) -> Any:
    """A fresh plugin manager whose AdamW goes through ``PerParameterAdapter``."""
    manager = swapopt.new_plugin_manager(load_entrypoints=False)
    manager.register(GenericAdamW(swapopt), name="generic-adamw")
    return manager


def make_stack(n_params: int, width: int, seed: int) -> nn.Sequential:
    """Square bias-free Linear layers of ``width`` whose total is close to ``n_params``."""
    depth = max(1, round(n_params / width**2))
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (step counters included)."""
    return sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def same_bits(plain: dict[str, Any], swapped: dict[str, Any]) -> bool:
    """Parameters and every state entry ``torch.equal`` (state read back through
    ``state_dict``, which waits for the copies it reads)."""
    pairs = zip(plain["params"], swapped["params"], strict=True)
    if not all(torch.equal(a, b) for a, b in pairs):
        return False
    a, b = plain["opt"].state_dict()["state"], swapped["opt"].state_dict()["state"]
    if a.keys() != b.keys():
        return False
    for key, entry in a.items():
        if entry.keys() != b[key].keys():
            return False
        for name, value in entry.items():
            other = b[key][name]
            if isinstance(value, torch.Tensor):
                if not (isinstance(other, torch.Tensor) and torch.equal(value, other.cpu())):
                    return False
            elif value != other:
                return False
    return True


def adapter_name(opt: torch.optim.Optimizer) -> str:
    """The class name of the adapter serving a swapped optimizer (which path ran)."""
    engine = import_swapopt("swapopt_core._swap.engine").engine_of(opt)
    return type(engine.adapter).__name__ if engine is not None else "-"


def bench_family(
    swapopt: ModuleType,
    family: str,
    model: nn.Sequential,
    grads: list[list[torch.Tensor]],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """The plain optimizer and its swapped twins (each path, both runtimes), stepped round
    robin in a rotating order."""
    build = FAMILIES[family]
    paths = PATHS.get(family, ("",))
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for key in [("", "plain")] + [(path, rt) for path in paths for rt in RUNTIMES]:
        path, runtime = key
        m = copy.deepcopy(model)
        params = list(m.parameters())
        run: dict[str, Any] = {"params": params, "opt": build(params), "times": []}
        if runtime != "plain":
            manager = generic_adamw_manager(swapopt) if path == "generic" else None
            config = swapopt.SwapOptimizerConfig(swap_times=args.swap_times, runtime=runtime)
            link = args.gbps if runtime == "loopback-async" else None
            try:
                with emulated_link(link):  # read when the runtime is made, at install
                    swapopt.swap_optimizer(run["opt"], config, plugin_manager=manager)
                run["adapter"] = adapter_name(run["opt"])
            except Exception as exc:
                traceback.print_exc()
                run["error"] = f"install: {type(exc).__name__}: {exc}"
        runs[key] = run

    order = list(runs)
    for step in range(args.warmup + args.steps):
        shift = step % len(order)
        for key in order[shift:] + order[:shift]:
            run = runs[key]
            if "error" in run:
                continue
            set_grads(run["params"], grads[step % 2])
            try:
                start = time.perf_counter()
                run["opt"].step()
                if key[1] != "plain":
                    swapopt.swap_stats(run["opt"])  # waits for the step's copies still queued
                run["times"].append(time.perf_counter() - start)
            except Exception as exc:
                traceback.print_exc()
                run["error"] = f"step {step}: {type(exc).__name__}: {exc}"

    plain = runs[("", "plain")]
    plain_s = median(plain["times"][args.warmup :])
    plain_bytes = state_bytes(plain["opt"])
    rows = []
    for (path, runtime), run in runs.items():
        if runtime == "plain":
            continue
        row: dict[str, Any] = {
            "optimizer": f"{family} {path}".strip(),
            "runtime": runtime,
            "plain_s": plain_s,
            "plain_state_bytes": plain_bytes,
            "error": run.get("error") or plain.get("error"),
            "adapter": run.get("adapter"),
            "over_dedicated": None,
        }
        if row["error"] is None:
            stats = swapopt.swap_stats(run["opt"])
            swapped_s = median(run["times"][args.warmup :])
            # State the engine leaves alone (step counters, tensors under min_numel) stays on
            # the device throughout, so it counts towards the peak as well.
            peak = stats.peak_resident_state_bytes + plain_bytes - stats.total_state_bytes
            row.update(
                swapped_s=swapped_s,
                over_plain=ratio(swapped_s, plain_s),
                swapped_state_bytes=stats.total_state_bytes,
                peak_state_bytes=peak,
                peak_over_plain_state=ratio(peak, plain_bytes),
                bit_exact=same_bits(plain, run),
                plain_s_all=plain["times"],
                swapped_s_all=run["times"],
            )
            dedicated = runs.get(("dedicated", runtime))
            if path == "generic" and dedicated is not None and "error" not in dedicated:
                row["over_dedicated"] = ratio(swapped_s, median(dedicated["times"][args.warmup :]))
        rows.append(row)
    del runs
    gc.collect()
    return rows


def bench_size(
    swapopt: ModuleType, n_target: int, args: argparse.Namespace, console: Console
) -> dict[str, Any]:
    start = time.perf_counter()
    model = make_stack(n_target, args.width, args.seed)
    grads = make_grads(model, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    for family in args.family_list:
        console.print(f"  {human(n_params)} {family} ...", end="")
        t0 = time.perf_counter()
        for row in bench_family(swapopt, family, model, grads, args):
            rows.append({"params": n_params, "layers": len(model), **row})
        console.print(f" {time.perf_counter() - t0:.1f} s")
    return {"params": n_params, "rows": rows, "wall_s": time.perf_counter() - start}


# --------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_rows(results: list[dict[str, Any]], gbps: float) -> tuple[list[str], list[list[str]]]:
    head = ["params", "optimizer", "runtime", "adapter", "plain ms", "swapped ms", "x plain"]
    head += ["x dedicated"]
    head += ["plain state MB", "swapped MB", "peak state / plain", "bit-exact"]
    rows = []
    for result in results:
        for r in result["rows"]:
            runtime = r["runtime"] if r["runtime"] == "loopback" else f"async {gbps:g} GB/s"
            if r["error"]:
                rows.append([human(r["params"]), r["optimizer"], runtime, "FAILED"] + ["-"] * 8)
                continue
            rows.append(
                [
                    human(r["params"]),
                    r["optimizer"],
                    runtime,
                    str(r["adapter"]).removesuffix("Adapter"),
                    _fmt(r["plain_s"] * 1e3, ".1f"),
                    _fmt(r["swapped_s"] * 1e3, ".1f"),
                    _fmt(r["over_plain"], ".2f"),
                    _fmt(r["over_dedicated"], ".2f"),
                    f"{r['plain_state_bytes'] / 2**20:.1f}",
                    f"{r['swapped_state_bytes'] / 2**20:.1f}",
                    _fmt(r["peak_over_plain_state"], ".3f"),
                    "yes" if r["bit_exact"] else "NO",
                ]
            )
    return head, rows


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10M,50M", help="parameter counts, K/M/G (10M,50M)")
    p.add_argument("--width", type=int, default=512, help="width of the square layers (512)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (2)")
    p.add_argument("--swap-times", type=int, default=8, help="swap_times (8)")
    p.add_argument(
        "--gbps", type=float, default=2.0, help="emulated link of loopback-async, GB/s (2)"
    )
    p.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"comma-separated subset of: {', '.join(FAMILIES)}",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the smallest run, seconds: "
        + ", ".join(f"--{k} {v}" for k, v in QUICK.items())
        + " (flags given explicitly win)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the raw numbers here")
    p.add_argument("--markdown", type=Path, help="write the table as Markdown here")
    if argv is None:
        argv = sys.argv[1:]
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0].removeprefix("--").replace("-", "_") for a in argv}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.family_list = [s.strip() for s in args.families.split(",") if s.strip()]
    unknown = [s for s in args.family_list if s not in FAMILIES]
    if unknown:
        p.error(f"--families: unknown {unknown}; choose from {list(FAMILIES)}")
    if args.steps < 1 or args.warmup < 0 or args.width < 1 or args.gbps <= 0:
        p.error("--steps and --width must be >= 1, --warmup >= 0 and --gbps > 0")
    return args


def run(argv: list[str] | None = None, console: Console | None = None) -> dict[str, Any]:
    """Run the benchmark, print its table, and return everything it measured."""
    args = parse_args(argv)
    before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _measure(args, console)
    finally:
        torch.set_num_threads(before)  # an in-process caller (the smoke test) keeps its own


def _measure(args: argparse.Namespace, console: Console | None) -> dict[str, Any]:
    swapopt = import_swapopt()
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=170)  # do not squeeze the table into 80 columns in a pipe
    info = machine_info(torch.device("cpu"))
    console.print(
        f"[bold]swapopt optimizer families[/]: {info['cpu_count']} CPU cores, torch "
        f"{info['torch']} ({info['torch_threads']} threads), layers {args.width}x{args.width}, "
        f"{args.steps} timed + {args.warmup} warmup steps, swap_times={args.swap_times}, "
        f"loopback-async link {args.gbps:g} GB/s per direction"
    )
    start = time.perf_counter()
    results = [bench_size(swapopt, n, args, console) for n in args.size_list]
    wall = time.perf_counter() - start
    head, rows = table_rows(results, args.gbps)
    console.print(rich_table("Swapped / plain step (medians), peak device state", head, rows))
    load = machine_info(torch.device("cpu"))["loadavg_1_5_15"]
    console.print(
        f"wall time {wall:.1f} s; 1-minute load average {info['loadavg_1_5_15'][0]:.1f} at "
        f"start, {load[0]:.1f} at end"
    )
    report = {
        "machine": info,
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "markdown")},
        "wall_s": wall,
        "loadavg_at_end": load,
        "results": results,
        "table": {"head": head, "rows": rows},
    }
    if args.markdown:
        args.markdown.write_text(markdown_table(head, rows) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return report


def main(argv: list[str] | None = None) -> int:
    report = run(argv)
    rows = [r for result in report["results"] for r in result["rows"]]
    return 0 if all(not r["error"] and r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
