"""The replay phase of a session entry: follow a kept ``Plan`` and nothing else.

The ``ActivationTrace`` says which op comes next, which storages it writes and where its new
storages are; the ``ResidencySchedule`` says what to do before and after it. Per op a
``ReplayEntry`` compares the op's name with the trace, runs the ``pre`` actions due, readies
the storages the op touches when something is away or in flight, marks in-place writes, runs
the op, registers the storages some action needs (by id, at their recorded output positions),
keeps the recipes of storages to recompute, runs the ``post`` actions, and holds the plan's
peak (``limit``): when the live activation bytes exceed the plan's simulated peak, or would
once the op's actions and outputs allocate, it evicts the storages needed last (by the trace;
those it no longer reads first) that the op does not touch (copy out, then release). The
actions and the evictions themselves are an ``ActionRunner``'s (``_activations/actions.py``).

A plan serves every step with its op sequence, whatever the sizes: a storage at most its
planned size is registered at its live size (its host buffer is taken at the planned size,
so the pool reuses it). One that comes out larger is noted (``grown``): from then on the
replay registers every storage, holds the budget (not the plan's peak) on the live sizes,
makes room for each op's outputs as predicted on meta tensors and for its actions at their
live sizes, and the executor re-plans the op sequence with the grown sizes at the end.

When op ``k`` of the step is not op ``k`` of its trace, the replay **leaves** its plan. It
asks the session's ``PlanBook`` for a kept plan that starts with the same ``k`` ops on the
same storages and whose op ``k`` is the step's, and **switches** to it: the storages keep
their ids; one the new plan does not register is untracked (back on the device, host copy
dropped); a recipe it does not keep past op ``k`` is dropped, after its storage is recomputed
if only the recipe holds its bytes; the peak held becomes the new plan's. Without such a plan
it **falls back**: a ``WarmupEntry`` on the same residency goes on with the entry, keeping the
budget. When the replay registered every storage so far, that warmup also records, seeded
with the plan's first ``k`` ops, and the executor plans the new op sequence at the end; a
replay that registered only some storages (an empty plan) cannot see the others, so its
plans are marked to register everything next time (``Plan.track``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from swapopt_core._activations.actions import ActionRunner
from swapopt_core._activations.prediction import fresh_bytes
from swapopt_core._activations.recipe import check_bytes, drop_recipes, keep_recipes
from swapopt_core._activations.scope import Open, Scope, away_bytes
from swapopt_core._activations.warmup import Seed, WarmupEntry

if TYPE_CHECKING:
    from swapopt_core._activations.plans import Plan, PlanBook

logger = logging.getLogger(__name__)

__all__ = ["ReplayEntry"]


class ReplayEntry:
    """Replays ``plan`` from the entry's first op (see the module doc).

    Args:
        scope: What the entry's phases share.
        book: The session's kept plans (a replay that leaves its plan looks there first).
        plan: The plan to replay.
        hand_over: Called with the warmup that goes on with the entry when the replay falls
            back; from then on the entry's ops go to that warmup.
    """

    def __init__(
        self,
        scope: Scope,
        book: PlanBook,
        plan: Plan,
        hand_over: Callable[[WarmupEntry], None],
    ) -> None:
        self.scope = scope
        self.book = book
        self.hand_over = hand_over
        self.op = -1
        self.next_sid = 1  # the id of the next storage a fall-back's recording tracks
        self.grown: dict[int, int] = {}  # sid -> live bytes, for storages larger than planned
        self.switches = 0
        self.followed: list[Plan] = []  # every plan the replay followed, in order
        self.blind = False  # some ops ran under tables that register only some storages
        self.unseen = 0  # planned bytes of live storages a blind replay never registered
        self.warmup: WarmupEntry | None = None  # who went on with the entry, after a fall-back
        self.runner = ActionRunner(scope)  # runs the plan's actions, evicts to hold its peak
        self.follow(plan)

    def follow(self, plan: Plan) -> None:
        """Replay ``plan`` from the next op on: its tables and the peak to hold."""
        tables = plan.tables(self.book.tracks(plan) or bool(self.grown))
        self.plan, self.tables = plan, tables
        self.followed.append(plan)
        self.blind = self.blind or not tables.track_all
        self.ops_planned = len(plan.trace.ops)
        budget = self.scope.budget
        # An empty plan registered in full holds the budget, not its natural peak.
        limit = tables.limit if plan.binding else max(tables.limit, budget)
        # Storages larger than planned: the plan's peak no longer says what fits.
        self.limit = (min(limit, budget) if self.grown else limit) - self.unseen
        self.next_sid = max(self.next_sid, plan.top_sid + 1)

    def start(self) -> None:
        """The entry's first op: the scope has its residency now."""
        if not self.tables.track_all:
            # Nothing is registered (the plan has no action): the plan's peak stands for it.
            self.scope.residency.peak_bytes = self.tables.planned_peak

    @property
    def planned_recomputes(self) -> int:
        """The ``RECOMPUTE`` actions the replay ran."""
        return self.runner.recomputes

    @property
    def replayed_to_end(self) -> bool:
        """The entry replayed every op of its trace, and nothing else."""
        return self.warmup is None and self.op + 1 == self.ops_planned

    # ---- the op path ---------------------------------------------------------------------

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        index = self.op + 1
        if index < self.ops_planned and func.__name__ == self.tables.names[index]:
            return self._replay(index, func, args, kwargs)
        if self.leave(func.__name__):  # another kept plan goes on from here
            return self._replay(index, func, args, kwargs)
        assert self.warmup is not None
        return self.warmup.dispatch(func, args, kwargs)

    def begin_region(self, name: str, inputs: object) -> Open:
        """Open a region that counts as one op ``name`` (``skip_offload``)."""
        index = self.op + 1
        matches = index < self.ops_planned and self.tables.names[index] == name
        if not matches and not self.leave(name):
            assert self.warmup is not None
            return self.warmup.begin_region(name, inputs)
        self.op = index
        self._replay_pre(index)
        return Open(index, name, None)

    def end(self, opened: Open, out: Any) -> Any:
        self._replay_post(opened.index, out)
        return out

    def _replay(self, index: int, func: Any, args: tuple, kwargs: dict) -> Any:
        """Op ``index`` of the trace, matched by name: its actions around it."""
        self.op = index
        tables, residency = self.tables, self.scope.residency
        if tables.busy[index] or residency.released or residency.pending_in:
            # Sizes grew: room for what this op makes, at its live sizes.
            self._replay_pre(index, fresh_bytes(func, args, kwargs) if self.grown else 0)
            out = func(*args, **kwargs)
            self._replay_post(index, out, func, args, kwargs)
            return out
        out = func(*args, **kwargs)  # nothing to do: at most a size check
        probe = tables.probes[index]
        if probe is not None:
            position, nbytes = probe
            value = out if position == 0 and type(out) is torch.Tensor else None
            if value is None or value.untyped_storage().nbytes() > nbytes:
                self._bind(index, tables.binds[index], out)  # the full check
        return out

    def _replay_pre(self, index: int, predicted: int = 0) -> None:
        tables, residency = self.tables, self.scope.residency
        actions = tables.pre[index]
        made = tables.made[index]
        if predicted > made:
            made = predicted
        if actions:
            room = (self.runner.live_net(actions) if self.grown else tables.pre_net[index]) + made
            if residency.resident_bytes + room > self.limit:
                self.hold_peak(index, room)  # before reloads and recomputes allocate
            for action in actions:
                self.runner.apply(action)
        if residency.released or residency.pending_in:
            by_sid = residency.by_sid
            away = [
                entry
                for sid in tables.touched[index]
                if (entry := by_sid.get(sid)) is not None
                and (not entry.resident or entry.h2d is not None)
            ]
            if away:
                # Paged in (or recomputed) on demand: make room first.
                room = sum(e.nbytes for e in away if not e.resident) + made
                if residency.resident_bytes + room > self.limit:
                    self.hold_peak(index, room)
                for entry in away:
                    residency.ready(entry)
        for sid in tables.written[index]:
            entry = residency.by_sid.get(sid)
            if entry is not None and (entry.host is not None or entry.recipe is not None):
                residency.written(entry)
        if residency.resident_bytes + made > self.limit:
            self.hold_peak(index, made)

    def _replay_post(
        self,
        index: int,
        out: Any,
        func: Any = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> None:
        binds = self.tables.binds[index]
        if binds and not self._bind(index, binds, out):
            return
        tables, residency = self.tables, self.scope.residency  # a growth may have changed them
        recipes = tables.recipes[index]
        if recipes and func is not None:
            scratch = check_bytes(func, args, kwargs or {}, out)
            if scratch and residency.resident_bytes + scratch > self.limit:
                # The first recipe of this op checks its out= variant in a scratch copy of
                # its outputs: room is made for it as for any storage the plan counts.
                self.hold_peak(index, scratch)
            keep_recipes(
                recipes, residency.by_sid, tables.names[index], func, args, kwargs or {}, out
            )
        actions = tables.post[index]
        if actions:
            room = self.runner.live_net(actions) if self.grown else tables.post_net[index]
            if residency.resident_bytes + room > self.limit:
                self.hold_peak(index, room)
            for action in actions:
                self.runner.apply(action)
        drops = tables.drops[index]
        if drops:
            drop_recipes(drops, residency.by_sid)
        if residency.resident_bytes > self.limit:
            self.hold_peak(index, 0)

    def _bind(self, index: int, binds: tuple[tuple[int, int, int, bool], ...], out: Any) -> bool:
        """Register the storages op ``index`` made, at their recorded output positions (at
        their live sizes: a storage larger than planned switches the entry to growth)."""
        residency = self.scope.residency
        leaves = (out,) if type(out) is torch.Tensor else tree_leaves(out)
        for position, sid, nbytes, register in binds:
            value = leaves[position] if position < len(leaves) else None
            if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
                # Its outputs stay untracked (never offloaded): safe, just not in budget.
                self._fall_back(
                    f"op {index} ({self.tables.names[index]}) made other outputs", seed=False
                )
                return False
            storage = value.untyped_storage()
            live = storage.nbytes()
            if live > nbytes and live > self.grown.get(sid, 0) and self._grew(sid, live):
                return self._bind(index, self.tables.binds[index], out)  # now all of them
            if not register:
                continue
            known = residency.by_sid.get(sid)
            if known is None or not known.alive:
                residency.track_sid(storage, sid, index, nbytes)
        return True

    def _grew(self, sid: int, live: int) -> bool:
        """Storage ``sid`` came out at ``live`` bytes, more than planned. Returns whether
        the entry switched to tables that register every storage (bind again)."""
        first = not self.grown
        self.grown[sid] = live
        if not first:
            return False
        logger.info(
            "activation storage %d is larger than planned (%d bytes): the replay holds the "
            "budget on live sizes, and re-plans at the end",
            sid,
            live,
        )
        registered_all = self.tables.track_all
        self._count_unseen(self.plan, self.op)  # its storages are registered next
        self.follow(self.plan)  # the same plan, every storage registered, the budget held
        return not registered_all

    def hold_peak(self, index: int, room: int) -> None:
        """Evict resident storages op ``index`` does not touch, those needed last first,
        until the live bytes and ``room`` more fit under the plan's simulated peak."""
        self.runner.evict(self.tables, index, self.limit - room)

    # ---- leaving the plan ----------------------------------------------------------------

    def leave(self, name: str) -> bool:
        """Op ``self.op + 1``, ``name``, is not the plan's: switch to a kept plan that goes
        on with it (True), or fall back to a warmup (False)."""
        index = self.op + 1
        other = self.book.continuation(self.plan, index, name)
        if other is None:
            self._fall_back(f"op {index} is {name}", seed=True)
            return False
        logger.info("activation replay goes on with another kept plan at op %d", index)
        self.switches += 1
        self._count_unseen(other, index)
        self.follow(other)
        residency, tables = self.scope.residency, self.tables
        registered, until = tables.registered, tables.recipe_until
        for entry in list(residency.by_sid.values()):
            if not entry.alive:
                continue
            if entry.sid not in registered:
                residency.untrack(entry)
                entry.recipe = None  # its inputs may go
            elif entry.recipe is not None and until.get(entry.sid, -1) < index:
                if not entry.resident and not entry.host_valid:  # only the recipe holds it
                    self.hold_peak(index, sum(away_bytes(entry).values()))
                    residency.ready(entry)  # recomputes it (its inputs paged in first)
                entry.recipe = None
        if not tables.track_all:  # it registers little: its plan's peak stands for it
            residency.peak_bytes = max(residency.peak_bytes, tables.planned_peak)
        if residency.resident_bytes > self.limit:
            self.hold_peak(index, 0)
        return True

    def _count_unseen(self, plan: Plan, count: int) -> None:
        """After ``count`` ops of a blind replay: the planned bytes of the storages it made
        and never registered that ``plan`` says are still alive. Nothing can move them;
        the budget left for the others is smaller by as much, to the end of the entry."""
        if self.blind:
            self.unseen = plan.held_bytes(count, self.scope.residency.by_sid)

    def _fall_back(self, why: str, *, seed: bool) -> None:
        """Hand the entry over to a warmup that keeps the budget; with ``seed``, one that
        records (when the replay saw every storage so far)."""
        logger.info("activation replay left its plan (%s)", why)
        plan, count, scope = self.plan, self.op + 1, self.scope
        recording = seed and (count == 0 or not self.blind)
        self._count_unseen(plan, count)
        warmup = WarmupEntry(
            scope,
            op=self.op,
            next_sid=1 if recording and count == 0 else self.next_sid,  # 0 ops: from scratch
            recording=recording,
            seed=Seed.of(plan, count) if recording else None,
            unseen=self.unseen,
        )
        if recording:
            if count == 0:
                # Nothing ran: the plan's peak that stood for an unregistered replay goes.
                scope.residency.peak_bytes = scope.residency.resident_bytes
            scope.gradients.watch_all(scope.leaves)
        elif seed:
            for followed in self.followed:  # next time they see every storage, and record
                followed.track = True
        self.warmup = warmup
        warmup.take_over()
        self.hand_over(warmup)
