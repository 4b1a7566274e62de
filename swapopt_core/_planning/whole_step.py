"""Plan a whole training step under one device budget.

The step is forward and backward (an ``ActivationTrace``) followed by the optimizer's update
(``OptimizerCosts``). The plan chooses how much optimizer state stays resident for good,
``swap_times``, how many batches are prefetched during backward and the activation budget
(with its schedule), by predicted step time, with the predicted peak at every point at most
the budget. See ``plan_step``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from swapopt_core._planning.floor import floor_reason, format_bytes
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.step_forward import Activations, Forward
from swapopt_core._planning.step_types import BudgetTooSmall, OptimizerCosts, StepInputs, StepPlan
from swapopt_core._planning.update_model import UpdateCosts, UpdateShape, update_shape

__all__ = ["BudgetTooSmall", "OptimizerCosts", "StepInputs", "StepPlan", "plan_step"]

#: Resident fractions tried (sixteenths), pipeline depths and prefetch depths.
_FRACTIONS = tuple(i / 16 for i in range(17))
_SWAP_TIMES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_PREFETCH = (0, 1, 2)
#: Where the activation budgets tried sit between the floor (0) and the natural peak (1).
_LADDER = (0.75, 0.5, 0.3, 0.15, 0.0)
#: Bisection rounds that refine the chosen activation budget towards the next larger one.
_REFINE = 2


@dataclass(frozen=True)
class _Candidate:
    ms: float
    peak: int
    fraction: float
    swap_times: int
    shape: UpdateShape
    forward: Forward


def plan_step(inputs: StepInputs) -> StepPlan:
    """Choose the knobs of the fastest predicted step whose peak fits ``budget_bytes``.

    The step's device bytes at any point are the parameters, the inputs made before the
    step (``inputs_bytes``), the optimizer state that never moves (``fixed_state_bytes`` and
    the resident fraction), the gradients landed so far, the activations the plan keeps
    (in-flight copies included) and, from backward's first op on, the prefetched batches;
    during the update, the gradients and ``staging_factor`` times the largest swapped batch
    instead of activations and prefetch. Time: forward and backward as the activation plan
    simulates them, the prefetch's copies where they exceed backward's idle link time, the
    update as ``update_model`` predicts it, and the update's copies out where they meet
    forward's own.

    Raises:
        BudgetTooSmall: No plan fits; the message gives the floor and what sets it.
    """
    opt = inputs.optimizer
    state = sum(opt.unit_bytes)
    base = inputs.params_bytes + opt.fixed_state_bytes + inputs.inputs_bytes
    acts = Activations(inputs, _screening_planner(inputs))
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
    # One unit per batch (the first step's settings) is tried too: a budget that step kept
    # is never refused for want of a finer pipeline than the grid's.
    swap_times = sorted({*_SWAP_TIMES, max(1, units)})
    for fraction, times, prefetch in itertools.product(_FRACTIONS, swap_times, _PREFETCH):
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
        update_extra_bytes=best.shape.extra_bytes(opt.staging_factor, opt.resident_factor),
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


def _final(inputs: StepInputs, acts: Activations, base: int, best: _Candidate) -> _Candidate:
    """Plan the chosen activation budget with the session's planner, if it screened with
    another; keep the screened plan where the session's does not fit or is slower."""
    if acts.planner is inputs.planner or best.forward.budget is None:
        return best
    real = Activations(inputs, inputs.planner)
    candidate = _evaluate(
        inputs, acts, base, best.shape, best.fraction, best.swap_times, real.at(best.forward.budget)
    )
    return candidate if candidate is not None and candidate.ms <= best.ms else best


def _ladder(acts: Activations) -> list[int]:
    natural = acts.natural
    assert natural is not None
    top = max(natural.before_backward, natural.in_backward - acts.grads[-1], acts.floor)
    levels = sorted({int(acts.floor + (top - acts.floor) * q) for q in _LADDER}, reverse=True)
    return [level for level in levels if level < top] or [acts.floor]


def _may_fit(inputs: StepInputs, acts: Activations, base: int, shape: UpdateShape) -> bool:
    """Whether the parts no activation plan changes fit: the gradients and prefetch at the
    end of backward, the update's staging."""
    held = base + shape.resident_bytes + acts.grads[-1] + acts.retained
    opt = inputs.optimizer
    staging = shape.extra_bytes(opt.staging_factor, opt.resident_factor)
    return max(held + shape.prefetch_bytes, held + staging) <= inputs.budget_bytes


def _evaluate(
    inputs: StepInputs,
    acts: Activations,
    base: int,
    shape: UpdateShape,
    fraction: float,
    times: int,
    forward: Forward | None,
) -> _Candidate | None:
    if forward is None:
        return None
    held = base + shape.resident_bytes
    # The update holds the gradients and what the step keeps past backward (``retained``,
    # as the plain peak and ``_may_fit`` count them) besides its batches.
    update_peak = (
        held
        + inputs.grads_bytes
        + acts.retained
        + shape.extra_bytes(inputs.optimizer.staging_factor, inputs.optimizer.resident_factor)
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
    """Faster wins; at equal time (1 us), the one that moves less, then the one whose peak
    is lower. (With every unit resident, any ``swap_times`` takes the same time: more
    batches only make each batch's undo copy and temporaries smaller. Without the last
    rule the first one tried, a single batch, won wherever it fit, and a larger budget
    gave a higher peak for nothing.)"""
    if abs(a.ms - b.ms) > 1e-3:
        return a.ms < b.ms
    moved_a = sum(a.shape.batch_bytes) + (0 if a.forward.budget is None else 1)
    moved_b = sum(b.shape.batch_bytes) + (0 if b.forward.budget is None else 1)
    if moved_a != moved_b:
        return moved_a < moved_b
    return a.peak < b.peak


def _refine(
    inputs: StepInputs,
    acts: Activations,
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


def _check_floor(inputs: StepInputs, acts: Activations, state: int, base: int) -> None:
    floor = _floor(inputs, acts, base)
    if inputs.budget_bytes < floor[0]:
        raise BudgetTooSmall(_floor_message(inputs, acts, state, base, floor), floor[0])


def _floor(inputs: StepInputs, acts: Activations, base: int) -> tuple[int, str]:
    """The smallest budget a plan may exist for, and what sets it."""
    opt = inputs.optimizer
    grads = inputs.grads_bytes
    staging = int(opt.staging_factor * max(opt.unit_bytes, default=0))
    update = base + grads + staging
    forward = base + acts.floor
    held = f"parameters {format_bytes(inputs.params_bytes)}"
    if inputs.inputs_bytes:
        held += f" + inputs made before the step {format_bytes(inputs.inputs_bytes)}"
    if update >= forward:
        return update, (
            f"{held} + optimizer state that never "
            f"moves {format_bytes(opt.fixed_state_bytes)} + gradients {format_bytes(grads)} "
            f"+ the update of the largest parameter's state {format_bytes(staging)}"
        )
    return forward, (
        f"{held} + optimizer state that never moves "
        f"{format_bytes(opt.fixed_state_bytes)} + activations: "
        f"{floor_reason(inputs.trace, index=acts.index)}"
    )


def _floor_message(
    inputs: StepInputs,
    acts: Activations,
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
