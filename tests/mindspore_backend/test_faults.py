"""The fault-injection matrix for MindSpore ``nn.Adam`` and ``nn.AdamWeightDecay``.

An ``Exception`` and a ``KeyboardInterrupt`` are raised at the first, a middle and the last
call one step makes to each entry point of the engine's real loopback runtime instance,
and before and after the adapter's batch update (``update_batch``, one compiled graph per
batch); then the state is complete (a), the stats true (e), the step repeated with the same
gradients equals one plain step (b), training goes on exactly (c) and ``unswap_optimizer``
leaves a plain optimizer that stays exact (d). The fast row of the matrix runs on
``loopback-async`` with jitter too, where the copies run on worker threads, and so do the
rows of torch's lane-fault matrix for a copy out that fails on its lane after the call that
queued it returned (first, middle and last batch, packed and per-tensor).
"""

from __future__ import annotations

import functools
import itertools
import threading

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import Parameter, Tensor, nn  # noqa: E402

from swapopt_core import (  # noqa: E402
    SwapOptimizerConfig,
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._device.lanes import CopyFailed  # noqa: E402
from swapopt_core._swap.engine import engine_of  # noqa: E402

pytestmark = pytest.mark.mindspore

SHAPES = [(12, 8), (8,), (16, 4), (3,), (10, 6)]
POINTS = (
    "copy_in",
    "copy_out",
    "alloc_device",
    "release_device",
    "wait",
    "synchronize",
    "update:before",
    "update:after",
)
FAMILIES = {
    "adam": lambda ps: nn.Adam(ps, learning_rate=1e-2, weight_decay=0.01),
    "adamwd": lambda ps: nn.AdamWeightDecay(ps, learning_rate=1e-2, weight_decay=0.01),
}


#: MindSpore hands each launch to a worker thread (milliseconds): see test_mindspore.py.
ASYNC_JITTER_US = "2000"


class Injected(Exception):
    pass


@pytest.fixture(autouse=True)
def _pynative_cpu(monkeypatch):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    # Read by loopback-async when a swap builds it; the synchronous loopback ignores it.
    monkeypatch.setenv("SWAPOPT_LOOPBACK_JITTER_US", ASYNC_JITTER_US)


def _params() -> list[Parameter]:
    rng = np.random.default_rng(0)
    return [
        Parameter(Tensor(rng.standard_normal(s).astype(np.float32)), name=f"w{i}")
        for i, s in enumerate(SHAPES)
    ]


def _grads(step: int) -> tuple[Tensor, ...]:
    rng = np.random.default_rng(100 + step)
    return tuple(Tensor(rng.standard_normal(s).astype(np.float32)) for s in SHAPES)


def _swapped(
    family: str, packed: bool, runtime: str = "loopback"
) -> tuple[list[Parameter], object]:
    params = _params()
    opt = FAMILIES[family](params)
    config = SwapOptimizerConfig(runtime=runtime, min_numel=0, swap_times=3, packed_swap=packed)
    swap_optimizer(opt, config)
    return params, opt


def _target(opt: object, point: str) -> tuple[object, str]:
    engine = engine_of(opt)
    if point.startswith("update"):
        return engine.adapter, "update_batch"
    return engine.runtime, point


@functools.cache
def _calls(family: str, packed: bool, point: str, runtime: str) -> int:
    """How often the second clean step reaches ``point``."""
    _, opt = _swapped(family, packed, runtime)
    opt(_grads(0))
    obj, name = _target(opt, point)
    original, counter = getattr(obj, name), [0]

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counter[0] += 1
        return original(*args, **kwargs)

    setattr(obj, name, counted)
    opt(_grads(1))
    return counter[0]


def _inject(opt: object, point: str, at: int, error: type) -> None:
    obj, name = _target(opt, point)
    original, calls = getattr(obj, name), [0]

    def faulty(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] != at:
            return original(*args, **kwargs)
        if point == "update:after":
            original(*args, **kwargs)
        raise error(f"injected at {point} call {at}")

    setattr(obj, name, faulty)


def _arrays(opt: object) -> dict[str, np.ndarray]:
    return {name: p.asnumpy() for name, p in opt.parameters_dict().items()}


def _assert_same(ref_params, params, ref, opt) -> None:  # noqa: ANN001
    for a, b in zip(ref_params, params, strict=True):
        assert np.array_equal(a.asnumpy(), b.asnumpy()), a.name
    expected, actual = _arrays(ref), _arrays(opt)
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert np.array_equal(value, actual[name]), name


def run_case(
    family: str, packed: bool, point: str, which: str, error: type, runtime: str = "loopback"
) -> None:
    calls = _calls(family, packed, point, runtime)
    if calls == 0:
        pytest.skip(f"a step makes no {point} call in this configuration")
    at = {"first": 1, "middle": (calls + 1) // 2, "last": calls}[which]
    ref_params = _params()
    ref = FAMILIES[family](ref_params)
    params, opt = _swapped(family, packed, runtime)
    ref(_grads(0))
    opt(_grads(0))
    ref(_grads(1))
    grads = _grads(1)
    _inject(opt, point, at, error)
    with pytest.raises(error):
        opt(grads)
    # (a) every state Parameter is readable; (e) nothing is left on the device.
    assert _arrays(opt).keys() == _arrays(ref).keys()
    assert swap_stats(opt).resident_state_bytes == 0
    assert swap_stats(opt).steps == 1
    # (b) the same gradients again finish the step exactly.
    opt(grads)
    assert swap_stats(opt).steps == 2
    _assert_same(ref_params, params, ref, opt)
    # (c) training goes on exactly; (d) and so does the unswapped optimizer.
    ref(_grads(2))
    opt(_grads(2))
    _assert_same(ref_params, params, ref, opt)
    unswap_optimizer(opt)
    ref(_grads(3))
    opt(_grads(3))
    _assert_same(ref_params, params, ref, opt)


ERRORS = {"error": Injected, "interrupt": KeyboardInterrupt}
CASES = [
    pytest.param(
        family,
        mode,
        point,
        which,
        error,
        id=f"{family}-{mode}-{point}-{which}-{error}",
        marks=() if (family, mode, which) == ("adam", "packed", "middle") else pytest.mark.slow,
    )
    for family, mode, point, which, error in itertools.product(
        FAMILIES, ("packed", "per-tensor"), POINTS, ("first", "middle", "last"), ERRORS
    )
]


@pytest.mark.parametrize(("family", "mode", "point", "which", "error"), CASES)
def test_fault(family: str, mode: str, point: str, which: str, error: str) -> None:
    run_case(family, mode == "packed", point, which, ERRORS[error])


@pytest.mark.parametrize("error", sorted(ERRORS))
@pytest.mark.parametrize("point", POINTS)
def test_fault_on_loopback_async(point: str, error: str) -> None:
    run_case("adam", True, point, "middle", ERRORS[error], runtime="loopback-async")


def test_a_copy_out_that_keeps_failing_keeps_the_batch_until_it_can_be_written() -> None:
    ref_params = _params()
    ref = FAMILIES["adam"](ref_params)
    params, opt = _swapped("adam", packed=True)
    runtime = engine_of(opt).runtime
    original = runtime.copy_out

    def broken(pairs, **kw):  # noqa: ANN001, ANN003, ANN202
        raise Injected("copy engine down")

    runtime.copy_out = broken
    grads = _grads(0)
    with pytest.raises(Injected):
        opt(grads)
    assert swap_stats(opt).resident_state_bytes > 0  # kept on the device, not lost
    runtime.copy_out = original
    opt(grads)  # writes the kept batch back, then finishes the step
    ref(grads)
    assert swap_stats(opt).resident_state_bytes == 0
    _assert_same(ref_params, params, ref, opt)


def test_an_observer_that_raises_does_not_make_the_retry_step_twice() -> None:
    from swapopt_core._plugins import new_plugin_manager
    from swapopt_core.hookspecs import hookimpl

    class Observer:
        armed = True

        @hookimpl
        def swapopt_after_step(self, optimizer: object, stats: object) -> None:
            if self.armed:
                self.armed = False
                raise Injected("observer")

    manager = new_plugin_manager(load_entrypoints=False)
    manager.register(Observer())
    ref_params, params = _params(), _params()
    ref, opt = FAMILIES["adam"](ref_params), FAMILIES["adam"](params)
    config = SwapOptimizerConfig(runtime="loopback", min_numel=0)
    swap_optimizer(opt, config, plugin_manager=manager)
    grads = _grads(0)
    with pytest.raises(Injected):
        opt(grads)
    assert swap_stats(opt).steps == 1  # the step finished; only an observer failed
    opt(grads)  # tells the observers again, applies nothing
    ref(grads)
    assert swap_stats(opt).steps == 1
    _assert_same(ref_params, params, ref, opt)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_a_failed_batch_update_puts_the_resident_state_back(packed: bool) -> None:
    # exp_avg_sq is not swapped, and two parameters are too small to swap anything
    ref_params, params = _params(), _params()
    ref, opt = FAMILIES["adam"](ref_params), FAMILIES["adam"](params)
    config = SwapOptimizerConfig(
        runtime="loopback", min_numel=20, state_keys=("exp_avg",), swap_times=3, packed_swap=packed
    )
    swap_optimizer(opt, config)
    ref(_grads(0))
    opt(_grads(0))
    grads = _grads(1)
    _inject(opt, "update:after", 2, Injected)  # the second batch updates, then fails
    with pytest.raises(Injected):
        opt(grads)
    opt(grads)  # the failed batch again, from its undo copy
    ref(grads)
    _assert_same(ref_params, params, ref, opt)


def _fail_on_lane(runtime: object, at: int, seen: list[str]) -> None:
    """Make the copy queued by the ``at``-th ``copy_out`` fail where it runs, on its lane
    (the call itself returns its ticket), as in torch's test_lane_faults.py."""
    original, calls = runtime.copy_out, [0]

    def failing(pairs, **kw):  # noqa: ANN001, ANN003, ANN202
        calls[0] += 1
        if calls[0] != at:
            return original(pairs, **kw)
        lane = runtime.d2h
        submit = lane.submit

        def poisoned(operation, **kw):  # noqa: ANN001, ANN003, ANN202
            def broken() -> None:
                seen.append(threading.current_thread().name)
                raise Injected(f"copy_out call {at}, on its lane")

            return submit(broken, **kw)

        lane.submit = poisoned
        try:
            return original(pairs, **kw)
        finally:
            del lane.submit

    runtime.copy_out = failing


@pytest.mark.parametrize("which", ["first", "middle", "last"])
@pytest.mark.parametrize("mode", ["packed", "per-tensor"])
def test_a_copy_out_failing_on_its_lane_loses_nothing(mode: str, which: str) -> None:
    """The copy out of the first, a middle or the last batch fails on the d2h lane, after
    ``copy_out`` returned. MindSpore reads state Parameters with no hook to wait in (its
    ``save_checkpoint``), so right after the call (a retry, if it raised) they are (a) exact,
    (e) nothing stays on the device, then (c) training and (d) the unswapped optimizer stay
    exact."""
    packed = mode == "packed"
    calls = _calls("adam", packed, "copy_out", "loopback-async")
    at = {"first": 1, "middle": (calls + 1) // 2, "last": calls}[which]
    ref_params = _params()
    ref = FAMILIES["adam"](ref_params)
    params, opt = _swapped("adam", packed, "loopback-async")
    ref(_grads(0))
    opt(_grads(0))
    ref(_grads(1))
    grads, seen = _grads(1), []
    _fail_on_lane(engine_of(opt).runtime, at, seen)
    try:
        opt(grads)
    except CopyFailed as error:
        assert isinstance(error.__cause__, Injected), error
        opt(grads)  # the same gradients: written back, then finished
    assert seen == ["swapopt-d2h"], seen  # it failed on the copy lane, once
    _assert_same(ref_params, params, ref, opt)
    assert swap_stats(opt).resident_state_bytes == 0
    assert swap_stats(opt).steps == 2
    ref(_grads(2))
    opt(_grads(2))
    _assert_same(ref_params, params, ref, opt)
    unswap_optimizer(opt)
    ref(_grads(3))
    opt(_grads(3))
    _assert_same(ref_params, params, ref, opt)
