"""One-shot check of swapopt on a CUDA machine, summarised as one JSON object.

Sections, in order, each with its own deadline inside one overall time budget:

* ``cuda_tests``: the CUDA tests (``pytest -k cuda`` over the torch, activation and CLI
  suites) in a subprocess, with pass / fail / skip counts from its JUnit XML.
* ``bandwidth``: pinned host <-> device copies of one buffer (1 GiB), each direction alone
  and both at once on two streams, in GB/s (1e9 bytes per second); the same copies from
  pageable memory (``torch.empty``, not pinned) for reference; and the swap runtime's own
  figures (``measure_bandwidth`` at its 32 MiB default, as the planner uses them, and at
  1 GiB; ``measure_duplex_bandwidth`` where the runtime has it) on the buffers swapopt
  really uses (the runtime of a swapped optimizer).
* ``adamw``: plain ``torch.optim.AdamW`` against the same optimizer after ``swap_optimizer``
  (``swap_times=16``, packed and per-tensor staging) on about a billion elements of state
  (500M fp32 parameters; ``--params 1e9`` for 1B parameters), fed identical random
  gradients; parameters and state must be bitwise equal. It times the steps against the
  link-bound time (state bytes each way over the bandwidth measured with both directions at
  once) and the fully serialised sum, and measures the device memory of a swapped step:
  ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` around ``step()`` less what
  was allocated / reserved before it (peak statistics reset first; the last step starts from
  an emptied cache), against 3/``swap_times`` of the state, next to the swap's own
  ``peak_resident_state_bytes``, ``peak_reserved_state_bytes`` and
  ``pinned_fallback_buffers``; and allocated, reserved and pinned bytes after step 2 and
  after the last timed step (they must not grow).
* ``offload``: an ``OffloadSession`` at 50 % of an MLP's natural activation peak (measured
  with ``torch.cuda.max_memory_allocated`` in a plain step): peak against budget, step time
  against plain, gradients bitwise equal to plain; per-block activation checkpointing
  (``torch.utils.checkpoint``) of the same MLP as a baseline (peak and step time against
  plain); then a swapped AdamW steps with the session and must drive the same runtime
  instance.
* ``device_budget``: ``OffloadSession(config, optimizer=opt)`` under a whole-step
  ``device_budget_mb`` at 60 % of a plain step's peak (``gpu_budget.py``): the session
  meter's peak, and on CUDA the allocator's own allocated and reserved peaks, against it.
* ``profile``: a ``torch.profiler`` trace (CPU and CUDA activities, Python stacks) of a few
  steps of the MLP with a swapped AdamW (``prefetch_during_backward=True``) and an
  ``OffloadSession`` in the same step: the share of copy time that runs while compute
  kernels run, and the host-to-device copies of activations (page-ins) and of the
  optimizer's prefetch told apart by the Python stack that issued them, with the streams
  each ran on and how long they waited. The trace is saved as
  ``$OUT/gpu_check_trace.json.gz``. On the CPU only the CPU profiler's counts are reported.
* ``drop_while_queued``: a swapped AdamW is dropped (``del``, ``gc.collect()``) right after
  ``step()``, while its copies may still be queued; fresh host and device memory is then
  filled and, after a synchronize, it, a separate reference tensor and the parameters must
  hold what they should, with no CUDA error.
* ``cuda_sanitizer``: the optimizer CUDA tests (``pytest -k cuda tests/torch_backend``)
  again under ``TORCH_CUDA_SANITIZER=1``, counted like ``cuda_tests``.

Every budget, pinned, reserved and leak figure is asserted in ``summary.checks`` (each
``passed``, ``failed`` or ``skipped`` with its value, limit and tolerance); the lists
``failed_checks`` and ``skipped_checks`` name them. A section that fails is recorded with
its traceback and the next one runs; a section that no longer fits in the budget is
recorded as skipped; a section that needs CUDA is ``not_applicable`` on ``--cpu-smoke``.
Progress goes to stderr, one JSON object to stdout (and to ``$OUT/gpu_check.json`` when
``$OUT`` is set). If a section hangs, a watchdog prints what was gathered so far, dumps
every thread's stack to stderr and exits with status 3. Otherwise the exit status is 0
when every section ran (or does not apply) and no check failed, 1 otherwise, and 2 when
the run cannot start: no CUDA device, or ``import swapopt_core`` failing (a missing
``pluggy``, say); the JSON then says why, and ``meta.prerequisites`` lists what is missing
(a CUDA build of torch, ``pluggy``, ``pytest``, ``hypothesis``). The script installs
nothing.

``--cpu-smoke`` runs the same sections at tiny sizes on the CPU (the ``loopback-async``
runtime where it is registered, else ``loopback``), so the script itself can be tested
without a GPU; its timings mean nothing, and checks that need CUDA are listed as skipped.

Run::

    python benchmarks/gpu_check.py                  # on the CUDA machine, at most ~8 minutes
    python benchmarks/gpu_check.py --params 1e9     # 1B parameters (about 40 GB of device
                                                    # and 18 GB of host memory; ~1 min more)
    python benchmarks/gpu_check.py --only adamw,profile   # some sections only
    python benchmarks/gpu_check.py --cpu-smoke      # anywhere, a few tens of seconds

The default budget is 450 s for the sections (CUDA initialisation included), plus 20 s of
watchdog grace: under 8 minutes with the imports, inside a 10-minute device call.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import faulthandler
import functools
import gc
import gzip
import importlib
import importlib.util
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
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_budget  # noqa: E402  (beside this script)

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
MiB = 2**20
TEST_PATHS = ("tests/torch_backend", "tests/activations", "tests/cli")
#: What the sanitizer section runs: the optimizer's CUDA tests.
SANITIZER_PATHS = ("tests/torch_backend",)
# Wanted seconds per section on the GPU; each is also cut by what is left of the budget.
SECTION_S = {
    "cuda_tests": 75.0,
    "bandwidth": 25.0,
    "adamw": 100.0,
    "offload": 50.0,
    "device_budget": 40.0,
    "profile": 45.0,
    "drop_while_queued": 20.0,
    "cuda_sanitizer": 90.0,
}
# How long past the budget a hung section may run before the watchdog reports and exits.
WATCHDOG_GRACE_S = 20.0
MIN_S = {
    "cuda_tests": 10.0,
    "bandwidth": 3.0,
    "adamw": 20.0,
    "offload": 8.0,
    "device_budget": 10.0,
    "profile": 10.0,
    "drop_while_queued": 5.0,
    "cuda_sanitizer": 20.0,
}
#: Seconds for all sections on the GPU (CUDA initialisation included), and on --cpu-smoke.
GPU_BUDGET_S = 450.0
SMOKE_BUDGET_S = 60.0
#: Sections that need CUDA: ``not_applicable`` on --cpu-smoke, not counted as failures.
CUDA_ONLY = {"cuda_sanitizer": "not applicable on cpu: the CUDA sanitizer needs CUDA"}
#: ``swap_times`` of the swapped AdamW runs (the library's default).
SWAP_TIMES = 16
#: A swapped step stages at most three batches at once (3 / swap_times of the state); the
#: checks allow four, the allocator's blocks not yet reusable included.
RESERVED_LIMIT_BATCHES = 4
#: Allowed excess of the offload section's measured peak over its activation budget: the
#: peak counts the step's gradients and transient buffers besides the tracked activations.
OFFLOAD_PEAK_TOLERANCE = 0.05
#: Allowed excess of the device-budget run's reserved peak over its target (the allocator
#: rounds blocks up and reserves whole segments).
RESERVED_TARGET_TOLERANCE = 0.05
#: Growth of allocated or reserved device bytes between step 2 and the last step that still
#: counts as flat (one small-block segment of the caching allocator); pinned bytes: none.
FLAT_TOLERANCE_BYTES = 2 * MiB


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
    drop_params: int  # parameters of the optimizer dropped while its copies are queued
    profile_steps: int  # steps in the profiler trace


GPU_SIZES = Sizes(500_000_000, 32, 4096, 2**30, 4096, 8192, 8, 1024, 5, 4, 64 * 2**20, 3)
SMOKE_SIZES = Sizes(2_000_000, 16, 256, 8 * MiB, 256, 512, 4, 16, 2, 2, 2**18, 2)


class SectionNotApplicable(Exception):
    """Raised by a section that cannot run here; recorded as ``not_applicable``."""


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


def _pytest_cuda(
    m: Machine, paths: list[str], deadline: float, extra_env: dict[str, str] | None = None
) -> dict:
    """``pytest -k cuda`` over ``paths`` in a subprocess, counted from its JUnit XML."""
    timeout = max(1.0, deadline - time.monotonic())
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda"]
        cmd += ["--continue-on-collection-errors", "--junitxml", str(xml), *paths]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.update(extra_env or {})
        shown = " ".join(f"{k}={v}" for k, v in (extra_env or {}).items())
        log(f"{shown} pytest {' '.join(cmd[4:])} (timeout {timeout:.0f} s)".strip())
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
        "command": (shown + " pytest " + " ".join(cmd[4:])).strip(),
        "returncode": proc.returncode,
        **counts,
        "output_tail": "" if ok else (proc.stdout + proc.stderr)[-3000:],
        "ok": ok,
    }


def section_cuda_tests(m: Machine, sizes: Sizes, deadline: float, ctx: dict) -> dict:
    paths = ["tests/torch_backend/test_cuda.py"] if m.smoke else list(TEST_PATHS)
    return _pytest_cuda(m, paths, deadline)


def section_cuda_sanitizer(m: Machine, sizes: Sizes, deadline: float, ctx: dict) -> dict:
    """The optimizer CUDA tests under ``TORCH_CUDA_SANITIZER=1`` (stream-ordering races)."""
    if not m.cuda:
        raise SectionNotApplicable(CUDA_ONLY["cuda_sanitizer"])
    return _pytest_cuda(m, list(SANITIZER_PATHS), deadline, {"TORCH_CUDA_SANITIZER": "1"})


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


def _engine_of(optimizer: object) -> Any:
    return importlib.import_module("swapopt_core._swap.engine").engine_of(optimizer)


def _swapped_probe(m: Machine, ctx: dict) -> torch.optim.Optimizer:
    """A one-tensor AdamW, swapped and stepped once: its engine holds the runtime swapopt
    really uses on this device (the shared instance, with its own host buffers)."""
    swapopt = ctx["swapopt"]
    param = nn.Parameter(torch.zeros(4096, device=m.device))
    param.grad = torch.zeros_like(param)
    opt = torch.optim.AdamW([param])
    swapopt.swap_optimizer(opt, swapopt.SwapOptimizerConfig(runtime=ctx["swap_runtime"]))
    opt.step()
    return opt


def _runtime_bandwidth(m: Machine, copy_bytes: int, ctx: dict) -> dict:
    """The swap runtime's own bandwidth figures, through its own buffers and copies."""
    probe = _swapped_probe(m, ctx)
    runtime = _engine_of(probe).runtime
    result: dict[str, Any] = {"runtime": runtime.name, "class": type(runtime).__qualname__}
    d2h, h2d = runtime.measure_bandwidth()
    result.update(nbytes=32 * MiB, d2h_gbps=d2h, h2d_gbps=h2d)
    d2h, h2d = runtime.measure_bandwidth(nbytes=copy_bytes, repeats=3)
    result.update(large_nbytes=copy_bytes, large_d2h_gbps=d2h, large_h2d_gbps=h2d)
    duplex = getattr(runtime, "measure_duplex_bandwidth", None)
    if callable(duplex):
        d2h, h2d = duplex()
        result.update(duplex_d2h_gbps=d2h, duplex_h2d_gbps=h2d, duplex_total_gbps=d2h + h2d)
    else:
        result["duplex"] = "absent: the runtime has no measure_duplex_bandwidth"
    ctx["swapopt"].unswap_optimizer(probe)
    return result


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
    del host_in, host_out
    # Pageable reference: the same copies from and to ``torch.empty`` host memory, timed on
    # the wall clock (the driver stages pageable memory on the host, outside stream events).
    pageable = torch.empty(n, dtype=torch.uint8).fill_(5)
    page_in, page_out = [], []
    for rep in range(4):
        if rep >= 2 and time.monotonic() > deadline:
            break
        page_in.append(m.timed(lambda d=dev_in, h=pageable: d.copy_(h)))
        page_out.append(m.timed(lambda d=dev_out, h=pageable: h.copy_(d)))
    page_med = [_median(x[1:] if len(x) > 2 else x) for x in (page_in, page_out)]
    del pageable, dev_in, dev_out
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
        "pageable_h2d_gbps": n / page_med[0] / GB,
        "pageable_d2h_gbps": n / page_med[1] / GB,
        "pinned_over_pageable_h2d": page_med[0] / med[0],
        "pinned_over_pageable_d2h": page_med[1] / med[1],
    }
    m.release()
    runtime = _runtime_bandwidth(m, n, ctx)
    result["runtime"] = runtime
    result["runtime_h2d_over_pinned_1gib"] = _ratio(runtime["h2d_gbps"], h2d_bw)
    result["runtime_d2h_over_pinned_1gib"] = _ratio(runtime["d2h_gbps"], d2h_bw)
    log(
        f"bandwidth: pinned {h2d_bw:.1f}/{d2h_bw:.1f} GB/s, pageable "
        f"{result['pageable_h2d_gbps']:.1f}/{result['pageable_d2h_gbps']:.1f} GB/s, runtime "
        f"{runtime['h2d_gbps']:.1f}/{runtime['d2h_gbps']:.1f} GB/s (h2d/d2h)"
    )
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
        # Plain holds params, grads and state (16 B/param); each swapped copy params, grads,
        # its staging and the step's temporaries (under 10 B/param with swap_times=16).
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
        run["memory"] = []
        if packed is not None:
            config = swapopt.SwapOptimizerConfig(
                swap_times=SWAP_TIMES, packed_swap=packed, runtime=ctx["swap_runtime"]
            )
            try:
                run["install_s"] = m.timed(lambda o=opt, c=config: swapopt.swap_optimizer(o, c))
            except Exception:  # noqa: BLE001 - recorded; the other mode still runs
                run["error"] = "install: " + traceback.format_exc()
        runs[name] = run
    return runs


def _device_bytes() -> tuple[int, int]:
    """Bytes the caching allocator has allocated and reserved on the current device."""
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _snapshot(m: Machine, runs: dict[str, dict], ctx: dict) -> dict[str, Any]:
    """Device bytes allocated and reserved (CUDA) and each swapped run's host bytes, now."""
    snap: dict[str, Any] = {}
    if m.cuda:
        m.sync()
        snap["allocated_bytes"], snap["reserved_bytes"] = _device_bytes()
    for name, run in runs.items():
        if name != "plain" and not run["error"]:
            stats = ctx["swapopt"].swap_stats(run["opt"])  # waits for the pending copies
            snap[name] = {
                "pinned_host_bytes": stats.pinned_host_bytes,
                "host_state_bytes": stats.host_state_bytes,
                "resident_state_bytes": stats.resident_state_bytes,
            }
    return snap


def _adamw_steps(
    m: Machine, runs: dict[str, dict], timed_steps: int, deadline: float, ctx: dict
) -> tuple[int, dict[str, Any]]:
    """Steps every run in turn on the same random gradients.

    Two warmup steps, then up to ``timed_steps`` timed ones, then one more from an emptied
    cache (on CUDA), whose reserved growth is what the step itself needs. Returns the steps
    done and the snapshots taken after step 2 and after the last timed step.
    """
    gen = torch.Generator(device=m.device)
    soft_deadline = deadline - 0.3 * (deadline - time.monotonic())  # keep time to compare

    def one_step(step: int, clean: bool) -> None:
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

            if m.cuda:
                m.sync()
                if clean:
                    torch.cuda.empty_cache()  # reserved before = allocated, give or take
                allocated, reserved = _device_bytes()
                torch.cuda.reset_peak_memory_stats()
            try:
                seconds = m.timed(do_step)
            except Exception:  # noqa: BLE001 - recorded; the other runs go on
                if name == "plain":
                    raise
                run["error"] = f"step {step + 1}: " + traceback.format_exc()
                continue
            if m.cuda:
                run["memory"].append(
                    {
                        "step": step + 1,
                        "from_empty_cache": clean,
                        "allocated_during_step": torch.cuda.max_memory_allocated() - allocated,
                        "reserved_during_step": torch.cuda.max_memory_reserved() - reserved,
                    }
                )
            if step >= 2 and not clean:  # the first two create the state and warm the caches
                run["times"].append(seconds)

    snapshots: dict[str, Any] = {}
    done = 0
    for step in range(2 + timed_steps):
        if step > 2 and time.monotonic() > soft_deadline:
            break
        one_step(step, clean=False)
        done = step + 1
        if done == 2:
            snapshots["after_step_2"] = _snapshot(m, runs, ctx)
        log(f"adamw: step {done} done")
    snapshots["after_last_timed_step"] = _snapshot(m, runs, ctx)
    snapshots["last_timed_step"] = done
    one_step(done, clean=True)
    done += 1
    log(f"adamw: step {done} (from an emptied cache) done")
    return done, snapshots


def _growth(snapshots: dict[str, Any], *keys: str) -> int | None:
    """How much a snapshot figure grew from after step 2 to after the last timed step."""
    values = []
    for when in ("after_step_2", "after_last_timed_step"):
        value: Any = snapshots.get(when)
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        values.append(value)
    first, last = values
    return None if first is None or last is None else last - first


def _adamw_mode(
    runs: dict[str, dict], name: str, bw: dict | None, snapshots: dict[str, Any], ctx: dict
) -> dict:
    """One swapped run against the plain one: bitwise equality, step time, link bound,
    device memory during the step against the state it stages."""
    run, plain = runs[name], runs["plain"]
    if run["error"]:
        return {"bitwise_equal": False, "error": run["error"]}
    stats = ctx["swapopt"].swap_stats(run["opt"])  # waits for the copies still pending
    entry: dict[str, Any] = _compare(plain["opt"], run["opt"])
    swapped_s, plain_s = _median(run["times"]), _median(plain["times"])
    state = stats.total_state_bytes
    clean = [r for r in run["memory"] if r["from_empty_cache"]]
    timed = [r for r in run["memory"] if not r["from_empty_cache"] and r["step"] > 2]
    allocated = clean[-1]["allocated_during_step"] if clean else None
    reserved = clean[-1]["reserved_during_step"] if clean else None
    # New SwapStats fields, read so that the script still runs on a tree without them.
    peak_reserved = getattr(stats, "peak_reserved_state_bytes", None)
    entry.update(
        install_s=run["install_s"],
        step_ms=[t * 1e3 for t in run["times"]],
        swapped_over_plain=_ratio(swapped_s, plain_s),
        moved_per_step=_ratio(
            (stats.h2d_bytes + stats.d2h_bytes) / max(stats.steps, 1), 2 * stats.total_state_bytes
        ),
        peak_resident_over_total=_ratio(stats.peak_resident_state_bytes, stats.total_state_bytes),
        state_bytes=state,
        target_over_state=3 / SWAP_TIMES,
        target_bytes=state * 3 // SWAP_TIMES,
        limit_over_state=RESERVED_LIMIT_BATCHES / SWAP_TIMES,
        memory_source=(
            "torch.cuda.max_memory_allocated / max_memory_reserved around step(), less the "
            "bytes allocated / reserved before it; the last step starts from an emptied cache"
            if clean
            else "no allocator statistics on cpu"
        ),
        allocated_during_step=allocated,
        reserved_during_step=reserved,
        allocated_during_step_over_state=_ratio(allocated, state),
        reserved_during_step_over_state=_ratio(reserved, state),
        allocated_during_step_over_target=_ratio(allocated, state * 3 / SWAP_TIMES),
        reserved_during_step_over_target=_ratio(reserved, state * 3 / SWAP_TIMES),
        max_allocated_during_timed_steps=max(
            (r["allocated_during_step"] for r in timed), default=None
        ),
        max_reserved_during_timed_steps=max(
            (r["reserved_during_step"] for r in timed), default=None
        ),
        memory_per_step=run["memory"],
        peak_resident_state_bytes=stats.peak_resident_state_bytes,
        peak_reserved_state_bytes=peak_reserved,
        peak_reserved_state_over_state=_ratio(peak_reserved, state),
        pinned_fallback_buffers=getattr(stats, "pinned_fallback_buffers", None),
        pinned_host_bytes=stats.pinned_host_bytes,
        pinned_host_growth=_growth(snapshots, name, "pinned_host_bytes"),
        host_state_growth=_growth(snapshots, name, "host_state_bytes"),
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
    steps, snapshots = _adamw_steps(m, runs, sizes.timed_steps, deadline, ctx)
    if steps < 3 + sizes.timed_steps:
        notes.append(f"stopped after {steps} steps at the deadline")
    m.sync()
    result: dict[str, Any] = {
        "params": n_params,
        "state_elements": 2 * n_params,
        "state_bytes": 8 * n_params,
        "tensors": sizes.tensors,
        "swap_times": SWAP_TIMES,
        "runtime": ctx["swap_runtime"],
        "steps": steps,
        "warmup_steps": 2,
        "plain_step_ms": [t * 1e3 for t in runs["plain"]["times"]],
        "plain_memory_per_step": runs["plain"]["memory"],
        "snapshots": snapshots,
        # Device-wide, all three runs: flat once the state exists and the caches are warm.
        "allocated_growth": _growth(snapshots, "allocated_bytes"),
        "reserved_growth": _growth(snapshots, "reserved_bytes"),
        "flat_tolerance_bytes": FLAT_TOLERANCE_BYTES,
        "notes": notes,
        "modes": {},
    }
    for name in ("packed", "per-tensor"):
        entry = _adamw_mode(runs, name, ctx.get("bandwidth"), snapshots, ctx)
        result["modes"][name] = entry
        log(
            f"adamw {name}: bitwise_equal={entry['bitwise_equal']}, reserved during step "
            f"{entry.get('reserved_during_step_over_state')} of the state (CUDA), swap's "
            f"peak_reserved {entry.get('peak_reserved_state_over_state')}"
        )
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


def _checkpointed(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model``'s forward with every block under ``torch.utils.checkpoint`` (non-reentrant,
    as ``benchmarks/checkpoint_comparison.py`` runs it): only block inputs stay saved."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        for block in model:
            x = checkpoint(block, x, use_reentrant=False)
        return x

    return forward


def _natural_peak(
    m: Machine, sizes: Sizes, x: torch.Tensor, ctx: dict
) -> tuple[int, str, Callable[[nn.Module, Callable[[], object]], tuple[float, int | None]]]:
    """The MLP's natural activation peak, where it comes from, and the measuring helper."""
    swapopt = ctx["swapopt"]

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

    reference = _mlp(sizes, m.device)

    def step() -> None:
        reference(x).square().mean().backward()

    measured(reference, step)  # kernels chosen, caches warm
    if m.cuda:
        _, natural = measured(reference, step)
        assert natural is not None
        return natural, "torch.cuda.max_memory_allocated", measured
    # No allocator statistics on CPU: a session whose budget never binds reports the peak.
    probe = swapopt.OffloadSession(
        swapopt.OffloadConfig(max_resident_activation_mb=2**20, runtime=ctx["offload_runtime"])
    )
    with probe:
        step()
    natural = probe.stats().peak_resident_activation_bytes
    return natural, "OffloadStats.peak_resident_activation_bytes", measured


def section_offload(m: Machine, sizes: Sizes, deadline: float, ctx: dict) -> dict:
    swapopt = ctx["swapopt"]
    reference, offloaded = _mlp(sizes, m.device), _mlp(sizes, m.device)
    checkpointed = _mlp(sizes, m.device)
    checkpointed_forward = _checkpointed(checkpointed)
    gen = torch.Generator(device=m.device).manual_seed(0)
    x = torch.randn(sizes.mlp_batch, sizes.mlp_width, generator=gen, device=m.device)

    def step(model: nn.Module, scale: float) -> None:
        model(x * scale).square().mean().backward()

    runtime = ctx["offload_runtime"]
    natural, peak_source, measured = _natural_peak(m, sizes, x, ctx)
    budget_mb = 0.5 * natural / MiB
    ctx["offload_budget_mb"] = budget_mb
    config = swapopt.OffloadConfig(
        max_resident_activation_mb=budget_mb, runtime=runtime, min_offload_kib=sizes.min_offload_kib
    )
    session = swapopt.OffloadSession(config)
    log(f"offload: natural peak {natural / MiB:.0f} MiB, budget {budget_mb:.0f} MiB ({runtime})")

    def in_session(scale: float) -> None:
        with session:
            step(offloaded, scale)

    def with_checkpoints(scale: float) -> None:
        checkpointed_forward(x * scale).square().mean().backward()

    plain_times, session_times, peaks, tracked_peaks, equal = [], [], [], [], []
    ckpt_times: list[float] = []
    ckpt_peaks: list[int] = []
    ckpt_equal: list[bool] = []
    for i in range(1 + sizes.replays):
        if i >= 2 and time.monotonic() > deadline:
            break
        t_plain, _ = measured(reference, lambda s=i + 1.0: step(reference, s))
        t_session, peak = measured(offloaded, lambda s=i + 1.0: in_session(s))
        t_ckpt, ckpt_peak = measured(checkpointed, lambda s=i + 1.0: with_checkpoints(s))
        same = all(
            torch.equal(a.grad, b.grad)
            for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True)
        )
        equal.append(same)
        ckpt_equal.append(
            all(
                torch.equal(a.grad, b.grad)
                for a, b in zip(reference.parameters(), checkpointed.parameters(), strict=True)
            )
        )
        if i > 0:  # the first entry is the warmup, which traces instead of replaying
            plain_times.append(t_plain)
            session_times.append(t_session)
            ckpt_times.append(t_ckpt)
            tracked_peaks.append(session.stats().last_peak_resident_activation_bytes)
            peaks.append(peak if peak is not None else tracked_peaks[-1])
            if ckpt_peak is not None:
                ckpt_peaks.append(ckpt_peak)
        log(f"offload: step {i + 1} grads bitwise equal={same}")
    stats = session.stats()
    peak = max(peaks) if peaks else None
    ckpt_peak_max = max(ckpt_peaks) if ckpt_peaks else None
    checkpointing = {
        "how": "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) per block",
        "peak_bytes": ckpt_peak_max,
        "peak_source": peak_source if ckpt_peak_max is not None else None,
        "peak_note": None if ckpt_peak_max is not None else "no allocator statistics on cpu",
        "peak_over_natural": _ratio(ckpt_peak_max, natural),
        "step_ms": [t * 1e3 for t in ckpt_times],
        "step_over_plain": _ratio(_median(ckpt_times), _median(plain_times)),
        "grads_bitwise_equal": bool(ckpt_equal) and all(ckpt_equal),
        "session_peak_over_checkpointing": _ratio(peak, ckpt_peak_max),
        "session_step_over_checkpointing": _ratio(_median(session_times), _median(ckpt_times)),
    }
    return {
        "runtime": runtime,
        "shares_swap_runtime": _shares_swap_runtime(offloaded, session, step, ctx),
        "model": f"{sizes.mlp_layers} x (Linear({sizes.mlp_width}), GELU), batch {sizes.mlp_batch}",
        "peak_source": peak_source,
        "natural_peak_bytes": natural,
        "budget_bytes": config.budget_bytes,
        "replay_peak_bytes": peak,
        "peak_over_budget": _ratio(peak, config.budget_bytes),
        "peak_over_budget_tolerance": OFFLOAD_PEAK_TOLERANCE,
        "tracked_peak_over_budget": _ratio(max(tracked_peaks, default=None), config.budget_bytes),
        "plain_step_ms": [t * 1e3 for t in plain_times],
        "session_step_ms": [t * 1e3 for t in session_times],
        "step_over_plain": _ratio(_median(session_times), _median(plain_times)),
        "grads_bitwise_equal": bool(equal) and all(equal),
        "grads_equal_per_step": equal,
        "checkpointing": checkpointing,
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


# --------------------------------------------------------------------------- profile

#: Python files whose frames on the issuing thread's stack tell who queued a copy.
OWNERS = (
    ("optimizer_prefetch", "swapopt_core/_torch/prefetch.py"),
    ("activations", "swapopt_core/_activations/"),
    ("optimizer", "swapopt_core/_swap/"),
    ("optimizer", "swapopt_core/_torch/"),
)


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(start: float, end: float, union: list[tuple[float, float]], starts: list) -> float:
    """How much of ``[start, end)`` the disjoint sorted ``union`` covers."""
    i = max(0, bisect.bisect_right(starts, start) - 1)
    total = 0.0
    while i < len(union) and union[i][0] < end:
        total += max(0.0, min(end, union[i][1]) - max(start, union[i][0]))
        i += 1
    return total


def _enclosing(events: list[dict], queries: list[tuple[Any, float, int]]) -> dict[int, list[str]]:
    """For each ``(tid, ts, key)``: the names of the ``events`` on ``tid`` running at ``ts``.

    The events of one thread nest (Python calls do), so one sweep per thread keeps the
    chain of open calls on a stack.
    """
    by_tid: dict[Any, list[tuple[float, float, str]]] = {}
    for e in events:
        start = float(e["ts"])
        by_tid.setdefault(e.get("tid"), []).append(
            (start, start + float(e.get("dur", 0)), e["name"])
        )
    asked: dict[Any, list[tuple[float, int]]] = {}
    for tid, ts, key in queries:
        asked.setdefault(tid, []).append((ts, key))
    found: dict[int, list[str]] = {}
    for tid, points in asked.items():
        calls = sorted(by_tid.get(tid, []), key=lambda c: (c[0], -c[1]))
        stack: list[tuple[float, float, str]] = []
        i = 0
        for ts, key in sorted(points):
            while i < len(calls) and calls[i][0] <= ts:
                while stack and stack[-1][1] < calls[i][0]:
                    stack.pop()
                stack.append(calls[i])
                i += 1
            found[key] = [name for start, end, name in stack if end >= ts]
    return found


def _owner(names: list[str]) -> str:
    for owner, marker in OWNERS:
        if any(marker in name for name in names):
            return owner
    return "other" if names else "unknown"


def _trace_analysis(events: list[dict]) -> dict[str, Any]:
    """Copies against compute kernels, and who queued each host-to-device copy, from a
    Chrome trace of ``torch.profiler`` (CUDA activity and Python stacks).

    * ``overlap_fraction``: the time memcpys ran while some compute kernel ran, over the
      total memcpy time (1.0: every copy hidden under compute).
    * Each memcpy is tied by its correlation id to the runtime call that queued it, and that
      call to the Python frames open on its thread: ``prefetch.py`` makes it the optimizer's
      prefetch during backward, ``_activations`` an activation's page-in (or page-out),
      other optimizer modules the step's own copies.
    * ``launch_delay_us``: from the call that queued a copy to the copy's start on the GPU;
      an activation page-in that waits behind the optimizer's prefetch on one FIFO stream
      shows it here, and in ``activation_h2d_behind_prefetch``.
    """
    done = [e for e in events if e.get("ph") == "X" and "ts" in e]
    memcpys = [e for e in done if e.get("cat") == "gpu_memcpy"]
    kernels = [e for e in done if e.get("cat") == "kernel"]
    launches = {
        (e.get("args") or {}).get("correlation"): e
        for e in done
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
    }
    python = [e for e in done if e.get("cat") == "python_function"]
    union = _merged([(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in kernels])
    starts = [u[0] for u in union]
    copies: list[dict[str, Any]] = []
    queries = []
    for key, e in enumerate(memcpys):
        args = e.get("args") or {}
        start, dur = float(e["ts"]), float(e.get("dur", 0))
        name = e.get("name", "")
        direction = next((d for d in ("HtoD", "DtoH", "DtoD", "HtoH") if d in name), "other")
        launch = launches.get(args.get("correlation"))
        copy = {
            "direction": direction,
            "pageable": "Pageable" in name,
            "stream": args.get("stream"),
            "start": start,
            "end": start + dur,
            "dur": dur,
            "bytes": args.get("bytes"),
            "overlap": _covered(start, start + dur, union, starts),
            "launch": float(launch["ts"]) if launch else None,
        }
        copies.append(copy)
        if launch is not None:
            queries.append((launch.get("tid"), float(launch["ts"]), key))
    frames = _enclosing(python, queries)
    for key, copy in enumerate(copies):
        copy["owner"] = _owner(frames[key]) if key in frames else "unknown"
        if copy["launch"] is not None:
            copy["launch_delay_us"] = copy["start"] - copy["launch"]
    result: dict[str, Any] = {
        "kernels": len(kernels),
        "memcpys": len(copies),
        "python_events": len(python),
        "pageable_memcpys": sum(c["pageable"] for c in copies),
        "kernel_busy_us": sum(e - s for s, e in union),
    }
    total = sum(c["dur"] for c in copies)
    result["copy_us"] = total
    result["overlap_fraction"] = sum(c["overlap"] for c in copies) / total if total else None
    for direction, label in (("HtoD", "h2d"), ("DtoH", "d2h")):
        chosen = [c for c in copies if c["direction"] == direction]
        spent = sum(c["dur"] for c in chosen)
        result[f"{label}_memcpys"] = len(chosen)
        result[f"{label}_copy_us"] = spent
        result[f"{label}_overlap_fraction"] = (
            sum(c["overlap"] for c in chosen) / spent if spent else None
        )
    h2d = [c for c in copies if c["direction"] == "HtoD"]
    result["h2d_streams"] = sorted({c["stream"] for c in h2d}, key=str)
    by_owner: dict[str, dict[str, Any]] = {}
    for owner in sorted({c["owner"] for c in copies}):
        mine = [c for c in copies if c["owner"] == owner]
        mine_h2d = [c for c in mine if c["direction"] == "HtoD"]
        delays = [c["launch_delay_us"] for c in mine_h2d if "launch_delay_us" in c]
        by_owner[owner] = {
            "memcpys": len(mine),
            "h2d_memcpys": len(mine_h2d),
            "h2d_bytes": sum(c["bytes"] or 0 for c in mine_h2d),
            "h2d_streams": sorted({c["stream"] for c in mine_h2d}, key=str),
            "streams": sorted({c["stream"] for c in mine}, key=str),
            "max_h2d_launch_delay_us": max(delays, default=None),
            "median_h2d_launch_delay_us": _median(delays),
        }
    result["by_owner"] = by_owner
    pages = [c for c in h2d if c["owner"] == "activations" and c["launch"] is not None]
    fetches = [c for c in h2d if c["owner"] == "optimizer_prefetch" and c["launch"] is not None]
    behind = []
    for page in pages:
        # Queued after a prefetch copy on the same stream that was still running: a FIFO
        # stream makes the page-in wait for it.
        if any(
            f["stream"] == page["stream"] and f["launch"] < page["launch"] < f["end"]
            for f in fetches
        ):
            behind.append(page)
    result["distinct_h2d_streams"] = len(result["h2d_streams"])
    result["activation_h2d_memcpys"] = len(pages)
    result["prefetch_h2d_memcpys"] = len(fetches)
    shared = {c["stream"] for c in pages} & {c["stream"] for c in fetches}
    result["activation_and_prefetch_share_h2d_stream"] = bool(shared) if pages and fetches else None
    result["activation_h2d_behind_prefetch"] = len(behind)
    result["max_activation_h2d_delay_us"] = max((c["launch_delay_us"] for c in pages), default=None)
    result["max_delay_behind_prefetch_us"] = max(
        (c["launch_delay_us"] for c in behind), default=None
    )
    return result


def _cpu_trace_figures(events: list[dict]) -> dict[str, Any]:
    """What a CPU-only trace shows: op and Python-call counts, and the threads that ran
    tensor copies (``loopback-async`` copies on its own lane threads)."""
    done = [e for e in events if e.get("ph") == "X"]
    copy_threads: dict[str, int] = {}
    for e in done:
        if e.get("cat") == "python_function" and e.get("name", "").startswith(
            "<built-in method copy_ of Tensor"
        ):
            key = str(e.get("tid"))
            copy_threads[key] = copy_threads.get(key, 0) + 1
    return {
        "cpu_ops": sum(e.get("cat") == "cpu_op" for e in done),
        "python_events": sum(e.get("cat") == "python_function" for e in done),
        "copy_calls_by_thread": copy_threads,
        "copy_threads": len(copy_threads),
    }


def section_profile(m: Machine, sizes: Sizes, deadline: float, ctx: dict) -> dict:
    """A profiler trace of swapped steps with a backward prefetch and an OffloadSession."""
    swapopt = ctx["swapopt"]
    gen = torch.Generator(device=m.device).manual_seed(0)
    x = torch.randn(sizes.mlp_batch, sizes.mlp_width, generator=gen, device=m.device)
    budget_mb = ctx.get("offload_budget_mb")
    if budget_mb is None:
        natural, _source, _measured = _natural_peak(m, sizes, x, ctx)
        budget_mb = 0.5 * natural / MiB
    model = _mlp(sizes, m.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    swap_config = swapopt.SwapOptimizerConfig(
        swap_times=SWAP_TIMES, prefetch_during_backward=True, runtime=ctx["swap_runtime"]
    )
    swapopt.swap_optimizer(opt, swap_config)
    session = swapopt.OffloadSession(
        swapopt.OffloadConfig(
            max_resident_activation_mb=budget_mb,
            runtime=ctx["offload_runtime"],
            min_offload_kib=sizes.min_offload_kib,
        )
    )

    def train_step(scale: float) -> None:
        with torch.profiler.record_function("gpu_check.forward_backward"), session:
            model(x * scale).square().mean().backward()
        with torch.profiler.record_function("gpu_check.optimizer_step"):
            opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(2):  # the session traces, then replays; the optimizer's state exists
        train_step(1.0 + i)
    m.sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if m.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    steps = 0
    soft_deadline = deadline - 0.4 * (deadline - time.monotonic())  # keep time to export
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for i in range(sizes.profile_steps):
            if i >= 1 and time.monotonic() > soft_deadline:
                break
            train_step(3.0 + i)
            steps += 1
        m.sync()
    stats = swapopt.swap_stats(opt)
    session_stats = session.stats()
    with tempfile.TemporaryDirectory(prefix="gpu-check-trace-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        raw = path.read_bytes()
    result: dict[str, Any] = {
        "model": f"{sizes.mlp_layers} x (Linear({sizes.mlp_width}), GELU), batch {sizes.mlp_batch}",
        "profiled_steps": steps,
        "activities": [str(a).rsplit(".", 1)[-1] for a in activities],
        "prefetch_batches": stats.prefetch_batches,
        "swap_h2d_bytes": stats.h2d_bytes,
        "session_h2d_bytes": getattr(session_stats, "h2d_bytes", None),
        "session_d2h_bytes": getattr(session_stats, "d2h_bytes", None),
    }
    out = os.environ.get("OUT")
    if out:  # saved first: the trace comes back even if reading it fails below
        target = Path(out) / "gpu_check_trace.json.gz"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(gzip.compress(raw, compresslevel=6))
        result["trace_file"] = str(target)
        result["trace_file_bytes"] = target.stat().st_size
    events = json.loads(raw).get("traceEvents", [])
    del raw
    result["trace_events"] = len(events)
    result["cpu"] = _cpu_trace_figures(events)
    if m.cuda:
        result["gpu"] = _trace_analysis(events)
    else:
        result["gpu"] = "not applicable on cpu: no CUDA activity in the trace"
    gpu = result["gpu"]
    if isinstance(gpu, dict):
        log(
            f"profile: copies overlap compute {gpu['overlap_fraction']}, H2D streams "
            f"{gpu['h2d_streams']}, activation page-ins behind the prefetch "
            f"{gpu['activation_h2d_behind_prefetch']}"
        )
    swapopt.unswap_optimizer(opt)
    return result


# --------------------------------------------------------------------------- drop_while_queued


def section_drop_while_queued(m: Machine, sizes: Sizes, deadline: float, ctx: dict) -> dict:
    """Drop a swapped AdamW right after ``step()``, while its copies may still be queued.

    Then fill fresh host (pageable and pinned) and device memory of the state's size and
    synchronize: a copy still writing into the freed host buffers would corrupt them (or
    raise a CUDA error); a separate reference tensor and the parameters (against a plain
    AdamW fed the same gradients) must hold what they should.
    """
    swapopt = ctx["swapopt"]
    cols = 1024
    rows = max(1, sizes.drop_params // (4 * cols))
    reference = torch.arange(rows * cols, dtype=torch.float32, device=m.device)
    host_reference = torch.arange(rows * cols, dtype=torch.float32)
    rounds: list[dict[str, Any]] = []
    for r in range(3):
        if r >= 1 and time.monotonic() > deadline:
            break
        entry: dict[str, Any] = {"round": r + 1}
        try:
            gen = torch.Generator(device=m.device).manual_seed(r)
            swapped_params = [
                nn.Parameter(torch.randn(rows, cols, generator=gen, device=m.device))
                for _ in range(4)
            ]
            plain_params = [nn.Parameter(p.detach().clone()) for p in swapped_params]
            plain = torch.optim.AdamW(plain_params, lr=1e-3)
            opt = torch.optim.AdamW(swapped_params, lr=1e-3)
            config = swapopt.SwapOptimizerConfig(swap_times=SWAP_TIMES, runtime=ctx["swap_runtime"])
            swapopt.swap_optimizer(opt, config)
            state_numel = 2 * sum(p.numel() for p in swapped_params)
            for step in range(2):
                gen.manual_seed(100 + step)
                for a, b in zip(plain_params, swapped_params, strict=True):
                    a.grad = torch.randn(a.shape, generator=gen, device=m.device)
                    b.grad = a.grad.clone()
                plain.step()
                opt.step()
            # Dropped at once: the last step's copies out may still be queued.
            del opt
            gc.collect()
            host = torch.empty(state_numel, dtype=torch.float32).fill_(7.0)
            pinned = torch.empty(state_numel, dtype=torch.float32, pin_memory=m.cuda).fill_(9.0)
            device = torch.full((state_numel,), 11.0, device=m.device)
            m.sync()
            entry.update(
                fresh_host_intact=bool((host == 7.0).all()),
                fresh_pinned_intact=bool((pinned == 9.0).all()),
                fresh_device_intact=bool((device == 11.0).all()),
                reference_intact=bool(
                    torch.equal(
                        reference, torch.arange(rows * cols, dtype=torch.float32, device=m.device)
                    )
                ),
                host_reference_intact=bool(
                    torch.equal(host_reference, torch.arange(rows * cols, dtype=torch.float32))
                ),
                params_equal_plain=all(
                    torch.equal(a, b) for a, b in zip(plain_params, swapped_params, strict=True)
                ),
            )
            entry["ok"] = all(v for k, v in entry.items() if k != "round")
            del host, pinned, device
        except Exception as exc:  # noqa: BLE001 - a CUDA error here is the finding
            entry.update(ok=False, error=repr(exc), traceback=traceback.format_exc()[-2000:])
        rounds.append(entry)
        log(f"drop_while_queued: round {r + 1} ok={entry['ok']}")
        gc.collect()
    return {
        "params": 4 * rows * cols,
        "state_bytes": 8 * 4 * rows * cols,
        "runtime": ctx["swap_runtime"],
        "rounds": rounds,
        "ok": bool(rounds) and all(e["ok"] for e in rounds),
    }


# --------------------------------------------------------------------------- driver

SECTIONS: dict[str, Callable[[Machine, Sizes, float, dict], dict]] = {
    "cuda_tests": section_cuda_tests,
    "bandwidth": section_bandwidth,
    "adamw": section_adamw,
    "offload": section_offload,
    "device_budget": gpu_budget.section_device_budget,
    "profile": section_profile,
    "drop_while_queued": section_drop_while_queued,
    "cuda_sanitizer": section_cuda_sanitizer,
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


def _get(sections: dict[str, dict], name: str, *keys: str) -> Any:
    value: Any = sections.get(name, {}).get("result")
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _is_true(value: Any) -> bool:
    return value is True


def _at_most(limit: float) -> Callable[[Any], bool]:
    return lambda value: value <= limit


def _checks(sections: dict[str, dict], cuda: bool) -> dict[str, dict[str, Any]]:
    """Every assertion of the run: ``passed``, ``failed`` or ``skipped`` (with the reason:
    its section did not run to the end, it needs CUDA, or the figure is not reported), each
    with the value and what it must be. A section left out with ``--only`` checks nothing.
    """
    checks: dict[str, dict[str, Any]] = {}

    def check(
        name: str,
        section: str,
        value: Any,
        holds: Callable[[Any], bool],
        expect: str,
        *,
        cuda_only: bool = False,
        missing: str = "not reported",
        **extra: Any,
    ) -> None:
        entry = sections.get(section, {})
        status = entry.get("status")
        if status in (None, "not_requested"):
            return
        result: dict[str, Any] = {"expect": expect, "value": value, **extra}
        if status != "ok":
            reason = f"section {section} {status}"
            if entry.get("reason"):
                reason += f" ({entry['reason']})"
            result.update(status="skipped", reason=reason)
        elif cuda_only and not cuda:
            result.update(status="skipped", reason="needs CUDA: not evaluated on cpu")
        elif value is None:
            result.update(status="skipped", reason=missing)
        else:
            result["status"] = "passed" if holds(value) else "failed"
        checks[name] = result

    get = functools.partial(_get, sections)
    check("cuda_tests", "cuda_tests", get("cuda_tests", "ok"), _is_true, "the CUDA tests pass")
    runtime = get("bandwidth", "runtime") or {}
    figures = [runtime.get("d2h_gbps"), runtime.get("h2d_gbps")]
    check(
        "bandwidth.runtime_measured",
        "bandwidth",
        None if None in figures else min(figures),
        lambda v: v > 0,
        "the swap runtime's measure_bandwidth() gives > 0 GB/s each way",
    )
    check("adamw", "adamw", get("adamw", "bitwise_equal"), _is_true, "bitwise equal to plain")
    swap_times = get("adamw", "swap_times") or SWAP_TIMES
    limit = RESERVED_LIMIT_BATCHES / swap_times
    within = f"<= {RESERVED_LIMIT_BATCHES}/{swap_times} of the state ({limit:.4f})"
    for mode, entry in (get("adamw", "modes") or {}).items():
        prefix = f"adamw.{mode}."
        check(
            prefix + "reserved_during_step",
            "adamw",
            entry.get("reserved_during_step_over_state"),
            _at_most(limit),
            "max_memory_reserved growth during step(), from an emptied cache, " + within,
            cuda_only=True,
            limit=limit,
        )
        peak_reserved = entry.get("peak_reserved_state_bytes")
        check(
            prefix + "peak_reserved_state_bytes",
            "adamw",
            entry.get("peak_reserved_state_over_state") if peak_reserved else None,
            _at_most(limit),
            "SwapStats.peak_reserved_state_bytes " + within,
            missing="SwapStats.peak_reserved_state_bytes is absent or 0 in this build",
            limit=limit,
        )
        check(
            prefix + "pinned_fallback_buffers",
            "adamw",
            entry.get("pinned_fallback_buffers"),
            lambda v: v == 0,
            "== 0: no host buffer of the state left pageable",
            missing="SwapStats.pinned_fallback_buffers is absent in this build",
        )
        pinned, off = entry.get("pinned_state_tensors"), entry.get("off_device_state_tensors")
        check(
            prefix + "state_pinned",
            "adamw",
            None if pinned is None or off is None else [pinned, off],
            lambda v: 0 < v[1] == v[0],
            "[pinned, off-device] state tensors: every off-device one pinned, and some",
            cuda_only=True,
        )
        check(
            prefix + "pinned_flat",
            "adamw",
            entry.get("pinned_host_growth"),
            _at_most(0),
            "SwapStats.pinned_host_bytes does not grow from step 2 to the last timed step",
        )
    for kind in ("allocated", "reserved"):
        check(
            f"adamw.{kind}_flat",
            "adamw",
            get("adamw", f"{kind}_growth"),
            _at_most(FLAT_TOLERANCE_BYTES),
            f"device {kind} bytes grow by <= {FLAT_TOLERANCE_BYTES} from step 2 to the last "
            "timed step",
            cuda_only=True,
            tolerance_bytes=FLAT_TOLERANCE_BYTES,
        )
    check(
        "offload",
        "offload",
        get("offload", "grads_bitwise_equal") and get("offload", "shares_swap_runtime"),
        _is_true,
        "grads bitwise equal to plain, and one runtime instance with the optimizer swap",
    )
    check(
        "offload.peak_over_budget",
        "offload",
        get("offload", "peak_over_budget"),
        _at_most(1.0 + OFFLOAD_PEAK_TOLERANCE),
        f"<= 1 + {OFFLOAD_PEAK_TOLERANCE} (the step's gradients and transients on top of "
        "the tracked activations)",
        tolerance=OFFLOAD_PEAK_TOLERANCE,
    )
    check(
        "device_budget",
        "device_budget",
        get("device_budget", "params_bitwise_equal"),
        _is_true,
        "params bitwise equal to plain",
    )
    check(
        "device_budget.peak_over_target",
        "device_budget",
        get("device_budget", "peak_over_target"),
        _at_most(1.0),
        "<= 1 (the session meter's step peak)",
    )
    check(
        "device_budget.allocated_peak_over_target",
        "device_budget",
        get("device_budget", "allocated_peak_over_target"),
        _at_most(1.0),
        "<= 1 (torch.cuda.max_memory_allocated)",
        cuda_only=True,
    )
    check(
        "device_budget.reserved_peak_over_target",
        "device_budget",
        get("device_budget", "reserved_peak_over_target"),
        _at_most(1.0 + RESERVED_TARGET_TOLERANCE),
        f"<= 1 + {RESERVED_TARGET_TOLERANCE} (torch.cuda.max_memory_reserved)",
        cuda_only=True,
        tolerance=RESERVED_TARGET_TOLERANCE,
    )
    gpu = get("profile", "gpu")
    gpu = gpu if isinstance(gpu, dict) else {}
    check(
        "profile.copies_overlap_compute",
        "profile",
        gpu.get("overlap_fraction"),
        lambda v: v > 0,
        "> 0: some copy time runs under compute kernels",
        cuda_only=True,
        missing="no memcpy in the trace",
    )
    check(
        "profile.activation_h2d_apart_from_prefetch",
        "profile",
        gpu.get("activation_and_prefetch_share_h2d_stream"),
        lambda v: v is False,
        "activation page-ins and the optimizer's prefetch never share an H2D stream",
        cuda_only=True,
        missing="no activation page-in or no prefetch copy told apart in the trace",
    )
    check(
        "drop_while_queued",
        "drop_while_queued",
        get("drop_while_queued", "ok"),
        _is_true,
        "no CUDA error, no corruption after dropping an optimizer with queued copies",
    )
    check(
        "cuda_sanitizer",
        "cuda_sanitizer",
        get("cuda_sanitizer", "ok"),
        _is_true,
        "the optimizer CUDA tests pass under TORCH_CUDA_SANITIZER=1",
        cuda_only=True,
    )
    return checks


def _summary(sections: dict[str, dict], cuda: bool = True) -> dict[str, Any]:
    get = functools.partial(_get, sections)
    modes = get("adamw", "modes") or {}
    ran = {k: v for k, v in sections.items() if v["status"] != "not_requested"}
    by_mode = lambda key: {k: v.get(key) for k, v in modes.items()}  # noqa: E731
    gpu = get("profile", "gpu")
    gpu = gpu if isinstance(gpu, dict) else {}
    summary = {
        "sections_ok": [k for k, v in ran.items() if v["status"] == "ok"],
        "sections_not_ok": {
            k: v["status"] for k, v in ran.items() if v["status"] not in ("ok", "not_applicable")
        },
        "sections_not_applicable": [k for k, v in ran.items() if v["status"] == "not_applicable"],
        "cuda_tests_ok": get("cuda_tests", "ok"),
        "cuda_tests_passed": get("cuda_tests", "passed"),
        "cuda_tests_failed": get("cuda_tests", "failed"),
        "cuda_sanitizer_passed": get("cuda_sanitizer", "passed"),
        "cuda_sanitizer_failed": get("cuda_sanitizer", "failed"),
        "adamw_params": get("adamw", "params"),
        "adamw_bitwise_equal": by_mode("bitwise_equal"),
        "h2d_gbps": get("bandwidth", "h2d_gbps"),
        "d2h_gbps": get("bandwidth", "d2h_gbps"),
        "duplex_total_gbps": get("bandwidth", "duplex_total_gbps"),
        "pageable_h2d_gbps": get("bandwidth", "pageable_h2d_gbps"),
        "pageable_d2h_gbps": get("bandwidth", "pageable_d2h_gbps"),
        "runtime_h2d_gbps": get("bandwidth", "runtime", "h2d_gbps"),
        "runtime_d2h_gbps": get("bandwidth", "runtime", "d2h_gbps"),
        "runtime_duplex_total_gbps": get("bandwidth", "runtime", "duplex_total_gbps"),
        "swapped_over_plain": by_mode("swapped_over_plain"),
        "swapped_over_link_bound": by_mode("swapped_over_link_bound"),
        "swapped_over_max_plain_link": by_mode("swapped_over_max_plain_link"),
        "reserved_during_step_over_state": by_mode("reserved_during_step_over_state"),
        "allocated_during_step_over_state": by_mode("allocated_during_step_over_state"),
        "peak_reserved_state_over_state": by_mode("peak_reserved_state_over_state"),
        "peak_resident_over_total": by_mode("peak_resident_over_total"),
        "pinned_fallback_buffers": by_mode("pinned_fallback_buffers"),
        "offload_peak_over_budget": get("offload", "peak_over_budget"),
        "offload_step_over_plain": get("offload", "step_over_plain"),
        "offload_grads_bitwise_equal": get("offload", "grads_bitwise_equal"),
        "offload_shares_swap_runtime": get("offload", "shares_swap_runtime"),
        "checkpointing_peak_over_natural": get("offload", "checkpointing", "peak_over_natural"),
        "checkpointing_step_over_plain": get("offload", "checkpointing", "step_over_plain"),
        "budget_peak_over_target": get("device_budget", "peak_over_target"),
        "budget_allocated_peak_over_target": get("device_budget", "allocated_peak_over_target"),
        "budget_reserved_peak_over_target": get("device_budget", "reserved_peak_over_target"),
        "budget_step_over_plain": get("device_budget", "step_over_plain"),
        "budget_step_over_planned": get("device_budget", "step_over_planned"),
        "budget_params_bitwise_equal": get("device_budget", "params_bitwise_equal"),
        "profile_overlap_fraction": gpu.get("overlap_fraction"),
        "profile_h2d_streams": gpu.get("h2d_streams"),
        "profile_activation_h2d_behind_prefetch": gpu.get("activation_h2d_behind_prefetch"),
        "profile_max_activation_h2d_delay_us": gpu.get("max_activation_h2d_delay_us"),
        "drop_while_queued_ok": get("drop_while_queued", "ok"),
    }
    checks = _checks(sections, cuda)
    summary["checks"] = checks
    summary["passed_checks"] = [k for k, v in checks.items() if v["status"] == "passed"]
    summary["failed_checks"] = [k for k, v in checks.items() if v["status"] == "failed"]
    summary["skipped_checks"] = {
        k: v["reason"] for k, v in checks.items() if v["status"] == "skipped"
    }
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


def _prerequisites(smoke: bool) -> dict[str, Any]:
    """What the run needs and whether it is here; the script installs nothing."""
    found = {
        name: importlib.util.find_spec(name) is not None
        for name in ("pluggy", "pytest", "hypothesis")
    }
    have = {
        "torch_cuda_build": torch.version.cuda is not None,
        "cuda_available": torch.cuda.is_available(),
        **found,
    }
    needs = {
        "torch_cuda_build": "a CUDA build of torch (this one is CPU-only): nothing runs on a GPU",
        "cuda_available": "a visible CUDA device: nothing runs on a GPU",
        "pluggy": "pluggy: import swapopt_core fails, no section runs",
        "pytest": "pytest: cuda_tests and cuda_sanitizer fail",
        "hypothesis": "hypothesis: test_properties.py is a collection error (counted apart)",
    }
    skip = {"torch_cuda_build", "cuda_available"} if smoke else set()
    have["missing"] = [needs[k] for k, ok in have.items() if not ok and k not in skip]
    return have


def _meta(args: argparse.Namespace, sizes: Sizes, budget_s: float) -> dict[str, Any]:
    smoke = args.cpu_smoke
    cuda = torch.cuda.is_available() and not smoke
    return {
        "mode": "cpu-smoke" if smoke else "cuda",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "python": platform.python_version(),
        "prerequisites": _prerequisites(smoke),
        "budget_s": budget_s,
        "sizes": dataclasses.asdict(sizes),
        "host_available_bytes": _host_available_bytes(),
    }


def _refuse(report: Report, reason: str, detail: str | None = None) -> int:
    """The run cannot start: say why in the JSON (and on stderr), exit with status 2."""
    print(f"gpu_check: {reason}", file=sys.stderr)
    with report.lock:
        report.data["summary"] = {"ok": False, "error": reason}
        if detail:
            report.data["summary"]["traceback"] = detail
    report.emit()
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument(
        "--budget-s", type=float, default=None, help=f"overall seconds ({GPU_BUDGET_S:.0f})"
    )
    parser.add_argument(
        "--params", type=float, default=None, help="AdamW parameters (5e8; 1e9 for 1B)"
    )
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
    sizes = SMOKE_SIZES if smoke else GPU_SIZES
    if args.params:
        sizes = dataclasses.replace(sizes, params=int(args.params))
    budget_s = args.budget_s or (SMOKE_BUDGET_S if smoke else GPU_BUDGET_S)
    out = os.environ.get("OUT")
    paths = [p for p in (args.json, Path(out) / "gpu_check.json" if out else None) if p]
    report = Report(_meta(args, sizes, budget_s), paths)
    if not smoke and not torch.cuda.is_available():
        why = "a CPU-only build of torch" if torch.version.cuda is None else "no visible device"
        return _refuse(report, f"no CUDA device ({why}); use --cpu-smoke to run on the CPU")
    try:
        swapopt = _import_swapopt()
    except Exception as exc:  # noqa: BLE001 - a missing dependency is reported, not raised
        return _refuse(report, f"import swapopt_core failed: {exc!r}", traceback.format_exc())
    threads = torch.get_num_threads()
    if smoke:
        torch.set_num_threads(1)  # gentle on a shared machine; put back before returning
    try:
        return _run(args, only, sizes, budget_s, started, report, swapopt)
    finally:
        torch.set_num_threads(threads)


def _run(
    args: argparse.Namespace,
    only: set[str],
    sizes: Sizes,
    budget_s: float,
    started: float,
    report: Report,
    swapopt: ModuleType,
) -> int:
    """Run the sections in order under the budget; print and write the JSON summary."""
    smoke = args.cpu_smoke
    scale = 0.25 if smoke else 1.0  # the smoke sizes need a quarter of the time, at most
    end = started + budget_s
    swap_runtime, offload_runtime = _runtimes(swapopt, smoke)
    swap_runtime = args.swap_runtime or swap_runtime
    offload_runtime = args.offload_runtime or offload_runtime
    report.data["meta"].update(
        swapopt_path=str(Path(swapopt.__file__).parent),
        swap_runtime=swap_runtime,
        offload_runtime=offload_runtime,
    )
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
            if smoke and name in CUDA_ONLY:
                sections[name] = {"status": "not_applicable", "reason": CUDA_ONLY[name]}
                log(f"{name}: {CUDA_ONLY[name]}")
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
            except SectionNotApplicable as exc:
                entry = {"status": "not_applicable", "reason": str(exc)}
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
        report.data["summary"] = _summary(sections, cuda=not smoke)
        report.data["meta"]["total_s"] = time.monotonic() - started
    summary = report.data["summary"]
    log(
        f"checks: {len(summary['passed_checks'])} passed, {len(summary['failed_checks'])} "
        f"failed {summary['failed_checks']}, {len(summary['skipped_checks'])} skipped"
    )
    report.emit()
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
