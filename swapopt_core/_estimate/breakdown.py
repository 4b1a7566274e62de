"""Estimate one training step before it runs: plain, and planned under a device budget.

``estimate`` builds the model on fake tensors, records one step (``fake_trace``), prices it
with a device profile (``costs``) and reports, for plain training and for the plan that
``plan_step`` makes at the budget, the peak device bytes, the step time and what the peak is
made of.

Plain training is modelled op by op: parameters and optimizer state for the whole step, each
gradient from the op after which autograd stores it, activations from the op that makes them
to their last use (or their death, for those the caller holds), then the update with its
temporaries (AdamW's foreach update makes one parameter-sized temporary, the square root of
the second moment). Its time is the sum of the op durations plus the update's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode

from swapopt_core._estimate.costs import OPTIMIZERS, activation_trace, optimizer_costs
from swapopt_core._estimate.fake_trace import FakeStep, StepRecorder
from swapopt_core._estimate.models import ModelSpec, loss_of
from swapopt_core._estimate.profiles import DeviceProfile
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ActivationTrace
from swapopt_core._planning.simulate import simulate
from swapopt_core._planning.whole_step import OptimizerCosts, StepInputs, StepPlan, plan_step

logger = logging.getLogger(__name__)

__all__ = ["Breakdown", "Estimate", "estimate", "trace_fake_step"]


@dataclass(frozen=True)
class Breakdown:
    """One column of the estimate: a peak, a time and what the peak holds.

    Attributes:
        peak_bytes: Peak device bytes of the whole step.
        step_ms: Predicted step time.
        params_bytes: Parameters.
        grads_bytes: Gradients (at their fullest, during the update).
        optimizer_state_bytes: Optimizer state kept on the device.
        activations_peak_bytes: Peak of the activations.
        knobs: The plan's choices (plan only).
    """

    peak_bytes: int
    step_ms: float
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    activations_peak_bytes: int
    knobs: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        found: dict[str, Any] = {
            "peak_bytes": self.peak_bytes,
            "step_ms": self.step_ms,
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "activations_peak_bytes": self.activations_peak_bytes,
        }
        if self.knobs is not None:
            found.update(self.knobs)
        return found


@dataclass(frozen=True)
class Estimate:
    """What ``estimate`` found.

    Attributes:
        plain: Plain training.
        plan: The plan at ``budget_bytes`` (``None`` without a budget).
        budget_bytes: The budget asked for.
        profile: The device profile used.
        details: How the trace was made (model, batch, sequence, ops, seconds).
        trace: The priced activation trace (what ``swapopt plan`` and ``plot`` read).
    """

    plain: Breakdown
    plan: Breakdown | None
    budget_bytes: int | None
    profile: DeviceProfile
    details: dict[str, Any] = field(default_factory=dict)
    trace: ActivationTrace | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``plain``, ``plan`` and how they were made."""
        return {
            "plain": self.plain.to_dict(),
            "plan": None if self.plan is None else self.plan.to_dict(),
            "budget_bytes": self.budget_bytes,
            "profile": self.profile.to_dict(),
            **self.details,
        }


@dataclass(frozen=True)
class _Traced:
    step: FakeStep
    params: tuple[tuple[int, int], ...]  # (numel, element size) of trainable params, step order
    params_bytes: int  # every parameter and buffer


def trace_fake_step(spec: ModelSpec, batch: int, seq: int, on_cpu: bool) -> _Traced:
    """Build the model on fake tensors and record one step: forward, loss, backward."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, inputs = spec.build(batch, seq)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        held = [*model.parameters(), *model.buffers()]
        recorder = StepRecorder(on_cpu)
        with recorder:
            out, loss = loss_of(model, inputs, spec.label)
            recorder.mark_backward()
            loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        step = recorder.finish(grads)
        del out, loss, grads
    seen: set[int] = set()
    unique = []
    for p in params:  # tied weights are one parameter to the optimizer
        if id(p) not in seen:
            seen.add(id(p))
            unique.append((p.numel(), p.element_size()))
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in held}.values())
    return _Traced(step, tuple(unique), total)


def _plain(
    traced: _Traced, trace: ActivationTrace, costs: OptimizerCosts, update_temp: int
) -> Breakdown:
    step = traced.step
    n = len(trace.ops)
    delta = [0] * (n + 1)  # bytes allocated at op i, and freed after op i (at i + 1)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for index, op in enumerate(trace.ops):
        for access in op.accesses:
            first.setdefault(access.storage_id, index)
            last[access.storage_id] = index
    for sid, size in trace.storage_sizes.items():
        if sid not in first:
            continue
        delta[first[sid]] += size
        if sid not in trace.retained_sids:
            delta[trace.freed_after.get(sid, last[sid]) + 1] -= size
    activations = [0] * n
    gradients = [0] * n
    for made, size in step.gradients:
        gradients[made] += size
    act = grad = act_peak = peak = 0
    for index in range(n):
        act += delta[index]
        grad += gradients[index]
        activations[index] = act
        act_peak = max(act_peak, act)
        peak = max(peak, act + grad)
    grads_bytes = sum(size for _, size in step.gradients)
    state = costs.fixed_state_bytes + sum(costs.unit_bytes)
    retained_bytes = sum(trace.storage_sizes[s] for s in trace.retained_sids)
    update_peak = grads_bytes + retained_bytes + update_temp
    fixed = traced.params_bytes + state
    update_ms = state * costs.update_ms_per_byte + costs.batch_overhead_ms
    return Breakdown(
        peak_bytes=fixed + max(peak, update_peak),
        step_ms=sum(op.duration_ms for op in trace.ops) + update_ms,
        params_bytes=traced.params_bytes,
        grads_bytes=grads_bytes,
        optimizer_state_bytes=state,
        activations_peak_bytes=act_peak,
    )


def _planned(
    plan: StepPlan, plain: Breakdown, trace: ActivationTrace, costs: OptimizerCosts
) -> Breakdown:
    swappable = sum(costs.unit_bytes)
    if plan.schedule is not None and plan.activation_budget_bytes is not None:
        limited = trace.with_limit(plan.activation_budget_bytes)
        activations = simulate(limited, plan.schedule, record=False).peak_bytes
    else:
        activations = plain.activations_peak_bytes
    return Breakdown(
        peak_bytes=plan.planned_peak_bytes,
        step_ms=plan.planned_step_ms,
        params_bytes=plain.params_bytes,
        grads_bytes=plain.grads_bytes,
        optimizer_state_bytes=costs.fixed_state_bytes
        + round(plan.resident_state_fraction * swappable),
        activations_peak_bytes=activations,
        knobs={
            "resident_state_fraction": plan.resident_state_fraction,
            "swap_times": plan.swap_times,
            "prefetch_batches": plan.prefetch_batches,
            "activation_budget_bytes": plan.activation_budget_bytes,
            "moves_nothing": plan.moves_nothing,
        },
    )


def estimate(
    spec: ModelSpec,
    batch: int,
    seq: int,
    profile: DeviceProfile,
    planner: ResidencyPlanner,
    *,
    optimizer: str = "adamw",
    budget_bytes: int | None = None,
    min_numel: int = 1024,
) -> Estimate:
    """Trace one step of ``spec`` on fake tensors and estimate plain training and the plan.

    Args:
        spec: The model and its inputs.
        batch: Batch size.
        seq: Sequence length.
        profile: The device the step is priced for.
        planner: Plans activations at a given budget (``plan_step`` asks it).
        optimizer: A name in ``costs.OPTIMIZERS``.
        budget_bytes: The device budget of the plan; ``None``: plain training only.
        min_numel: Parameters below this keep their optimizer state on the device.

    Raises:
        BudgetTooSmall: No plan fits ``budget_bytes``; its message says the floor.
        ValueError: An unknown optimizer, or a model that does not build or returns no loss.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {optimizer}: expected one of {', '.join(OPTIMIZERS)}.")
    model = OPTIMIZERS[optimizer]
    started = time.perf_counter()
    traced = trace_fake_step(spec, batch, seq, on_cpu=profile.name == "cpu")
    traced_s = time.perf_counter() - started
    trace = activation_trace(traced.step, profile)
    costs = optimizer_costs(traced.params, model, profile, min_numel)
    temp = sum(n * s for n, s in traced.params) if model.states == 2 else 0
    plain = _plain(traced, trace, costs, temp)
    plan = None
    if budget_bytes is not None:
        inputs = StepInputs(
            budget_bytes=budget_bytes,
            params_bytes=traced.params_bytes,
            grads_bytes=plain.grads_bytes,
            optimizer=costs,
            trace=trace,
            backward_start_op=traced.step.backward_start,
            planner=planner,
            grad_ready=tuple(traced.step.gradients),
        )
        plan = _planned(plan_step(inputs), plain, trace, costs)
    details = {
        "model": spec.label,
        "batch": batch,
        "seq": seq,
        "optimizer": optimizer,
        "ops": len(trace.ops),
        "backward_start_op": traced.step.backward_start,
        "trace_seconds": round(traced_s, 3),
        "estimate_seconds": round(time.perf_counter() - started, 3),
    }
    logger.info("estimate: %d ops traced in %.1f s", len(trace.ops), traced_s)
    return Estimate(plain, plan, budget_bytes, profile, details, trace)
