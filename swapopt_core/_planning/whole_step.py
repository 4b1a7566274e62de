"""Plan a whole training step under one device budget.

The step is forward and backward (an ``ActivationTrace``) followed by the optimizer's update
(``OptimizerCosts``). The plan chooses how much optimizer state stays resident for good,
``swap_times``, how many batches are prefetched during backward and the activation budget
(with its schedule), by predicted step time, with the predicted peak at every point at most
the budget. See ``plan_step``.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from swapopt_core._planning.floor import (
    floor_reason,
    format_bytes,
    min_feasible_budget,
    retained_bytes,
)
from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule
from swapopt_core._planning.simulate import SimulationResult, simulate
from swapopt_core._planning.update_model import UpdateCosts, UpdateShape, update_shape

__all__ = ["BudgetTooSmall", "OptimizerCosts", "StepInputs", "StepPlan", "plan_step"]


class BudgetTooSmall(ValueError):
    """The budget is below what any plan needs; the message says the floor and what sets it.

    Attributes:
        floor_bytes: The smallest budget a plan exists for.
    """

    def __init__(self, message: str, floor_bytes: int) -> None:
        super().__init__(message)
        self.floor_bytes = floor_bytes


@dataclass(frozen=True)
class OptimizerCosts:
    """What the optimizer's update costs in device memory and time.

    Attributes:
        unit_bytes: Swappable state bytes of each parameter, in step order.
        update_ms_per_byte: Compute time of the update per byte of state (measured at the
            first step, or priced from a device profile).
        fixed_state_bytes: Optimizer state that never moves (below ``min_numel``, keys not
            swapped): on the device for the whole step.
        staging_factor: Device bytes the update holds per byte of its largest swapped batch
            (the staging of up to three batches, the undo copy, the update's temporaries).
        batch_overhead_ms: Fixed time per pipeline batch (launches, waits).
    """

    unit_bytes: tuple[int, ...]
    update_ms_per_byte: float
    fixed_state_bytes: int = 0
    staging_factor: float = 3.0
    batch_overhead_ms: float = 0.0


@dataclass(frozen=True)
class StepInputs:
    """Everything ``plan_step`` plans from.

    Attributes:
        budget_bytes: The most device bytes the step may hold.
        params_bytes: Parameters (on the device for the whole step).
        grads_bytes: Parameter gradients (on the device from backward through the update).
        optimizer: The update's costs.
        trace: Forward and backward; its ``memory_limit_bytes`` is ignored and its
            bandwidths are the link's (shared with the optimizer's copies).
        backward_start_op: Index in ``trace.ops`` of backward's first op: a prefetch of
            optimizer state starts there.
        planner: Plans the activations at a given activation budget.
        grad_ready: When each gradient lands on the device: ``(op index, bytes)`` pairs
            (the op after which autograd stored it). Empty: all of ``grads_bytes`` counts
            from ``backward_start_op`` on (safe, and what a plan without the warmup's
            record assumes).
    """

    budget_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer: OptimizerCosts
    trace: ActivationTrace
    backward_start_op: int
    planner: ResidencyPlanner
    grad_ready: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """The chosen knobs and what the plan predicts.

    Attributes:
        resident_state_fraction: Share of the swappable state bytes that stays on the device.
        swap_times: Pipeline batches of the swapped rest.
        prefetch_batches: Batches copied in during backward.
        activation_budget_bytes: Budget of the activation plan; ``None``: activations are
            not moved.
        schedule: The activation schedule at that budget (``None`` when nothing moves).
        planned_peak_bytes: Predicted peak device bytes of the whole step.
        planned_step_ms: Predicted time of the whole step.
        plain_peak_bytes: Predicted peak of the same step without swapopt.
        plain_step_ms: Predicted time of the same step without swapopt.
        largest_batch_bytes: State bytes of the update's largest batch, resident or swapped
            (what ``staging_factor`` multiplies).
        update_extra_bytes: Device bytes the update is predicted to hold beyond the state
            that stays resident, the gradients and the parameters.
    """

    resident_state_fraction: float
    swap_times: int
    prefetch_batches: int
    activation_budget_bytes: int | None
    schedule: ResidencySchedule | None
    planned_peak_bytes: int
    planned_step_ms: float
    plain_peak_bytes: int
    plain_step_ms: float
    largest_batch_bytes: int = 0
    update_extra_bytes: int = 0

    @property
    def moves_nothing(self) -> bool:
        """Whether the plan keeps everything on the device (the update still runs in
        ``swap_times`` batches, so that its undo copy stays one batch's)."""
        return self.resident_state_fraction >= 1.0 and self.activation_budget_bytes is None


#: Resident fractions tried (sixteenths), pipeline depths and prefetch depths.
_FRACTIONS = tuple(i / 16 for i in range(17))
_SWAP_TIMES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_PREFETCH = (0, 1, 2)
#: Where the activation budgets tried sit between the floor (0) and the natural peak (1).
_LADDER = (0.75, 0.5, 0.3, 0.15, 0.0)
#: Bisection rounds that refine the chosen activation budget towards the next larger one.
_REFINE = 2


@dataclass(frozen=True)
class _Forward:
    """Forward and backward under one activation plan, as the step planner needs them."""

    budget: int | None
    schedule: ResidencySchedule | None
    ms: float
    before_backward: int  # peak of activations + gradients before backward's first op
    in_backward: int  # the same from backward's first op on
    backward_link_free_ms: float  # backward's time the copy-in queue is idle
    forward_out_busy_ms: float  # time the copy-out queue works for forward's activations


class _Activations:
    """Plans forward and backward at activation budgets, once each."""

    def __init__(self, inputs: StepInputs, planner: ResidencyPlanner) -> None:
        self.inputs = inputs
        self.planner = planner
        self.index = TraceIndex(inputs.trace)
        self.floor = min_feasible_budget(inputs.trace, index=self.index)
        self.grads = _gradient_curve(inputs, self.index.n)
        self.retained = retained_bytes(self.index)
        self._cache: dict[int | None, _Forward | None] = {}
        self.natural = self.at(None)
        assert self.natural is not None  # an unlimited budget always has a plan

    def at(self, budget: int | None) -> _Forward | None:
        """Forward and backward under ``budget`` (``None``: nothing moves); ``None`` where
        the planner's schedule does not keep the budget."""
        if budget not in self._cache:
            self._cache[budget] = self._plan(budget)
        return self._cache[budget]

    def _plan(self, budget: int | None) -> _Forward | None:
        trace = self.inputs.trace.with_limit(budget)
        schedule = None if budget is None else self.planner.plan(trace)
        result = simulate(trace, schedule, index=self.index)
        if budget is not None and result.peak_bytes > budget:
            return None
        return self._summary(budget, schedule, result)

    def _summary(
        self, budget: int | None, schedule: ResidencySchedule | None, result: SimulationResult
    ) -> _Forward:
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
        return _Forward(
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


@dataclass(frozen=True)
class _Candidate:
    ms: float
    peak: int
    fraction: float
    swap_times: int
    shape: UpdateShape
    forward: _Forward


def plan_step(inputs: StepInputs) -> StepPlan:
    """Choose the knobs of the fastest predicted step whose peak fits ``budget_bytes``.

    The step's device bytes at any point are the parameters, the optimizer state that never
    moves (``fixed_state_bytes`` and the resident fraction), the gradients landed so far,
    the activations the plan keeps (in-flight copies included) and, from backward's first op
    on, the prefetched batches; during the update, the gradients and ``staging_factor``
    times the largest swapped batch instead of activations and prefetch. Time: forward and
    backward as the activation plan simulates them, the prefetch's copies where they exceed
    backward's idle link time, the update as ``update_model`` predicts it, and the update's
    copies out where they meet forward's own.

    Raises:
        BudgetTooSmall: No plan fits; the message gives the floor and what sets it.
    """
    opt = inputs.optimizer
    state = sum(opt.unit_bytes)
    base = inputs.params_bytes + opt.fixed_state_bytes
    acts = _Activations(inputs, _screening_planner(inputs))
    natural = acts.natural
    assert natural is not None
    plain_update_ms = state * opt.update_ms_per_byte + opt.batch_overhead_ms
    plain_peak = (
        base
        + state
        + max(natural.before_backward, natural.in_backward, inputs.grads_bytes + acts.retained)
    )
    plain = (plain_peak, natural.ms + plain_update_ms)
    link = UpdateCosts(
        ms_per_byte=opt.update_ms_per_byte,
        h2d_bytes_per_ms=inputs.trace.h2d_bandwidth_gbps * 1e6,
        d2h_bytes_per_ms=inputs.trace.d2h_bandwidth_gbps * 1e6,
        batch_overhead_ms=opt.batch_overhead_ms,
    )
    ladder = [None, *_ladder(acts)]
    best: _Candidate | None = None
    best_rung = 0
    units = len(opt.unit_bytes)
    for fraction, times, prefetch in itertools.product(_FRACTIONS, _SWAP_TIMES, _PREFETCH):
        if times > max(1, units) or (fraction >= 1.0 and prefetch):
            continue  # the same as a smaller choice
        shape = update_shape(opt.unit_bytes, fraction, times, prefetch, link)
        if shape.prefetch_batches != prefetch or not _may_fit(inputs, acts, base, shape):
            continue  # the same as a smaller choice, or no activation plan can help it
        for rung, level in enumerate(ladder):
            candidate = _evaluate(inputs, acts, base, shape, fraction, times, acts.at(level))
            if candidate is not None:
                if best is None or _better(candidate, best):
                    best, best_rung = candidate, rung
                break  # a smaller activation budget is never faster
    if best is None:
        _check_floor(inputs, acts, state, base)
        raise BudgetTooSmall(_floor_message(inputs, acts, state, base, None), inputs.budget_bytes)
    best = _refine(inputs, acts, base, best, ladder, best_rung)
    best = _final(inputs, acts, base, best)
    return StepPlan(
        resident_state_fraction=best.fraction,
        swap_times=best.swap_times,
        prefetch_batches=best.shape.prefetch_batches,
        activation_budget_bytes=best.forward.budget,
        schedule=best.forward.schedule,
        planned_peak_bytes=best.peak,
        planned_step_ms=best.ms,
        plain_peak_bytes=plain[0],
        plain_step_ms=plain[1],
        largest_batch_bytes=best.shape.largest_batch,
        update_extra_bytes=best.shape.extra_bytes(opt.staging_factor),
    )


#: Traces longer than this are screened with the offload-only planner (the candidates'
#: activation budgets), and only the chosen budget is planned with the session's planner.
SCREEN_OPS = 2000


def _screening_planner(inputs: StepInputs) -> ResidencyPlanner:
    """The planner the candidate activation budgets are priced with: the session's, or on
    long traces the offload-only one (recompute trials cost seconds per budget there)."""
    if len(inputs.trace.ops) <= SCREEN_OPS:
        return inputs.planner
    from swapopt_core._planning.timed import TimedPlanner

    return TimedPlanner(recompute=False)


def _final(inputs: StepInputs, acts: _Activations, base: int, best: _Candidate) -> _Candidate:
    """Plan the chosen activation budget with the session's planner, if it screened with
    another; keep the screened plan where the session's does not fit or is slower."""
    if acts.planner is inputs.planner or best.forward.budget is None:
        return best
    real = _Activations(inputs, inputs.planner)
    candidate = _evaluate(
        inputs, acts, base, best.shape, best.fraction, best.swap_times, real.at(best.forward.budget)
    )
    return candidate if candidate is not None and candidate.ms <= best.ms else best


def _ladder(acts: _Activations) -> list[int]:
    natural = acts.natural
    assert natural is not None
    top = max(natural.before_backward, natural.in_backward - acts.grads[-1], acts.floor)
    levels = sorted({int(acts.floor + (top - acts.floor) * q) for q in _LADDER}, reverse=True)
    return [level for level in levels if level < top] or [acts.floor]


def _may_fit(inputs: StepInputs, acts: _Activations, base: int, shape: UpdateShape) -> bool:
    """Whether the parts no activation plan changes fit: the gradients and prefetch at the
    end of backward, the update's staging."""
    held = base + shape.resident_bytes + acts.grads[-1] + acts.retained
    staging = shape.extra_bytes(inputs.optimizer.staging_factor)
    return max(held + shape.prefetch_bytes, held + staging) <= inputs.budget_bytes


def _evaluate(
    inputs: StepInputs,
    acts: _Activations,
    base: int,
    shape: UpdateShape,
    fraction: float,
    times: int,
    forward: _Forward | None,
) -> _Candidate | None:
    if forward is None:
        return None
    held = base + shape.resident_bytes
    update_peak = (
        held + inputs.grads_bytes + int(inputs.optimizer.staging_factor * shape.largest_batch)
    )
    peak = max(
        held + forward.before_backward,
        held + forward.in_backward + shape.prefetch_bytes,
        update_peak,
    )
    if peak > inputs.budget_bytes:
        return None
    link_ms = shape.prefetch_bytes / (inputs.trace.h2d_bandwidth_gbps * 1e6)
    ms = (
        forward.ms
        + max(0.0, link_ms - forward.backward_link_free_ms)
        + shape.step_ms
        + min(shape.tail_ms, forward.forward_out_busy_ms)
    )
    return _Candidate(ms, peak, fraction, times, shape, forward)


def _better(a: _Candidate, b: _Candidate) -> bool:
    """Faster wins; at equal time (1 us), the one that moves less."""
    if abs(a.ms - b.ms) > 1e-3:
        return a.ms < b.ms
    moved_a = sum(a.shape.batch_bytes) + (0 if a.forward.budget is None else 1)
    moved_b = sum(b.shape.batch_bytes) + (0 if b.forward.budget is None else 1)
    return moved_a < moved_b


def _refine(
    inputs: StepInputs,
    acts: _Activations,
    base: int,
    best: _Candidate,
    ladder: list[int | None],
    rung: int,
) -> _Candidate:
    """Raise the chosen activation budget towards the next larger rung while it fits."""
    if rung == 0 or best.forward.budget is None:
        return best
    above = ladder[rung - 1]
    low = best.forward.budget
    high = above if above is not None else max(low, acts.natural.in_backward)  # type: ignore[union-attr]
    for _ in range(_REFINE):
        middle = (low + high) // 2
        if middle <= low:
            break
        candidate = _evaluate(
            inputs, acts, base, best.shape, best.fraction, best.swap_times, acts.at(middle)
        )
        if candidate is not None and candidate.ms <= best.ms:
            best, low = candidate, middle
        else:
            high = middle
    return best


def _check_floor(inputs: StepInputs, acts: _Activations, state: int, base: int) -> None:
    floor = _floor(inputs, acts, base)
    if inputs.budget_bytes < floor[0]:
        raise BudgetTooSmall(_floor_message(inputs, acts, state, base, floor), floor[0])


def _floor(inputs: StepInputs, acts: _Activations, base: int) -> tuple[int, str]:
    """The smallest budget a plan may exist for, and what sets it."""
    opt = inputs.optimizer
    grads = inputs.grads_bytes
    staging = int(opt.staging_factor * max(opt.unit_bytes, default=0))
    update = base + grads + staging
    forward = base + acts.floor
    if update >= forward:
        return update, (
            f"parameters {format_bytes(inputs.params_bytes)} + optimizer state that never "
            f"moves {format_bytes(opt.fixed_state_bytes)} + gradients {format_bytes(grads)} "
            f"+ the update of the largest parameter's state {format_bytes(staging)}"
        )
    return forward, (
        f"parameters {format_bytes(inputs.params_bytes)} + optimizer state that never moves "
        f"{format_bytes(opt.fixed_state_bytes)} + activations: "
        f"{floor_reason(inputs.trace, index=acts.index)}"
    )


def _floor_message(
    inputs: StepInputs,
    acts: _Activations,
    state: int,
    base: int,
    floor: tuple[int, str] | None,
) -> str:
    floor_bytes, reason = floor if floor is not None else _floor(inputs, acts, base)
    budget = format_bytes(inputs.budget_bytes)
    if floor is None:
        return (
            f"No plan keeps the step within the device budget of {budget}: at every choice "
            f"the gradients landing in backward or the update's staging go over it (the "
            f"floor is {format_bytes(floor_bytes)}: {reason}). Raise device_budget_mb."
        )
    return (
        f"The device budget of {budget} is below the step's floor of "
        f"{format_bytes(floor_bytes)}: {reason}. Raise device_budget_mb to at least "
        f"{-(-floor_bytes // 2**20)} MiB."
    )
