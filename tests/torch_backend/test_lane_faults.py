"""The fault matrix, extended to copies that fail where they run: on a copy lane.

On ``loopback-async`` a copy runs on a worker thread after the call that queued it has
returned, so its failure reaches the engine late: at the wait of a later step, or only after
``step()`` returned (the copy out of the last batch). The fault is injected for real: the
operation the runtime queues on its lane raises when the lane runs it. The same sites on the
synchronous ``loopback`` raise in the caller, where that runtime copies.

Sites: the copy in (prefetch off, so the step makes every copy in) and the copy out (prefetch
on) of the first, a middle and the last batch of a step, and each copy in of the prefetch
during backward. Afterwards, as in ``test_faults``: (a) ``state_dict()`` is complete, (e)
``swap_stats`` is true, (b) a step that raised, repeated with the same gradients, equals one
plain step (a step that returned is one), (c) further training equals plain training, a
caller retrying what raised, and (d) ``unswap_optimizer`` leaves a plain optimizer that keeps
training exactly. ``follow="step"`` trains on right after the fault, with no reader between.
"""

from __future__ import annotations

import functools
import itertools
import threading

import pytest
import torch

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats, unswap_optimizer
from swapopt_core._device.lanes import CopyFailed
from swapopt_core._swap.engine import engine_of
from tests.conftest import ASYNC_JITTER_US

KEYS = {"step", "exp_avg", "exp_avg_sq"}
LANES = {"copy_in": "h2d", "copy_out": "d2h"}


class Injected(Exception):
    pass


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])


def _backward(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def _raised_here(error: BaseException) -> bool:
    """Whether ``error`` is (or was caused by) an injected fault."""
    while error is not None:
        if isinstance(error, Injected):
            return True
        error = error.__cause__
    return False


def _step(opt: torch.optim.Optimizer) -> bool:
    """``opt.step()``; whether it raised the injected fault (anything else propagates)."""
    try:
        opt.step()
    except (Injected, CopyFailed) as error:
        assert _raised_here(error), error
        return True
    return False


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One step as a caller who retries what raised does it."""
    _backward(model, opt, seed)
    if _step(opt):
        assert not _step(opt)  # the same gradients again: the step finishes


def _swapped(runtime: str, packed: bool, swap_times: int, prefetch: bool) -> tuple:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = SwapOptimizerConfig(
        swap_times=swap_times,
        min_numel=0,
        runtime=runtime,
        packed_swap=packed,
        prefetch_during_backward=prefetch,
    )
    return model, swap_optimizer(opt, config)


def _fail_on_lane(runtime: object, name: str, at: int, seen: list[str]) -> None:
    """Make the copy queued by the ``at``-th call of ``runtime.name`` fail where it runs.

    On a runtime with copy lanes the queued operation raises on the lane's thread (the call
    itself returns its ticket); a synchronous runtime copies in the call, which raises.
    """
    original = getattr(runtime, name)
    calls = [0]

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] != at:
            return original(*args, **kwargs)
        pick = getattr(runtime, "lane", None)  # the lane of the queue the call names
        lane = None if pick is None else pick(LANES[name], kwargs.get("queue", "activations"))
        if lane is None:
            seen.append(threading.current_thread().name)
            raise Injected(f"{name} call {at}")
        submit = lane.submit

        def poisoned(operation, **kw):  # noqa: ANN001, ANN003, ANN202
            def broken() -> None:
                seen.append(threading.current_thread().name)
                raise Injected(f"{name} call {at}, on its lane")

            return submit(broken, **kw)

        lane.submit = poisoned
        try:
            return original(*args, **kwargs)
        finally:
            del lane.submit

    setattr(runtime, name, failing)


def _count(runtime: object, name: str, counter: list[int]) -> None:
    original = getattr(runtime, name)

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counter[0] += 1
        return original(*args, **kwargs)

    setattr(runtime, name, counted)


def _site(site: str) -> tuple[str, bool, bool]:
    """The runtime call of ``site``, whether the prefetch is on, whether it is armed for
    backward (else for the step)."""
    return {
        "in": ("copy_in", False, False),
        "out": ("copy_out", True, False),
        "prefetch": ("copy_in", True, True),
    }[site]


@functools.cache
def _calls(runtime: str, packed: bool, swap_times: int, site: str) -> int:
    """How often step 1 (its backward, or the step itself) calls the site's runtime entry."""
    name, prefetch, in_backward = _site(site)
    model, opt = _swapped(runtime, packed, swap_times, prefetch)
    _train(model, opt, 0)
    counter = [0]
    if in_backward:
        _count(engine_of(opt).runtime, name, counter)
    _backward(model, opt, 1)
    if in_backward:
        return counter[0]
    _count(engine_of(opt).runtime, name, counter)
    opt.step()
    return counter[0]


def _assert_equal(model_a, opt_a, model_b, opt_b) -> None:  # noqa: ANN001
    if engine_of(opt_b) is not None:
        swap_stats(opt_b)  # the host state is read below: the step's copies must be done
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
        assert opt_a.state[a].keys() == opt_b.state[b].keys()
        for key, value in opt_a.state[a].items():
            assert torch.equal(value, opt_b.state[b][key]), key


def run_case(
    runtime: str, packed: bool, swap_times: int, site: str, which: str, follow: str
) -> None:
    name, prefetch, in_backward = _site(site)
    calls = _calls(runtime, packed, swap_times, site)
    if calls == 0:
        pytest.skip(f"no {name} {'during backward' if in_backward else 'in the step'} here")
    at = {"first": 1, "middle": (calls + 1) // 2, "last": calls}[which]
    plain_model = _model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    model, opt = _swapped(runtime, packed, swap_times, prefetch)
    _train(plain_model, plain, 0)
    _train(model, opt, 0)
    _train(plain_model, plain, 1)

    seen: list[str] = []
    if in_backward:
        _fail_on_lane(engine_of(opt).runtime, name, at, seen)
    _backward(model, opt, 1)
    if not in_backward:
        _fail_on_lane(engine_of(opt).runtime, name, at, seen)
    raised = _step(opt)

    if follow == "read":
        # (a) complete, and (e) true: a batch whose copy out failed was written back.
        state = opt.state_dict()["state"]
        assert all(set(entry) == KEYS for entry in state.values())
        stats = swap_stats(opt)
        assert stats.resident_state_bytes == 0
        assert stats.steps == 2 - raised
        # (b) a step that raised is finished by the same gradients; one that returned
        # is complete.
        if raised:
            assert not _step(opt)
        _assert_equal(plain_model, plain, model, opt)
    elif raised:
        assert not _step(opt)
    # (c) training goes on exactly, retrying what raises.
    for seed in (2, 3):
        _train(plain_model, plain, seed)
        _train(model, opt, seed)
    _assert_equal(plain_model, plain, model, opt)
    assert seen, "the fault was never reached"
    if runtime == "loopback-async":
        assert seen[0].startswith("swapopt-"), seen  # it failed on a copy lane
    assert swap_stats(opt).steps == 4
    assert swap_stats(opt).resident_state_bytes == 0
    # (d) a plain optimizer again, still exact.
    unswap_optimizer(opt)
    assert engine_of(opt) is None
    _train(plain_model, plain, 4)
    _train(model, opt, 4)
    _assert_equal(plain_model, plain, model, opt)


MODES = {"packed": True, "per-tensor": False}
CASES = [
    pytest.param(
        runtime,
        mode,
        swap_times,
        site,
        which,
        follow,
        id="-".join((runtime, mode, f"x{swap_times}", site, which, follow)),
    )
    for runtime, mode, swap_times, site, which, follow in itertools.product(
        ("loopback", "loopback-async"),
        MODES,
        (3, 8),
        ("in", "out", "prefetch"),
        ("first", "middle", "last"),
        ("read", "step"),
    )
    if (follow == "read" or site == "out") and not (site == "prefetch" and which == "middle")
]


@pytest.mark.parametrize(("runtime", "mode", "swap_times", "site", "which", "follow"), CASES)
def test_a_copy_failing_where_it_runs_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
    runtime: str,
    mode: str,
    swap_times: int,
    site: str,
    which: str,
    follow: str,
) -> None:
    if runtime == "loopback-async":
        monkeypatch.setenv("SWAPOPT_LOOPBACK_JITTER_US", ASYNC_JITTER_US)
    run_case(runtime, MODES[mode], swap_times, site, which, follow)


@pytest.mark.parametrize("mode", MODES)
def test_a_failure_the_next_step_meets_first_fails_that_step_and_the_retry_recovers(
    mode: str,
) -> None:
    """The last copy out fails, but only once the next step has started: nothing knew of it
    when the step began, so the copy in that reads what it should have written fails, and
    the step raises. Retrying writes the kept batch back and finishes the step exactly."""
    plain_model = _model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    # No prefetch: its allocation during backward would take a block freed in compute
    # order after step 1's gated copies out, and the CPU's compute queue (the caller)
    # would wait for them there, before the gate opens.
    model, opt = _swapped("loopback-async", MODES[mode], 3, prefetch=False)
    for seed in (0, 1, 2):
        _train(plain_model, plain, seed)
    _train(model, opt, 0)
    swap_stats(opt)
    engine = engine_of(opt)
    gate = threading.Event()
    engine.runtime.lane("d2h", "optimizer").submit(gate.wait)  # step 1's copies out wait
    settle = engine.settle

    def settle_then_open() -> None:  # step 2 starts knowing of no failure
        settle()
        gate.set()

    try:
        _fail_on_lane(engine.runtime, "copy_out", 3, [])
        _backward(model, opt, 1)
        assert not _step(opt)
        engine.settle = settle_then_open
        _backward(model, opt, 2)
        assert _step(opt)
    finally:
        gate.set()
    del engine.settle
    assert swap_stats(opt).resident_state_bytes > 0  # kept until written back
    assert not _step(opt)  # the same gradients: written back, then finished
    _assert_equal(plain_model, plain, model, opt)
    assert swap_stats(opt).steps == 3
