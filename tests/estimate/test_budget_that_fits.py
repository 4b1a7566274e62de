"""``swapopt estimate`` at budgets that hold the whole step: nothing moves, and the plan's
peak, time and knobs are the same at every such budget (issue 31, item 8)."""

from __future__ import annotations

import functools
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import swapopt_core._estimate.breakdown as breakdown
from swapopt_core._estimate import DeviceProfile, Estimate, estimate, model_spec
from swapopt_core._planning.timed import TimedPlanner

TINY = str(Path(__file__).parent / "data" / "tiny_llama.json")
#: A made-up device, so that no test measures this machine.
PROFILE = DeviceProfile("test", 1.0, 0.5, 10.0, 5.0, 4.0, 5.0)


@functools.cache
def _traced() -> object:
    """The tiny Llama's step, traced once for every budget below."""
    return breakdown.trace_fake_step(model_spec(TINY), 2, 64, on_cpu=False)


def _estimate(budget: int | None) -> Estimate:
    traced = _traced()
    with mock.patch.object(breakdown, "trace_fake_step", lambda *a, **k: traced):
        return estimate(model_spec(TINY), 2, 64, PROFILE, TimedPlanner(), budget_bytes=budget)


@functools.cache
def _at_the_plain_peak() -> Estimate:
    plain = _estimate(None).plain
    return _estimate(plain.peak_bytes)


@settings(max_examples=12, deadline=None)
@given(scale=st.one_of(st.just(1.0), st.floats(1.0, 64.0), st.just(1000.0)))
def test_a_budget_that_holds_the_step_moves_nothing_at_the_plain_peak(scale: float) -> None:
    first = _at_the_plain_peak()
    plain = first.plain
    found = _estimate(int(plain.peak_bytes * scale))
    assert found.plan is not None and first.plan is not None
    plan, knobs = found.plan, found.plan.knobs
    assert knobs is not None and first.plan.knobs is not None
    assert knobs["moves_nothing"]
    assert knobs["resident_state_fraction"] == 1.0 and knobs["prefetch_batches"] == 0
    assert knobs["activation_budget_bytes"] is None
    # The peak is plain training's (the tiny Llama's forward and backward set it), at
    # every budget: a larger one buys nothing, so it changes nothing.
    assert plan.peak_bytes == plain.peak_bytes
    assert knobs == first.plan.knobs
    assert plan.optimizer_state_bytes == plain.optimizer_state_bytes
    assert plan.activations_peak_bytes == plain.activations_peak_bytes
    assert plan.step_ms == pytest.approx(plain.step_ms, rel=1e-3)
