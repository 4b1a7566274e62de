"""One-shot check of swapopt on a CUDA machine, summarised as one JSON object.

Sections, in order, each with its own deadline inside one overall time budget:

* ``cuda_tests``: the CUDA tests (``pytest -k cuda`` over the torch, activation and CLI
  suites) in a subprocess, with pass / fail / skip counts from its JUnit XML.
* ``bandwidth``: pinned host <-> device copies of one buffer (1 GiB), each direction alone
  and both at once on two streams, in GB/s (1e9 bytes per second).
* ``adamw``: plain ``torch.optim.AdamW`` against the same optimizer after ``swap_optimizer``
  (packed and per-tensor staging) on about a billion elements of state (500M fp32
  parameters), fed identical random gradients; parameters and state must be bitwise equal.
  It also times the steps against the link-bound time (state bytes each way over the
  bandwidth measured with both directions at once) and the fully serialised sum.
* ``offload``: an ``OffloadSession`` at 50 % of an MLP's natural activation peak (measured
  with ``torch.cuda.max_memory_allocated`` in a plain step): peak against budget, step time
  against plain, gradients bitwise equal to plain; then a swapped AdamW steps with the
  session and must drive the same runtime instance (one set of copy queues per device).

A section that fails is recorded with its traceback and the next one runs; a section that
no longer fits in the budget is recorded as skipped. Progress goes to stderr, one JSON
object to stdout (and to ``$OUT/gpu_check.json`` when ``$OUT`` is set). If a section hangs,
a watchdog prints what was gathered so far, dumps every thread's stack to stderr and exits
with status 3. Otherwise the exit status is 0 when every section ran and every check held.

``--cpu-smoke`` runs the same sections at tiny sizes on the CPU (the ``loopback-async``
runtime where it is registered, else ``loopback``), so the script itself can be tested
without a GPU; its timings mean nothing.

Run::

    python benchmarks/gpu_check.py                  # on the CUDA machine, about 2-3 minutes
    python benchmarks/gpu_check.py --cpu-smoke      # anywhere, a few seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_budget  # noqa: E402  (beside this script)

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
MiB = 2**20
TEST_PATHS = ("tests/torch_backend", "tests/activations", "tests/cli")
# Wanted seconds per section on the GPU; each is also cut by what is left of the budget.
SECTION_S = {
    "cuda_tests": 75.0,
    "bandwidth": 20.0,
    "adamw": 100.0,
    "offload": 40.0,
    "device_budget": 40.0,
}
# How long past the budget a hung section may run before the watchdog reports and exits.
WATCHDOG_GRACE_S = 20.0
MIN_S = {
    "cuda_tests": 10.0,
    "bandwidth": 3.0,
    "adamw": 20.0,
    "offload": 8.0,
    "device_budget": 10.0,
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    params: int  # AdamW parameters (state elements = 2x)
    tensors: int
    cols: int
    copy_bytes: int
    mlp_width: int
    mlp_batch: int
    mlp_layers: int
    min_offload_kib: float
    timed_steps: int
    replays: int


GPU_SIZES = Sizes(500_000_000, 40, 4096, 2**30, 4096, 8192, 8, 1024, 5, 4)
SMOKE_SIZES = Sizes(2_000_000, 8, 256, 8 * MiB, 256, 512, 4, 16, 2, 2)


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _import_swapopt() -> ModuleType:
    """Import ``swapopt_core``, falling back to the checkout this script lives in."""
    try:
        return importlib.import_module("swapopt_core")
    except ImportError:
        sys.path.insert(0, str(ROOT))
        return importlib.import_module("swapopt_core")


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None, so the JSON stays valid."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class Report:
    """The JSON summary being built; the watchdog may print it from another thread."""

    def __init__(self, meta: dict[str, Any], json_paths: list[Path]) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {"meta": meta, "sections": {}, "summary": {}}
        self.json_paths = json_paths
        self.emitted = False

    def emit(self) -> None:
        with self.lock:
            if self.emitted:
                return
            self.emitted = True
            text = json.dumps(_finite(self.data), indent=2, default=str, allow_nan=False)
        for path in self.json_paths:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text + "\n")
            except OSError as exc:
                log(f"could not write {path}: {exc}")
        print(text, flush=True)


class Machine:
    """The device under test and the operations whose meaning depends on it."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.cuda = not smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")

    def sync(self) -> None:
        if self.cuda:
            # Timings and comparisons must see every stream's work, the swap's copies included.
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _host_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------- cuda_tests


def _junit_counts(xml: Path) -> dict[str, Any]:
    """Outcome counts from a pytest JUnit XML file; collection errors counted apart."""
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    counts.update(collection_errors=0, test_cuda_py={"passed": 0, "total": 0}, failures=[])
    counts["junit_found"] = xml.exists()
    if not counts["junit_found"]:
        return counts
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors"}.get(child.tag, "skipped")
                message = (child.get("message") or "")[:300]
        if outcome == "errors" and "collection failure" in message:
            outcome = "collection_errors"
        counts[outcome] += 1
        if outcome in ("failed", "errors", "collection_errors"):
            counts["failures"].append(f"{case.get('classname')}::{case.get('name')}: {message}")
        if "test_cuda" in (case.get("classname") or ""):
            counts["test_cuda_py"]["total"] += 1
            counts["test_cuda_py"]["passed"] += outcome == "passed"
    return counts


def section_cuda_tests(m: Machine, sizes: Sizes, deadline: float, ctx: dict) -> dict:
    paths = ["tests/torch_backend/test_cuda.py"] if m.smoke else list(TEST_PATHS)
    timeout = max(1.0, deadline - time.monotonic())
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda"]
        cmd += ["--continue-on-collection-errors", "--junitxml", str(xml), *paths]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        log(f"cuda_tests: pytest {' '.join(cmd[4:])} (timeout {timeout:.0f} s)")
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            tail = exc.stdout or ""
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            raise TimeoutError(f"pytest ran past {timeout:.0f} s; output: {tail[-2000:]}") from None
        counts = _junit_counts(xml)
    in_file = counts["test_cuda_py"]
    # Collection errors (a module whose imports fail here) are listed, not counted as failed;
    # on a GPU every test of test_cuda.py must have run and passed, none skipped.
    ok = proc.returncode in (0, 1, 5) and counts["junit_found"]
    ok = ok and counts["failed"] == counts["errors"] == 0
    ok = ok and (m.smoke or 0 < in_file["passed"] == in_file["total"])
    return {
        "command": "pytest " + " ".join(cmd[4:]),
        "returncode": proc.returncode,
        **counts,
        "output_tail": "" if ok else (proc.stdout + proc.stderr)[-3000:],
        "ok": ok,
    }


# --------------------------------------------------------------------------- bandwidth


def _copy_once_cuda(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
    # The events' times are readable only once the copy behind them finished.
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _duplex_cuda(pairs: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]]) -> list[float]:
    """Start every copy at once, one per stream; seconds from the common start to each end."""
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    ends = []
    for dst, src, stream in pairs:
        end = torch.cuda.Event(enable_timing=True)
        # Every stream starts from the same recorded moment, so their copies overlap.
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        ends.append(end)
    # Elapsed times are readable only after both copies finished.
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for end in ends]


def _duplex_cpu(pairs: list[tuple[torch.Tensor, torch.Tensor, Any]]) -> list[float]:
    """CPU stand-in for two streams: one thread per copy, released together."""
    barrier = threading.Barrier(len(pairs) + 1)
    times = [0.0] * len(pairs)

    def run(i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        dst.copy_(src)
        times[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=run, args=(i, d, s)) for i, (d, s, _) in enumerate(pairs)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    return times


def section_bandwidth(m: Machine, sizes: Sizes, deadline: float, ctx: dict) -> dict:
    n = sizes.copy_bytes
    host_in = torch.empty(n, dtype=torch.uint8, pin_memory=m.cuda)
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=m.cuda)
    dev_in = torch.empty(n, dtype=torch.uint8, device=m.device)
    dev_out = torch.empty(n, dtype=torch.uint8, device=m.device)
    for buf, value in ((host_in, 1), (host_out, 2), (dev_in, 3), (dev_out, 4)):
        buf.fill_(value)  # touch every page once, so no copy pays first-touch faults
    if m.cuda:
        s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()
        # The copy streams must not start before the fills on the default stream finished.
        s_in.wait_stream(torch.cuda.current_stream())
        s_out.wait_stream(torch.cuda.current_stream())
        one = _copy_once_cuda
        duplex = _duplex_cuda
    else:
        s_in = s_out = None

        def one(dst: torch.Tensor, src: torch.Tensor, _stream: object) -> float:
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0

        duplex = _duplex_cpu
    h2d, d2h, both_in, both_out = [], [], [], []
    for rep in range(8):
        if rep >= 2 and time.monotonic() > deadline:
            break
        h2d.append(one(dev_in, host_in, s_in))
        d2h.append(one(host_out, dev_out, s_out))
        t_in, t_out = duplex([(dev_in, host_in, s_in), (host_out, dev_out, s_out)])
        both_in.append(t_in)
        both_out.append(t_out)
    # Medians; the first repetition includes one-off setup and is dropped when there are more.
    med = [_median(x[1:] if len(x) > 2 else x) for x in (h2d, d2h, both_in, both_out)]
    h2d_bw, d2h_bw, dup_in_bw, dup_out_bw = (n / t / GB for t in med)
    both_bw = 2 * n / max(med[2], med[3]) / GB
    result = {
        "bytes": n,
        "pinned": m.cuda,
        "repetitions": len(h2d),
        "h2d_gbps": h2d_bw,
        "d2h_gbps": d2h_bw,
        "duplex_h2d_gbps": dup_in_bw,
        "duplex_d2h_gbps": dup_out_bw,
        "duplex_total_gbps": both_bw,
        "duplex_total_over_sum_alone": both_bw / (h2d_bw + d2h_bw),
        "duplex_total_over_best_alone": both_bw / max(h2d_bw, d2h_bw),
    }
    ctx["bandwidth"] = result
    return result


# --------------------------------------------------------------------------- adamw


def _params(sizes: Sizes, n_params: int, device: torch.device) -> list[nn.Parameter]:
    rows = max(1, math.ceil(n_params / sizes.tensors / sizes.cols))
    gen = torch.Generator(device=device).manual_seed(0)
    return [
        nn.Parameter(torch.randn(rows, sizes.cols, generator=gen, device=device))
        for _ in range(sizes.tensors)
    ]


def _compare(plain: torch.optim.Optimizer, swapped: torch.optim.Optimizer) -> dict:
    """Bitwise comparison of parameters and every state entry; the first mismatches named."""
    mismatches: list[str] = []
    host_tensors = pinned = 0
    a_params = [p for g in plain.param_groups for p in g["params"]]
    b_params = [p for g in swapped.param_groups for p in g["params"]]
    for i, (a, b) in enumerate(zip(a_params, b_params, strict=True)):
        if not torch.equal(a, b):
            mismatches.append(f"param {i}")
        a_state, b_state = plain.state[a], swapped.state[b]
        if set(a_state) != set(b_state):
            mismatches.append(f"param {i}: state keys {sorted(a_state)} != {sorted(b_state)}")
        for key, value in a_state.items():
            other = b_state.get(key)
            if not torch.is_tensor(other) or not torch.is_tensor(value):
                if other != value:
                    mismatches.append(f"param {i} state {key}")
                continue
            if other.device != value.device:
                host_tensors += 1
                pinned += other.device.type == "cpu" and other.is_pinned()
            if not torch.equal(value, other.to(value.device)):
                mismatches.append(f"param {i} state {key}")
    return {
        "bitwise_equal": not mismatches,
        "mismatches": mismatches[:10],
        "mismatch_count": len(mismatches),
        "off_device_state_tensors": host_tensors,
        "pinned_state_tensors": pinned,
    }


def _adamw_size(m: Machine, n_params: int, notes: list[str]) -> int:
    """``n_params``, scaled down if host or device memory cannot hold the three runs."""
    available = _host_available_bytes()
    # Two swapped copies of the state live in host memory at once (packed and per-tensor).
    need = 2 * 8 * n_params + 2 * 2**30
    if available is not None and available < need:
        n_params = max(2**20, (available - 2 * 2**30) // 16)
        notes.append(f"host memory {available / GB:.1f} GB < {need / GB:.1f} GB: scaled down")
    if m.cuda:
        free, _total = torch.cuda.mem_get_info()
        # Plain holds params, grads and state (16 B/param); each swapped copy params, grads
        # and its staging and undo buffers (about 10 B/param with swap_times=8).
        per_param = 16 + 2 * 10
        if free < n_params * per_param * 1.2:
            n_params = int(free / per_param / 1.2)
            notes.append(f"device memory {free / GB:.1f} GB free: scaled down")
    return n_params


def _adamw_runs(m: Machine, sizes: Sizes, n_params: int, ctx: dict) -> dict[str, dict]:
    """Plain AdamW and two swapped copies (packed, per-tensor) of the same parameters."""
    swapopt = ctx["swapopt"]
    base = _params(sizes, n_params, m.device)
    runs: dict[str, dict] = {}
    for name, packed in (("plain", None), ("packed", True), ("per-tensor", False)):
        params = base if name == "plain" else [nn.Parameter(p.detach().clone()) for p in base]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)
        run = {"opt": opt, "params": params, "times": [], "install_s": 0.0, "error": None}
        if packed is not None:
            config = swapopt.SwapOptimizerConfig(
                swap_times=8, packed_swap=packed, runtime=ctx["swap_runtime"]
            )
            try:
                run["install_s"] = m.timed(lambda o=opt, c=config: swapopt.swap_optimizer(o, c))
            except Exception:  # noqa: BLE001 - recorded; the other mode still runs
                run["error"] = "install: " + traceback.format_exc()
        runs[name] = run
    return runs


def _adamw_steps(
    m: Machine, runs: dict[str, dict], timed_steps: int, deadline: float, ctx: dict
) -> int:
    """Steps every run in turn on the same random gradients; returns the steps done."""
    gen = torch.Generator(device=m.device)
    soft_deadline = deadline - 0.3 * (deadline - time.monotonic())  # keep time to compare
    done = 0
    for step in range(2 + timed_steps):
        if step > 2 and time.monotonic() > soft_deadline:
            break
        names = list(runs)
        for name in names[step % 3 :] + names[: step % 3]:  # rotate: no run always goes first
            run = runs[name]
            if run["error"]:
                continue
            gen.manual_seed(1000 + step)  # the same gradients for every run
            for p in run["params"]:
                p.grad.normal_(generator=gen)

            def do_step(run: dict = run, name: str = name) -> None:
                run["opt"].step()
                if name != "plain" and not m.cuda:
                    ctx["swapopt"].swap_stats(run["opt"])  # on CPU, count the step's copies too

            try:
                seconds = m.timed(do_step)
            except Exception:  # noqa: BLE001 - recorded; the other runs go on
                if name == "plain":
                    raise
                run["error"] = f"step {step + 1}: " + traceback.format_exc()
                continue
            if step >= 2:  # the first two steps create the state and warm the caches
                run["times"].append(seconds)
        done = step + 1
        log(f"adamw: step {done} done")
    return done


def _adamw_mode(runs: dict[str, dict], name: str, bw: dict | None, ctx: dict) -> dict:
    """One swapped run against the plain one: bitwise equality, step time, link bound."""
    run, plain = runs[name], runs["plain"]
    if run["error"]:
        return {"bitwise_equal": False, "error": run["error"]}
    stats = ctx["swapopt"].swap_stats(run["opt"])  # waits for the copies still pending
    entry: dict[str, Any] = _compare(plain["opt"], run["opt"])
    swapped_s, plain_s = _median(run["times"]), _median(plain["times"])
    entry.update(
        install_s=run["install_s"],
        step_ms=[t * 1e3 for t in run["times"]],
        swapped_over_plain=_ratio(swapped_s, plain_s),
        moved_per_step=_ratio(
            (stats.h2d_bytes + stats.d2h_bytes) / max(stats.steps, 1), 2 * stats.total_state_bytes
        ),
        peak_resident_over_total=_ratio(stats.peak_resident_state_bytes, stats.total_state_bytes),
        swap_stats=dataclasses.asdict(stats),
    )
    if bw is not None and swapped_s is not None and plain_s is not None:
        nbytes = stats.total_state_bytes
        # Both directions at once: the slower of the two, at the bandwidths measured together.
        link = max(nbytes / (bw["duplex_h2d_gbps"] * GB), nbytes / (bw["duplex_d2h_gbps"] * GB))
        serial = plain_s + nbytes / (bw["h2d_gbps"] * GB) + nbytes / (bw["d2h_gbps"] * GB)
        entry.update(
            plain_step_s=plain_s,
            swapped_step_s=swapped_s,
            link_bound_s=link,
            serialised_s=serial,
            swapped_over_link_bound=swapped_s / link,
            swapped_over_max_plain_link=swapped_s / max(plain_s, link),
            swapped_over_serialised=swapped_s / serial,
            visible_swap_over_link_bound=(swapped_s - plain_s) / link,
        )
    return entry


def section_adamw(m: Machine, sizes: Sizes, deadline: float, ctx: dict) -> dict:
    notes: list[str] = []
    runs = _adamw_runs(m, sizes, _adamw_size(m, sizes.params, notes), ctx)
    n_params = sum(p.numel() for p in runs["plain"]["params"])
    log(f"adamw: {n_params / 1e6:.0f}M parameters, {2 * n_params / 1e9:.2f}G state elements")
    steps = _adamw_steps(m, runs, sizes.timed_steps, deadline, ctx)
    if steps < 2 + sizes.timed_steps:
        notes.append(f"stopped after {steps} steps at the deadline")
    m.sync()
    result: dict[str, Any] = {
        "params": n_params,
        "state_elements": 2 * n_params,
        "state_bytes": 8 * n_params,
        "tensors": sizes.tensors,
        "swap_times": 8,
        "runtime": ctx["swap_runtime"],
        "steps": steps,
        "warmup_steps": 2,
        "plain_step_ms": [t * 1e3 for t in runs["plain"]["times"]],
        "notes": notes,
        "modes": {},
    }
    for name in ("packed", "per-tensor"):
        entry = _adamw_mode(runs, name, ctx.get("bandwidth"), ctx)
        result["modes"][name] = entry
        log(f"adamw {name}: bitwise_equal={entry['bitwise_equal']}")
    result["bitwise_equal"] = all(e["bitwise_equal"] for e in result["modes"].values())
    runs.clear()
    return result


# --------------------------------------------------------------------------- offload


def _mlp(sizes: Sizes, device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # every copy of the model starts from the same weights
    blocks = [
        nn.Sequential(nn.Linear(sizes.mlp_width, sizes.mlp_width), nn.GELU())
        for _ in range(sizes.mlp_layers)
    ]
    return nn.Sequential(*blocks).to(device)


def section_offload(m: Machine, sizes: Sizes, deadline: float, ctx: dict) -> dict:
    swapopt = ctx["swapopt"]
    reference, offloaded = _mlp(sizes, m.device), _mlp(sizes, m.device)
    gen = torch.Generator(device=m.device).manual_seed(0)
    x = torch.randn(sizes.mlp_batch, sizes.mlp_width, generator=gen, device=m.device)

    def step(model: nn.Module, scale: float) -> None:
        model(x * scale).square().mean().backward()

    def measured(model: nn.Module, fn: Callable[[], object]) -> tuple[float, int | None]:
        """Seconds of ``fn`` and, on CUDA, its allocation peak above what was allocated before.

        The model's gradients are dropped first, so the step creates them (as it does in a
        session, which tracks them) and the peak includes them.
        """
        model.zero_grad(set_to_none=True)
        if not m.cuda:
            return m.timed(fn), None
        m.sync()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        seconds = m.timed(fn)
        return seconds, torch.cuda.max_memory_allocated() - before

    runtime = ctx["offload_runtime"]
    measured(reference, lambda: step(reference, 1.0))  # kernels chosen, caches warm
    if m.cuda:
        _, natural = measured(reference, lambda: step(reference, 1.0))
        peak_source = "torch.cuda.max_memory_allocated"
    else:
        # No allocator statistics on CPU: a session whose budget never binds reports the peak.
        probe = swapopt.OffloadSession(
            swapopt.OffloadConfig(max_resident_activation_mb=2**20, runtime=runtime)
        )
        with probe:
            step(_mlp(sizes, m.device), 1.0)
        natural = probe.stats().peak_resident_activation_bytes
        peak_source = "OffloadStats.peak_resident_activation_bytes"
    budget_mb = 0.5 * natural / MiB
    config = swapopt.OffloadConfig(
        max_resident_activation_mb=budget_mb, runtime=runtime, min_offload_kib=sizes.min_offload_kib
    )
    session = swapopt.OffloadSession(config)
    log(f"offload: natural peak {natural / MiB:.0f} MiB, budget {budget_mb:.0f} MiB ({runtime})")

    def in_session(scale: float) -> None:
        with session:
            step(offloaded, scale)

    plain_times, session_times, peaks, tracked_peaks, equal = [], [], [], [], []
    for i in range(1 + sizes.replays):
        if i >= 2 and time.monotonic() > deadline:
            break
        t_plain, _ = measured(reference, lambda s=i + 1.0: step(reference, s))
        t_session, peak = measured(offloaded, lambda s=i + 1.0: in_session(s))
        same = all(
            torch.equal(a.grad, b.grad)
            for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True)
        )
        equal.append(same)
        if i > 0:  # the first entry is the warmup, which traces instead of replaying
            plain_times.append(t_plain)
            session_times.append(t_session)
            tracked_peaks.append(session.stats().last_peak_resident_activation_bytes)
            peaks.append(peak if peak is not None else tracked_peaks[-1])
        log(f"offload: step {i + 1} grads bitwise equal={same}")
    stats = session.stats()
    peak = max(peaks) if peaks else None
    return {
        "runtime": runtime,
        "shares_swap_runtime": _shares_swap_runtime(offloaded, session, step, ctx),
        "model": f"{sizes.mlp_layers} x (Linear({sizes.mlp_width}), GELU), batch {sizes.mlp_batch}",
        "peak_source": peak_source,
        "natural_peak_bytes": natural,
        "budget_bytes": config.budget_bytes,
        "replay_peak_bytes": peak,
        "peak_over_budget": _ratio(peak, config.budget_bytes),
        "tracked_peak_over_budget": _ratio(max(tracked_peaks, default=None), config.budget_bytes),
        "plain_step_ms": [t * 1e3 for t in plain_times],
        "session_step_ms": [t * 1e3 for t in session_times],
        "step_over_plain": _ratio(_median(session_times), _median(plain_times)),
        "grads_bitwise_equal": bool(equal) and all(equal),
        "grads_equal_per_step": equal,
        "stats": dataclasses.asdict(stats),
    }


def _shares_swap_runtime(model: nn.Module, session: Any, step: Callable, ctx: dict) -> bool:
    """Whether a swapped AdamW on ``model`` and ``session`` drive one runtime instance."""
    swapopt = ctx["swapopt"]
    opt = torch.optim.AdamW(model.parameters())
    config = swapopt.SwapOptimizerConfig(runtime=ctx["swap_runtime"])
    swapopt.swap_optimizer(opt, config)
    model.zero_grad(set_to_none=True)
    with session:
        step(model, 1.0)
    opt.step()
    engine = importlib.import_module("swapopt_core._swap.engine").engine_of(opt)
    shared = engine is not None and engine.runtime is session._executor.runtime
    log(f"offload: the optimizer swap shares the session's runtime instance: {shared}")
    swapopt.unswap_optimizer(opt)
    return bool(shared)


# --------------------------------------------------------------------------- driver

SECTIONS: dict[str, Callable[[Machine, Sizes, float, dict], dict]] = {
    "cuda_tests": section_cuda_tests,
    "bandwidth": section_bandwidth,
    "adamw": section_adamw,
    "offload": section_offload,
    "device_budget": gpu_budget.section_device_budget,
}


def _runtimes(swapopt: ModuleType, smoke: bool) -> tuple[str, str]:
    """The optimizer-swap and activation-offload runtimes: ``auto``/``cuda`` on the GPU."""
    if not smoke:
        return "auto", "cuda"
    swap = "loopback-async" if "loopback-async" in swapopt.runtime_names("torch") else "loopback"
    try:
        swapopt.OffloadConfig(runtime="loopback-async")
        offload = "loopback-async"
    except ValueError:
        offload = "loopback"
    return swap, offload


def _summary(sections: dict[str, dict]) -> dict[str, Any]:
    def get(name: str, *keys: str) -> Any:
        value: Any = sections.get(name, {}).get("result")
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    modes = get("adamw", "modes") or {}
    ran = {k: v for k, v in sections.items() if v["status"] != "not_requested"}
    summary = {
        "sections_ok": [k for k, v in ran.items() if v["status"] == "ok"],
        "sections_not_ok": {k: v["status"] for k, v in ran.items() if v["status"] != "ok"},
        "cuda_tests_ok": get("cuda_tests", "ok"),
        "cuda_tests_passed": get("cuda_tests", "passed"),
        "cuda_tests_failed": get("cuda_tests", "failed"),
        "adamw_params": get("adamw", "params"),
        "adamw_bitwise_equal": {k: v.get("bitwise_equal") for k, v in modes.items()},
        "h2d_gbps": get("bandwidth", "h2d_gbps"),
        "d2h_gbps": get("bandwidth", "d2h_gbps"),
        "duplex_total_gbps": get("bandwidth", "duplex_total_gbps"),
        "swapped_over_plain": {k: v.get("swapped_over_plain") for k, v in modes.items()},
        "swapped_over_link_bound": {k: v.get("swapped_over_link_bound") for k, v in modes.items()},
        "swapped_over_max_plain_link": {
            k: v.get("swapped_over_max_plain_link") for k, v in modes.items()
        },
        "offload_peak_over_budget": get("offload", "peak_over_budget"),
        "offload_step_over_plain": get("offload", "step_over_plain"),
        "offload_grads_bitwise_equal": get("offload", "grads_bitwise_equal"),
        "offload_shares_swap_runtime": get("offload", "shares_swap_runtime"),
        "budget_peak_over_target": get("device_budget", "peak_over_target"),
        "budget_step_over_plain": get("device_budget", "step_over_plain"),
        "budget_step_over_planned": get("device_budget", "step_over_planned"),
        "budget_params_bitwise_equal": get("device_budget", "params_bitwise_equal"),
    }
    # Each check that ran must hold; a section left out with --only checks nothing.
    checks = {
        "cuda_tests": summary["cuda_tests_ok"],
        "adamw": get("adamw", "bitwise_equal"),
        "offload": summary["offload_grads_bitwise_equal"]
        and summary["offload_shares_swap_runtime"],
        "device_budget": summary["budget_params_bitwise_equal"],
    }
    summary["failed_checks"] = [k for k, v in checks.items() if k in ran and v is not True]
    summary["ok"] = not summary["sections_not_ok"] and not summary["failed_checks"]
    return summary


def _watchdog(report: Report, at: float, current: dict[str, str]) -> threading.Timer:
    """Print what was gathered if the run hangs past the budget, then exit."""

    def fire() -> None:
        name = current.get("name")
        with report.lock:
            if name and report.data["sections"].get(name, {}).get("status") == "running":
                report.data["sections"][name]["status"] = "timed_out"
            report.data["summary"] = {"ok": False, "watchdog": f"section {name!r} hung"}
        log(f"watchdog: section {name!r} still running past the budget; stacks follow")
        faulthandler.dump_traceback(file=sys.stderr)
        report.emit()
        os._exit(3)

    timer = threading.Timer(max(0.0, at - time.monotonic()), fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--budget-s", type=float, default=None, help="overall seconds (240)")
    parser.add_argument("--params", type=float, default=None, help="AdamW parameters (5e8)")
    parser.add_argument("--only", default="", help="comma-separated sections to run")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--swap-runtime", default=None, help="optimizer runtime (auto)")
    parser.add_argument("--offload-runtime", default=None, help="OffloadConfig.runtime (cuda)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    smoke = args.cpu_smoke
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - set(SECTIONS)
    if unknown:
        parser.error(f"--only names unknown sections {sorted(unknown)}; use {list(SECTIONS)}")
    if not smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --cpu-smoke to run on the CPU", file=sys.stderr)
        return 2
    sizes = SMOKE_SIZES if smoke else GPU_SIZES
    if args.params:
        sizes = dataclasses.replace(sizes, params=int(args.params))
    budget_s = args.budget_s or (60.0 if smoke else 240.0)
    threads = torch.get_num_threads()
    if smoke:
        torch.set_num_threads(1)  # gentle on a shared machine; put back before returning
    try:
        return _run(args, only, sizes, budget_s, started)
    finally:
        torch.set_num_threads(threads)


def _run(
    args: argparse.Namespace, only: set[str], sizes: Sizes, budget_s: float, started: float
) -> int:
    """Run the sections in order under the budget; print and write the JSON summary."""
    smoke = args.cpu_smoke
    scale = 0.25 if smoke else 1.0  # the smoke sizes need a quarter of the time, at most
    end = started + budget_s
    swapopt = _import_swapopt()
    swap_runtime, offload_runtime = _runtimes(swapopt, smoke)
    swap_runtime = args.swap_runtime or swap_runtime
    offload_runtime = args.offload_runtime or offload_runtime
    meta = {
        "mode": "cpu-smoke" if smoke else "cuda",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if not smoke else platform.processor() or "cpu",
        "python": platform.python_version(),
        "swapopt_path": str(Path(swapopt.__file__).parent),
        "swap_runtime": swap_runtime,
        "offload_runtime": offload_runtime,
        "budget_s": budget_s,
        "sizes": dataclasses.asdict(sizes),
        "host_available_bytes": _host_available_bytes(),
    }
    out = os.environ.get("OUT")
    paths = [p for p in (args.json, Path(out) / "gpu_check.json" if out else None) if p]
    report = Report(meta, paths)
    current: dict[str, str] = {}
    watchdog = _watchdog(report, end + WATCHDOG_GRACE_S, current)
    try:
        m = Machine(smoke)
        ctx: dict[str, Any] = {
            "swapopt": swapopt,
            "swap_runtime": swap_runtime,
            "offload_runtime": offload_runtime,
        }
        sections = report.data["sections"]
        for name, fn in SECTIONS.items():
            left = end - time.monotonic()
            if only and name not in only:
                sections[name] = {"status": "not_requested"}
                continue
            if left < MIN_S[name] * scale:
                sections[name] = {"status": "skipped", "reason": f"out of time ({left:.0f} s left)"}
                log(f"{name}: skipped, {left:.0f} s left")
                continue
            deadline = time.monotonic() + min(SECTION_S[name] * scale, left)
            with report.lock:
                sections[name] = {"status": "running"}
                current["name"] = name
            log(f"{name}: start ({deadline - time.monotonic():.0f} s)")
            t0 = time.monotonic()
            try:
                result = fn(m, sizes, deadline, ctx)
                entry = {"status": "ok", "result": result}
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, the rest runs
                log(f"{name}: FAILED: {exc!r}")
                entry = {
                    "status": "failed",
                    "error": repr(exc),
                    "traceback": traceback.format_exc(),
                }
            entry["seconds"] = time.monotonic() - t0
            with report.lock:
                sections[name] = entry
                current.pop("name", None)
            m.release()
            log(f"{name}: {entry['status']} in {entry['seconds']:.1f} s")
    finally:
        # An in-process caller (the tests) must never meet a watchdog left running.
        watchdog.cancel()
    with report.lock:
        report.data["summary"] = _summary(sections)
        report.data["meta"]["total_s"] = time.monotonic() - started
    report.emit()
    return 0 if report.data["summary"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
