"""``EngineBase.costs()``: what the update cost at a measured step, for the step planner."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swapopt_core import swap_optimizer
from swapopt_core._api import reconfigure_swap
from swapopt_core._planning.whole_step import OptimizerCosts
from swapopt_core._swap.engine import engine_of
from tests.conftest import loopback, make_model, train

#: Each test runs on the synchronous loopback and on loopback-async with jitter.
pytestmark = pytest.mark.usefixtures("swap_runtime")


def _swapped(width: int = 16, **config) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    swap_optimizer(opt, loopback(**{"swap_times": 3, "min_numel": 64, **config}))
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, width: int = 16) -> None:
    opt.zero_grad()
    model(torch.ones(2, width)).square().mean().backward()
    opt.step()


def test_costs_is_none_before_the_first_step_then_measured() -> None:
    model, opt = _swapped()
    engine = engine_of(opt)
    assert engine.costs() is None
    _step(model, opt)
    costs = engine.costs()
    assert isinstance(costs, OptimizerCosts)
    # Adam keeps exp_avg and exp_avg_sq (fp32) per weight (16 x 16); the biases (16) are
    # below min_numel, and with the step counters they are the fixed state.
    assert costs.unit_bytes == (2 * 256 * 4,) * 4
    assert costs.fixed_state_bytes == 4 * 2 * 16 * 4 + sum(
        s["step"].numel() * s["step"].element_size() for s in opt.state.values()
    )
    assert costs.update_ms_per_byte > 0
    assert costs.staging_factor > 0 and costs.batch_overhead_ms == 0.0


def test_only_asked_steps_are_measured() -> None:
    model, opt = _swapped()
    engine = engine_of(opt)
    _step(model, opt)
    first = engine.costs()
    _step(model, opt)
    assert engine.costs() is first  # not measured again
    engine.measure_next_step()
    _step(model, opt)
    assert engine.costs() is not first and engine.costs() is not None


def test_bigger_state_costs_more_bytes() -> None:
    small_model, small = _swapped(16)
    big_model, big = _swapped(32)
    _step(small_model, small, 16)
    _step(big_model, big, 32)
    a, b = engine_of(small).costs(), engine_of(big).costs()
    assert a is not None and b is not None
    assert len(a.unit_bytes) == len(b.unit_bytes)
    assert all(x < y for x, y in zip(a.unit_bytes, b.unit_bytes, strict=True))
    assert a.fixed_state_bytes < b.fixed_state_bytes


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_the_resident_fraction_does_not_change_unit_bytes(fraction: float) -> None:
    model, opt = _swapped()
    engine = engine_of(opt)
    _step(model, opt)
    before = engine.costs()
    reconfigure_swap(opt, dataclasses.replace(engine.config, resident_state_fraction=fraction))
    engine.measure_next_step()
    _step(model, opt)
    after = engine.costs()
    assert before is not None and after is not None
    assert after.unit_bytes == before.unit_bytes
    assert after.fixed_state_bytes == before.fixed_state_bytes


def test_unit_bytes_cover_parameters_without_a_gradient_this_step() -> None:
    """``odd`` has a gradient on odd steps only: it keeps its place in ``unit_bytes``."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    swap_optimizer(opt, loopback(swap_times=3, min_numel=64))
    engine = engine_of(opt)
    train(model, opt, 2)  # ``odd`` has state from step 1 on
    engine.measure_next_step()
    train(model, opt, 1, start=2)  # an even step: no gradient for ``odd``
    measured = engine.costs()
    assert measured is not None
    with_state = [p for p in model.parameters() if opt.state.get(p) and p.numel() >= 64]
    assert len(measured.unit_bytes) == len(with_state)
