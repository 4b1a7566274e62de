"""Step time of a ~30M-parameter GPT-style model inside an OffloadSession that never binds.

Measures what tracing and replaying cost by themselves: the budget is far above the natural
peak, so the plan is empty and nothing moves. Plain and session steps alternate so they see
the same machine load; the ratio of medians is reported.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._cli.demo import _TinyGPT
from swapopt_core._planning.simulate import simulate


def measure(steps: int = 8, threads: int = 1) -> dict[str, float]:
    """Median plain and in-session step times (forward + backward) and their ratio."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    vocab, width, layers, seq = 8192, 512, 8, 256
    model = _TinyGPT(vocab=vocab, width=width, layers=layers, heads=8, max_len=seq)
    tokens = torch.randint(0, vocab, (4, seq), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        model.zero_grad()

    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, runtime="loopback"))
    with session:  # the warmup: traced, planned (nothing to do under this budget)
        step()
    step()  # warm the allocator for the plain path too
    plain, inside = [], []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        with session:
            step()
        inside.append(time.perf_counter() - start)
    stats = session.stats()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "ops": len(session.trace.ops) if session.trace is not None else 0,
        "plain_ms": statistics.median(plain) * 1e3,
        "session_ms": statistics.median(inside) * 1e3,
        "ratio": statistics.median(inside) / statistics.median(plain),
        "replays": stats.replays,
        "planned_actions": stats.planned_actions,
    }


class _BareMode(TorchDispatchMode):
    """A dispatch mode that only forwards each op: the floor any per-op interception pays."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return func(*args, **(kwargs or {}))


def replay_cost(rounds: int = 15, threads: int = 1) -> dict[str, float]:
    """Per-op microseconds of a launch-bound step (a tiny GPT of a few-microsecond ops).

    Four variants alternate round by round so they see the same machine load: the plain
    step, a bare ``TorchDispatchMode``, a session replaying an empty plan, and a session
    replaying the default planner's plan at half the natural peak (loopback: each copy is
    real, a few kilobytes). Each figure is the median over ``rounds`` of the main thread's
    CPU time (``time.thread_time``; torch runs on that one thread), which other processes on
    a shared machine disturb far less than the wall clock.
    """
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    vocab, width, layers, seq = 256, 64, 2, 16
    model = _TinyGPT(vocab=vocab, width=width, layers=layers, heads=4, max_len=seq)
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        model.zero_grad()  # gradients made afresh each step, as in the warmup

    empty = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, runtime="loopback"))
    with empty:
        step()
    half_mb = simulate(empty.trace).natural_peak_bytes / 2 / 2**20
    planned = OffloadSession(
        OffloadConfig(max_resident_activation_mb=half_mb, runtime="loopback", min_offload_kib=0)
    )
    with planned:
        step()
    ops = len(empty.trace.ops)
    variants = {
        "plain": contextlib.nullcontext,
        "bare_mode": _BareMode,
        "empty_plan": lambda: empty,
        "with_plan": lambda: planned,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, context in variants.items():
            start = time.thread_time()
            for _ in range(5):
                with context():
                    step()
            times[name].append((time.thread_time() - start) / 5 / ops * 1e6)
    result = {name: statistics.median(values) for name, values in times.items()}
    result["ops"] = ops
    result["planned_actions"] = planned.stats().planned_actions
    result["replays_ok"] = float(empty.stats().retraces == 0 and planned.stats().retraces == 0)
    return result


if __name__ == "__main__":
    costs = replay_cost()
    bare = costs["bare_mode"]
    print(f"launch-bound tiny GPT: {costs['ops']:.0f} ops, {costs['planned_actions']:.0f} actions")
    for name in ("plain", "bare_mode", "empty_plan", "with_plan"):
        print(f"  {name:11s} {costs[name]:6.2f} us/op  {costs[name] / bare:4.2f} x bare mode")
