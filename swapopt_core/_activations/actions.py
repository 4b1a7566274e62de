"""What a replay does to the residency: the plan's actions, and evictions to hold its peak.

A ``ResidencySchedule`` names, before and after each op, the storages to copy out, release,
copy in, drop on the host and recompute. :class:`ActionRunner` carries them out on the entry's
residency (an action on a storage that is gone is skipped), says what a list of them costs at
the storages' live sizes, and, when the replay's live bytes would exceed the peak it holds,
evicts resident storages the op does not touch, those the trace needs last first (copy out,
then release).
"""

from __future__ import annotations

import bisect
import logging
import math
from typing import TYPE_CHECKING

from swapopt_core._activations.residency import Tracked
from swapopt_core._activations.scope import Scope
from swapopt_core._planning.ir import Action, ActionKind

if TYPE_CHECKING:
    from swapopt_core._activations.replay import ReplayTables

logger = logging.getLogger(__name__)

__all__ = ["ActionRunner"]

# Those an action's net bytes depend on: reloads and recomputes allocate, releases free.
_ALLOCATES = frozenset((ActionKind.COPY_H2D, ActionKind.RECOMPUTE))


class ActionRunner:
    """Runs a replay's actions on the residency of ``scope`` and counts what they did.

    Args:
        scope: What the entry's phases share (its residency from the entry's first op on).
    """

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.recomputes = 0  # RECOMPUTE actions run
        self.evictions = 0  # storages evicted to hold the plan's peak
        self._stale_recipes: set[int] = set()  # releases refused, logged once each

    def live_net(self, actions: tuple[Action, ...]) -> int:
        """Bytes ``actions`` allocate less those they release, at the storages' live sizes."""
        by_sid = self.scope.residency.by_sid
        net = 0
        for action in actions:
            entry = by_sid.get(action.storage_id)
            if entry is None or not entry.alive:
                continue
            if action.kind in _ALLOCATES and not entry.resident:
                net += entry.nbytes
            elif action.kind is ActionKind.RELEASE_DEVICE and entry.resident:
                net -= entry.nbytes
        return net

    def apply(self, action: Action) -> None:
        """Carry ``action`` out on its storage, if that is still alive."""
        residency = self.scope.residency
        entry: Tracked | None = residency.by_sid.get(action.storage_id)
        if entry is None or not entry.alive:
            return
        kind = action.kind
        if kind is ActionKind.COPY_D2H:
            residency.copy_out(entry)
        elif kind is ActionKind.RELEASE_DEVICE:
            if not entry.host_valid and entry.recipe is not None and not entry.recipe.intact():
                self._refused(entry)
            residency.release(entry)
        elif kind is ActionKind.COPY_H2D:
            residency.copy_in(entry)
        elif kind is ActionKind.RELEASE_HOST:
            residency.release_host(entry)
        elif kind is ActionKind.RECOMPUTE and not entry.resident and entry.recipe is not None:
            self.recomputes += 1
            residency.recompute(entry)

    def _refused(self, entry: Tracked) -> None:
        if entry.recipe is not None and entry.sid not in self._stale_recipes:
            self._stale_recipes.add(entry.sid)
            logger.warning(
                "activation %d stays on the device: an input of %s, which made it, was "
                "modified in place since, so it could not be recomputed (over the plan's "
                "budget by %d bytes, still correct)",
                entry.sid,
                entry.recipe.name,
                entry.nbytes,
            )

    def evict(self, tables: ReplayTables, index: int, limit: float) -> None:
        """Evict resident storages op ``index`` does not touch, those ``tables`` says are
        needed last first, until the live bytes are at most ``limit``."""
        residency = self.scope.residency
        if residency.resident_bytes <= limit:
            return
        touched = set(tables.touched[index])
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
            # Copied out and released at once: the release makes compute wait for that
            # copy (counted in ``eviction_stalls``); releasing later would break ``limit``.
            if residency.evict(entry):
                self.evictions += 1
