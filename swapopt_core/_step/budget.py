"""One device budget for the whole step: the session plans the optimizer's update too.

With ``OffloadConfig(device_budget_mb=N)`` and ``OffloadSession(config, optimizer=opt)`` the
session owns the swap of ``opt``. The first step's forward and backward are traced with
activations under what the parameters, gradients, unmoving state and the batch read from
outside leave. Before its update, where the whole step fits with every state resident and
every activation kept, the update keeps its state (nothing moves, ever); otherwise it runs
conservatively (every state swapped, one parameter per pipeline batch, no prefetch) and is
measured. After it, the whole-step planner (``swapopt_core._planning.whole_step``) chooses how
much state stays resident, ``swap_times``, the prefetch and the activation budget from the
trace and the measured update; the swap is re-configured in place and the activation plans
re-planned. A step that grows past the plan is traced and planned again, or refused
(``BudgetTooSmall``).

Steps are metered on the runtime's whole-step meter (from the first entry of a step until
``opt.step()`` returns): ``OffloadStats.step_peak_device_bytes`` and
``last_step_peak_device_bytes``. The budget's part of ``opt.step()`` is the ``"budget"`` part
of the optimizer's ``StepHooks``, held weakly: closing or collecting the session removes it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from swapopt_core._activations.config import OffloadConfig
from swapopt_core._activations.executor import Executor
from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._device.meter import AllocatorMeter, StepMeter
from swapopt_core._errors import SwapOptWarning
from swapopt_core._planning.floor import format_bytes
from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.ir import ActivationTrace
from swapopt_core._planning.partition import partition
from swapopt_core._planning.update_model import HELD_BATCHES
from swapopt_core._planning.whole_step import (
    BudgetTooSmall,
    OptimizerCosts,
    StepInputs,
    StepPlan,
    plan_step,
)
from swapopt_core._step.growth import SavedBytes
from swapopt_core._step.hooks import StepHooks
from swapopt_core._swap.engine import EngineBase, engine_of

logger = logging.getLogger(__name__)

__all__ = ["StepBudget"]

#: Device bytes the update holds per byte of its largest batch before one was measured:
#: three staged batches and the undo copy of one.
_FIRST_STAGING_FACTOR = 4.0
#: Device bytes the update holds per byte of a resident batch, at least: its undo copy and
#: the update's temporaries (a foreach update makes about one more of the batch at once,
#: which a first update of one parameter per batch does not show).
_FIRST_RESIDENT_FACTOR = 2.0
#: Head room on the first plan's price of a batch: the first update ran one parameter per
#: batch, and bigger batches hold somewhat more per byte (the plan is corrected once a
#: planned update was metered).
_BATCH_MARGIN = 1.1
#: Steps metered from the start and after each plan where the meter counts storages (the
#: loopback runtimes): the first, conservative step and the first planned ones.
METERED_STEPS = 2
#: Bytes of optimizer state per parameter byte assumed before the state exists (Adam's two).
_STATE_PER_PARAM = 2


def _unique_storages(tensors: Iterator[torch.Tensor]) -> dict[torch.UntypedStorage, torch.Tensor]:
    """One tensor per storage (parameters may share one: tied weights), keyed by the
    storage itself."""
    seen: dict[torch.UntypedStorage, torch.Tensor] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            seen.setdefault(tensor.untyped_storage(), tensor)
    return seen


class StepBudget:
    """The whole-step side of an ``OffloadSession``: the swap it owns, the plan, the meter.

    Args:
        config: The session's config; ``device_budget_bytes`` is set.
        optimizer: The optimizer whose ``step()`` follows each ``with`` block.
        executor: The session's activation executor (its budget is set from here).

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer.
        BudgetTooSmall: The budget cannot hold the parameters, their gradients and the
            state of the largest parameter.
    """

    def __init__(self, config: OffloadConfig, optimizer: Any, executor: Executor) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "OffloadSession(optimizer=...) must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}."
            )
        budget = config.device_budget_bytes
        assert budget is not None
        self.budget = budget
        self.optimizer = optimizer
        self.executor = executor
        self.plan: StepPlan | None = None
        self.step_peak = 0
        self._meter: StepMeter | None = None
        self._planned_once = False
        params = list(_unique_storages(self._params()).values())
        self.params_bytes = sum(p.untyped_storage().nbytes() for p in params)
        self.grads_bytes = sum(p.untyped_storage().nbytes() for p in params if p.requires_grad)
        largest = max((p.untyped_storage().nbytes() for p in params), default=0)
        # What surely cannot fit is refused here: the parameters, their gradients and the
        # state of the largest one, which its update needs on the device. What the step
        # really needs is known once it was traced and its update measured (``plan_step``
        # refuses with that floor, as ``swapopt estimate`` does).
        sure = self.params_bytes + self.grads_bytes + _STATE_PER_PARAM * largest
        if budget < sure:
            raise BudgetTooSmall(
                f"OffloadConfig.device_budget_mb={config.device_budget_mb} "
                f"({format_bytes(budget)}) cannot hold the step: parameters "
                f"{format_bytes(self.params_bytes)} + gradients {format_bytes(self.grads_bytes)}"
                f" + the state of the largest parameter {format_bytes(_STATE_PER_PARAM * largest)}"
                f" need {format_bytes(sure)}. Raise device_budget_mb to at least "
                f"{sure / 2**20:.2f}.",
                sure,
            )
        self.engine = self._install(config)
        # The executor plans no warmup of its own until the whole-step plan did (which
        # replaces it), and refuses a trace that grew past the plan after that.
        executor.owned = "defer"
        executor.device_budget_bytes = budget
        self._saved = SavedBytes()  # the growth watch of entries the tracer does not see
        self._saved_planned: int | None = None  # what the traced step saved
        self._grew: tuple[int, int] | None = None  # saved bytes: planned, then seen
        self._traced_before = 0
        self._plan_due = False  # a step traced again after it grew: plan after its update
        self._first_kept_state = False  # the first update ran with every state resident
        # Forward and backward hold no staging (the update comes after them): the first
        # warmup keeps activations under what parameters, gradients and the state that never
        # moves leave (and the batch it reads from outside, as it reads it).
        executor.budget_bytes = max(
            0, budget - self.params_bytes - self.grads_bytes - self._fixed_state_bytes()
        )
        logger.info(
            "swapopt: first step under a device budget of %s: activations under %s",
            format_bytes(budget),
            format_bytes(executor.budget_bytes),
        )
        self.engine.measure_next_step()
        # The link is probed now, not in the first step: the probe's buffers are no part of
        # the step and must not count against its budget.
        executor.bandwidths(self.engine.runtime)
        self._update_extra: int | None = None  # the first update's bytes over its start
        self._inputs: StepInputs | None = None  # what the current plan was made from
        self._update_start = 0
        self._phase_peak = 0  # the current step's forward and backward peak
        self._state_at_start = 0  # device bytes of unmoving state as the update began
        self._to_meter = METERED_STEPS  # steps a storage-counting meter still watches
        self._every_step = config.meter_every_step
        self.last_step_peak = 0
        self.ended: str | None = None  # why the budget no longer plans the step
        self._said_ended = False
        # The budget's part of opt.step() (StepHooks orders it after the swap's update). It
        # is held weakly: the optimizer must not keep the session's plans and traces alive;
        # the hooks leave when the session is closed or collected.
        hooks = StepHooks.of(optimizer)
        other = hooks.holder("budget")
        if isinstance(other, StepBudget):
            # One budget plans an optimizer's step: the newest session's, as a loop that
            # makes a session per epoch expects. The other one says it ended.
            other.end("another OffloadSession's device budget took over its optimizer", warn=False)
        leave = hooks.join(
            "budget",
            pre=self._before_step,
            post=self._after_step,
            abort=self.abort,
            weak=True,
        )
        self._release = weakref.finalize(self, leave)

    def _params(self) -> Iterator[torch.Tensor]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    # ---- the swap ------------------------------------------------------------------------

    def _install(self, config: OffloadConfig) -> EngineBase:
        from swapopt_core._api import reconfigure_swap, swap_optimizer

        batches = max(1, sum(1 for _ in self._params()))
        existing = engine_of(self.optimizer)
        if existing is not None:
            safe = dataclasses.replace(
                existing.config,
                swap_times=batches,
                resident_state_fraction=0.0,
                prefetch_batches=0,
            )
            reconfigure_swap(self.optimizer, safe)
        else:
            runtime = config.runtime
            if runtime == "auto" and all(p.device.type == "cpu" for p in self._params()):
                runtime = "loopback"  # as the activations' "auto" does for CPU tensors
            swap_optimizer(
                self.optimizer,
                SwapOptimizerConfig(
                    swap_times=batches,
                    resident_state_fraction=0.0,
                    prefetch_batches=0,
                    runtime=runtime,
                ),
            )
        engine = engine_of(self.optimizer)
        if engine is None:
            raise ValueError(
                "OffloadConfig.device_budget_mb needs the optimizer's state swapped, but "
                f"swap_optimizer found no runtime for its parameters' devices "
                f"({sorted({p.device.type for p in self._params()})}). Set "
                "OffloadConfig.runtime to one that serves them ('loopback' on CPU)."
            )
        return engine

    def _fixed_state_bytes(self) -> int:
        """Device bytes of optimizer state that is not swapped (tiny tensors, step counts);
        on the loopback runtimes CPU plays the device, so every state tensor that is not a
        swapped slot's host copy counts."""
        hosts = {slot.host.untyped_storage() for slot in self.engine.slots.values()}
        loopback = self.engine.runtime.name.startswith("loopback")
        held = _unique_storages(
            value
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        return sum(
            t.untyped_storage().nbytes()
            for key, t in held.items()
            if key not in hosts and (loopback or t.device.type != "cpu")
        )

    # ---- the budget's life ----------------------------------------------------------------

    def close(self) -> None:
        """End the budget: close an open meter window and take the hooks off the optimizer.
        The session calls it from ``close()``; the hooks also leave when it is collected."""
        self.abort()
        self._release()

    def live(self) -> bool:
        """Whether the budget still plans the step; notices an unswap of its optimizer.

        ``unswap_optimizer(opt)`` takes away the swap the plan steers: the budget ends with a
        warning (the session goes on keeping activations under the activation budget it
        last set) instead of going on as if the step were still planned.
        """
        if self.ended is not None:
            if not self._said_ended:
                self._say_ended()
            return False
        if engine_of(self.optimizer) is self.engine:
            return True
        self.end("its optimizer was unswapped (unswap_optimizer)")
        return False

    def end(self, why: str, *, warn: bool = True) -> None:
        """Stop planning the step, saying ``why`` in a warning now, or (``warn=False``) at
        the session's next use."""
        self.ended = why
        self.close()
        if warn:
            self._say_ended()

    def _say_ended(self) -> None:
        self._said_ended = True
        kept = (
            "every activation stays on the device"
            if self.keeps_activations
            else f"its activations stay under {format_bytes(self.executor.budget_bytes)}"
        )
        warnings.warn(
            f"swapopt: the device budget of an OffloadSession ended: {self.ended}. The "
            f"optimizer's update is no longer planned or metered by it; {kept}. Make a new "
            "OffloadSession(config, optimizer=opt) to plan the step again.",
            SwapOptWarning,
            stacklevel=5,
        )

    def exited(self, *, failed: bool) -> None:
        """An entry ended (``failed``: with an exception, which abandons the step).

        A traced entry sets what the step saves for backward; an entry the tracer did not
        see (the plan keeps every activation) that saved more has grown past the plan: the
        next entry traces the step again under the room the plan leaves activations, and the
        step after it is planned again (or refused, ``BudgetTooSmall``)."""
        saved = self._saved.close()
        self.executor.outside_counts = None
        if failed:
            self.abort()
            return
        if self.ended is not None:
            return
        counts = self.executor.counts
        if counts.warmups + counts.retraces > self._traced_before:
            self._saved_planned = saved
            self._plan_due = self._grew is not None  # the grown step, traced: plan it
        elif (
            self.keeps_activations
            and self._saved_planned is not None
            and saved > self._saved_planned
        ):
            self._regrow(self._saved_planned, saved)

    def _regrow(self, planned: int, seen: int) -> None:
        plan, trace = self.plan, self.executor.trace
        assert plan is not None
        natural = TraceIndex(trace).natural_peak if trace is not None else 0
        room = max(0, self.budget - plan.planned_peak_bytes + natural)
        logger.info(
            "swapopt: the step saved %s for backward, over the %s it was planned for; "
            "tracing it again with activations under %s",
            format_bytes(seen),
            format_bytes(planned),
            format_bytes(room),
        )
        self._grew = (planned, seen)
        self.executor.forget_plans()
        self.executor.budget_bytes = room
        self.executor.owned = "defer"

    def abort(self) -> None:
        """The step ended with an exception: close its meter window (the retry is metered
        on its own, from its own start)."""
        meter, self._meter = self._meter, None
        if meter is not None and meter.is_open:
            meter.end()

    # ---- the step ------------------------------------------------------------------------

    def entered(self) -> None:
        """An entry starts: open the step's meter window unless one is open (accumulation),
        or unless the meter counts storages, ``meter_every_step`` is off and the steps after
        the last plan were metered (it costs about half a CPU step; an allocator's meter
        costs nothing and runs always). The growth watch counts what the entry saves."""
        if not self.live():
            return
        counts = self.executor.counts
        self._traced_before = counts.warmups + counts.retraces
        self._saved.open()
        if self.executor.owned == "defer":
            # Before a plan, the warmup keeps activations under what the rest of the step
            # leaves; the batch made before the entry is part of that rest once read.
            held = self._held_storages()
            self.executor.outside_counts = lambda storage: storage not in held
        if self._meter is None:
            meter = self.engine.runtime.step_meter()
            if (
                self._to_meter <= 0
                and not self._every_step
                and not isinstance(meter, AllocatorMeter)
            ):
                return
            self._to_meter -= 1
            meter.begin(self._held())
            self._meter = meter
            self._phase_peak = 0

    def _held_storages(self) -> set[torch.UntypedStorage]:
        """The storages of what the step holds from its start (see ``_held``)."""
        return {t.untyped_storage() for t in self._held() if t.device.type != "meta"}

    def _held(self) -> Iterator[torch.Tensor]:
        for param in self._params():
            yield param
            if param.grad is not None:
                yield param.grad
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value

    def _before_step(
        self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Step pre-hook: the update's phase starts here, or after the step's closure.

        A closure (``opt.step(closure)``, as Lightning's automatic optimization calls it)
        runs forward and backward inside ``step()``: those bytes are no part of the update,
        so the step is handed a closure that starts the update's phase once it returned.
        """
        if not self.live():
            return None
        # ``args`` starts with the optimizer itself; the closure follows, or is a keyword.
        positional = len(args) > 1
        closure = args[1] if positional else kwargs.get("closure")
        if closure is None:
            self._update_begins()
            return None
        if getattr(closure, "step_budget", None) is self:
            return None  # a nested step() call (super().step()): the outer one wrapped it

        def closure_then_update() -> Any:
            try:
                loss = closure()
            except BaseException:
                self.abort()  # no post-hook runs after a step that raised
                raise
            self._update_begins()
            return loss

        if inspect.isfunction(closure):
            # Keeps the marks the caller put on its closure.
            functools.update_wrapper(closure_then_update, closure)
        closure_then_update.step_budget = self  # type: ignore[attr-defined]
        if positional:
            return (args[0], closure_then_update, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_update}

    def _update_begins(self) -> None:
        meter = self._meter
        if meter is not None:
            # Forward and backward end here: the update is metered as a phase of its own.
            self._phase_peak = meter.restart_peak()
            self.step_peak = max(self.step_peak, self._phase_peak)
            self._update_start = meter.current_bytes
            if self._update_extra is None:  # the first update may create the state
                self._state_at_start = self._fixed_state_bytes()
        if not self._planned_once and self.plan is None:
            self._plan_first_update()

    def _plan_first_update(self) -> None:
        """Before the first update: where the whole step fits with every state resident and
        every activation kept, by the traced forward and backward and the state's size
        (Adam's two per parameter byte where it does not exist yet), the first update
        already keeps its state (a budget that fits moves nothing, the first step included).
        Otherwise it runs on the conservative settings and is measured; the plan after it
        decides."""
        trace = self.executor.trace
        if trace is None:
            return
        units = tuple(self._predicted_state(param) for param in self._params())
        costs = OptimizerCosts(
            unit_bytes=tuple(b for b in units if b),
            update_ms_per_byte=0.0,  # not measured yet: only "does it all fit" is asked
            fixed_state_bytes=self._fixed_state_bytes(),
            staging_factor=_FIRST_STAGING_FACTOR,
            resident_factor=_FIRST_RESIDENT_FACTOR,
        )
        try:
            plan = plan_step(self._step_inputs(trace, costs))
        except BudgetTooSmall:
            return
        if not plan.moves_nothing:
            return
        from swapopt_core._api import reconfigure_swap

        logger.info(
            "swapopt: the whole step fits %s with every state resident (predicted peak %s): "
            "the first update keeps its state",
            format_bytes(self.budget),
            format_bytes(plan.planned_peak_bytes),
        )
        reconfigure_swap(
            self.optimizer,
            dataclasses.replace(
                self.engine.config,
                swap_times=plan.swap_times,
                resident_state_fraction=1.0,
                prefetch_batches=0,
            ),
        )
        self._first_kept_state = True

    def _predicted_state(self, param: torch.Tensor) -> int:
        """Swappable state bytes of ``param``: what it has, else Adam's two per byte."""
        state = self.optimizer.state.get(param)
        if state:
            return sum(
                v.untyped_storage().nbytes()
                for v in state.values()
                if isinstance(v, torch.Tensor) and v.numel() >= self.engine.config.min_numel
            )
        if param.numel() < self.engine.config.min_numel or not param.requires_grad:
            return 0
        return _STATE_PER_PARAM * param.untyped_storage().nbytes()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.live():
            return
        inside = getattr(getattr(self.engine, "adapter", None), "inside_step", None)
        if inside is not None and inside(optimizer):
            return  # a nested step() call (super().step()): the outer one ends the step
        meter, self._meter = self._meter, None
        if meter is not None:
            update_peak = meter.end()
            self.last_step_peak = max(self._phase_peak, update_peak)
            self.step_peak = max(self.step_peak, update_peak)
            extra = max(0, update_peak - self._update_start)
            if self._update_extra is None:
                # State the first update created and kept (a fresh optimizer's, resident)
                # is state, not what the update holds besides it.
                created = max(0, self._fixed_state_bytes() - self._state_at_start)
                self._update_extra = max(0, extra - created)
            elif self.plan is not None and self._inputs is not None:
                self._correct(extra)
        if not self._planned_once or self._plan_due:
            self._planned_once, self._plan_due = True, False
            grew, self._grew = self._grew, None
            try:
                self._make_plan()
            except BudgetTooSmall as error:
                if grew is None:
                    raise
                raise BudgetTooSmall(
                    f"The step grew past what the device budget was planned for (it saved "
                    f"{format_bytes(grew[1])} for backward, {format_bytes(grew[0])} when "
                    f"planned), and no plan holds it: {error}",
                    error.floor_bytes,
                ) from error

    def _correct(self, extra: int) -> None:
        """Plan again if the update held more per batch than the plan assumed.

        The first update ran one parameter per batch; a planned one runs bigger batches,
        whose temporaries and undo copies need not scale the same way. What the meter saw
        is the better price: the plan is made again with it (once it differs by over 1 %).
        """
        assert self.plan is not None and self._inputs is not None
        largest = self.plan.largest_batch_bytes
        costs = self._inputs.optimizer
        planned = self.plan.update_extra_bytes
        if not largest or extra <= planned * 1.01:
            return
        logger.info(
            "swapopt: the update held %s beyond its start, over the %s planned; planning again",
            format_bytes(extra),
            format_bytes(planned),
        )
        # The price of a batch is a max of terms (staged batches, a resident one and what
        # arrives meanwhile), so scaling the factors scales it less: scale until the plan
        # prices its update at what was seen (a few rounds at most).
        inputs, plan = self._inputs, self.plan
        for _ in range(4):
            scale = extra / planned if planned else extra / largest / costs.staging_factor
            resident = costs.resident_factor
            costs = dataclasses.replace(
                costs,
                staging_factor=costs.staging_factor * scale,
                resident_factor=None if resident is None else resident * scale,
            )
            inputs = dataclasses.replace(inputs, optimizer=costs)
            plan = plan_step(inputs)
            planned = plan.update_extra_bytes
            if planned >= extra or plan.largest_batch_bytes != largest:
                break
        self._inputs = inputs
        self._apply(plan)

    def _make_plan(self) -> None:
        costs = self.engine.costs()
        trace = self.executor.trace
        if costs is None or trace is None:
            self.executor.owned = None
            self.executor.rebudget(self.executor.budget_bytes, None)
            logger.warning(
                "swapopt: the first step under device_budget_mb ran without %s; the step "
                "stays on the conservative settings",
                "a measured update" if costs is None else "a traced forward and backward",
            )
            return
        largest = max(costs.unit_bytes, default=0)
        if self._first_kept_state and costs.unit_bytes:
            # The first update kept its state, in ``swap_times`` batches of several units.
            units = costs.unit_bytes
            runs = partition(list(units), self.engine.config.swap_times)
            largest = max(sum(units[k] for k in run) for run in runs)
        if self._update_extra is not None and largest:
            # The first update ran one parameter per batch. Its staging (what the ledger saw
            # staged at once) says little of batches of equal size, whose three staged ones
            # are all as large as the largest; what it held besides (the undo copy, the
            # update's temporaries), over the largest parameter's state, is a batch's own
            # price. A batch then costs the pipeline's three staged batches plus that.
            ledger = self.engine.ledger
            staged = max(0, ledger.window_peak - ledger.held)
            besides = max(0, self._update_extra - staged) / largest
            measured = max(self._update_extra / largest, HELD_BATCHES + besides) * _BATCH_MARGIN
            # A batch whose state stays resident is staged nowhere: where the first update
            # kept its state, what it held besides is a resident batch's measured price.
            # Priced from swapped batches of one parameter, a resident batch costs what a
            # swapped one does (a foreach update's temporaries grow with the batch).
            resident = max(_FIRST_RESIDENT_FACTOR, besides) if self._first_kept_state else None
            costs = dataclasses.replace(
                costs,
                staging_factor=max(costs.staging_factor, measured),
                resident_factor=resident,
            )
        inputs = self._step_inputs(trace, costs)
        self._inputs = inputs
        try:
            plan = plan_step(inputs)
        except BudgetTooSmall:
            if self.plan is not None or not 0 < self.step_peak <= self.budget:
                raise
            # The first step kept the budget on its conservative settings: they stay (a
            # budget the first step kept is never refused after it for the same shapes).
            self._keep_first_settings()
            return
        self._apply(plan)

    def _step_inputs(self, trace: ActivationTrace, costs: OptimizerCosts) -> StepInputs:
        """What the whole-step planner plans from: the traced step, the update's ``costs``."""
        ready = tuple(self.executor.gradient_ready)
        start = min((op for op, _ in ready), default=None)
        if start is None:
            ix = TraceIndex(trace)
            start = max(range(ix.n), key=ix.natural.__getitem__, default=0)
        # The batch made before the window (on a GPU: moved to the device before it) is
        # read by the step and held through it, but no trace storage: it counts apart.
        held = self._held_storages()
        return StepInputs(
            budget_bytes=self.budget,
            params_bytes=self.params_bytes,
            grads_bytes=self.grads_bytes,
            optimizer=costs,
            trace=trace.with_limit(None),
            backward_start_op=start,
            planner=self.executor.planner,
            grad_ready=ready,
            inputs_bytes=self.executor.outside_inputs.bytes_besides(held),
        )

    def _keep_first_settings(self) -> None:
        """No plan the planner prices fits, but the first step, as it ran, did: keep its
        settings and plan its activations at the budget they had."""
        logger.info(
            "swapopt: no whole-step plan fits %s by the planner's prices, but the first step "
            "kept it (peak %s): its settings stay",
            format_bytes(self.budget),
            format_bytes(self.step_peak),
        )
        # Its activations keep what is left now that the state exists (the state that
        # never moves, step counts, was not there in the first step's forward).
        held = self._held_storages()
        room = (
            self.budget
            - self.params_bytes
            - self.grads_bytes
            - self._fixed_state_bytes()
            - self.executor.outside_inputs.bytes_besides(held)
        )
        self.executor.rebudget(max(0, min(self.executor.budget_bytes, room)), None)
        self.executor.owned = "refuse"

    def _apply(self, plan: StepPlan) -> None:
        from swapopt_core._api import reconfigure_swap

        reconfigure_swap(
            self.optimizer,
            dataclasses.replace(
                self.engine.config,
                swap_times=plan.swap_times,
                resident_state_fraction=plan.resident_state_fraction,
                prefetch_batches=plan.prefetch_batches,
            ),
        )
        self._to_meter = METERED_STEPS  # the new plan's first steps are watched again
        budget = plan.activation_budget_bytes
        self.executor.rebudget(budget if budget is not None else 2**62, plan.schedule)
        self.executor.owned = "refuse"
        self.plan = plan
        logger.info(
            "swapopt: whole step planned under %s: %.0f%% of the optimizer state resident, "
            "swap_times=%d, prefetch_batches=%d, activations %s; predicted peak %s, step "
            "%.1f ms (plain %.1f ms)",
            format_bytes(self.budget),
            100 * plan.resident_state_fraction,
            plan.swap_times,
            plan.prefetch_batches,
            "kept" if budget is None else f"under {format_bytes(budget)}",
            format_bytes(plan.planned_peak_bytes),
            plan.planned_step_ms,
            plan.plain_step_ms,
        )

    @property
    def keeps_activations(self) -> bool:
        """Whether the plan keeps every activation on the device: then the session's entries
        run without its tracer (nothing to move, nothing to pay per op), unless the step
        grew past the plan and is traced again."""
        return (
            self.plan is not None
            and self.plan.activation_budget_bytes is None
            and self._grew is None
        )

    def stats(self) -> dict[str, Any]:
        """The whole-step fields of ``OffloadStats``."""
        plan = self.plan
        config = self.engine.config
        return {
            "step_peak_device_bytes": self.step_peak,
            "last_step_peak_device_bytes": self.last_step_peak,
            "planned_step_peak_device_bytes": plan.planned_peak_bytes if plan else None,
            "planned_step_ms": plan.planned_step_ms if plan else None,
            "plain_step_ms": plan.plain_step_ms if plan else None,
            "resident_state_fraction": config.resident_state_fraction,
            "swap_times": config.swap_times,
            "prefetch_batches": config.prefetch_batches,
            "activation_budget_bytes": None
            if self.keeps_activations
            else self.executor.budget_bytes,
        }
