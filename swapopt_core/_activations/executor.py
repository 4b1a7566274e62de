"""The executor of an ``OffloadSession``: it runs each entry and decides what it becomes.

The session calls ``enter()`` and ``exit()`` around every entry; everything in between is
the executor's: which runtime serves the activations, whether the entry traces or replays,
what a replay that leaves its plan does, and when a plan is dropped. The plan is the
serialised contract, an ``ActivationTrace`` and its ``ResidencySchedule``: fresh from the
planner or read back from JSON, it is all a replay consults (see ``entry.py``).

The rules, in one place:

- With no plan, an entry is a **warmup**: it traces the step and the planner plans it.
- With a plan, it **replays** it. When an op differs from the trace at the very first op (a
  step of new shapes), the entry traces from scratch and re-plans. Later, it finishes as a
  warmup without a trace and the plan stays for the next step; a replay that ends before
  its trace does counts the same. The same plan missed twice in a row is dropped, and the
  next entry traces again.
"""

from __future__ import annotations

import enum
import logging

import torch

from swapopt_core._activations.config import OffloadConfig
from swapopt_core._activations.cuda_runtime import CudaActivationRuntime
from swapopt_core._activations.entry import Entry
from swapopt_core._activations.recording import check_marks
from swapopt_core._activations.residency import HostPool
from swapopt_core._activations.runtime import ActivationRuntime, RuntimeChoice, resolve_runtime
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule

logger = logging.getLogger(__name__)

__all__ = ["Executor", "Verdict"]


class Verdict(enum.Enum):
    """What an entry turned out to be."""

    REPLAYED = "replayed"  # the plan ran to its end
    MISSED = "missed"  # the replay left its plan after the first op; the plan stays
    DROPPED = "dropped"  # the second miss in a row: the plan is gone, the next entry traces
    TRACED = "traced"  # a warmup traced the step, and it was planned
    RETRACED = "retraced"  # the replay left its plan at the first op: traced and re-planned

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
        self.trace: ActivationTrace | None = None
        self.schedule: ResidencySchedule | None = None
        self.entry: Entry | None = None
        self.runtime: ActivationRuntime | None = None
        self.pool: HostPool | None = None
        self._bandwidth: tuple[ActivationRuntime, tuple[float, float]] | None = None
        self._misses = 0  # replays in a row that left the current plan
        self.counts = dict.fromkeys(
            ("warmups", "replays", "retraces", "d2h", "h2d", "peak", "last_peak", "refusals"), 0
        )
        self.counts["gradients"] = 0  # parameter gradient bytes the last warmup found
        self.counts["recomputes"] = self.counts["demand_recomputes"] = 0

    # ---- the plan ------------------------------------------------------------------------

    def adopt(self, trace: ActivationTrace, schedule: ResidencySchedule) -> None:
        """Replay ``schedule`` for ``trace`` from the next entry on."""
        self.trace, self.schedule = trace, schedule
        self._misses = 0

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
        if self.trace is not None and self.schedule is not None:
            self.entry = Entry(self, self.trace, self.schedule)
        else:
            self.entry = Entry(self)
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
            if verdict.traced:
                self._plan(entry)
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

    def trace_after_miss(self, ops_done: int) -> bool:
        """Whether a replay that left its plan after ``ops_done`` ops traces from scratch.

        Only when nothing ran yet: a step of new shapes gets a trace and a plan of its own.
        Later, the entry finishes untraced; ``exit`` then weighs the miss.
        """
        return ops_done == 0

    def _judge(self, entry: Entry) -> Verdict:
        if entry.replayed_to_end:
            self._misses = 0
            return Verdict.REPLAYED
        if entry.replaying:  # it ended early: its ops differ from the trace
            logger.info(
                "activation replay ran %d of %d traced ops", entry.op + 1, entry.ops_planned
            )
        elif entry.recording:
            self._misses = 0
            return Verdict.RETRACED if entry.diverged else Verdict.TRACED
        # NOTE: a one-off step (Lightning logs differently on an epoch's first batch) keeps the
        # plan; the same plan missed twice in a row is traced again.
        self._misses += 1
        if self._misses < 2:
            return Verdict.MISSED
        self.schedule, self._misses = None, 0
        return Verdict.DROPPED

    def _plan(self, entry: Entry) -> None:
        runtime = entry.runtime
        if isinstance(runtime, CudaActivationRuntime):
            # Op durations are read from events: they must all have completed.
            torch.cuda.synchronize(runtime.device)
        d2h, h2d = self._bandwidths(runtime or self.runtime or ActivationRuntime())
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
        schedule = _without(self.planner.plan(trace), entry.unmovable())
        self.adopt(trace, schedule)
        logger.info(
            "activation warmup traced %d ops, %d storages; planned %d actions",
            len(trace.ops),
            len(trace.storage_sizes),
            len(schedule),
        )

    # ---- the runtime ---------------------------------------------------------------------

    def runtime_for(self, device: torch.device) -> tuple[ActivationRuntime, HostPool]:
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

    def _use(self, runtime: ActivationRuntime) -> None:
        self.runtime, self.pool = runtime, HostPool(runtime, self.config.host_cap_bytes)

    def _bandwidths(self, runtime: ActivationRuntime) -> tuple[float, float]:
        """D2H and H2D bandwidth of ``runtime``, measured once."""
        if self._bandwidth is None or self._bandwidth[0] is not runtime:
            self._bandwidth = (runtime, runtime.measure_bandwidth())
        return self._bandwidth[1]


def _builtin_runtimes(name: str) -> RuntimeChoice:
    """``name`` resolved against the built-in runtimes (``_activations/plugin.py``)."""
    from swapopt_core._activations.plugin import swapopt_register_activation_runtimes

    return resolve_runtime(name, {c.name: c for c in swapopt_register_activation_runtimes()})


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
