"""What a replay does when the step leaves its plan: go on with another plan, or warm up.

``Handover`` is mixed into ``Entry``. A replay follows one ``Plan`` (``_follow``). When op
``k`` of the step is not op ``k`` of its trace, ``_leave`` asks the session's ``PlanBook``
for a kept plan that starts with the same ``k`` ops on the same storages and whose op ``k``
is the one the step runs, and **switches** to it (``_switch``): the storages registered so
far keep their ids (they are the same storages in both traces), and the residency is made
consistent with the new plan first:

- a storage the new plan does not register is untracked (back on the device, its host copy
  dropped): nothing in the new plan would see it written or bring it back;
- a recipe the new plan does not keep past op ``k`` is dropped, after its storage is
  recomputed if it is off the device without a host copy (only the new plan's future is
  known to leave the recipe's inputs unchanged);
- the peak the replay holds becomes the new plan's (``limit``), and is held at once.

Released storages with host copies, copies in flight and host buffers stay as they are: the
new plan's actions and the replay's on-demand fetches work from any such state.

Without such a plan the entry **falls back** (``_fall_back``) and goes on as a warmup that
keeps the budget (it does not bring everything back): storages away with a host copy are
paged in on demand, those away with only a recipe are recomputed now, and the recipes go.
When the replay registered every storage so far, the warmup also *records*, seeded with the
plan's first ``k`` ops (the same ops, by construction), and the executor plans the new op
sequence at the end. A replay that registered only some storages (an empty plan) cannot see
the others: it finishes without recording, and the plan is marked to register everything at
its next replays (``Plan.track``), so the next fall-back records.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from swapopt_core._activations.replay import ReplayTables
from swapopt_core._planning.ir import TraceOp

if TYPE_CHECKING:
    from swapopt_core._activations.executor import Executor
    from swapopt_core._activations.plans import Plan
    from swapopt_core._activations.residency import Residency, Tracked

logger = logging.getLogger(__name__)

__all__ = ["Handover"]


class Handover:
    """Plan switches and fall-backs of ``Entry`` (see the module doc)."""

    executor: Executor
    residency: Residency
    tables: ReplayTables
    budget: int
    op: int
    replaying: bool
    recording: bool
    diverged: bool
    next_sid: int

    def _init_handover(self, plan: Plan | None) -> None:
        self.plan = plan  # the plan the replay follows now
        self.grown: dict[int, int] = {}  # sid -> live bytes, for storages larger than planned
        self.switches = 0
        self.seed: tuple[TraceOp, ...] = ()  # a fall-back's first ops, from the plan
        self.seed_sizes: dict[int, int] = {}
        self.seed_pinned: frozenset[int] = frozenset()
        self.followed: list[Plan] = []  # every plan the replay followed, in order
        self.blind = False  # some ops ran under tables that register only some storages
        self.unseen = 0  # planned bytes of live storages a blind replay never registered
        if plan is not None:
            self._follow(plan)

    def _follow(self, plan: Plan) -> None:
        """Replay ``plan`` from the next op on: its tables and the peak to hold."""
        tables = plan.tables(self.executor.tracks(plan) or bool(self.grown))
        self.plan, self.tables = plan, tables
        self.followed.append(plan)
        self.blind = self.blind or not tables.track_all
        self.ops_planned = len(plan.trace.ops)
        # An empty plan registered in full holds the budget, not its natural peak.
        limit = tables.limit if plan.binding else max(tables.limit, self.budget)
        # Storages larger than planned: the plan's peak no longer says what fits.
        self.limit = (min(limit, self.budget) if self.grown else limit) - self.unseen
        self.next_sid = max(self.next_sid, plan.top_sid + 1)

    # ---- leaving a plan ------------------------------------------------------------------

    def _leave(self, name: str) -> bool:
        """Op ``self.op + 1``, ``name``, is not the plan's: switch to a kept plan that goes
        on with it (True), or fall back to a warmup (False)."""
        index = self.op + 1
        other = self.executor.book.continuation(self.plan, index, name)
        if other is not None:
            self._switch(other, index)
            return True
        self._fall_back(f"op {index} is {name}", seed=True)
        return False

    def _switch(self, other: Plan, index: int) -> None:
        """Go on with ``other`` from op ``index`` (it shares the ops before it)."""
        logger.info("activation replay goes on with another kept plan at op %d", index)
        self.switches += 1
        self._count_unseen(other, index)
        self._follow(other)
        residency, tables = self.residency, self.tables
        registered, until = tables.registered, tables.recipe_until
        for entry in list(residency.by_sid.values()):
            if not entry.alive:
                continue
            if entry.sid not in registered:
                self._untrack(entry)
            elif entry.recipe is not None and until.get(entry.sid, -1) < index:
                self._regenerate_now(entry, index)
                entry.recipe = None
        if not tables.track_all:  # it registers little: its plan's peak stands for it
            residency.peak_bytes = max(residency.peak_bytes, tables.planned_peak)
        if residency.resident_bytes > self.limit:
            self._hold_peak(index, 0)

    def _untrack(self, entry: Tracked) -> None:
        self.quiet += 1  # a page-in below runs ops of ours, not the step's
        try:
            self.residency.untrack(entry)
        finally:
            self.quiet -= 1
        entry.recipe = None  # its inputs may go

    def _count_unseen(self, plan: Plan, count: int) -> None:
        """After ``count`` ops of a blind replay: the planned bytes of the storages it made
        and never registered that ``plan`` says are still alive. Nothing can move them;
        the budget left for the others is smaller by as much, to the end of the entry."""
        if self.blind:
            self.unseen = plan.held_bytes(count, self.residency.by_sid)

    def _regenerate_now(self, entry: Tracked, index: int) -> None:
        """Bring back ``entry`` if only its recipe holds its bytes, making room first for it
        and for the inputs its recompute pages in (or recomputes)."""
        if entry.resident or entry.host_valid:
            return
        needed: dict[int, int] = {}
        _away_for(entry, needed)
        if self.replaying:
            self._hold_peak(index, sum(needed.values()))
        else:
            self._evict(protected=set(needed), room=sum(needed.values()))
        self.residency.ready(entry)  # recomputes it (the recipe's inputs paged in first)

    def _fall_back(self, why: str, *, seed: bool) -> None:
        """Stop replaying and go on as a warmup that keeps the budget; with ``seed``, one
        that records (when the replay saw every storage so far)."""
        logger.info("activation replay left its plan (%s)", why)
        plan, count = self.plan, self.op + 1
        self.diverged = True
        self.replaying = False
        self.recording = seed and (count == 0 or not self.blind)
        self._count_unseen(plan, count)
        if self.recording:
            self.seed = plan.trace.ops[:count]
            sizes = plan.trace.storage_sizes
            made = {a.storage_id for op in self.seed for a in op.accesses}
            self.seed_sizes = {sid: sizes[sid] for sid in made if sid in sizes}
            self.seed_pinned = plan.pinned & made
            if count == 0:
                self.next_sid = 1  # a trace from scratch
                # Nothing ran: the plan's peak that stood for an unregistered replay goes.
                self.residency.peak_bytes = self.residency.resident_bytes
            self.gradients.watch_all(self.executor.leaves)
        elif seed:
            for followed in self.followed:  # next time they see every storage, and record
                followed.track = True
        self._hand_over()

    def _hand_over(self) -> None:
        """Make the residency a warmup's: storages findable by object, no recipes (storages
        away with only a recipe are recomputed first), and under the budget."""
        residency = self.residency
        residency.index_storages()  # the warmup finds its storages by object
        for entry in list(residency.by_sid.values()):
            if entry.recipe is None:
                continue
            if entry.alive:
                self._regenerate_now(entry, self.op)
            entry.recipe = None  # no recompute after this: let their inputs go
        if self.unseen:
            logger.info(
                "activation fall-back: %d bytes the replay never registered stay on the device",
                self.unseen,
            )
        self._evict(protected=set())


def _away_for(entry: Tracked, needed: dict[int, int]) -> None:
    """Add to ``needed`` the bytes that bringing ``entry`` back allocates: its own, and,
    when it is recomputed, those of its recipe's inputs that are away (recursively)."""
    if entry.sid in needed or not entry.alive or entry.resident:
        return
    needed[entry.sid] = entry.nbytes
    if not entry.host_valid and entry.recipe is not None:
        for source in entry.recipe.inputs:
            _away_for(source, needed)
