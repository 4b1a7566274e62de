"""Regression tests: a fault anywhere in a swapped step loses nothing and applies nothing twice.

Faults are injected by wrapping the methods of the engine's real ``LoopbackRuntime`` (and
its adapter) instance, so every byte really moves through the engine's own code.
"""

from __future__ import annotations

import copy
import signal
import warnings

import pytest
import torch

from swapopt_core import (
    SwapOptError,
    SwapOptimizerConfig,
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._swap.engine import engine_of


class _Boom(Exception):
    pass


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])


def _backward(model: torch.nn.Module, seed: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def _pair(packed: bool, swap_times: int = 3) -> tuple:
    plain_model, swapped_model = _model(), _model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    swapped = torch.optim.Adam(swapped_model.parameters(), lr=1e-2)
    config = SwapOptimizerConfig(
        swap_times=swap_times, min_numel=0, runtime="loopback", packed_swap=packed
    )
    swap_optimizer(swapped, config)
    return plain_model, plain, swapped_model, swapped


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    _backward(model, seed)
    opt.step()


def _assert_equal(model_a, opt_a, model_b, opt_b) -> None:  # noqa: ANN001
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
        assert opt_a.state[a].keys() == opt_b.state[b].keys()
        for key, value in opt_a.state[a].items():
            assert torch.equal(value, opt_b.state[b][key]), key


def _fail_once(obj: object, name: str, error: type, *, at: int = 1, after: bool = False) -> None:
    """Make ``obj.name`` raise ``error`` on its ``at``-th call (after running it if ``after``)."""
    original = getattr(obj, name)
    calls = {"n": 0}

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] != at:
            return original(*args, **kwargs)
        if after:
            original(*args, **kwargs)
        raise error("injected")

    setattr(obj, name, failing)


def _interrupted_then_retried(pair: tuple, obj_of, name: str, error: type, **kw) -> None:  # noqa: ANN001
    plain_model, plain, swapped_model, swapped = pair
    _step(plain_model, plain, 0)
    _step(swapped_model, swapped, 0)
    _step(plain_model, plain, 1)
    swapped.zero_grad()
    _backward(swapped_model, 1)
    _fail_once(obj_of(engine_of(swapped)), name, error, **kw)
    with pytest.raises(error):
        swapped.step()
    swapped.step()  # same gradients: finishes the step
    _assert_equal(plain_model, plain, swapped_model, swapped)
    for seed in (2, 3):
        _step(plain_model, plain, seed)
        _step(swapped_model, swapped, seed)
    _assert_equal(plain_model, plain, swapped_model, swapped)
    assert swap_stats(swapped).resident_state_bytes == 0


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
@pytest.mark.parametrize("error", [_Boom, KeyboardInterrupt])
def test_a_failed_copy_out_keeps_the_batch_moments(packed: bool, error: type) -> None:
    # Before: the batch counted as updated but its moments never reached host memory.
    _interrupted_then_retried(_pair(packed), lambda e: e.runtime, "copy_out", error, at=2)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_an_interrupt_before_the_copy_out_is_queued_still_writes_the_batch_back(
    packed: bool,
) -> None:
    # Before: the failed-batch marker was cleared before copy_out was queued.
    _interrupted_then_retried(
        _pair(packed), lambda e: e.runtime, "copy_out", KeyboardInterrupt, at=1
    )


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
@pytest.mark.parametrize("error", [_Boom, KeyboardInterrupt])
def test_a_failure_after_the_update_ran_does_not_apply_it_twice(packed: bool, error: type) -> None:
    # Before: the retry ran the batch again: step counter 3 where plain Adam reads 2.
    _interrupted_then_retried(_pair(packed), lambda e: e.adapter, "update", error, at=2, after=True)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_a_failed_copy_out_twice_keeps_the_batch_on_the_device_until_written_back(
    packed: bool,
) -> None:
    plain_model, plain, swapped_model, swapped = _pair(packed)
    _step(plain_model, plain, 0)
    swapped.zero_grad()
    _backward(swapped_model, 0)
    runtime = engine_of(swapped).runtime
    original = runtime.copy_out
    runtime.copy_out = lambda pairs, **kw: (_ for _ in ()).throw(_Boom("copy engine down"))
    with pytest.raises(_Boom):
        swapped.step()
    stats = swap_stats(swapped)
    assert stats.resident_state_bytes > 0  # the updated batch is kept, not lost
    assert stats.steps == 0
    runtime.copy_out = original
    state = swapped.state_dict()["state"]  # writes the kept batch back first
    assert all({"step", "exp_avg", "exp_avg_sq"} <= set(s) for s in state.values())
    assert swap_stats(swapped).resident_state_bytes == 0
    swapped.step()
    _assert_equal(plain_model, plain, swapped_model, swapped)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_a_failed_release_leaves_the_stats_true(packed: bool) -> None:
    # Before: resident_state_bytes read 256 (per-tensor) or -16384 (packed) for good.
    plain_model, plain, swapped_model, swapped = _pair(packed)
    _fail_once(engine_of(swapped).runtime, "release_ordered", _Boom, at=1)
    swapped.zero_grad()
    _backward(swapped_model, 0)
    with pytest.raises(_Boom):
        swapped.step()
    assert swap_stats(swapped).resident_state_bytes == 0
    swapped.step()
    _step(plain_model, plain, 0)
    for seed in (1, 2):
        _step(plain_model, plain, seed)
        _step(swapped_model, swapped, seed)
    assert swap_stats(swapped).resident_state_bytes == 0
    assert swap_stats(swapped).steps == 3
    _assert_equal(plain_model, plain, swapped_model, swapped)


def test_host_memory_exhausted_at_the_first_step_leaves_no_half_state() -> None:
    # Before: only `step` was left in the state; every later step and unswap: KeyError.
    plain_model, plain, swapped_model, swapped = _pair(packed=False)
    _fail_once(engine_of(swapped).runtime, "alloc_host", MemoryError, at=4)
    swapped.zero_grad()
    _backward(swapped_model, 0)
    with pytest.raises(MemoryError):
        swapped.step()
    for state in swapped.state.values():
        assert not state or {"step", "exp_avg", "exp_avg_sq"} <= state.keys()
    swapped.step()
    _step(plain_model, plain, 0)
    _assert_equal(plain_model, plain, swapped_model, swapped)
    unswap_optimizer(swapped)
    for seed in (1, 2):
        _step(plain_model, plain, seed)
        _step(swapped_model, swapped, seed)
    _assert_equal(plain_model, plain, swapped_model, swapped)


@pytest.mark.parametrize("swap_times", [1, 3])
def test_zero_size_parameters_swap_in_packed_mode(swap_times: int) -> None:
    # Before: IndexError (list index out of range) when a batch held only zero-size state.
    def params() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s)) for s in ((0,), (5,), (0, 3), (7,))]

    plain_params, swapped_params = params(), params()
    plain = torch.optim.Adam(plain_params)
    swapped = torch.optim.Adam(swapped_params)
    swap_optimizer(swapped, SwapOptimizerConfig(swap_times=swap_times, runtime="loopback"))
    only_empty = torch.optim.Adam([torch.nn.Parameter(torch.zeros(0))])
    swap_optimizer(only_empty, SwapOptimizerConfig(runtime="loopback", min_numel=0))
    only_empty.param_groups[0]["params"][0].grad = torch.zeros(0)
    only_empty.step()
    for step in range(3):
        for ps, opt in ((plain_params, plain), (swapped_params, swapped)):
            for k, p in enumerate(ps):
                p.grad = torch.full_like(p, float(step + k))
            opt.step()
    for a, b in zip(plain_params, swapped_params, strict=True):
        assert torch.equal(a, b)
        for key, value in plain.state[a].items():
            assert torch.equal(value, swapped.state[b][key])


def test_a_parameter_listed_twice_is_refused_at_install_and_at_step() -> None:
    weight = torch.nn.Parameter(torch.randn(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the duplicate itself
        opt = torch.optim.Adam([weight, weight])
    config = SwapOptimizerConfig(runtime="loopback", min_numel=0)
    with pytest.raises(SwapOptError, match=r"\['params'\]\[1\] is the same tensor.*\[0\]"):
        swap_optimizer(opt, config)
    other = torch.nn.Parameter(torch.randn(8))
    opt = swap_optimizer(torch.optim.Adam([other]), config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.add_param_group({"params": [weight, weight]})
    weight.grad = torch.ones(8)
    with pytest.raises(SwapOptError, match="dict.fromkeys"):
        opt.step()


def test_a_named_runtime_that_serves_no_parameter_is_refused() -> None:
    # Before: runtime="cuda" with CPU parameters installed, swapped nothing, said nothing.
    opt = torch.optim.Adam([torch.nn.Parameter(torch.randn(8))])
    with pytest.raises(ValueError, match=r"runtime='cuda'.*\['cpu'\].*loopback"):
        swap_optimizer(opt, SwapOptimizerConfig(runtime="cuda"))
    assert engine_of(opt) is None


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs SIGINT")
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_ctrl_c_during_a_step_is_delivered_once_the_step_is_complete(packed: bool) -> None:
    plain_model, plain, swapped_model, swapped = _pair(packed)
    runtime = engine_of(swapped).runtime
    original = runtime.copy_out
    sent = []

    def copy_out_then_ctrl_c(pairs, **kw):  # noqa: ANN001, ANN003, ANN202
        result = original(pairs, **kw)
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)  # between two lines of the pipeline
        return result

    runtime.copy_out = copy_out_then_ctrl_c
    swapped.zero_grad()
    _backward(swapped_model, 0)
    with pytest.raises(KeyboardInterrupt):
        swapped.step()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert swap_stats(swapped).steps == 1  # the whole step ran before the interrupt
    _step(plain_model, plain, 0)
    _assert_equal(plain_model, plain, swapped_model, swapped)


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs SIGINT")
def test_a_second_ctrl_c_interrupts_the_step_at_once() -> None:
    _, _, swapped_model, swapped = _pair(packed=True)
    runtime = engine_of(swapped).runtime
    original = runtime.copy_in
    calls = []

    def copy_in_with_two_ctrl_c(pairs, after=(), **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append(True)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        return original(pairs, after, **kw)

    runtime.copy_in = copy_in_with_two_ctrl_c
    swapped.zero_grad()
    _backward(swapped_model, 0)
    with pytest.raises(KeyboardInterrupt):
        swapped.step()
    assert len(calls) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert swap_stats(swapped).steps == 0
    assert swap_stats(swapped).resident_state_bytes == 0


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
@pytest.mark.parametrize("fault", ["copy_out-kept", "update-after"])
def test_unswap_right_after_a_failure_gives_a_working_plain_optimizer(
    packed: bool, fault: str
) -> None:
    _, _, swapped_model, swapped = _pair(packed)
    _step(swapped_model, swapped, 0)
    swapped.zero_grad()
    _backward(swapped_model, 1)
    engine = engine_of(swapped)
    if fault == "copy_out-kept":
        original = engine.runtime.copy_out
        engine.runtime.copy_out = lambda pairs, **kw: (_ for _ in ()).throw(_Boom("down"))
    else:
        _fail_once(engine.adapter, "update", _Boom, at=2, after=True)
    with pytest.raises(_Boom):
        swapped.step()
    if fault == "copy_out-kept":
        engine.runtime.copy_out = original
    unswap_optimizer(swapped)  # writes a kept batch back first
    assert engine_of(swapped) is None
    # The plain optimizer now holds exactly what the interrupted step left: a plain
    # optimizer built from the same parameters and state steps to the same result.
    reference_model = _model()
    reference_model.load_state_dict(swapped_model.state_dict())
    reference = torch.optim.Adam(reference_model.parameters(), lr=1e-2)
    reference.load_state_dict(copy.deepcopy(swapped.state_dict()))
    for model, opt in ((reference_model, reference), (swapped_model, swapped)):
        _step(model, opt, 2)
    _assert_equal(reference_model, reference, swapped_model, swapped)
    assert all(len(s) == 3 for s in swapped.state.values())
