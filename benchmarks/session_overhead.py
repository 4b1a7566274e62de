"""Step time of a ~30M-parameter GPT-style model inside an OffloadSession that never binds.

Measures what tracing and replaying cost by themselves: the budget is far above the natural
peak, so the plan is empty and nothing moves. Plain and session steps alternate so they see
the same machine load; the ratio of medians is reported.
"""

from __future__ import annotations

import statistics
import time

import torch

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._cli.demo import _TinyGPT


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
