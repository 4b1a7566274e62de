"""What a swapped optimizer leaves behind: nothing in flight at exit, nothing once dropped."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import torch

from swapopt_core import SwapOptimizerConfig, swap_optimizer
from swapopt_core._swap.engine import engine_of

# The script's last line is a step: its copies out are still queued when the interpreter
# shuts down. A hook registered before swapopt is imported runs after swapopt's own exit
# hooks (last registered, first run) and reports what is still in flight; the unpaced
# 32 MB copy keeps a lane inside torch's copy kernel at shutdown, where an abandoned daemon
# thread used to abort the process ("terminate called without an active exception").
_EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys, threading

    OPTIMIZERS = []

    def report():
        from swapopt_core._swap.engine import engine_of
        lanes = [t.name for t in threading.enumerate() if t.name.startswith("swapopt-")]
        queued = [i for i, opt in enumerate(OPTIMIZERS)
                  if engine_of(opt).last_out is not None and not engine_of(opt).last_out.done()]
        if lanes or queued:
            sys.stderr.write(f"in flight at exit: lane threads {lanes}, optimizers {queued}\\n")

    atexit.register(report)

    import torch
    from swapopt_core import SwapOptimizerConfig, swap_optimizer

    def swapped(numel):
        param = torch.nn.Parameter(torch.zeros(numel))
        opt = torch.optim.Adam([param], lr=1e-3)
        swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback-async", swap_times=1))
        param.grad = torch.ones_like(param)
        opt.step()
        OPTIMIZERS.append(opt)
        return opt

    os.environ["SWAPOPT_LOOPBACK_GBPS"] = "0.002"  # 2 MB/s: 512 kB take a quarter second
    slow = swapped(64 * 1024)
    del os.environ["SWAPOPT_LOOPBACK_GBPS"]
    fast = swapped(4 * 2**20)
    slow.step()
    fast.step()
    """
)


def test_a_script_ending_right_after_a_step_exits_cleanly(tmp_path) -> None:  # noqa: ANN001
    # Before: exit code 134 in a quarter to half of the runs, and copies still queued (and
    # lane threads running) when the interpreter shut down, in every run.
    script = tmp_path / "train.py"
    script.write_text(_EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("SWAPOPT_LOOPBACK_JITTER_US", None)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert "terminate called" not in done.stderr
    assert "in flight at exit" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()


def test_a_dropped_swapped_optimizer_gives_back_threads_memory_and_hooks() -> None:
    # Before: the gradient hooks on the parameters held every engine, its lane threads and
    # its host state for as long as the model lived (2 threads and the state per optimizer).
    model = _mlp()
    gc.collect()
    before = set(threading.enumerate())
    dropped = []
    for _ in range(20):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = SwapOptimizerConfig(runtime="loopback-async", min_numel=0, swap_times=3)
        swap_optimizer(opt, config)
        _train(model, opt, 2)
        model.zero_grad()
        opt.zero_grad()
        _backward_only = model(torch.ones(4, 64)).sum()
        _backward_only.backward()  # a prefetch is in flight when the optimizer is dropped
        dropped.append((weakref.ref(opt), weakref.ref(engine_of(opt).runtime)))
        del opt, _backward_only
    gc.collect()
    assert all(opt() is None for opt, _ in dropped)
    # The runtime outlives its engine until the last host buffer it counts is freed.
    assert all(runtime() is None for _, runtime in dropped)
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:
        thread.join(timeout=60)  # a lane ends once its runtime is gone
    assert not [t.name for t in started if t.is_alive()]
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    # The model trains on with a new optimizer, swapped or not.
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 1)
