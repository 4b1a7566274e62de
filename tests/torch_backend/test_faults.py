"""The fault-injection matrix: a fault anywhere in a swapped step loses nothing.

For packed and per-tensor staging and ``swap_times`` 1, 3 and 8, an ``Exception`` and a
``KeyboardInterrupt`` are raised at the first, a middle and the last call that one step
makes to each runtime entry point of the engine's real runtime instance (``loopback``, and
``loopback-async`` with jitter at ``swap_times=3``), and
before and after the adapter's update. Afterwards (a) ``state_dict()`` is complete, (e)
``swap_stats`` is true, (b) the step repeated with the same gradients equals one plain step,
(c) further training equals plain training and (d) ``unswap_optimizer`` leaves a plain
optimizer that keeps training exactly. The matrix at ``swap_times=3`` runs again with part of
the state resident for good (``resident_state_fraction``).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats, unswap_optimizer
from swapopt_core._plugins import new_plugin_manager
from swapopt_core._swap.engine import engine_of
from swapopt_core.hookspecs import hookimpl

RUNTIME_CALLS = (
    "copy_in",
    "copy_out",
    "alloc_device",
    "release_device",
    "release_ordered",
    "wait",
    "host_wait",
    "synchronize",
)
POINTS = (*RUNTIME_CALLS, "update:before", "update:after", "alloc_host", "after_step")
KEYS = {"step", "exp_avg", "exp_avg_sq"}


class Injected(Exception):
    pass


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])


def _grads(model: torch.nn.Module, seed: int) -> None:
    for p in model.parameters():
        gen = torch.Generator().manual_seed(seed * 1000 + p.numel() + p.dim())
        p.grad = torch.randn(p.shape, generator=gen)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    _grads(model, seed)
    opt.step()


class _Observer:
    """A plugin observer that raises once, when armed."""

    armed = False

    @hookimpl
    def swapopt_after_step(self, optimizer: object, stats: object) -> None:
        if self.armed:
            self.armed = False
            raise Injected("observer")


def _swapped(
    packed: bool, swap_times: int, observer: _Observer, runtime: str, fraction: float = 0.0
) -> tuple:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = new_plugin_manager(load_entrypoints=False)
    manager.register(observer)
    config = SwapOptimizerConfig(
        swap_times=swap_times,
        min_numel=0,
        runtime=runtime,
        packed_swap=packed,
        resident_state_fraction=fraction,
    )
    swap_optimizer(opt, config, plugin_manager=manager)
    return model, opt


def _target(opt: torch.optim.Optimizer, point: str) -> tuple[object, str]:
    engine = engine_of(opt)
    if point.startswith("update"):
        return engine.adapter, "update"
    return engine.runtime, point


def _count(obj: object, name: str, counter: list[int]) -> None:
    original = getattr(obj, name)

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counter[0] += 1
        return original(*args, **kwargs)

    setattr(obj, name, counted)


@functools.cache
def _calls(
    packed: bool, swap_times: int, point: str, fault_step: int, runtime: str, fraction: float
) -> int:
    """How often a clean step number ``fault_step`` reaches ``point``."""
    if point == "after_step":
        return 1
    model, opt = _swapped(packed, swap_times, _Observer(), runtime, fraction)
    for seed in range(fault_step):
        _step(model, opt, seed)
    counter = [0]
    _count(*_target(opt, point), counter)
    _step(model, opt, fault_step)
    return counter[0]


def _inject(opt: torch.optim.Optimizer, point: str, at: int, error: type) -> None:
    obj, name = _target(opt, point)
    original = getattr(obj, name)
    calls = [0]

    def faulty(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] != at:
            return original(*args, **kwargs)
        if point == "update:after":
            original(*args, **kwargs)
        raise error(f"injected at {point} call {at}")

    setattr(obj, name, faulty)


def _assert_equal(model_a, opt_a, model_b, opt_b) -> None:  # noqa: ANN001
    if engine_of(opt_b) is not None:
        swap_stats(opt_b)  # the host state is read below: the step's copies must be done
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
        assert opt_a.state[a].keys() == opt_b.state[b].keys()
        for key, value in opt_a.state[a].items():
            assert torch.equal(value, opt_b.state[b][key]), key


def run_case(
    packed: bool,
    swap_times: int,
    point: str,
    which: str,
    error: type,
    runtime: str = "loopback",
    fraction: float = 0.0,
) -> None:
    # Host buffers are only allocated when state is created: fault the first step there.
    fault_step = 0 if point == "alloc_host" else 1
    calls = _calls(packed, swap_times, point, fault_step, runtime, fraction)
    if calls == 0:
        pytest.skip(f"a step makes no {point} call in this configuration")
    at = {"first": 1, "middle": (calls + 1) // 2, "last": calls}[which]
    observer = _Observer()
    plain_model = _model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    model, opt = _swapped(packed, swap_times, observer, runtime, fraction)
    for seed in range(fault_step):
        _step(plain_model, plain, seed)
        _step(model, opt, seed)
    total = swap_stats(opt).total_state_bytes
    _step(plain_model, plain, fault_step)

    _grads(model, fault_step)
    if point == "after_step":
        observer.armed = True
    else:
        _inject(opt, point, at, error)
    with pytest.raises(error if point != "after_step" else Injected):
        opt.step()

    # (a) the state is complete: every parameter has all of its entries, or none yet.
    state = opt.state_dict()["state"]
    assert all(set(entry) in (KEYS, set()) for entry in state.values())
    # (e) the stats tell the truth: nothing left on the device (but the resident part), the
    # failed step not counted unless it finished and only an observer raised.
    stats = swap_stats(opt)
    assert stats.resident_state_bytes == stats.resident_for_good_bytes
    assert stats.steps == fault_step + (point == "after_step")
    # (b) the same gradients again: exactly one step.
    opt.step()
    assert swap_stats(opt).steps == fault_step + 1
    _assert_equal(plain_model, plain, model, opt)
    assert total in (0, swap_stats(opt).total_state_bytes)
    # (c) training goes on exactly.
    _step(plain_model, plain, 10)
    _step(model, opt, 10)
    _assert_equal(plain_model, plain, model, opt)
    stats = swap_stats(opt)
    assert stats.resident_state_bytes == stats.resident_for_good_bytes
    assert (stats.resident_for_good_bytes > 0) == (fraction > 0)
    # (d) a plain optimizer again, still exact.
    unswap_optimizer(opt)
    assert engine_of(opt) is None
    _step(plain_model, plain, 11)
    _step(model, opt, 11)
    _assert_equal(plain_model, plain, model, opt)


MODES = {"packed": True, "per-tensor": False}
ERRORS = {"error": Injected, "interrupt": KeyboardInterrupt}
CASES = [
    pytest.param(
        mode,
        swap_times,
        point,
        which,
        error,
        id=f"{mode}-x{swap_times}-{point}-{which}-{error}",
    )
    for mode, swap_times, point, which, error in itertools.product(
        MODES, (1, 3, 8), POINTS, ("first", "middle", "last"), ERRORS
    )
    if not (point == "after_step" and (which != "first" or error != "error"))
]


@pytest.mark.parametrize(("mode", "swap_times", "point", "which", "error"), CASES)
def test_fault(mode: str, swap_times: int, point: str, which: str, error: str) -> None:
    run_case(MODES[mode], swap_times, point, which, ERRORS[error])


ASYNC_CASES = [
    pytest.param(mode, point, which, error, id=f"{mode}-x3-{point}-{which}-{error}")
    for mode, point, which, error in itertools.product(
        MODES, POINTS, ("first", "middle", "last"), ERRORS
    )
    if not (point == "after_step" and (which != "first" or error != "error"))
]


@pytest.mark.parametrize(("mode", "point", "which", "error"), ASYNC_CASES)
def test_fault_on_loopback_async(
    monkeypatch: pytest.MonkeyPatch, mode: str, point: str, which: str, error: str
) -> None:
    """The same matrix at ``swap_times=3`` with copies on worker threads, with jitter."""
    monkeypatch.setenv("SWAPOPT_LOOPBACK_JITTER_US", "300")
    run_case(MODES[mode], 3, point, which, ERRORS[error], runtime="loopback-async")


@pytest.mark.parametrize("runtime", ["loopback", "loopback-async"])
@pytest.mark.parametrize(("mode", "point", "which", "error"), ASYNC_CASES)
def test_fault_with_a_resident_part(
    monkeypatch: pytest.MonkeyPatch, mode: str, point: str, which: str, error: str, runtime: str
) -> None:
    """The same matrix at ``swap_times=3`` with 40 % of the state resident for good."""
    monkeypatch.setenv("SWAPOPT_LOOPBACK_JITTER_US", "300")
    run_case(MODES[mode], 3, point, which, ERRORS[error], runtime=runtime, fraction=0.4)


def test_the_matrix_covers_every_entry_point() -> None:
    assert {c.values[2] for c in CASES} == set(POINTS)
    assert len(CASES) == 2 * 3 * (len(POINTS) - 1) * 3 * 2 + 2 * 3
