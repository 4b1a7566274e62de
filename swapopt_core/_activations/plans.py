"""The plans a session keeps: one per distinct op sequence, a few at most.

Real loops do not repeat one step. With gradient accumulation and one session entry per
micro-batch, entries alternate between two op sequences (the first micro-batch creates the
parameter gradients, the others add into them); validation or logging steps come and go.
A ``PlanBook`` keeps a ``Plan`` (a trace, its schedule, and what the session learned about
it) per op sequence, up to ``PLANS_KEPT``, the least recently used going first, and says
which one an entry should start with: the plan that followed the last entry's plan last
time, so A, B, A, B is predicted right from the third entry on.

When a replay leaves its plan at op ``k``, ``continuation`` finds a kept plan whose first
``k`` ops are the same ops touching the same storages (same ids, same kinds, same output
positions) and whose op ``k`` is the one the step runs: the replay goes on with it.

Storage ids are numbered in the order the step creates the storages (``canonical``), so two
traces that start with the same ops share their ids over that prefix however they were
recorded. ``grown`` re-sizes a trace when a replay found storages larger than planned.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Container, Iterable, Mapping

from swapopt_core._activations.replay import ReplayTables, tables_for
from swapopt_core._planning.ir import Access, ActivationTrace, ResidencySchedule, TraceOp

logger = logging.getLogger(__name__)

__all__ = ["PLANS_KEPT", "Plan", "PlanBook", "canonical", "grown"]

#: How many plans (distinct op sequences) a session keeps.
PLANS_KEPT = 4


@dataclasses.dataclass(eq=False)
class Plan:
    """One op sequence the session knows, and how to replay it.

    Attributes:
        trace: The step as recorded (sizes: the largest seen for each storage).
        schedule: The planner's schedule for ``trace``.
        pinned: Storages that stay on the device (shared outside torch when recorded); a
            re-plan keeps them out of the schedule too.
        track: Register every storage when replaying, even with an empty schedule: set once
            a replay of it had to fall back without seeing its storages.
        misses: Replays in a row that left it without another plan to go on with.
        after: The plan of the entry that followed the last entry that ended on this one.
    """

    trace: ActivationTrace
    schedule: ResidencySchedule
    pinned: frozenset[int] = frozenset()
    track: bool = False
    misses: int = 0
    after: Plan | None = None
    _keys: list[int] | None = dataclasses.field(default=None, repr=False)
    _top: int | None = dataclasses.field(default=None, repr=False)

    def resize(self, trace: ActivationTrace, schedule: ResidencySchedule) -> None:
        """Take the trace re-sized by ``grown`` (same ops, same ids) and its new schedule."""
        self.trace, self.schedule = trace, schedule

    @property
    def top_sid(self) -> int:
        """The largest storage id the trace uses (0 for none)."""
        if self._top is None:
            ids = [a.storage_id for op in self.trace.ops for a in op.accesses]
            self._top = max([*ids, *self.trace.storage_sizes, 0])
        return self._top

    @property
    def binding(self) -> bool:
        """Whether the schedule moves anything (the budget binds for this step)."""
        return len(self.schedule) > 0

    def tables(self, track_all: bool) -> ReplayTables:
        return tables_for(self.trace, self.schedule, track_all)

    def prefix_key(self, count: int) -> int:
        """A hash of the first ``count`` ops: names and accesses (not durations, not
        sizes)."""
        keys = self._keys
        if keys is None:
            keys = [0]
            for op in self.trace.ops:
                keys.append(hash((keys[-1], op.name, op.accesses)))
            self._keys = keys
        return keys[count]

    def held_bytes(self, count: int, skip: Container[int]) -> int:
        """Planned bytes of the storages made by the first ``count`` ops that the trace
        still uses at op ``count`` or keeps past the step, except those in ``skip``."""
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for index, op in enumerate(self.trace.ops):
            for access in op.accesses:
                first.setdefault(access.storage_id, index)
                last[access.storage_id] = index
        retained = self.trace.retained_sids
        return sum(
            size
            for sid, size in self.trace.storage_sizes.items()
            if sid not in skip
            and first.get(sid, count) < count
            and (last[sid] >= count or sid in retained)
        )

    def shares_prefix(self, other: Plan, count: int) -> bool:
        """Whether both plans start with the same ``count`` ops on the same storages."""
        if len(self.trace.ops) < count or len(other.trace.ops) < count:
            return False
        if self.prefix_key(count) != other.prefix_key(count):
            return False
        pairs = zip(self.trace.ops[:count], other.trace.ops[:count], strict=True)
        return all(a.name == b.name and a.accesses == b.accesses for a, b in pairs)


class PlanBook:
    """The plans of one session, most recently used last (see the module doc)."""

    def __init__(self, capacity: int = PLANS_KEPT) -> None:
        self.capacity = capacity
        self.plans: list[Plan] = []
        self.last: Plan | None = None  # the plan the last judged entry ended on

    def __len__(self) -> int:
        return len(self.plans)

    @property
    def current(self) -> Plan | None:
        """The most recently used plan."""
        return self.plans[-1] if self.plans else None

    @property
    def binding(self) -> bool:
        """Whether any kept plan moves something."""
        return any(plan.binding for plan in self.plans)

    def tracks(self, plan: Plan) -> bool:
        """Whether a replay of ``plan`` registers every storage: when some kept plan moves
        storages (a switch to it must find them), or when a fall-back needed it."""
        return plan.binding or plan.track or self.binding

    def add(self, plan: Plan) -> None:
        """Keep ``plan`` (most recently used); the least recently used goes beyond
        ``capacity``."""
        self.plans.append(plan)
        while len(self.plans) > self.capacity:
            gone = self.plans.pop(0)
            logger.info("activation plans: %d kept, the least recently used goes", self.capacity)
            for kept in self.plans:
                if kept.after is gone:
                    kept.after = None
            if self.last is gone:
                self.last = None

    def use(self, plan: Plan) -> None:
        """``plan`` served an entry: it becomes the most recently used."""
        if plan in self.plans:
            self.plans.remove(plan)
            self.plans.append(plan)

    def drop(self, plan: Plan) -> None:
        if plan in self.plans:
            self.plans.remove(plan)
        for kept in self.plans:
            if kept.after is plan:
                kept.after = None
        if self.last is plan:
            self.last = None

    def clear(self) -> None:
        self.plans.clear()
        self.last = None

    def predict(self) -> Plan | None:
        """The plan to start the next entry with: what followed the last entry's plan last
        time, else that plan again, else the most recently used."""
        last = self.last
        if last is not None and last in self.plans:
            after = last.after
            return after if after is not None and after in self.plans else last
        return self.current

    def ended(self, plan: Plan) -> None:
        """An entry ended on ``plan``: remember it followed the last one."""
        if self.last is not None:
            self.last.after = plan
        self.last = plan
        self.use(plan)

    def continuation(self, left: Plan, count: int, name: str) -> Plan | None:
        """A kept plan other than ``left`` that starts with ``left``'s first ``count`` ops
        and has op ``count`` named ``name`` (the most recently used such plan)."""
        for plan in reversed(self.plans):
            if plan is left or len(plan.trace.ops) <= count:
                continue
            if plan.trace.ops[count].name == name and plan.shares_prefix(left, count):
                return plan
        return None


def canonical(
    trace: ActivationTrace, *sid_sets: Iterable[int]
) -> tuple[ActivationTrace, list[frozenset[int]]]:
    """``trace`` with its storages numbered 1, 2, ... in the order the step first touches
    them, and each of ``sid_sets`` renumbered alike (ids the trace lacks are dropped)."""
    numbers: dict[int, int] = {}
    for op in trace.ops:
        for access in op.accesses:
            numbers.setdefault(access.storage_id, len(numbers) + 1)
    for sid in trace.storage_sizes:
        numbers.setdefault(sid, len(numbers) + 1)
    if all(old == new for old, new in numbers.items()):
        return trace, [frozenset(s) for s in sid_sets]
    ops = tuple(
        dataclasses.replace(
            op,
            accesses=tuple(Access(numbers[a.storage_id], a.kind, a.output) for a in op.accesses),
        )
        for op in trace.ops
    )
    renamed = dataclasses.replace(
        trace,
        ops=ops,
        storage_sizes={numbers[sid]: size for sid, size in trace.storage_sizes.items()},
        retained_sids=frozenset(numbers[sid] for sid in trace.retained_sids),
        freed_after={numbers[sid]: op for sid, op in trace.freed_after.items()},
    )
    sets = [frozenset(numbers[sid] for sid in s if sid in numbers) for s in sid_sets]
    return renamed, sets


def grown(trace: ActivationTrace, sizes: Mapping[int, int]) -> ActivationTrace:
    """``trace`` with the storages of ``sizes`` at those (larger) sizes.

    Each op's duration is scaled by how much the activation bytes it touches grew (never
    shrunk): an elementwise op or a norm costs about its bytes, a matmul about its output's
    bytes along the grown axis, an attention score about its square, which its bytes follow.
    """
    new_sizes = dict(trace.storage_sizes)
    for sid, size in sizes.items():
        if sid in new_sizes and size > new_sizes[sid]:
            new_sizes[sid] = size
    old_sizes = trace.storage_sizes
    ops: list[TraceOp] = []
    for op in trace.ops:
        before = sum(old_sizes.get(a.storage_id, 0) for a in op.accesses)
        after = sum(new_sizes.get(a.storage_id, 0) for a in op.accesses)
        scale = after / before if before and after > before else 1.0
        ops.append(
            op if scale == 1.0 else dataclasses.replace(op, duration_ms=op.duration_ms * scale)
        )
    return dataclasses.replace(trace, ops=tuple(ops), storage_sizes=new_sizes)
