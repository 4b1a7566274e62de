"""The session's replays are exact in fresh processes too: each has its own heap layout,
address space and hash seed, so state left behind by a session, or identity by address,
shows as different bits in some of them.

This is the run of issue 29: a plain AdamW steps between entries, and a twin without the
session gets the same batches; every step's gradients and the final parameters must match.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import copy, logging, sys
    import torch
    from swapopt_core import OffloadConfig, OffloadSession

    logging.disable(logging.WARNING)  # the tight budget is infeasible: it says so
    runtime, dropout = sys.argv[1], sys.argv[2] == "1"
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(),
        torch.nn.Dropout(0.1) if dropout else torch.nn.Identity(),
        torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 10),
    )
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    config = OffloadConfig(max_resident_activation_mb=0.05, runtime=runtime, min_offload_kib=0)
    session = OffloadSession(config)
    for i in range(5):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(i))
        torch.manual_seed(100 + i)
        a(x).square().mean().backward()
        torch.manual_seed(100 + i)
        with session:
            b(x).square().mean().backward()
        for n, (p, q) in enumerate(zip(a.parameters(), b.parameters())):
            if not torch.equal(p.grad, q.grad):
                print(f"step {i}: gradient {n} differs")
                sys.exit(1)
        oa.step(); ob.step(); oa.zero_grad(); ob.zero_grad()
    if not all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())):
        print("parameters differ")
        sys.exit(1)
    stats = session.stats()
    assert stats.replays == 4 and stats.d2h_bytes > 0, stats
    print("exact")
    """
)


@pytest.mark.parametrize(
    ("runtime", "dropout"), [("loopback", "0"), ("loopback", "1"), ("loopback-async", "1")]
)
def test_replays_are_exact_in_fresh_processes(runtime: str, dropout: str) -> None:
    for hash_seed in range(2):
        env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "SWAPOPT_LOOPBACK_JITTER_US": "300"}
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT, runtime, dropout],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0 and done.stdout.strip() == "exact", (
            hash_seed,
            done.stdout,
            done.stderr[-2000:],
        )
