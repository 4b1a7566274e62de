"""One device budget for the whole step: bit-exact training, the plan, the meter, errors."""

from __future__ import annotations

import pytest
import torch

from swapopt_core import OffloadConfig, OffloadSession, swap_stats
from tests.activations.loops import backward, gpt, tokens

MIB = 2**20


def _plain(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        backward(model, tokens(step))
        opt.step()
        opt.zero_grad()
    return model, opt


def _budgeted(
    budget_mb: float, runtime: str, steps: int, *, reload_at: int | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, OffloadSession]:
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = OffloadConfig(device_budget_mb=budget_mb, runtime=runtime, min_offload_kib=0)
    session = OffloadSession(config, optimizer=opt)
    for step in range(steps):
        if step == reload_at:
            opt.load_state_dict(opt.state_dict())  # a checkpoint round trip mid-run
        with session:
            backward(model, tokens(step))
        opt.step()
        opt.zero_grad()
    return model, opt, session


def _same(a: tuple, b: tuple) -> None:
    model_a, opt_a = a
    model_b, opt_b = b
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q)
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for name, value in state_a[key].items():
            assert torch.equal(value.cpu(), state_b[key][name].cpu()), (key, name)


@pytest.fixture(scope="module")
def plain_peak() -> int:
    """The whole step's peak with a budget that holds everything (nothing moves)."""
    *_, session = _budgeted(1 << 20, "loopback", 2)
    stats = session.stats()
    assert stats.resident_state_fraction == 1.0 and stats.activation_budget_bytes is None
    return stats.planned_step_peak_device_bytes


def test_a_budget_that_fits_moves_nothing_after_the_first_step(plain_peak: int) -> None:
    model, opt, session = _budgeted(1 << 20, "loopback", 4)
    before = swap_stats(opt).h2d_bytes
    backward(model, tokens(9))
    with session:
        backward(model, tokens(10))
    opt.step()
    assert swap_stats(opt).h2d_bytes == before


@pytest.mark.parametrize("share", [0.7, 0.5])
def test_training_under_a_device_budget_is_bit_exact(
    runtime_name: str, plain_peak: int, share: float
) -> None:
    budget_mb = plain_peak * share / MIB
    model, opt, session = _budgeted(budget_mb, runtime_name, 6, reload_at=3)
    _same((model, opt), _plain(6))
    stats = session.stats()
    assert stats.planned_step_peak_device_bytes <= budget_mb * MIB
    assert stats.resident_state_fraction < 1.0 or stats.activation_budget_bytes is not None
    assert stats.step_peak_device_bytes <= budget_mb * MIB * 1.02
    assert stats.planned_step_ms >= stats.plain_step_ms * 0.999


def test_a_device_budget_needs_the_optimizer() -> None:
    with pytest.raises(ValueError, match="optimizer=opt"):
        OffloadSession(OffloadConfig(device_budget_mb=64))
    opt = torch.optim.AdamW(gpt().parameters())
    with pytest.raises(ValueError, match="no device_budget_mb"):
        OffloadSession(OffloadConfig(max_resident_activation_mb=64), optimizer=opt)


def test_both_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="device_budget_mb=64 and max_resident"):
        OffloadConfig(device_budget_mb=64, max_resident_activation_mb=32)


def test_a_budget_below_the_parameters_says_what_it_needs() -> None:
    opt = torch.optim.AdamW(gpt().parameters())
    with pytest.raises(ValueError, match=r"device_budget_mb=0.01 .*parameters .*gradients"):
        OffloadSession(OffloadConfig(device_budget_mb=0.01, runtime="loopback"), optimizer=opt)
