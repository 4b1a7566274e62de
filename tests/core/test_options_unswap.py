"""``unswap_optimizer`` on an optimizer that is not swapped says so; swapopt's own ways out
(the callback core's ``remove``, an Accelerate ``SwapState``'s ``unswap``) never trigger it."""

from __future__ import annotations

import warnings

import pytest
import torch

from swapopt_core import (
    SwapOptimizerConfig,
    SwapOptWarning,
    is_swap_optimizer,
    swap_optimizer,
    unswap_optimizer,
)
from swapopt_core.callbacks import SwapCallbackCore
from swapopt_core.options import SwapSettings
from swapopt_core.swaps import SwapState

LOOPBACK = SwapOptimizerConfig(runtime="loopback", min_numel=0)


def _adam() -> torch.optim.Adam:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(64))])


def test_unswap_of_a_plain_optimizer_warns_and_changes_nothing() -> None:
    opt = _adam()
    before = opt.state_dict()
    with pytest.warns(SwapOptWarning) as caught:
        assert unswap_optimizer(opt) is opt
    assert [str(w.message) for w in caught] == [
        "unswap_optimizer: this Adam is not swapped, so nothing was undone. Pass the optimizer "
        "swap_optimizer returned (not a wrapper around it), or check "
        "is_swap_optimizer(optimizer) first."
    ]
    assert caught[0].filename == __file__  # points at the caller
    assert opt.state_dict() == before and not is_swap_optimizer(opt)


def test_unswap_of_a_swapped_optimizer_is_silent() -> None:
    opt = swap_optimizer(_adam(), LOOPBACK)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unswap_optimizer(opt)
    assert not is_swap_optimizer(opt)


def test_swap_state_unswaps_only_what_is_swapped() -> None:
    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(64))])
    adam, kept = _adam(), swap_optimizer(_adam(), LOOPBACK)
    state = SwapState(SwapSettings(offload_optimizer_device="cpu", runtime="loopback"), lambda o: o)
    with pytest.warns(SwapOptWarning, match="LBFGS"):  # refused: stays as it is
        state.install([lbfgs, adam, kept])
    assert is_swap_optimizer(adam) and not is_swap_optimizer(lbfgs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.unswap()
    assert not any(map(is_swap_optimizer, (lbfgs, adam, kept)))


def test_callback_core_remove_skips_an_optimizer_unswapped_by_hand() -> None:
    core = SwapCallbackCore(LOOPBACK)
    first, second = _adam(), _adam()
    core.install([first, second])
    assert is_swap_optimizer(first) and is_swap_optimizer(second)
    unswap_optimizer(first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        core.remove()
    assert not is_swap_optimizer(second)
