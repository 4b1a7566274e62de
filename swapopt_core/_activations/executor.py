"""The executor of an ``OffloadSession``: it runs each entry and decides what it becomes.

The session calls ``enter()`` and ``exit()`` around every entry; everything in between is
the executor's: which runtime serves the activations, whether the entry traces or replays,
what a replay that leaves its plan does, and when a plan is dropped. The plan is the
serialised contract, an ``ActivationTrace`` and its ``ResidencySchedule``: fresh from the
planner or read back from JSON, it is all a replay consults (see ``replay_entry.py``).

The rules, in one place:

- With no plan, an entry is a **warmup**: it traces the step and the planner plans it.
- The session keeps a plan per distinct op sequence (``PlanBook``, ``plans.py``). An entry
  **replays** the plan that followed the last entry's plan last time (else that plan
  again). When the step leaves it at op ``k``, the replay goes on with a kept plan that
  shares the first ``k`` ops and has the step's op ``k`` (``replay_entry.py``); without one it
  falls back to a warmup seeded with the plan's first ``k`` ops, which is planned at the
  end and kept as another plan (a **retrace**).
- A replay whose storages come out larger than planned keeps replaying under the budget,
  and at its end the plan is made again for the grown sizes (a **re-plan**: same ops, no
  warmup). Smaller storages simply replay: a plan holds the largest sizes seen.
- A replay that ends before its trace does, or that fell back without seeing its storages
  (an empty plan registers only what it must), plans nothing and keeps its plan; the same
  plan missed twice in a row is dropped.
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import Literal

import torch

from swapopt_core._activations.config import OffloadConfig
from swapopt_core._activations.entry import Entry
from swapopt_core._activations.plans import Plan, PlanBook, canonical, grown
from swapopt_core._activations.recording import check_marks
from swapopt_core._activations.replay_entry import ReplayEntry
from swapopt_core._activations.residency import HostPool
from swapopt_core._activations.scope import Scope
from swapopt_core._activations.warmup import OutsideReads, WarmupEntry
from swapopt_core._device.interface import TorchRuntime
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._device.registry import RuntimeChoice, resolve_runtime, shared_runtime
from swapopt_core._planning.floor import floor_reason, format_bytes, min_feasible_budget
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule
from swapopt_core._planning.step_types import BudgetTooSmall

logger = logging.getLogger(__name__)

__all__ = ["Counts", "Executor", "Verdict"]


class Verdict(enum.Enum):
    """What an entry turned out to be."""

    REPLAYED = "replayed"  # a kept plan ran to its end (switches and growth included)
    MISSED = "missed"  # the replay left its plan and recorded nothing; the plan stays
    DROPPED = "dropped"  # the second miss in a row: the plan is gone
    TRACED = "traced"  # a warmup traced the step, and it was planned
    RETRACED = "retraced"  # the replay left its plan and recorded the rest: a new plan

    @property
    def traced(self) -> bool:
        return self in (Verdict.TRACED, Verdict.RETRACED)

    @property
    def missed(self) -> bool:
        return self in (Verdict.MISSED, Verdict.DROPPED, Verdict.RETRACED)


@dataclass(frozen=True)
class Counts:
    """What the session's entries did, added up by the executor as each entry ends. The
    session's ``OffloadStats`` is these counts and a few figures of the session now; its
    docstring says what each means."""

    peak_resident_activation_bytes: int = 0
    last_peak_resident_activation_bytes: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    warmups: int = 0
    replays: int = 0
    retraces: int = 0
    host_cap_refusals: int = 0
    gradient_bytes: int = 0  # parameter gradient bytes the last warmup found
    recomputes: int = 0
    demand_recomputes: int = 0
    replans: int = 0
    plan_switches: int = 0
    eviction_stalls: int = 0


class Executor:
    """Runs the entries of one session under its config, with its planner.

    Args:
        config: The session's budget, host cap, runtime and size threshold.
        planner: What plans each new trace.
        runtimes: How to make the runtime ``config.runtime`` selects. Default: resolved
            against the built-in runtimes only (the session resolves it with its plugins).
    """

    def __init__(
        self,
        config: OffloadConfig,
        planner: ResidencyPlanner,
        *,
        runtimes: RuntimeChoice | None = None,
    ) -> None:
        self.config = config
        self.planner = planner
        self.runtimes = runtimes if runtimes is not None else _builtin_runtimes(config.runtime)
        self.budget_bytes = config.budget_bytes
        self.min_offload_bytes = config.min_offload_bytes
        self.book = PlanBook()
        self.entry: Entry | None = None
        self.runtime: TorchRuntime | None = None
        self.pool: HostPool | None = None
        self.leaves: list[weakref.ref] = []  # leaf tensors the last recording hooked
        self._bandwidth: tuple[TorchRuntime, tuple[float, float]] | None = None
        self.counts = Counts()
        #: ``(op, bytes)`` of the gradients the last recording warmup saw land (the
        #: whole-step planner's input).
        self.gradient_ready: list[tuple[int, int]] = []
        #: Storages made before the last recording warmup that its ops read, with their
        #: bytes (``WarmupEntry.outside``: the whole-step planner counts those no optimizer
        #: holds).
        self.outside_inputs = OutsideReads()
        #: Set by a whole-step budget (``swapopt_core._step.budget``): ``"defer"`` until its
        #: first plan (a warmup's plan is its to make: none is made here), ``"refuse"``
        #: after it (a trace that grew past the activation budget raises ``BudgetTooSmall``
        #: instead of being planned for more), ``None`` without one.
        self.owned: Literal["defer", "refuse"] | None = None
        self.device_budget_bytes = 0  # the owning budget's, for BudgetTooSmall.floor_bytes
        #: Set by the owning budget before its plan: which storages made before an entry
        #: take room from a warmup's budget when read (``Scope.outside_counts``).
        self.outside_counts: Callable[[torch.UntypedStorage], bool] | None = None

    # ---- the plans -----------------------------------------------------------------------

    @property
    def trace(self) -> ActivationTrace | None:
        """The trace of the most recently used plan."""
        plan = self.book.current
        return plan.trace if plan is not None else None

    @property
    def schedule(self) -> ResidencySchedule | None:
        """The schedule of the most recently used plan."""
        plan = self.book.current
        return plan.schedule if plan is not None else None

    def adopt(self, trace: ActivationTrace, schedule: ResidencySchedule) -> None:
        """Replay ``schedule`` for ``trace`` from the next entry on (the plans kept so far
        stay, behind it)."""
        plan = Plan(trace, schedule)
        self.book.add(plan)
        self.book.last = plan  # the next entry starts with it

    def load(self, trace: ActivationTrace, schedule: ResidencySchedule) -> None:
        """``adopt`` a plan from elsewhere (JSON files), after checking it can drive a replay.

        Raises:
            TypeError: ``trace`` or ``schedule`` has the wrong type.
            ValueError: The trace lacks the output positions a replay binds storages by (only
                a session records them), the schedule names ops or storages the trace does
                not have, or the trace marks recompute an op the tracer never would
                (``recording.check_marks``).
        """
        if not isinstance(trace, ActivationTrace):
            raise TypeError(f"trace must be an ActivationTrace, got {type(trace).__name__}.")
        if not isinstance(schedule, ResidencySchedule):
            raise TypeError(f"schedule must be a ResidencySchedule, got {type(schedule).__name__}.")
        made = {a.storage_id for op in trace.ops for a in op.accesses if a.output is not None}
        unplaced = sorted(set(trace.storage_sizes) - made)
        if unplaced:
            raise ValueError(
                f"The trace cannot drive a replay: storage {unplaced[0]} (and "
                f"{len(unplaced) - 1} more) has no output position on the access that creates "
                "it. Pass a trace an OffloadSession recorded (session.trace.to_json())."
            )
        for side, op, action in schedule.actions():
            if not 0 <= op < len(trace.ops) or action.storage_id not in trace.storage_sizes:
                raise ValueError(
                    f"The schedule does not fit the trace: {side} op {op} {action.kind.value} "
                    f"storage {action.storage_id}, but the trace has {len(trace.ops)} ops and "
                    "no such storage or op. Pass the schedule planned for this trace "
                    "(swapopt plan --trace ...)."
                )
        check_marks(trace)  # a mark a replay would trust: the tracer's rules, by op name
        self.adopt(trace, schedule)

    # ---- entries -------------------------------------------------------------------------

    def enter(self) -> None:
        """Start an entry: a replay of the plan if there is one, else a warmup."""
        if self.runtime is None and self.config.runtime != "auto":
            # A named runtime is made at once, so a missing CUDA fails here and not in an op.
            self._use(self.runtimes.make())
        self.entry = Entry(self, self.book.predict())
        self.entry.mode.__enter__()
        self.entry.mode.armed = True

    def exit(
        self, exc_type: object = None, exc: object = None, tb: object = None
    ) -> Verdict | None:
        """End the entry; when it ended without an exception, decide and plan.

        Returns:
            The verdict, or ``None`` after an exception (which decides nothing).
        """
        entry = self.entry
        assert entry is not None
        entry.mode.armed = False
        entry.mode.__exit__(exc_type, exc, tb)
        try:
            if exc_type is not None:
                return None
            verdict = self._judge(entry)
            replay, warmup = entry.replay, entry.warmup
            counts = self.counts
            self.counts = replace(
                counts,
                warmups=counts.warmups + verdict.traced,
                retraces=counts.retraces + verdict.missed,
                replays=counts.replays + (verdict is Verdict.REPLAYED),
                plan_switches=counts.plan_switches + (replay.switches if replay else 0),
            )
            if verdict.traced:
                assert warmup is not None
                self.book.ended(self._plan(entry.scope, warmup))
            elif verdict is Verdict.REPLAYED:
                assert replay is not None
                if replay.grown:
                    self._replan(entry.scope, replay)
                self.book.ended(replay.plan)
            return verdict
        finally:
            self.entry = None
            try:
                entry.close()
            finally:
                self._tally(entry)

    def _tally(self, entry: Entry) -> None:
        """Add what the entry moved and held to the session's counts."""
        scope, counts, warmup = entry.scope, self.counts, entry.warmup
        traced = warmup is not None and warmup.recording  # its gradients are the plan's
        if not scope.started:  # no op ran: nothing moved, nothing held
            found = 0 if traced else counts.gradient_bytes
            self.counts = replace(
                counts, last_peak_resident_activation_bytes=0, gradient_bytes=found
            )
            return
        residency, gradients = scope.residency, scope.gradients
        last = residency.peak_bytes
        peak = gradients.peak() if warmup is not None else None
        if peak is not None:  # a warmup or a fall-back: its parameter gradients taken out
            last = peak
        planned = entry.replay.planned_recomputes if entry.replay is not None else 0
        self.counts = replace(
            counts,
            last_peak_resident_activation_bytes=last,
            peak_resident_activation_bytes=max(counts.peak_resident_activation_bytes, last),
            d2h_bytes=counts.d2h_bytes + residency.d2h_bytes,
            h2d_bytes=counts.h2d_bytes + residency.h2d_bytes,
            host_cap_refusals=counts.host_cap_refusals + residency.host_cap_refusals,
            recomputes=counts.recomputes + residency.recomputes,
            demand_recomputes=counts.demand_recomputes + residency.recomputes - planned,
            eviction_stalls=counts.eviction_stalls + residency.eviction_stalls,
            gradient_bytes=gradients.nbytes if traced else counts.gradient_bytes,
        )

    def _judge(self, entry: Entry) -> Verdict:
        replay, warmup = entry.replay, entry.warmup
        if warmup is not None and warmup.recording:
            return Verdict.RETRACED if replay is not None else Verdict.TRACED
        assert replay is not None  # a warmup that does not record took over from a replay
        if replay.replayed_to_end:
            replay.plan.misses = 0
            return Verdict.REPLAYED
        if warmup is None:  # it ended early: its ops differ from the trace
            logger.info(
                "activation replay ran %d of %d traced ops", replay.op + 1, replay.ops_planned
            )
        # NOTE: a one-off step (Lightning logs differently on an epoch's first batch) keeps the
        # plan; the same plan missed twice in a row is dropped.
        plan = replay.plan
        plan.misses += 1
        if plan.misses < 2:
            return Verdict.MISSED
        self.book.drop(plan)
        self._trim_pool()
        return Verdict.DROPPED

    def _plan(self, scope: Scope, warmup: WarmupEntry) -> Plan:
        """Plan the step a recording warmup traced; the new plan is kept."""
        runtime = scope.runtime if scope.started else None
        if runtime is not None and runtime.stamps_need_sync:
            # Op durations are read from device events: they must all have completed.
            runtime.wait_stamps()
        d2h, h2d = self.bandwidths(runtime or self.runtime or shared_runtime(LoopbackRuntime))
        trace = ActivationTrace(
            tuple(warmup.trace_ops()),
            warmup.storage_sizes(),
            scope.retained(),
            self.budget_bytes,
            d2h,
            h2d,
            self.min_offload_bytes,
            warmup.freed_after(),
        )
        trace, (pinned,) = canonical(trace, warmup.unmovable())
        schedule = _without(self._schedule(trace, "a new op sequence"), pinned)
        plan = Plan(trace, schedule, pinned)
        self.book.add(plan)
        self._trim_pool()
        leaves = scope.gradients.leaves() if scope.started else []
        self.gradient_ready = list(scope.gradients.ready) if scope.started else []
        self.outside_inputs = warmup.outside if scope.started else OutsideReads()
        if leaves:
            self.leaves = leaves
        logger.info(
            "activation warmup traced %d ops, %d storages; planned %d actions (%d plans kept)",
            len(trace.ops),
            len(trace.storage_sizes),
            len(schedule),
            len(self.book),
        )
        return plan

    def _replan(self, scope: Scope, replay: ReplayEntry) -> None:
        """Plan the replayed op sequence again for the sizes that grew (no warmup)."""
        plan = replay.plan
        trace = grown(plan.trace, replay.grown)
        pinned = plan.pinned | (scope.unresizable() & set(trace.storage_sizes))
        why = f"{len(replay.grown)} storages larger than planned"
        plan.resize(trace, _without(self._schedule(trace, why), pinned))
        plan.pinned = frozenset(pinned)
        self.counts = replace(self.counts, replans=self.counts.replans + 1)
        self._trim_pool()
        logger.info(
            "activation plan made again for %d larger storages: %d actions",
            len(replay.grown),
            len(plan.schedule),
        )

    def _schedule(self, trace: ActivationTrace, why: str) -> ResidencySchedule:
        """The planner's schedule for ``trace``, as the owning budget wants it (``owned``).

        Raises:
            BudgetTooSmall: Under a whole-step plan, no activation schedule holds the step
                (``why`` says what changed) within the activation budget the plan left.
        """
        if self.owned == "defer":
            return ResidencySchedule()  # the whole-step plan makes it, after the update
        limit = trace.memory_limit_bytes
        if self.owned == "refuse" and limit is not None:
            floor = min_feasible_budget(trace)
            if floor > limit:
                raise BudgetTooSmall(
                    f"The step grew past its device budget ({why}): its activations need at "
                    f"least {format_bytes(floor)} on the device, since "
                    f"{floor_reason(trace)}, and the whole-step plan leaves them "
                    f"{format_bytes(limit)}. Raise OffloadConfig.device_budget_mb by "
                    f"{-(-(floor - limit) // 2**20)} MiB or more, or keep the batch at the "
                    "size the plan was made for.",
                    self.device_budget_bytes + floor - limit,
                )
        return self.planner.plan(trace)

    def forget_plans(self) -> None:
        """Drop every kept plan: the next entry traces the step again."""
        self.book.clear()
        self._trim_pool()

    def rebudget(self, budget_bytes: int, schedule: ResidencySchedule | None) -> None:
        """Keep activations under ``budget_bytes`` from the next entry on.

        The current plan takes ``schedule`` (planned for its trace at that budget; ``None``:
        plan it here), the other kept plans are planned again; a warmup from now on keeps
        the new budget.
        """
        self.budget_bytes = budget_bytes
        current = self.book.current
        for plan in self.book.plans:
            trace = plan.trace.with_limit(budget_bytes)
            fresh = schedule if plan is current and schedule is not None else None
            plan.resize(trace, _without(fresh or self.planner.plan(trace), plan.pinned))
        logger.info("activation budget set to %d bytes for every kept plan", budget_bytes)

    def _trim_pool(self) -> None:
        """Free the idle host buffers of sizes no kept plan takes any more."""
        if self.pool is not None:
            self.pool.keep_only(
                {s for plan in self.book.plans for s in plan.trace.storage_sizes.values()}
            )

    # ---- the runtime ---------------------------------------------------------------------

    def runtime_for(self, device: torch.device) -> tuple[TorchRuntime, HostPool]:
        """The runtime and host pool for an entry whose first tensor is on ``device``.

        With ``runtime="auto"`` they follow the activations: an entry whose tensors are on
        another device than the last one's gets a runtime (and host pool) of its own. A named
        runtime was made at the first entry and serves them all.
        """
        runtime, pool = self.runtime, self.pool
        if runtime is None or pool is None or not self.runtimes.keeps(runtime, device):
            runtime, pool = self._use(self.runtimes.make(device))
            logger.info("activation offload: %s runtime for tensors on %s", runtime.name, device)
        return runtime, pool

    def _use(self, runtime: TorchRuntime) -> tuple[TorchRuntime, HostPool]:
        self.runtime, self.pool = runtime, HostPool(runtime, self.config.host_cap_bytes)
        return self.runtime, self.pool

    def bandwidths(self, runtime: TorchRuntime) -> tuple[float, float]:
        """D2H and H2D bandwidth of ``runtime``, measured once."""
        if self._bandwidth is None or self._bandwidth[0] is not runtime:
            self._bandwidth = (runtime, runtime.measure_bandwidth())
        return self._bandwidth[1]


def _builtin_runtimes(name: str) -> RuntimeChoice:
    """``name`` resolved against the built-in runtimes (``_device/plugin.py``)."""
    from swapopt_core._device.plugin import swapopt_register_runtimes

    return resolve_runtime(name, {c.name: c for c in swapopt_register_runtimes()})


def _without(schedule: ResidencySchedule, pinned: AbstractSet[int]) -> ResidencySchedule:
    """``schedule`` with no action on the ``pinned`` storages: they stay on the device."""
    if not pinned:
        return schedule
    kept = ResidencySchedule()
    for side, op, action in schedule.actions():
        if action.storage_id not in pinned:
            add = kept.add_pre if side == "pre" else kept.add_post
            add(op, action.storage_id, action.kind)
    logger.info("activation plan: %d storages shared outside torch stay on the device", len(pinned))
    return kept
