"""What a replay needs from its plan, worked out once per plan, and recipes to recompute.

``ReplayTables`` turns a trace and its schedule into per-op tuples, so an op of the replay
does no more than compare its name, run the actions due and register the storages that
some action needs: nothing parses a schema, walks the accesses or looks a storage up by
object. The tables are cached per plan (``tables_for``).

A ``Recipe`` is what re-runs the op that made a storage (``RECOMPUTE``): the op, its
arguments (references to its input tensors, which the plan keeps alive until the
recompute anyway), where the storage is among its outputs, and the version counter of each
input tensor, so a storage is released without a host copy only while its inputs are
unchanged, and a recompute from changed inputs fails instead of giving other bits.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from swapopt_core._activations.recording import live_refusal
from swapopt_core._activations.residency import Tracked
from swapopt_core._activations.runtime import byte_view
from swapopt_core._planning.ir import (
    AccessKind,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
)
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
            actions (the replay then measures its peak and holds it, ``limit``). An op
            that makes only storages nothing needs has its first one listed unregistered:
            its size is checked, so a step of other shapes still leaves the plan.
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
        uses: The ops that access each registered storage, in order (what the replay reads
            to evict the storage needed last).
    """

    def __init__(self, trace: ActivationTrace, schedule: ResidencySchedule) -> None:
        ops, sizes = trace.ops, trace.storage_sizes
        count = len(ops)
        self.names = [op.name for op in ops]
        self.pre = [tuple(schedule.pre.get(i, _NONE)) for i in range(count)]
        self.post = [tuple(schedule.post.get(i, _NONE)) for i in range(count)]
        acted: dict[int, list[tuple[int, ActionKind]]] = {}  # sid -> (op, kind), in order
        for _, op, action in schedule.actions():
            acted.setdefault(action.storage_id, []).append((op, action.kind))
        specs = _recipe_specs(trace, acted)
        self.track_all = len(schedule) > 0
        needed = set(acted)
        for spec in specs.values():
            needed.update(spec.inputs)
        binds: list[list[tuple[int, int, int, bool]]] = [[] for _ in range(count)]
        touched: list[list[int]] = [[] for _ in range(count)]
        written: list[list[int]] = [[] for _ in range(count)]
        last_access: dict[int, int] = {}
        self.uses: dict[int, list[int]] = {}
        for index, op in enumerate(ops):
            for access in op.accesses:
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
        for spec in specs.values():
            recipes[spec.producer].append(spec)
            drops[drop_op(acted[spec.sid], last_access.get(spec.sid, 0))].append(spec.sid)
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


def _net(actions: tuple, sizes: dict[int, int]) -> int:
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


_CACHE: dict[int, tuple[weakref.ref, weakref.ref, tuple[int, ...], ReplayTables]] = {}


def tables_for(trace: ActivationTrace, schedule: ResidencySchedule) -> ReplayTables:
    """The tables of this plan, built at its first replay and reused while it lasts."""
    shape = (len(schedule.pre), len(schedule.post), len(schedule))
    cached = _CACHE.get(id(schedule))
    # A schedule edited in place (another shape) gets new tables.
    if (
        cached is not None
        and cached[0]() is trace
        and cached[1]() is schedule
        and cached[2] == shape
    ):
        return cached[3]
    tables = ReplayTables(trace, schedule)
    for key in [k for k, c in _CACHE.items() if c[1]() is None or c[0]() is None]:
        del _CACHE[key]
    _CACHE[id(schedule)] = (weakref.ref(trace), weakref.ref(schedule), shape, tables)
    return tables


class Recipe:
    """How to make one storage's bytes again: re-run the op that made it.

    Args:
        sid: The storage.
        name: The op's name (for messages).
        func: The op (an ``OpOverload``).
        args: Its positional arguments, as it ran.
        kwargs: Its keyword arguments.
        position: Where the storage is among the op's outputs (pytree leaf order).
        inputs: The registered storages it reads (made ready before it re-runs).
    """

    __slots__ = ("sid", "name", "func", "args", "kwargs", "position", "inputs", "versions")

    def __init__(
        self,
        sid: int,
        name: str,
        func: Any,
        args: tuple,
        kwargs: dict,
        position: int,
        inputs: tuple[Tracked, ...],
    ) -> None:
        self.sid, self.name, self.func = sid, name, func
        self.args, self.kwargs, self.position, self.inputs = args, kwargs, position, inputs
        # A tensor made under inference mode has no version counter: it can change only by
        # an in-place write inside inference mode, which the warmup saw (recording.py).
        self.versions = tuple(
            (t, t._version)
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not t.is_inference()
        )

    def intact(self) -> bool:
        """Whether no input tensor was modified since the op ran."""
        return all(t._version == version for t, version in self.versions)

    def run_into(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Re-run the op and copy the storage's bytes into ``storage`` (re-allocated here).

        Raises:
            RuntimeError: An input was modified in place since the op ran, or the op made
                an output of another size: the bytes would not be the ones it made.
        """
        changed = next(((t, v) for t, v in self.versions if t._version != v), None)
        if changed is not None:
            raise RuntimeError(
                f"Cannot recompute activation storage {self.sid} (made by {self.name}): an "
                f"input of {self.name} was modified in place since it ran (tensor version "
                f"{changed[1]} -> {changed[0]._version}), so the recomputed bits would differ. "
                "Mark that op recompute=false in the trace, or plan this storage as an "
                "offload."
            )
        # No autograd graph: the bytes are all that is wanted (and close() runs outside
        # the dispatch mode, where autograd would record the op).
        with torch.no_grad():
            out = self.func(*self.args, **self.kwargs)
        leaves = tree_leaves(out)
        value = leaves[self.position] if self.position < len(leaves) else None
        if not isinstance(value, torch.Tensor) or value.untyped_storage().nbytes() != nbytes:
            raise RuntimeError(
                f"Cannot recompute activation storage {self.sid}: {self.name} re-ran but its "
                f"output {self.position} is not a {nbytes}-byte tensor as recorded. Mark that "
                "op recompute=false in the trace."
            )
        storage.resize_(nbytes)
        byte_view(storage).copy_(byte_view(value.untyped_storage()))


def keep_recipes(
    specs: tuple[_RecipeSpec, ...],
    by_sid: dict[int, Tracked],
    name: str,
    func: Any,
    args: tuple,
    kwargs: dict,
    out: Any,
) -> None:
    """Attach a recipe to each storage in ``specs`` that op ``func`` just made (it returned
    ``out``), once the live call passes the tracer's rules (``recording.live_refusal``): a
    trace read back from JSON may mark an op that cannot repeat its bits. A storage refused
    a recipe is never released without a host copy: it stays, or is copied out."""
    why = live_refusal(func, args, kwargs, out)
    if why:
        _refuse(name, func, why)
        return
    for spec in specs:
        entry = by_sid.get(spec.sid)
        if entry is None or not entry.alive:
            continue
        inputs = tuple(e for sid in spec.inputs if (e := by_sid.get(sid)) is not None)
        entry.recipe = Recipe(spec.sid, name, func, args, kwargs, spec.position, inputs)


_REFUSED: set[tuple[str, str]] = set()  # (op, why) already reported


def _refuse(name: str, func: Any, why: str) -> None:
    level = logging.DEBUG if (name, why) in _REFUSED else logging.WARNING
    _REFUSED.add((name, why))
    logger.log(
        level,
        "the trace marks %s recompute, but the op that ran (%s) %s: its outputs are kept or "
        "copied instead of recomputed (same bits, more memory or link time). Record the "
        'trace again, or set that op\'s "recompute" to false.',
        name,
        func,
        why,
    )


def drop_recipes(sids: tuple[int, ...], by_sid: dict[int, Tracked]) -> None:
    """Let go of the recipes of ``sids`` (and the inputs they hold), unless one is off the
    device without a host copy and still needs it."""
    for sid in sids:
        entry = by_sid.get(sid)
        if entry is not None and (entry.resident or entry.host_valid):
            entry.recipe = None
