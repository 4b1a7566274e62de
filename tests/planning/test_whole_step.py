"""The whole-step planner: one budget for parameters, gradients, optimizer state and
activations."""

from __future__ import annotations

import dataclasses

import pytest

from swapopt_core._planning.synthetic import SHAPES, llama_training_trace
from swapopt_core._planning.timed import TimedPlanner
from swapopt_core._planning.update_model import UpdateCosts, update_shape
from swapopt_core._planning.whole_step import (
    BudgetTooSmall,
    OptimizerCosts,
    StepInputs,
    plan_step,
)

MIB = 2**20


@pytest.fixture(scope="module")
def trace():
    # Two layers of the tiny decoder: the same op mix, planned in a fraction of the time.
    shape = dataclasses.replace(SHAPES["tiny"], layers=2, seq=512)
    return llama_training_trace(shape, link_gbps=20.0)


def _backward_start(trace) -> int:
    names = [op.name for op in trace.ops]
    return next(i for i, name in enumerate(names) if "bwd" in name)


def _inputs(trace, budget: int, *, units: int = 24, unit_mib: int = 2) -> StepInputs:
    return StepInputs(
        budget_bytes=budget,
        params_bytes=units * unit_mib * MIB // 2,
        grads_bytes=units * unit_mib * MIB // 2,
        optimizer=OptimizerCosts(
            unit_bytes=(unit_mib * MIB,) * units,
            update_ms_per_byte=1e-7,
            fixed_state_bytes=MIB,
            staging_factor=4.0,
        ),
        trace=trace,
        backward_start_op=_backward_start(trace),
        planner=TimedPlanner(),
    )


def _plain(trace):
    return plan_step(_inputs(trace, 2**50))


def test_a_budget_that_fits_everything_moves_nothing(trace) -> None:
    plain = _plain(trace)
    assert plain.moves_nothing and plain.prefetch_batches == 0
    # The update still runs in batches (their undo copies), in no more time than plain.
    assert plain.planned_step_ms == pytest.approx(plain.plain_step_ms)
    assert plain.planned_peak_bytes >= plain.plain_peak_bytes - plain.update_extra_bytes
    at_peak = plan_step(_inputs(trace, plain.planned_peak_bytes))
    assert at_peak.moves_nothing and at_peak.planned_peak_bytes <= plain.planned_peak_bytes


@pytest.mark.parametrize("share", [0.9, 0.7, 0.5, 0.35])
def test_the_plan_fits_its_budget(trace, share: float) -> None:
    plain = _plain(trace)
    budget = int(plain.plain_peak_bytes * share)
    try:
        plan = plan_step(_inputs(trace, budget))
    except BudgetTooSmall as error:
        assert error.floor_bytes > budget
        return
    assert not plan.moves_nothing
    assert plan.planned_peak_bytes <= budget
    assert plan.planned_step_ms >= plan.plain_step_ms * 0.999
    assert 0.0 <= plan.resident_state_fraction < 1.0 or plan.activation_budget_bytes is not None


def test_tighter_budgets_are_never_predicted_faster(trace) -> None:
    plain = _plain(trace)
    times = []
    for share in (0.95, 0.8, 0.65):
        times.append(plan_step(_inputs(trace, int(plain.plain_peak_bytes * share))).planned_step_ms)
    assert times == sorted(times)


def test_below_the_floor_says_the_floor_and_what_sets_it(trace) -> None:
    with pytest.raises(BudgetTooSmall, match="below the step's floor") as caught:
        plan_step(_inputs(trace, 10 * MIB))
    assert caught.value.floor_bytes > 10 * MIB
    assert "device_budget_mb" in str(caught.value) and "parameters" in str(caught.value)


def test_the_update_model_pipelines_copies_under_compute() -> None:
    costs = UpdateCosts(ms_per_byte=1.0, h2d_bytes_per_ms=1.0, d2h_bytes_per_ms=1.0)
    one = update_shape((4,) * 8, 0.0, 1, 0, costs)
    assert one.step_ms == 32 + 32  # copy all in, then compute all
    deep = update_shape((4,) * 8, 0.0, 8, 0, costs)
    assert deep.step_ms < one.step_ms  # the copies of later batches overlap compute
    prefetched = update_shape((4,) * 8, 0.0, 8, 2, costs)
    assert prefetched.step_ms < deep.step_ms and prefetched.prefetch_bytes == 8
    resident = update_shape((4,) * 8, 0.5, 4, 0, costs)
    assert resident.resident_bytes == 16 and sum(resident.batch_bytes) == 16
