"""The executor of an ``OffloadSession``: it runs each entry and decides what it becomes.

The session calls ``enter()`` and ``exit()`` around every entry; everything in between is
the executor's: which runtime serves the activations, whether the entry traces or replays,
what a replay that leaves its plan does, and when a plan is dropped. The plan is the
serialised contract, an ``ActivationTrace`` and its ``ResidencySchedule``: fresh from the
planner or read back from JSON, it is all a replay consults (see ``entry.py``).

The rules, in one place:

- With no plan, an entry is a **warmup**: it traces the step and the planner plans it.
- The session keeps a plan per distinct op sequence (``PlanBook``, ``plans.py``). An entry
  **replays** the plan that followed the last entry's plan last time (else that plan
  again). When the step leaves it at op ``k``, the replay goes on with a kept plan that
  shares the first ``k`` ops and has the step's op ``k`` (``handover.py``); without one it
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

import torch

from swapopt_core._activations.config import OffloadConfig
from swapopt_core._activations.entry import Entry
from swapopt_core._activations.plans import Plan, PlanBook, canonical, grown
from swapopt_core._activations.recording import check_marks
from swapopt_core._activations.residency import HostPool
from swapopt_core._device.interface import TorchRuntime
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._device.registry import RuntimeChoice, resolve_runtime, shared_runtime
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule

logger = logging.getLogger(__name__)

__all__ = ["Executor", "Verdict"]


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
        self.counts = dict.fromkeys(
            ("warmups", "replays", "retraces", "d2h", "h2d", "peak", "last_peak", "refusals"), 0
        )
        self.counts["gradients"] = 0  # parameter gradient bytes the last warmup found
        self.counts["recomputes"] = self.counts["demand_recomputes"] = 0
        self.counts["replans"] = self.counts["switches"] = 0

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

    def tracks(self, plan: Plan) -> bool:
        """Whether a replay of ``plan`` registers every storage: when some kept plan moves
        storages (a switch to it must find them), or when a fall-back needed it."""
        return plan.binding or plan.track or self.book.binding

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
            counts = self.counts
            counts["warmups"] += verdict.traced
            counts["retraces"] += verdict.missed
            counts["replays"] += verdict is Verdict.REPLAYED
            counts["switches"] += entry.switches
            if verdict.traced:
                self.book.ended(self._plan(entry))
            elif verdict is Verdict.REPLAYED:
                if entry.grown:
                    self._replan(entry)
                self.book.ended(entry.plan)
            return verdict
        finally:
            self.entry = None
            try:
                entry.close()
            finally:
                self._tally(entry)

    def _tally(self, entry: Entry) -> None:
        """Add what the entry moved and held to the session's counts."""
        residency, counts = entry.residency, self.counts
        counts["last_peak"] = residency.peak_bytes if residency is not None else 0
        peak = None if entry.replaying else entry.gradients.peak()
        if peak is not None:  # a warmup or a fall-back: its parameter gradients taken out
            counts["last_peak"] = peak
        counts["peak"] = max(counts["peak"], counts["last_peak"])
        if residency is not None:
            counts["d2h"] += residency.d2h_bytes
            counts["h2d"] += residency.h2d_bytes
            counts["refusals"] += residency.host_cap_refusals
        counts["recomputes"] += entry.recomputes
        counts["demand_recomputes"] += entry.recomputes - entry.planned_recomputes
        if entry.recording:  # it traced the step: the gradients it found are the plan's
            counts["gradients"] = entry.gradients.nbytes

    def _judge(self, entry: Entry) -> Verdict:
        if entry.replayed_to_end:
            entry.plan.misses = 0
            return Verdict.REPLAYED
        if entry.recording:
            return Verdict.RETRACED if entry.diverged else Verdict.TRACED
        if entry.replaying:  # it ended early: its ops differ from the trace
            logger.info(
                "activation replay ran %d of %d traced ops", entry.op + 1, entry.ops_planned
            )
        # NOTE: a one-off step (Lightning logs differently on an epoch's first batch) keeps the
        # plan; the same plan missed twice in a row is dropped.
        plan = entry.plan
        plan.misses += 1
        if plan.misses < 2:
            return Verdict.MISSED
        self.book.drop(plan)
        self._trim_pool()
        return Verdict.DROPPED

    def _plan(self, entry: Entry) -> Plan:
        """Plan the step a recording entry traced; the new plan is kept."""
        runtime = entry.runtime
        if runtime is not None and runtime.stamps_need_sync:
            # Op durations are read from device events: they must all have completed.
            runtime.wait_stamps()
        d2h, h2d = self._bandwidths(runtime or self.runtime or shared_runtime(LoopbackRuntime))
        trace = ActivationTrace(
            tuple(entry.trace_ops()),
            entry.storage_sizes(),
            entry.retained(),
            self.budget_bytes,
            d2h,
            h2d,
            self.min_offload_bytes,
            entry.freed_after(),
        )
        trace, (pinned,) = canonical(trace, entry.unmovable())
        schedule = _without(self.planner.plan(trace), pinned)
        plan = Plan(trace, schedule, pinned)
        self.book.add(plan)
        self._trim_pool()
        leaves = entry.gradients.leaves()
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

    def _replan(self, entry: Entry) -> None:
        """Plan the replayed op sequence again for the sizes that grew (no warmup)."""
        plan = entry.plan
        trace = grown(plan.trace, entry.grown)
        pinned = plan.pinned | (entry.unmovable() & set(trace.storage_sizes))
        plan.resize(trace, _without(self.planner.plan(trace), pinned))
        plan.pinned = frozenset(pinned)
        self.counts["replans"] += 1
        self._trim_pool()
        logger.info(
            "activation plan made again for %d larger storages: %d actions",
            len(entry.grown),
            len(plan.schedule),
        )

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
        runtime = self.runtime
        if runtime is None or not self.runtimes.keeps(runtime, device):
            self._use(self.runtimes.make(device))
            logger.info(
                "activation offload: %s runtime for tensors on %s", self.runtime.name, device
            )
        return self.runtime, self.pool

    def _use(self, runtime: TorchRuntime) -> None:
        self.runtime, self.pool = runtime, HostPool(runtime, self.config.host_cap_bytes)

    def _bandwidths(self, runtime: TorchRuntime) -> tuple[float, float]:
        """D2H and H2D bandwidth of ``runtime``, measured once."""
        if self._bandwidth is None or self._bandwidth[0] is not runtime:
            self._bandwidth = (runtime, runtime.measure_bandwidth())
        return self._bandwidth[1]


def _builtin_runtimes(name: str) -> RuntimeChoice:
    """``name`` resolved against the built-in runtimes (``_device/plugin.py``)."""
    from swapopt_core._device.plugin import swapopt_register_runtimes

    return resolve_runtime(name, {c.name: c for c in swapopt_register_runtimes()})


def _without(schedule: ResidencySchedule, pinned: set[int]) -> ResidencySchedule:
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
