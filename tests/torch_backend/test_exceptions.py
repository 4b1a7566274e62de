"""An exception in a step leaves the optimizer consistent, drained and usable."""

from __future__ import annotations

import pytest
import torch

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._torch.adam import TorchAdamAdapter


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])


def _backward(model: torch.nn.Module, seed: int) -> torch.Tensor:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
    loss = model(x).square().mean()
    loss.backward()
    return loss


def _pair(packed: bool) -> tuple:
    plain_model, swapped_model = _model(), _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    swapped = torch.optim.AdamW(swapped_model.parameters(), lr=1e-2)
    config = SwapOptimizerConfig(swap_times=3, min_numel=0, runtime="loopback", packed_swap=packed)
    swap_optimizer(swapped, config)
    return plain_model, plain, swapped_model, swapped


def _assert_equal(model_a, opt_a, model_b, opt_b) -> None:  # noqa: ANN001
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in opt_a.state[a].items():
            assert torch.equal(value, opt_b.state[b][key]), key


def _train_both(pair: tuple, seeds: range) -> None:
    plain_model, plain, swapped_model, swapped = pair
    for seed in seeds:
        for model, opt in ((plain_model, plain), (swapped_model, swapped)):
            opt.zero_grad()
            _backward(model, seed)
            opt.step()


class _Boom(Exception):
    pass


def _fail_on_call(
    monkeypatch: pytest.MonkeyPatch, owner: type, name: str, error: type, calls: dict
) -> None:
    """Make ``owner.name`` raise ``error`` on the call numbered ``calls["fail"]`` (from 1)."""
    original = getattr(owner, name)
    calls.setdefault("n", 0)

    def failing(self, *args, **kwargs):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == calls["fail"]:
            raise error("injected")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


@pytest.mark.parametrize("packed", [True, False])
def test_closure_exception_changes_nothing(packed: bool) -> None:
    pair = _pair(packed)
    _train_both(pair, range(3))
    plain_model, plain, swapped_model, swapped = pair

    def closure() -> torch.Tensor:
        raise _Boom

    with pytest.raises(_Boom):
        swapped.step(closure)
    assert swap_stats(swapped).resident_state_bytes == 0
    _assert_equal(plain_model, plain, swapped_model, swapped)
    _train_both(pair, range(3, 6))
    _assert_equal(plain_model, plain, swapped_model, swapped)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("error", [_Boom, KeyboardInterrupt])
@pytest.mark.parametrize("failing_batch", [0, 1, 2])
def test_update_exception_drains_and_repeating_the_step_matches(
    monkeypatch: pytest.MonkeyPatch, packed: bool, error: type, failing_batch: int
) -> None:
    pair = _pair(packed)
    _train_both(pair, range(2))
    plain_model, plain, swapped_model, swapped = pair
    _fail_on_call(monkeypatch, TorchAdamAdapter, "update", error, {"fail": failing_batch + 1})
    plain.zero_grad()
    _backward(plain_model, 2)
    plain.step()
    swapped.zero_grad()
    _backward(swapped_model, 2)
    before = swap_stats(swapped)
    with pytest.raises(error):
        swapped.step()
    after = swap_stats(swapped)
    assert after.resident_state_bytes == 0
    assert after.steps == before.steps  # the interrupted step is not counted
    swapped.step()  # same gradients: finishes the interrupted step
    _assert_equal(plain_model, plain, swapped_model, swapped)
    _train_both(pair, range(3, 6))
    _assert_equal(plain_model, plain, swapped_model, swapped)


@pytest.mark.parametrize("packed", [True, False])
def test_new_gradients_after_an_interruption_give_a_full_step(
    monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    pair = _pair(packed)
    plain_model, plain, swapped_model, swapped = pair
    _fail_on_call(monkeypatch, TorchAdamAdapter, "update", _Boom, {"fail": 2})
    swapped.zero_grad()
    _backward(swapped_model, 0)
    with pytest.raises(_Boom):
        swapped.step()
    # A plain optimizer interrupted after its first batch, then stepped on new gradients.
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_opt.zero_grad()
    _backward(reference, 0)
    first = list(reference.parameters())[: len(list(reference.parameters())) // 3]
    groups = ref_opt.param_groups[0]["params"]
    ref_opt.param_groups[0]["params"] = first
    ref_opt.step()
    ref_opt.param_groups[0]["params"] = groups
    for model, opt in ((reference, ref_opt), (swapped_model, swapped)):
        opt.zero_grad()
        _backward(model, 1)
        opt.step()
    _assert_equal(reference, ref_opt, swapped_model, swapped)


@pytest.mark.parametrize("packed", [True, False])
def test_allocation_failure_mid_pipeline_is_drained(
    monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    pair = _pair(packed)
    _train_both(pair, range(2))
    plain_model, plain, swapped_model, swapped = pair
    alloc = LoopbackRuntime.alloc_device
    for model, opt in ((plain_model, plain), (swapped_model, swapped)):
        opt.zero_grad()
        _backward(model, 2)
    plain.step()
    # Backward brought batches 0 and 1 in already: the step's first allocation is the one
    # for batch 2, after batch 0 was updated and copied out.
    assert swap_stats(swapped).resident_state_bytes > 0
    _fail_on_call(monkeypatch, LoopbackRuntime, "alloc_device", MemoryError, {"fail": 1})
    with pytest.raises(MemoryError):
        swapped.step()
    assert swap_stats(swapped).resident_state_bytes == 0
    monkeypatch.setattr(LoopbackRuntime, "alloc_device", alloc)
    swapped.step()
    _assert_equal(plain_model, plain, swapped_model, swapped)
