"""Forward and backward under candidate activation budgets, as the whole-step planner
needs them: each budget planned once, its simulated time, the peak of activations plus the
gradients landed so far before and during backward, and how busy the link is."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from swapopt_core._planning.floor import min_feasible_budget, retained_bytes
from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ResidencySchedule
from swapopt_core._planning.simulate import SimulationResult, simulate
from swapopt_core._planning.step_types import StepInputs

__all__ = ["Activations", "Forward"]


@dataclass(frozen=True)
class Forward:
    """Forward and backward under one activation plan, as the step planner needs them."""

    budget: int | None
    schedule: ResidencySchedule | None
    ms: float
    before_backward: int  # peak of activations + gradients before backward's first op
    in_backward: int  # the same from backward's first op on
    backward_link_free_ms: float  # backward's time the copy-in queue is idle
    forward_out_busy_ms: float  # time the copy-out queue works for forward's activations


class Activations:
    """Plans forward and backward at activation budgets, once each."""

    def __init__(self, inputs: StepInputs, planner: ResidencyPlanner) -> None:
        self.inputs = inputs
        self.planner = planner
        self.index = TraceIndex(inputs.trace)
        self.floor = min_feasible_budget(inputs.trace, index=self.index)
        self.grads = _gradient_curve(inputs, self.index.n)
        self.retained = retained_bytes(self.index)
        self._cache: dict[int | None, Forward | None] = {}
        self.natural = self.at(None)
        assert self.natural is not None  # an unlimited budget always has a plan

    def at(self, budget: int | None) -> Forward | None:
        """Forward and backward under ``budget`` (``None``: nothing moves); ``None`` where
        the planner's schedule does not keep the budget."""
        if budget not in self._cache:
            self._cache[budget] = self._plan(budget)
        return self._cache[budget]

    def _plan(self, budget: int | None) -> Forward | None:
        trace = self.inputs.trace.with_limit(budget)
        schedule = None if budget is None else self.planner.plan(trace)
        result = simulate(trace, schedule, index=self.index)
        if budget is not None and result.peak_bytes > budget:
            return None
        return self._summary(budget, schedule, result)

    def _summary(
        self, budget: int | None, schedule: ResidencySchedule | None, result: SimulationResult
    ) -> Forward:
        start = self.inputs.backward_start_op
        starts = result.op_start_ms
        backward_ms = starts[start] if start < len(starts) else result.total_ms
        before = after = 0
        for time_ms, resident in ((0.0, 0), *result.timeline):
            op = max(0, bisect.bisect_right(starts, time_ms) - 1)
            total = resident + self.grads[op]
            if op < start:
                before = max(before, total)
            else:
                after = max(after, total)
        after = max(after, self.grads[-1])
        busy_in = sum(
            max(0.0, c.end_ms - max(c.start_ms, backward_ms))
            for c in result.copies
            if c.direction == "h2d"
        )
        busy_out = sum(
            min(c.end_ms, backward_ms) - c.start_ms
            for c in result.copies
            if c.direction == "d2h" and c.start_ms < backward_ms
        )
        return Forward(
            budget=budget,
            schedule=schedule,
            ms=result.total_ms,
            before_backward=before,
            in_backward=after,
            backward_link_free_ms=max(0.0, result.total_ms - backward_ms - busy_in),
            forward_out_busy_ms=busy_out,
        )


def _gradient_curve(inputs: StepInputs, n: int) -> list[int]:
    """Gradient bytes on the device during each op (and one more entry: after the last)."""
    curve = [0] * (n + 1)
    if inputs.grad_ready:
        for op, nbytes in inputs.grad_ready:
            curve[min(max(op, 0), n)] += nbytes
    else:
        curve[min(max(inputs.backward_start_op, 0), n)] += inputs.grads_bytes
    for i in range(1, n + 1):
        curve[i] += curve[i - 1]
    # Gradients not reported by op are there from backward on, to be safe.
    missing = inputs.grads_bytes - curve[n]
    if missing > 0:
        for i in range(min(max(inputs.backward_start_op, 0), n), n + 1):
            curve[i] += missing
    return curve
