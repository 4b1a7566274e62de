"""``prefetch_batches``: how many of the next step's batches backward brings in."""

from __future__ import annotations

import pytest
import torch

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats
from swapopt_core._swap.engine import engine_of
from tests.conftest import assert_same, twin


def _mlp() -> torch.nn.Module:
    """Every parameter has a gradient at every step, so each step's batches are the last's."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])


def _backward(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(
    ("ahead", "fraction", "switched_on"),
    [(0, 0.0, True), (1, 0.0, True), (3, 0.0, True), (9, 0.0, True), (2, 0.5, True), (3, 0, False)],
)
def test_backward_brings_in_prefetch_batches(
    ahead: int, fraction: float, switched_on: bool, packed: bool
) -> None:
    plain_model = _mlp()
    model = twin(plain_model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = SwapOptimizerConfig(
        runtime="loopback-async",
        min_numel=0,
        swap_times=4,
        packed_swap=packed,
        prefetch_batches=ahead,
        prefetch_during_backward=switched_on,
        resident_state_fraction=fraction,
    )
    swap_optimizer(opt, config)
    engine = engine_of(opt)
    effective = ahead if switched_on else 0
    for step in range(4):
        _backward(plain_model, plain, step)
        _backward(model, opt, step)
        stats = swap_stats(opt)
        assert stats.prefetch_batches == effective
        held = stats.resident_for_good_bytes
        assert (held > 0) == (fraction > 0 and step > 0)  # state exists from the first step
        if step == 0:  # no plan yet: nothing comes in before the first step
            assert stats.resident_state_bytes == held
        else:
            plan = engine.prefetch.plan
            assert plan is not None and len(plan) == 4
            brought = sum(slot.nbytes for batch in plan[:effective] for slot in batch)
            assert stats.resident_state_bytes == held + brought
        plain.step()
        opt.step()
        after = swap_stats(opt)
        assert after.resident_state_bytes == after.resident_for_good_bytes
    assert_same(plain, opt, plain_model, model)
