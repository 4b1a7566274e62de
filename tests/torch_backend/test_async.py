"""The asynchronous paths on CPU: copies in flight after the step, prefetch during backward,
and the lanes that play the copy streams."""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch

from swapopt_core import (
    OffloadConfig,
    OffloadSession,
    SwapOptimizerConfig,
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._device.lanes import CopyFailed, Lane, LaneSettings
from swapopt_core._swap.engine import engine_of
from tests.conftest import assert_same, loss_of, make_model, train, twin


def _async(**kwargs) -> SwapOptimizerConfig:
    return SwapOptimizerConfig(runtime="loopback-async", min_numel=0, **kwargs)


def _mlp() -> torch.nn.Module:
    """Every parameter has a gradient at every step, so each step's batches are the last's."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])


def _pair(config: SwapOptimizerConfig, *, every_step: bool = False) -> tuple:
    plain_model = _mlp() if every_step else make_model()
    model = twin(plain_model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    swap_optimizer(opt, config)
    return plain_model, plain, model, opt


def _backward(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    if isinstance(model, torch.nn.Sequential):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
    else:
        loss_of(model, step).backward()


# ---- no host sync at the end of a step ------------------------------------------------------


def test_the_step_returns_while_its_copies_out_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWAPOPT_LOOPBACK_GBPS", "0.002")  # 2 MB/s: each batch takes ms
    plain_model, plain, model, opt = _pair(_async(swap_times=3, packed_swap=True))
    train(plain_model, plain, 2)
    train(model, opt, 2)
    engine = engine_of(opt)
    assert engine.last_out is not None and not engine.last_out.done()
    assert_same(plain, opt, plain_model, model)  # swap_stats inside waits for them
    assert engine.last_out is None


def test_bad_lane_settings_are_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opt = torch.optim.AdamW(make_model().parameters())
    for name, value in (("SWAPOPT_LOOPBACK_GBPS", "fast"), ("SWAPOPT_LOOPBACK_JITTER_US", "-1")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name}='{value}' is invalid"):
            swap_optimizer(opt, _async())
        monkeypatch.delenv(name)
    assert engine_of(opt) is None


# ---- prefetch during backward ----------------------------------------------------------------


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_backward_brings_the_first_two_batches_in(packed: bool) -> None:
    plain_model, plain, model, opt = _pair(
        _async(swap_times=4, packed_swap=packed), every_step=True
    )
    for step in range(5):
        _backward(plain_model, plain, step)
        _backward(model, opt, step)
        stats = swap_stats(opt)
        if step == 0:  # no plan yet: nothing comes in before the first step
            assert stats.resident_state_bytes == 0
        else:
            # Two of the four batches (packed: two of the three arenas).
            assert 0 < stats.resident_state_bytes < stats.peak_resident_state_bytes
            assert stats.h2d_bytes == step * stats.total_state_bytes  # counted at the step
        plain.step()
        opt.step()
        stats = swap_stats(opt)
        assert stats.resident_state_bytes == 0
        assert stats.h2d_bytes == stats.d2h_bytes == (step + 1) * stats.total_state_bytes
    assert_same(plain, opt, plain_model, model)


def test_prefetch_off_leaves_backward_without_state() -> None:
    _, _, model, opt = _pair(_async(swap_times=4, prefetch_during_backward=False))
    for step in range(3):
        _backward(model, opt, step)
        assert swap_stats(opt).resident_state_bytes == 0
        opt.step()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_prefetch_of_other_batches_is_given_back(packed: bool) -> None:
    """``SmallNet.odd`` has a gradient on odd steps only: every step's batches differ from
    the last step's, so each prefetch is for the wrong batches."""
    plain_model, plain, model, opt = _pair(_async(swap_times=3, packed_swap=packed))
    for step in range(6):
        for m, o in ((plain_model, plain), (model, opt)):
            _backward(m, o, step)
            o.step()
        assert swap_stats(opt).resident_state_bytes == 0
    assert_same(plain, opt, plain_model, model)


def test_load_state_dict_between_backward_and_step_drops_the_prefetch() -> None:
    plain_model, plain, model, opt = _pair(_async(swap_times=3, packed_swap=True))
    train(plain_model, plain, 3)
    train(model, opt, 3)
    checkpoint = copy.deepcopy(plain.state_dict())
    for entry in checkpoint["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key] = entry[key] * 0.5
    _backward(model, opt, 3)
    assert swap_stats(opt).resident_state_bytes > 0  # the prefetch of the old values
    opt.load_state_dict(copy.deepcopy(checkpoint))  # torch's loader keeps "step" as given
    assert swap_stats(opt).resident_state_bytes == 0
    plain.load_state_dict(copy.deepcopy(checkpoint))
    _backward(plain_model, plain, 3)
    plain.step()
    opt.step()
    assert_same(plain, opt, plain_model, model)


def test_unswap_between_backward_and_step_drops_the_prefetch() -> None:
    plain_model, plain, model, opt = _pair(_async(swap_times=3))
    train(plain_model, plain, 2)
    train(model, opt, 2)
    _backward(plain_model, plain, 2)
    _backward(model, opt, 2)
    assert swap_stats(opt).resident_state_bytes > 0
    unswap_optimizer(opt)
    assert engine_of(opt) is None
    plain.step()
    opt.step()
    train(plain_model, plain, 2, start=3)
    train(model, opt, 2, start=3)
    assert_same(plain, opt, plain_model, model)


def test_a_failing_prefetch_does_not_stop_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    plain_model, plain, model, opt = _pair(_async(swap_times=3))
    train(plain_model, plain, 2)
    train(model, opt, 2)
    runtime = engine_of(opt).runtime
    original = runtime.copy_in
    calls = []

    def failing(pairs, after=(), **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append(True)
        if len(calls) == 1:
            raise RuntimeError("copy engine down")
        return original(pairs, after, **kw)

    monkeypatch.setattr(runtime, "copy_in", failing)
    _backward(model, opt, 2)  # the prefetch fails and is given back; backward finishes
    assert calls and swap_stats(opt).resident_state_bytes == 0
    opt.step()
    _backward(plain_model, plain, 2)
    plain.step()
    assert_same(plain, opt, plain_model, model)


# ---- the lanes ---------------------------------------------------------------------------------


def test_a_lane_runs_in_order_and_waits_for_another_lanes_ticket() -> None:
    gate = threading.Event()
    first, second = Lane("d2h"), Lane("h2d")
    order: list[str] = []
    blocked = first.submit(lambda: (gate.wait(), order.append("out"))[0])
    after = second.submit(lambda: order.append("in"), after=[blocked])
    also = second.submit(lambda: order.append("in-2"))
    assert not blocked.done() and not after.done() and not also.done()
    gate.set()
    also.wait()
    assert order == ["out", "in", "in-2"]


def test_a_failed_operation_is_raised_where_its_ticket_is_waited_for() -> None:
    lane = Lane("h2d")
    bad = lane.submit(lambda: 1 / 0)
    good = lane.submit(lambda: None)
    good.wait()  # the lane goes on after a failure
    with pytest.raises(CopyFailed) as info:
        bad.wait()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    follower = Lane("d2h").submit(lambda: None, after=[bad])
    with pytest.raises(CopyFailed):
        follower.wait()


def test_a_paced_copy_is_still_pending_right_after_it_is_queued() -> None:
    lane = Lane("h2d", LaneSettings(gbps=0.001))  # 1 MB/s
    ticket = lane.submit(lambda: 100_000)  # "copies" 100 kB: 100 ms
    assert not ticket.done()
    ticket.wait()
    assert ticket.done()


@pytest.mark.parametrize(
    ("gbps", "jitter"), [(0, 0), (-1.0, 0), (float("nan"), 0), (None, -1), (None, 1.5)]
)
def test_lane_settings_refuse_nonsense(gbps: object, jitter: object) -> None:
    with pytest.raises(ValueError, match="is invalid"):
        LaneSettings(gbps=gbps, jitter_us=jitter)  # type: ignore[arg-type]


def test_the_prefetch_is_invisible_to_an_offload_session() -> None:
    """The prefetch runs inside backward, hence inside a session's tracer: it must not show
    up as ops of the model (the second step would then differ from the traced first one)."""
    plain_model, plain, model, opt = _pair(_async(swap_times=3), every_step=True)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.001, runtime="loopback"))
    for step in range(4):
        for m, o, traced in ((plain_model, plain, False), (model, opt, True)):
            o.zero_grad()
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            with session if traced else contextlib.nullcontext():
                m(x).square().mean().backward()
            o.step()
    stats = session.stats()
    assert (stats.warmups, stats.replays, stats.retraces) == (1, 3, 0)
    assert swap_stats(opt).h2d_bytes == 4 * swap_stats(opt).total_state_bytes
    assert_same(plain, opt, plain_model, model)
