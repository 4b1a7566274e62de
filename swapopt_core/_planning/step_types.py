"""What the whole-step planner plans from and what it returns (``whole_step.plan_step``)."""

from __future__ import annotations

from dataclasses import dataclass

from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule

__all__ = ["BudgetTooSmall", "OptimizerCosts", "StepInputs", "StepPlan"]


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
        resident_factor: Device bytes the update holds per byte of a batch whose state is
            resident (its undo copy and temporaries: no staging); ``None``: as
            ``staging_factor``.
        batch_overhead_ms: Fixed time per pipeline batch (launches, waits).
    """

    unit_bytes: tuple[int, ...]
    update_ms_per_byte: float
    fixed_state_bytes: int = 0
    staging_factor: float = 3.0
    resident_factor: float | None = None
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
        inputs_bytes: Device bytes the step reads that were made before it and are neither
            parameters, gradients nor optimizer state (the batch moved to the device before
            the session's window): held for the whole step, like the parameters.
    """

    budget_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer: OptimizerCosts
    trace: ActivationTrace
    backward_start_op: int
    planner: ResidencyPlanner
    grad_ready: tuple[tuple[int, int], ...] = ()
    inputs_bytes: int = 0


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
