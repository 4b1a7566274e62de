"""``swap_automatically``: the one install the automatic ways in use, and ``SWAPOPT_STRICT``."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from swapopt_core import (
    SwapOptError,
    SwapOptimizerConfig,
    SwapOptWarning,
    UnsupportedOptimizerError,
    is_swap_optimizer,
    swap_optimizer,
    unswap_optimizer,
)
from swapopt_core._automatic import STRICT_ENV, refused, strict_mode, swap_automatically

LOOPBACK = SwapOptimizerConfig(runtime="loopback", min_numel=0)


@pytest.fixture(autouse=True)
def no_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STRICT_ENV, raising=False)


def _lbfgs() -> torch.optim.Optimizer:
    return torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(8))])


def _refusals(run) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in record if issubclass(w.category, SwapOptWarning)]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", False), ("  ", False), ("0", False), ("No", False), ("off", False), ("FALSE", False)]
    + [("1", True), ("yes", True), ("On", True), (" true ", True)],
)
def test_strict_words(value: str, expected: bool) -> None:
    assert strict_mode({STRICT_ENV: value}) is expected
    assert strict_mode({}) is False


@pytest.mark.parametrize("value", ["2", "strict", "yess"])
def test_strict_bad_value_is_named(value: str) -> None:
    with pytest.raises(ValueError) as info:
        strict_mode({STRICT_ENV: value})
    message = str(info.value)
    assert f"SWAPOPT_STRICT={value!r}" in message
    assert "1/true/yes" in message and "0/false/no" in message


def test_unserved_is_left_alone_and_warned_once_per_optimizer() -> None:
    first, second = _lbfgs(), _lbfgs()
    results: list[bool] = []
    said = _refusals(lambda: results.extend(swap_automatically(first, LOOPBACK) for _ in "ab"))
    assert results == [False, False] and not is_swap_optimizer(first) and refused(first)
    (message,) = said
    assert message.startswith("swapopt leaves torch.optim.lbfgs.LBFGS unswapped: ")
    assert "cannot swap torch.optim.lbfgs.LBFGS" in message  # the refusal's reason
    assert "without swapping this optimizer" in message and "SWAPOPT_STRICT=1" in message
    assert len(_refusals(lambda: swap_automatically(second, LOOPBACK))) == 1
    assert not refused(torch.optim.Adam([torch.nn.Parameter(torch.zeros(8))]))


def test_served_is_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(8))])
    assert swap_automatically(opt, LOOPBACK) and is_swap_optimizer(opt)
    unswap_optimizer(opt)


def test_strict_raises_and_explicit_swap_always_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS"):
        swap_optimizer(_lbfgs(), LOOPBACK)
    monkeypatch.setenv(STRICT_ENV, "yes")
    opt = _lbfgs()
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS"):
        swap_automatically(opt, LOOPBACK)
    assert not refused(opt)
    monkeypatch.setenv(STRICT_ENV, "perhaps")
    with pytest.raises(ValueError, match="SWAPOPT_STRICT"):
        swap_automatically(torch.optim.Adam([torch.nn.Parameter(torch.zeros(8))]), LOOPBACK)


def test_other_errors_propagate() -> None:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(8))])
    swap_optimizer(opt, LOOPBACK)
    try:
        with pytest.raises(SwapOptError, match="already swapped") as info:
            swap_automatically(opt, SwapOptimizerConfig(runtime="loopback", swap_times=3))
        assert not isinstance(info.value, UnsupportedOptimizerError)
        config = SwapOptimizerConfig(runtime="loopback", state_keys=("nope",))
        adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(8))])
        with pytest.raises(ValueError, match="state_keys"):
            swap_automatically(adamw, config)
    finally:
        unswap_optimizer(opt)


class _UnhashableLBFGS(torch.optim.LBFGS):
    """An optimizer a WeakSet cannot hold: ``__eq__`` without ``__hash__``."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return self is other


def test_an_unhashable_refused_optimizer_is_not_confused_with_one_at_its_address() -> None:
    first = _UnhashableLBFGS([torch.nn.Parameter(torch.zeros(8))])
    assert len(_refusals(functools.partial(swap_automatically, first, LOOPBACK))) == 1
    assert refused(first)
    assert not _refusals(functools.partial(swap_automatically, first, LOOPBACK))  # named once
    address = id(first)
    del first
    # CPython hands the freed address to the next object of its size: allocate bare
    # objects until one lands there (all kept, so each try gets a new address).
    tries = [_UnhashableLBFGS.__new__(_UnhashableLBFGS) for _ in range(1000)]
    (second,) = [opt for opt in tries if id(opt) == address]
    torch.optim.LBFGS.__init__(second, [torch.nn.Parameter(torch.zeros(8))])
    assert not refused(second)
    assert len(_refusals(lambda: swap_automatically(second, LOOPBACK))) == 1
    assert refused(second)
