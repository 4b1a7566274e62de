"""Faults inside a step of the generic per-parameter path lose nothing: the optimizer is left
consistent, and the same step again finishes it bit for bit.

SGD with momentum is faulted on its first step (the family creates its momentum buffers
inside the batch's update), RMSprop (centered, with momentum) on a later one (its state is
swapped in, updated in place, and its step counter changed by the update), each at every
entry point; the other families (scalar, factored and sparse state, foreach and fused
kernels) at a fault after a batch's update and at its copy out.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats
from swapopt_core._swap.engine import engine_of
from tests.conftest import ASYNC_JITTER_US, assert_same
from tests.torch_backend.per_parameter_cases import MIN_NUMEL, make_net, make_opt, step

pytestmark = pytest.mark.usefixtures("single_thread")

FAMILIES: dict[str, tuple[type, dict[str, Any], int]] = {
    # name: (class, flags, the step faulted)
    "SGD_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, 0),
    "RMSprop": (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}, 2),
    # A smaller matrix for the others: scalar state (ASGD's eta and mu, NAdam's mu_product),
    # factored state, sparse gradients, the foreach and fused kernels.
    "ASGD": (torch.optim.ASGD, {"t0": 1}, 2),
    "NAdam": (torch.optim.NAdam, {"weight_decay": 0.1}, 2),
    "Adafactor": (torch.optim.Adafactor, {"lr": 0.01}, 1),
    "SparseAdam": (torch.optim.SparseAdam, {}, 1),
    "Muon": (torch.optim.Muon, {}, 1),
    "SGD_foreach": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "foreach": True}, 0),
    "RMSprop_foreach": (torch.optim.RMSprop, {"momentum": 0.3, "foreach": True}, 2),
    "Adagrad_fused": (torch.optim.Adagrad, {"fused": True}, 1),
}
FULL = ("SGD_momentum", "RMSprop")
POINTS = ("update:before", "update:after", "copy_in", "copy_out", "alloc_host")
SWAP_TIMES = 3


class Injected(Exception):
    pass


def _swapped(name: str, packed: bool, runtime: str) -> tuple[torch.nn.Module, Any]:
    cls, flags, _ = FAMILIES[name]
    model = make_net(cls)
    opt = make_opt(cls, model, flags)
    config = SwapOptimizerConfig(
        runtime=runtime, swap_times=SWAP_TIMES, min_numel=MIN_NUMEL, packed_swap=packed
    )
    swap_optimizer(opt, config)
    return model, opt


def _target(opt: torch.optim.Optimizer, point: str) -> tuple[object, str]:
    engine = engine_of(opt)
    if point.startswith("update"):
        return engine.adapter, "update"
    return engine.runtime, point


def _grads(model: torch.nn.Module, opt: torch.optim.Optimizer, index: int) -> None:
    opt.zero_grad()
    model.loss(index).backward()  # type: ignore[operator]


@functools.cache
def _calls(name: str, packed: bool, runtime: str, point: str) -> int:
    """How often a clean faulted step reaches ``point`` after its backward."""
    model, opt = _swapped(name, packed, runtime)
    fault_step = FAMILIES[name][2]
    for index in range(fault_step):
        step(model, opt, index)
    _grads(model, opt, fault_step)  # a prefetch during backward may copy in already
    obj, attr = _target(opt, point)
    original, count = getattr(obj, attr), [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    setattr(obj, attr, counted)
    opt.step()
    return count[0]


def _inject(opt: torch.optim.Optimizer, point: str, at: int, error: type) -> None:
    obj, attr = _target(opt, point)
    original, count = getattr(obj, attr), [0]

    def faulty(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] != at:
            return original(*args, **kwargs)
        if point == "update:after":
            original(*args, **kwargs)  # the batch is updated, then the fault
        raise error(f"injected at {point} call {at}")

    setattr(obj, attr, faulty)


CASES = [
    pytest.param(name, point, which, error, id=f"{name}-{point}-{which}-{error.__name__}")
    for name in FULL
    for point in POINTS
    for which in ("first", "last")
    for error in (Injected, KeyboardInterrupt)
    if error is Injected or point.startswith("update")
] + [
    pytest.param(name, point, "last", Injected, id=f"{name}-{point}-last-Injected")
    for name in FAMILIES
    if name not in FULL
    for point in ("update:after", "copy_out")
]


@pytest.mark.parametrize("runtime", ["loopback", "loopback-async"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(("name", "point", "which", "error"), CASES)
def test_a_fault_mid_step_and_a_retry(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    point: str,
    which: str,
    error: type,
    packed: bool,
    runtime: str,
) -> None:
    if runtime == "loopback-async":
        monkeypatch.setenv("SWAPOPT_LOOPBACK_JITTER_US", ASYNC_JITTER_US)
    calls = _calls(name, packed, runtime, point)
    if calls == 0:
        pytest.skip(f"the faulted step makes no {point} call in this configuration")
    cls, flags, fault_step = FAMILIES[name]
    model, opt = _swapped(name, packed, runtime)
    plain_model = make_net(cls)
    plain = make_opt(cls, plain_model, flags)
    for index in range(fault_step):
        step(plain_model, plain, index)
        step(model, opt, index)
    before = {p: set(opt.state.get(p, {})) for g in opt.param_groups for p in g["params"]}
    step(plain_model, plain, fault_step)

    _grads(model, opt, fault_step)
    grads = [None if p.grad is None else p.grad.to_dense() for p in model.parameters()]
    _inject(opt, point, {"first": 1, "last": calls}[which], error)
    with pytest.raises(error):
        opt.step()

    # Consistent: each parameter's state is as before the step or complete (its batch
    # finished), nothing stays on the device, and the failed step is not counted.
    for group, plain_group in zip(opt.param_groups, plain.param_groups, strict=True):
        for p, q in zip(group["params"], plain_group["params"], strict=True):
            assert set(opt.state.get(p, {})) in (before[p], set(plain.state.get(q, {})))
    stats = swap_stats(opt)
    assert stats.resident_state_bytes == 0
    assert stats.steps == fault_step
    for p, g in zip(model.parameters(), grads, strict=True):
        assert (p.grad is None) == (g is None) and (g is None or torch.equal(p.grad.to_dense(), g))

    # The same gradients again: the step finishes, exactly once.
    opt.step()
    assert swap_stats(opt).steps == fault_step + 1
    assert_same(plain, opt, plain_model, model)
    # And training goes on exactly.
    for index in range(fault_step + 1, fault_step + 3):
        step(plain_model, plain, index)
        step(model, opt, index)
        assert_same(plain, opt, plain_model, model)


def test_the_faults_reach_state_created_inside_the_step() -> None:
    """SGD's momentum buffers do not exist before its first step: the faulted step creates
    them (so a fault after a batch's update must take them back or keep them whole)."""
    model, opt = _swapped("SGD_momentum", True, "loopback")
    assert not opt.state
    step(model, opt, 0)
    assert all("momentum_buffer" in opt.state[p] for p in list(opt.state))
    assert swap_stats(opt).swapped_tensors > 0


def test_a_step_failing_before_its_pipeline_gives_back_the_prefetch() -> None:
    model, opt = _swapped("RMSprop", True, "loopback")
    for index in range(2):
        step(model, opt, index)  # step 1 creates odd's state: step 2 packs it first
    _grads(model, opt, 2)  # prefetches the first batches during backward
    _inject(opt, "alloc_host", 1, Injected)
    with pytest.raises(Injected):
        opt.step()
    assert swap_stats(opt).resident_state_bytes == 0
