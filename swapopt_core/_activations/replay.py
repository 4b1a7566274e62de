"""What a replay needs from its plan, worked out once per plan, and recipes to recompute.

``ReplayTables`` turns a trace and its schedule into per-op tuples, so an op of the replay
does no more than compare its name, run the actions due and register the storages that
some action needs: nothing parses a schema, walks the accesses or looks a storage up by
object. The tables are cached per plan (``tables_for``).

The tables say which recipes to keep after each op and when to let them go
(``_planning/recipes.py``); a ``Recipe`` itself, what re-runs the op that made a storage
(``RECOMPUTE``), lives in ``recipe.py`` and is re-exported here.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

from swapopt_core._activations.recipe import Recipe, drop_recipes, keep_recipes
from swapopt_core._planning.ir import AccessKind, ActionKind, ActivationTrace, ResidencySchedule
from swapopt_core._planning.recipes import drop_op, wants_recipe

logger = logging.getLogger(__name__)

__all__ = ["Recipe", "ReplayTables", "drop_recipes", "keep_recipes", "tables_for"]

_NONE: tuple = ()


@dataclass(frozen=True)
class _RecipeSpec:
    """Where op ``producer`` leaves storage ``sid``, and the storages it reads to make it."""

    sid: int
    producer: int
    position: int
    inputs: tuple[int, ...]


class ReplayTables:
    """Per-op tables of one plan, indexed by op.

    Attributes:
        names: Each op's name, matched against the op the step runs.
        pre, post: The actions due before and after each op (empty tuples when none).
        binds: ``(output position, sid, nbytes, register)`` of the storages each op makes:
            registered are those some action or recipe needs, every one when the plan has
            actions or ``track_all`` is asked for (the replay then measures its peak and
            holds it, ``limit``). An op that makes only storages nothing needs has its first
            one listed unregistered: its size is checked, so a storage larger than planned
            is noticed (the replay then holds the budget on the live sizes and re-plans).
        touched: The registered storages each op reads or writes (made ready before it).
        made: The bytes of the registered storages each op makes.
        pre_net, post_net: The bytes the ``pre`` (``post``) actions of each op bring onto the
            device (reloads, recomputes) less those they release: the room the replay makes
            before it issues them.
        busy: Whether an op has anything to do besides a size check: actions, storages to
            register or mark written, recipes to keep or drop.
        probes: For an op that is not busy but makes storages, ``(output position, nbytes)``
            of the first one (its size is checked), else ``None``.
        written: The registered storages each op writes in place.
        recipes: The recipes to keep when each op runs.
        drops: The recipes no longer needed after each op (after its post actions).
        limit: The plan's simulated peak: the replay evicts above it. ``inf`` when the plan
            has no actions or the simulator refuses it.
        planned_peak: The plan's simulated peak (0 when the simulator refuses it): what a
            replay that registers nothing (``track_all`` false) reports as its peak.
        track_all: Whether every activation storage is registered.
        registered: The storages registered.
        recipe_until: For each storage a recipe is kept for, the op after which it is
            dropped.
        uses: The ops that access each registered storage, in order (what the replay reads
            to evict the storage needed last).

    Args:
        trace: The recorded step.
        schedule: Its plan.
        track_all: Register every activation storage even when the plan has no action
            (the session then sees them all: to hold the budget when sizes grow, or to
            hand a step over to a warmup); default: only when the plan has actions.
    """

    def __init__(
        self, trace: ActivationTrace, schedule: ResidencySchedule, track_all: bool = False
    ) -> None:
        ops, sizes = trace.ops, trace.storage_sizes
        count = len(ops)
        self.names = [op.name for op in ops]
        self.pre = [tuple(schedule.pre.get(i, _NONE)) for i in range(count)]
        self.post = [tuple(schedule.post.get(i, _NONE)) for i in range(count)]
        acted: dict[int, list[tuple[int, ActionKind]]] = {}  # sid -> (op, kind), in order
        for _, op, action in schedule.actions():
            acted.setdefault(action.storage_id, []).append((op, action.kind))
        specs = _recipe_specs(trace, acted)
        self.track_all = track_all or len(schedule) > 0
        needed = set(acted)
        for spec in specs.values():
            needed.update(spec.inputs)
        binds: list[list[tuple[int, int, int, bool]]] = [[] for _ in range(count)]
        touched: list[list[int]] = [[] for _ in range(count)]
        written: list[list[int]] = [[] for _ in range(count)]
        last_access: dict[int, int] = {}
        self.uses: dict[int, list[int]] = {}
        for index, traced in enumerate(ops):
            for access in traced.accesses:
                sid = access.storage_id
                if sid not in sizes:
                    continue  # a parameter gradient or another storage replay never moves
                last_access[sid] = index
                registered = self.track_all or sid in needed
                if access.output is not None and (registered or not binds[index]):
                    binds[index].append((access.output, sid, sizes[sid], registered))
                if registered:
                    touched[index].append(sid)
                    self.uses.setdefault(sid, []).append(index)
                    if access.kind is AccessKind.WRITE and access.output is None:
                        written[index].append(sid)
        self.binds = [tuple(b) for b in binds]
        self.made = [sum(b[2] for b in op_binds if b[3]) for op_binds in binds]
        self.pre_net = [_net(actions, sizes) for actions in self.pre]
        self.post_net = [_net(actions, sizes) for actions in self.post]
        self.touched = [tuple(t) for t in touched]
        self.written = [tuple(w) for w in written]
        recipes: list[list[_RecipeSpec]] = [[] for _ in range(count)]
        drops: list[list[int]] = [[] for _ in range(count)]
        self.recipe_until: dict[int, int] = {}
        for spec in specs.values():
            recipes[spec.producer].append(spec)
            until = drop_op(acted[spec.sid], last_access.get(spec.sid, 0))
            self.recipe_until[spec.sid] = until
            drops[until].append(spec.sid)
        self.registered = frozenset(sizes) if self.track_all else frozenset(needed & set(sizes))
        self.recipes = [tuple(r) for r in recipes]
        self.drops = [tuple(d) for d in drops]
        self.busy = [
            bool(
                self.pre[i]
                or self.post[i]
                or self.written[i]
                or self.recipes[i]
                or self.drops[i]
                or any(b[3] for b in self.binds[i])
            )
            for i in range(count)
        ]
        self.probes = [
            None if self.busy[i] or not self.binds[i] else self.binds[i][0][:2]
            for i in range(count)
        ]
        peak = _simulated_peak(trace, schedule)
        self.planned_peak = int(peak) if math.isfinite(peak) else 0
        self.limit = peak if self.track_all else math.inf


def _net(actions: tuple, sizes: Mapping[int, int]) -> int:
    """Bytes ``actions`` allocate on the device, less the bytes they release."""
    net = 0
    for action in actions:
        if action.kind in (ActionKind.COPY_H2D, ActionKind.RECOMPUTE):
            net += sizes.get(action.storage_id, 0)
        elif action.kind is ActionKind.RELEASE_DEVICE:
            net -= sizes.get(action.storage_id, 0)
    return net


def _recipe_specs(
    trace: ActivationTrace, acted: dict[int, list[tuple[int, ActionKind]]]
) -> dict[int, _RecipeSpec]:
    """The storages a recipe is kept for (``recipes.wants_recipe``) whose first access is
    the write of an op marked recompute."""
    wanted = {sid for sid, done in acted.items() if wants_recipe({kind for _, kind in done})}
    specs: dict[int, _RecipeSpec] = {}
    seen: set[int] = set()
    sizes = trace.storage_sizes
    for index, op in enumerate(trace.ops):
        made = {a.storage_id for a in op.accesses if a.output is not None}
        for access in op.accesses:
            sid = access.storage_id
            if sid in seen or sid not in sizes:
                continue
            seen.add(sid)
            if sid in wanted and op.recompute and access.output is not None:
                inputs = tuple(
                    a.storage_id
                    for a in op.accesses
                    if a.storage_id not in made and a.storage_id in sizes
                )
                specs[sid] = _RecipeSpec(sid, index, access.output, inputs)
    return specs


def _simulated_peak(trace: ActivationTrace, schedule: ResidencySchedule) -> float:
    # Imported here: the simulator is only needed once per plan.
    from swapopt_core._planning.simulate import simulate

    try:
        return float(simulate(trace, schedule).peak_bytes)
    except Exception:  # noqa: BLE001 - a plan the simulator refuses still replays, unchecked
        logger.info("the simulator refuses this plan: its replay has no peak to hold")
        return math.inf


_CACHE: dict[tuple[int, bool], tuple[weakref.ref, weakref.ref, tuple[int, ...], ReplayTables]] = {}


def tables_for(
    trace: ActivationTrace, schedule: ResidencySchedule, track_all: bool = False
) -> ReplayTables:
    """The tables of this plan, built at its first replay and reused while it lasts
    (``track_all``: see ``ReplayTables``)."""
    shape = (len(schedule.pre), len(schedule.post), len(schedule))
    key = (id(schedule), track_all)
    cached = _CACHE.get(key)
    # A schedule edited in place (another shape) gets new tables.
    if (
        cached is not None
        and cached[0]() is trace
        and cached[1]() is schedule
        and cached[2] == shape
    ):
        return cached[3]
    tables = ReplayTables(trace, schedule, track_all)
    for stale in [k for k, c in _CACHE.items() if c[1]() is None or c[0]() is None]:
        del _CACHE[stale]
    _CACHE[key] = (weakref.ref(trace), weakref.ref(schedule), shape, tables)
    return tables
