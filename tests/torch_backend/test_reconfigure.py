"""``reconfigure_swap``: an installed swap takes a new config in place, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swapopt_core import SwapOptError, SwapOptimizerConfig, swap_optimizer, swap_stats
from swapopt_core._api import reconfigure_swap
from swapopt_core._swap.engine import engine_of
from tests.conftest import assert_same, loopback, loss_of, make_model, train, twin

#: Each test runs on the synchronous loopback and on loopback-async with jitter.
pytestmark = pytest.mark.usefixtures("swap_runtime")


def _pair(config: SwapOptimizerConfig) -> tuple:
    ma = make_model()
    mb = twin(ma)
    oa = torch.optim.AdamW(ma.parameters(), lr=0.01)
    ob = torch.optim.AdamW(mb.parameters(), lr=0.01)
    swap_optimizer(ob, config)
    return ma, oa, mb, ob


def _swappable_bytes(opt: torch.optim.Optimizer, min_numel: int) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for k, v in state.items()
        if k != "step" and v.numel() >= min_numel
    )


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_training_across_reconfigures_is_bit_for_bit(packed: bool) -> None:
    config = loopback(swap_times=2, min_numel=64, packed_swap=packed)
    ma, oa, mb, ob = _pair(config)
    step = 0
    changes = [
        {},
        {"resident_state_fraction": 0.5, "swap_times": 3},
        {"resident_state_fraction": 0.0, "prefetch_batches": 0},
        {"resident_state_fraction": 1.0, "min_numel": 0},
        {"resident_state_fraction": 0.6, "min_numel": 2000, "prefetch_batches": 3},
        {"resident_state_fraction": 0.0, "min_numel": 64},
    ]
    for change in changes:
        config = dataclasses.replace(config, **change)
        reconfigure_swap(ob, config)
        assert engine_of(ob).config == config
        for _ in range(3):
            train(ma, oa, 1, start=step)
            train(mb, ob, 1, start=step)
            step += 1
            assert_same(oa, ob, ma, mb)
        stats = swap_stats(ob)
        assert stats.total_state_bytes == _swappable_bytes(ob, config.min_numel)
        if config.resident_state_fraction == 0:
            assert stats.resident_for_good_bytes == stats.resident_state_bytes == 0
        else:
            assert 0 < stats.resident_for_good_bytes == stats.resident_state_bytes
        if config.resident_state_fraction == 1.0:
            assert stats.host_state_bytes == 0
        else:
            assert stats.host_state_bytes > 0


def test_reconfigure_between_backward_and_step() -> None:
    """A prefetch of the old plan is given back; the step updates from the new placement."""
    config = loopback(swap_times=3, min_numel=64)
    ma, oa, mb, ob = _pair(config)
    train(ma, oa, 2)
    train(mb, ob, 2)
    for fraction in (0.6, 0.0):
        for model, opt in ((ma, oa), (mb, ob)):
            opt.zero_grad()
            loss_of(model, 9).backward()
        reconfigure_swap(ob, dataclasses.replace(config, resident_state_fraction=fraction))
        oa.step()
        ob.step()
        assert_same(oa, ob, ma, mb)


def test_moving_state_never_holds_all_of_it() -> None:
    """Going from all swapped to half resident brings in only the resident half."""
    config = loopback(swap_times=3, min_numel=64)
    ma, oa, mb, ob = _pair(config)
    train(mb, ob, 2)
    total = swap_stats(ob).total_state_bytes
    engine = engine_of(ob)
    brought: list[int] = []
    bring_in = engine.book.before_bring_in

    def counting() -> None:
        bring_in()
        brought.append(1)

    engine.book.before_bring_in = counting
    reconfigure_swap(ob, dataclasses.replace(config, resident_state_fraction=0.5))
    stats = swap_stats(ob)
    assert brought and 0 < stats.resident_for_good_bytes <= total // 2
    assert stats.host_state_bytes + stats.resident_for_good_bytes == total


@pytest.mark.parametrize(
    ("field", "value"),
    [("runtime", "loopback-other"), ("packed_swap", False), ("state_keys", ("exp_avg",))],
)
def test_fields_that_need_a_reinstall_are_refused(field: str, value: object) -> None:
    config = loopback(swap_times=3, packed_swap=True)
    _, _, mb, ob = _pair(config)
    with pytest.raises(SwapOptError, match=rf"SwapOptimizerConfig\.{field} .*unswap_optimizer"):
        reconfigure_swap(ob, dataclasses.replace(config, **{field: value}))
    assert engine_of(ob).config == config


def test_reconfigure_needs_a_swapped_optimizer_and_a_config() -> None:
    opt = torch.optim.AdamW(make_model().parameters())
    with pytest.raises(ValueError, match="not swapped"):
        reconfigure_swap(opt, loopback())
    swap_optimizer(opt, loopback())
    with pytest.raises(TypeError, match="SwapOptimizerConfig"):
        reconfigure_swap(opt, {"swap_times": 3})  # type: ignore[arg-type]
    reconfigure_swap(opt, loopback())  # the same config: nothing to do
