"""How `swapopt plan` scales with the number of ops: a chain of N ops planned and summarised.

Each trace is a training-step chain: N/2 forward ops each create a 1 MiB activation that the
matching backward op reads, so about N/2 activations are alive at the turn, the case a
per-op walk over live storages makes quadratic. The budget is half the natural peak, so the
plan moves about half the activations and the lower bound binds. Each case runs the whole
command in process (read the trace file, plan, simulate, print the summary with its lower
bound, write the schedule) and, separately, the lower bound alone.

Nothing runs on a device; every figure is simulated. Times are printed, never asserted.

Run::

    python benchmarks/plan_scale.py
    python benchmarks/plan_scale.py --ops 1000,4000,16000 --markdown table.md
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

MIB = 1 << 20


def _import(name: str) -> ModuleType:
    """Import a swapopt module, falling back to the checkout this script lives in."""
    try:
        return importlib.import_module(name)
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        return importlib.import_module(name)


def chain_trace(n_ops: int, ir: ModuleType):
    """A forward chain of ``n_ops // 2`` ops and its backward, 1 MiB per storage."""
    read, write = ir.AccessKind.READ, ir.AccessKind.WRITE
    half = n_ops // 2
    ops = []
    for k in range(half):  # forward: read the previous activation, write the next
        accesses = ((ir.Access(k - 1, read),) if k else ()) + (ir.Access(k, write),)
        ops.append(ir.TraceOp(f"fwd{k}", 0.01, accesses))
    for k in reversed(range(half)):  # backward: read the activation and the incoming grad
        grad, incoming = half + k, half + k + 1
        accesses = (ir.Access(k, read), ir.Access(grad, write))
        if k < half - 1:
            accesses += (ir.Access(incoming, read),)
        ops.append(ir.TraceOp(f"bwd{k}", 0.02, accesses))
    sizes = {sid: MIB for sid in range(2 * half)}
    return ir.ActivationTrace(tuple(ops), sizes, frozenset({half}), None, 25.0, 25.0)


def run_case(n_ops: int, folder: Path) -> dict[str, float]:
    ir = _import("swapopt_core._planning.ir")
    bounds = _import("swapopt_core._planning.bounds")
    simulate = _import("swapopt_core._planning.simulate")
    cli = _import("swapopt_core._cli.main")
    trace = chain_trace(n_ops, ir)
    peak = simulate.TraceIndex(trace).natural_peak
    budget_mb = peak / MIB / 2
    path = folder / f"chain{n_ops}.json"
    path.write_text(trace.to_json())
    out = folder / f"plan{n_ops}.json"
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(
            ["plan", "--trace", str(path), "--budget-mb", str(budget_mb), "--out", str(out)]
        )
    command = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"swapopt plan failed on the {n_ops}-op chain (exit {code})")
    start = time.perf_counter()
    bound = bounds.overhead_lower_bound(trace.with_limit(int(budget_mb * MIB)))
    alone = time.perf_counter() - start
    return {"ops": n_ops, "command_s": command, "bound_s": alone, "bound": bound}


def markdown_table(rows: list[dict[str, float]]) -> str:
    lines = [
        "| ops | `swapopt plan` (s) | lower bound alone (s) | bound on overhead |",
        "|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['ops']:,} | {row['command_s']:.2f} | {row['bound_s']:.2f} "
            f"| {100 * row['bound']:.1f} % |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ops", default="1000,4000,16000", help="comma-separated op counts (default: %(default)s)"
    )
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    args = parser.parse_args(argv)
    counts = [int(part) for part in args.ops.split(",") if part.strip()]
    with tempfile.TemporaryDirectory() as folder:
        rows = [run_case(n, Path(folder)) for n in counts]
    table = markdown_table(rows)
    print(table)
    if args.markdown is not None:
        args.markdown.write_text(table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
