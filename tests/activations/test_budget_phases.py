"""The whole-step budget's phases: forward and backward, then the update (its staging).

A step whose closure runs forward and backward inside ``opt.step(closure)`` (Lightning's
automatic optimization, or an own loop's closure) must not have those bytes taken for the
update's: they would price the staging of a 256 x 256 parameter's state at tens of MiB.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from swapopt_core import OffloadConfig, OffloadSession

MIB = 2**20
BATCH = 16384


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 32, generator=gen), torch.randn(BATCH, 1, generator=gen)


def _budgeted(opt: torch.optim.Optimizer) -> OffloadSession:
    config = OffloadConfig(device_budget_mb=64, runtime="loopback", min_offload_kib=0)
    return OffloadSession(config, optimizer=opt)


def _train(
    steps: int, window: str, session_of: Callable[[torch.optim.Optimizer], OffloadSession] | None
) -> tuple[nn.Module, OffloadSession | None]:
    """``window="around"``: Lightning's shape, the window opens before ``opt.step(closure)``
    and closes inside the closure after backward; ``"inside"``: the closure's own ``with``."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = session_of(opt) if session_of is not None else None
    for step in range(steps):
        x, y = _batch(step)
        if session is not None and window == "around":
            session.__enter__()

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            if session is not None and window == "inside":
                session.__enter__()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if session is not None:
                session.__exit__(None, None, None)
            return loss

        opt.step(closure)
        opt.zero_grad()
    return model, session


@pytest.mark.parametrize("window", ["around", "inside"])
def test_a_closure_forward_and_backward_is_no_part_of_the_update(window: str) -> None:
    model, session = _train(4, window, _budgeted)
    plain, _ = _train(4, window, None)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    assert session is not None
    # The update of AdamW's state of a 256 x 256 weight (512 KiB) holds a few MiB beyond its
    # start, not forward's and backward's activations (about 60 MiB here).
    plan = session._budget.plan  # noqa: SLF001
    assert plan is not None and plan.update_extra_bytes < 4 * MIB, plan.update_extra_bytes
