"""The replay side of a session entry: what one op of a replay does, from precomputed tables.

``ReplayPath`` is mixed into ``Entry``. Per op it compares the op's name with the trace,
runs the ``pre`` actions due, readies the storages the op touches when something is away or
in flight, marks in-place writes, runs the op, registers the storages some action needs (by
id, at their recorded output positions), keeps the recipes of storages to recompute, runs
the ``post`` actions, and holds the plan's peak (``limit``): when the live activation bytes
exceed the plan's simulated peak, or would once the op's actions and outputs allocate, it
evicts the storages needed last (by the trace; those it no longer reads first) that the op
does not touch (copy out, then release) rather than overshoot.

A plan serves every step with its op sequence, whatever the sizes: a storage at most its
planned size is registered at its live size (its host buffer is taken at the planned size,
so the pool reuses it). One that comes out larger is noted (``grown``): from then on the
entry registers every storage, holds the budget (not the plan's peak) on the live sizes,
makes room for each op's outputs as predicted on meta tensors and for its actions at their
live sizes, and the executor re-plans the op sequence with the grown sizes at the end.
"""

from __future__ import annotations

import bisect
import logging
import math
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from swapopt_core._activations.prediction import fresh_bytes
from swapopt_core._activations.replay import ReplayTables, drop_recipes, keep_recipes
from swapopt_core._activations.residency import Residency, Tracked
from swapopt_core._planning.ir import Action, ActionKind

if TYPE_CHECKING:
    from swapopt_core._activations.plans import Plan
    from swapopt_core._activations.replay import Recipe

logger = logging.getLogger(__name__)

__all__ = ["ReplayPath"]

_D2H, _RELEASE, _H2D, _RELEASE_HOST, _RECOMPUTE = (
    ActionKind.COPY_D2H,
    ActionKind.RELEASE_DEVICE,
    ActionKind.COPY_H2D,
    ActionKind.RELEASE_HOST,
    ActionKind.RECOMPUTE,
)


class ReplayPath:
    """Replay methods of ``Entry`` (see the module doc). The entry sets ``tables``."""

    tables: ReplayTables
    residency: Residency
    op: int
    quiet: int
    limit: float  # the peak the replay holds (``_follow``)
    grown: dict[int, int]
    budget: int
    plan: Plan

    def _init_replay(self) -> None:
        self.recomputes = 0  # every recompute: planned, on demand, at the end
        self.planned_recomputes = 0
        self.evictions = 0  # storages evicted to hold the plan's peak
        self._stale_recipes: set[int] = set()  # releases refused, logged once each

    def _replay(self, index: int, func: Any, args: tuple, kwargs: dict) -> Any:
        """Op ``index`` of the trace, matched by name: its actions around it."""
        self.op = index
        tables, residency = self.tables, self.residency
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
        tables, residency = self.tables, self.residency
        actions = tables.pre[index]
        made = tables.made[index]
        if predicted > made:
            made = predicted
        if actions:
            room = (self._live_net(actions) if self.grown else tables.pre_net[index]) + made
            if residency.resident_bytes + room > self.limit:
                self._hold_peak(index, room)  # before reloads and recomputes allocate
            for action in actions:
                self._apply(action)
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
                    self._hold_peak(index, room)
                for entry in away:
                    residency.ready(entry)
        for sid in tables.written[index]:
            entry = residency.by_sid.get(sid)
            if entry is not None and (entry.host is not None or entry.recipe is not None):
                residency.written(entry)
        if residency.resident_bytes + made > self.limit:
            self._hold_peak(index, made)

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
        tables, residency = self.tables, self.residency  # a growth may have changed them
        recipes = tables.recipes[index]
        if recipes and func is not None:
            keep_recipes(
                recipes, residency.by_sid, tables.names[index], func, args, kwargs or {}, out
            )
        actions = tables.post[index]
        if actions:
            room = self._live_net(actions) if self.grown else tables.post_net[index]
            if residency.resident_bytes + room > self.limit:
                self._hold_peak(index, room)
            for action in actions:
                self._apply(action)
        drops = tables.drops[index]
        if drops:
            drop_recipes(drops, residency.by_sid)
        if residency.resident_bytes > self.limit:
            self._hold_peak(index, 0)

    def _bind(self, index: int, binds: tuple[tuple[int, int, int, bool], ...], out: Any) -> bool:
        """Register the storages op ``index`` made, at their recorded output positions (at
        their live sizes: a storage larger than planned switches the entry to growth)."""
        residency = self.residency
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
        self._count_unseen(self.plan, self.op)  # this op's storages are registered next
        self._follow(self.plan)  # the same plan, every storage registered, the budget held
        return not registered_all

    def _live_net(self, actions: tuple[Action, ...]) -> int:
        """Bytes ``actions`` allocate less those they release, at the storages' live sizes."""
        by_sid = self.residency.by_sid
        net = 0
        for action in actions:
            entry = by_sid.get(action.storage_id)
            if entry is None or not entry.alive:
                continue
            if action.kind in (_H2D, _RECOMPUTE) and not entry.resident:
                net += entry.nbytes
            elif action.kind is _RELEASE and entry.resident:
                net -= entry.nbytes
        return net

    def _apply(self, action: Action) -> None:
        residency = self.residency
        entry: Tracked | None = residency.by_sid.get(action.storage_id)
        if entry is None or not entry.alive:
            return
        kind = action.kind
        if kind is _D2H:
            residency.copy_out(entry)
        elif kind is _RELEASE:
            if not entry.host_valid and entry.recipe is not None and not entry.recipe.intact():
                self._refused(entry)
            residency.release(entry)
        elif kind is _H2D:
            residency.copy_in(entry)
        elif kind is _RELEASE_HOST:
            residency.release_host(entry)
        elif kind is _RECOMPUTE and not entry.resident and entry.recipe is not None:
            self.planned_recomputes += 1
            residency.recompute(entry)

    def _refused(self, entry: Tracked) -> None:
        if entry.sid not in self._stale_recipes:
            self._stale_recipes.add(entry.sid)
            logger.warning(
                "activation %d stays on the device: an input of %s, which made it, was "
                "modified in place since, so it could not be recomputed (over the plan's "
                "budget by %d bytes, still correct)",
                entry.sid,
                entry.recipe.name,
                entry.nbytes,
            )

    def _regenerate(self, entry: Tracked) -> None:
        """Re-run the op that made ``entry`` into its storage (the residency's hook)."""
        recipe: Recipe = entry.recipe
        storage = entry.storage()
        if storage is None:
            return
        residency = self.residency
        self.quiet += 1  # the op re-run and the copies below are ours, not the step's
        try:
            for source in recipe.inputs:
                if source.alive:
                    residency.ready(source)  # pages in, or recomputes, what is away
            recipe.run_into(storage, entry.nbytes)
        finally:
            self.quiet -= 1
        self.recomputes += 1

    def _hold_peak(self, index: int, room: int) -> None:
        """Evict resident storages op ``index`` does not touch, those needed last first,
        until the live bytes and ``room`` more fit under the plan's simulated peak."""
        residency, tables = self.residency, self.tables
        touched = set(tables.touched[index])
        limit = self.limit - room
        if residency.resident_bytes <= limit:
            return
        uses = tables.uses

        def next_use(sid: int) -> float:
            ops = uses.get(sid, ())
            at = bisect.bisect_right(ops, index)
            return ops[at] if at < len(ops) else math.inf

        candidates = [
            e
            for e in residency.by_sid.values()
            if e.alive and e.resident and e.sid not in touched and e.sid not in residency.pending_in
        ]
        candidates.sort(key=lambda e: next_use(e.sid), reverse=True)
        for entry in candidates:
            if residency.resident_bytes <= limit:
                return
            if residency.copy_out(entry):
                residency.release(entry)
                self.evictions += 1
