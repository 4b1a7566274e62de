"""Where chosen recomputes run, and the virtual trace the offload placer plans for them.

A chosen recompute gap ``(a, b)`` of storage ``s`` (``recompute.py``) runs ``s``'s producer
again right before op ``b``. Its inputs must be on the device there:

- an input alive at ``b`` is simply read (the placer reloads it if it moved it out);
- an input released at that point by another chosen gap is recomputed at the same place,
  first (a *pulled* chain: the gated multiply reads the SiLU output);
- an input the trace frees before ``b`` (or that a chosen *tail* released for good) is
  *revived*: the replay's recipe of ``s`` holds it alive (``recipes.py``), so the plan
  releases it without a copy where the trace frees it, makes it again right before ``s``'s
  recompute (its own inputs by the same rules) and releases it again right after the last
  recompute that reads it. This is what lets a plan regenerate a whole attention block from
  its input, as activation checkpointing does.

**Virtual trace.** Each recompute (chosen or revived) becomes an op inserted right before its
place, with the producer's duration, that reads the current versions of the producer's
inputs and creates a fresh storage (a new *version*, same size); the old version dies at the
gap's start (a chosen gap) or where the trace frees the storage (a revived one). The placer plans
that trace as any other; the schedule maps back: the inserted op's actions around
``RECOMPUTE(s)`` in ``pre[b]``, ``RELEASE_DEVICE`` after each early death, and after the
last inserted op that reads a revived version, actions on versions to their storage.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    Action,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.recipes import wants_recipe

__all__ = ["Placer", "Recompute", "recover_limits", "revive_cost", "virtual_plan"]

#: Places offloads on a (virtual) trace under a budget: what the timed planner's search does.
Placer = Callable[[TraceIndex, int], ResidencySchedule]


class Recompute(Protocol):
    """What a chosen recompute gap offers (``recompute.RecomputeGap``, a frozen dataclass)."""

    @property
    def sid(self) -> int: ...
    @property
    def a(self) -> int: ...
    @property
    def b(self) -> int: ...
    @property
    def producer(self) -> int: ...
    @property
    def tail(self) -> bool: ...


def recover_limits(ix: TraceIndex) -> dict[int, int]:
    """For each storage of an op marked ``recompute``: the last op ``p`` before which it can
    be made again (its recompute inserted right before op ``p``).

    Nothing may write it or its producer's inputs after the producer before ``p``, and each
    input must be alive at ``p`` (accessed at ``p`` or later, or kept after the step), or be
    made again there in turn. An input the caller holds past its last access may be released
    there for good (its *tail*), so it counts as alive only up to that access: past it, it
    must be revivable.
    """
    limits: dict[int, int] = {}
    for sid in sorted(ix.producer, key=lambda s: (ix.producer[s], s)):
        producer = ix.producer[sid]
        limit = _next_write(ix, sid, producer)
        for x in ix.recompute_inputs[sid]:
            limit = min(limit, _next_write(ix, x, producer))
            if x in ix.retained:
                continue
            alive = ix.last[x] if has_tail(ix, x, limits) else ix.end[x]
            limit = min(limit, max(alive, limits.get(x, alive)))
        limits[sid] = limit
    return limits


def has_tail(ix: TraceIndex, sid: int, limits: dict[int, int]) -> bool:
    """Whether ``sid`` may be released for good after its last access (a *tail*): the
    caller holds it past that access and it can be made again there."""
    if sid in ix.retained or sid not in limits:
        return False
    last = ix.last[sid]
    return last < ix.end[sid] and last < limits[sid]


def _next_write(ix: TraceIndex, sid: int, after: int) -> int:
    """The first op after ``after`` that writes ``sid`` (``ix.n`` when none does)."""
    writes = ix.writes.get(sid, ())
    k = bisect_right(writes, after)
    return writes[k] if k < len(writes) else ix.n


def _dead(ix: TraceIndex, sid: int, at: int) -> bool:
    """Whether ``sid`` has died (its last access passed) before op ``at``."""
    return sid not in ix.retained and ix.end.get(sid, at) < at


def revive_cost(ix: TraceIndex, sid: int, at: int) -> float:
    """Milliseconds spent reviving the inputs of ``sid``'s producer that are dead at ``at``
    (and theirs, recursively): what a recompute there costs besides the producer."""
    seen: set[int] = set()
    stack = [x for x in ix.recompute_inputs.get(sid, ()) if _dead(ix, x, at)]
    cost = 0.0
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        cost += ix.durations[ix.producer[x]]
        stack.extend(y for y in ix.recompute_inputs[x] if _dead(ix, y, at))
    return cost


def _place(
    ix: TraceIndex, chosen: Iterable[Recompute]
) -> tuple[dict[Recompute, int], dict[int, set[int]]]:
    """Where each chosen recompute runs (before which real op), chains pulled forward, and
    which dead storages are revived before which op.

    A recompute at ``p`` needs its inputs there: one released by a chosen gap ``(a, b)``
    with ``a < p <= b`` is recomputed at ``p`` too; one dead at ``p`` is revived at ``p``.
    Inputs have earlier producers, so one pass in decreasing producer order settles every
    position. A gap whose recompute would come right after its release is dropped (the
    storage stays).
    """
    by_sid: dict[int, list[Recompute]] = defaultdict(list)
    tails: dict[int, Recompute] = {}
    for g in chosen:
        if g.tail:
            tails[g.sid] = g  # released after its last access for good: nothing runs again
        else:
            by_sid[g.sid].append(g)
    where = {g: g.b for gaps in by_sid.values() for g in gaps}
    revived: dict[int, set[int]] = defaultdict(set)
    # (-producer, sid, kind, position or gap index): gaps (0) and revivals (1).
    heap: list[tuple[int, int, int, int]] = []
    order = list(where)
    for k, g in enumerate(order):
        heap.append((-g.producer, g.sid, 0, k))
    heapq.heapify(heap)
    queued: set[tuple[int, int]] = set()
    while heap:
        _, sid, kind, ref = heapq.heappop(heap)
        if kind == 0:
            g = order[ref]
            p = where[g]
            if p <= g.a + 1:
                continue
        else:
            p = ref
        for x in ix.recompute_inputs[sid]:
            pulled = False
            for other in by_sid.get(x, ()):
                if other.a < p <= where[other]:
                    where[other] = p
                    pulled = True
            gone = _dead(ix, x, p) or (x in tails and tails[x].a < p)
            if not pulled and gone and (x, p) not in queued:
                queued.add((x, p))
                revived[p].add(x)
                heapq.heappush(heap, (-ix.producer[x], x, 1, p))
    placed = {g: p for g, p in where.items() if p > g.a + 1}
    placed.update((g, g.b) for g in tails.values())
    return placed, dict(revived)


@dataclass
class _Virtual:
    trace: ActivationTrace
    real_of: list[int | None]  # virtual op -> real op (None: an inserted recompute)
    inserted: dict[int, int]  # virtual op -> the real storage it makes again
    sid_of: dict[int, int]  # virtual storage id -> real one
    early: dict[int, list[int]]  # real op -> storages whose version dies after it
    spent: dict[int, list[int]]  # virtual op -> revived storages whose last reader it is


def _virtual_trace(
    ix: TraceIndex, placed: dict[Recompute, int], revived: dict[int, set[int]], budget: int
) -> _Virtual:
    trace = ix.trace
    seen = [a.storage_id for op in trace.ops for a in op.accesses]
    fresh = max([*seen, *ix.sizes, -1]) + 1
    before: dict[int, set[int]] = defaultdict(set)
    early: dict[int, list[int]] = defaultdict(list)
    tails = [g for g in placed if g.tail]
    for g, p in placed.items():
        if not g.tail:
            before[p].add(g.sid)
        early[g.a].append(g.sid)
    for p, sids in revived.items():
        before[p].update(sids)
    tailed = {g.sid for g in tails}
    for x in sorted({x for sids in revived.values() for x in sids} - tailed):
        # A recipe needs it later and keeps it alive: release it when the trace frees it
        # (recomputes up to then read it as it is).
        early[ix.end[x]].append(x)
    current: dict[int, int] = {}  # real sid -> its live version
    sizes = dict(ix.sizes)
    sid_of: dict[int, int] = {}
    ops: list[TraceOp] = []
    real_of: list[int | None] = []
    inserted: dict[int, int] = {}
    spent: dict[int, list[int]] = defaultdict(list)
    for i, op in enumerate(trace.ops):
        last_reader: dict[int, int] = {}  # revived version -> last inserted op reading it
        for sid in sorted(before.get(i, ()), key=lambda s: (ix.producer[s], s)):
            reads = []
            for x in ix.recompute_inputs[sid]:
                version = current.get(x, x)
                reads.append(Access(version, AccessKind.READ))
                if x in revived.get(i, ()):
                    last_reader[x] = len(ops)
            version, fresh = fresh, fresh + 1
            sizes[version] = ix.sizes[sid]
            sid_of[version] = sid
            current[sid] = version
            inserted[len(ops)] = sid
            real_of.append(None)
            name = f"recompute {trace.ops[ix.producer[sid]].name}"
            ops.append(
                TraceOp(
                    name,
                    ix.durations[ix.producer[sid]],
                    (*reads, Access(version, AccessKind.WRITE)),
                )
            )
        for x, k in last_reader.items():
            spent[k].append(x)
            current.pop(x, None)  # a later reader revives it again
        accesses = tuple(
            Access(current.get(a.storage_id, a.storage_id), a.kind) for a in op.accesses
        )
        ops.append(TraceOp(op.name, op.duration_ms, accesses))
        real_of.append(i)
    retained = frozenset(current.get(s, s) for s in trace.retained_sids)
    # Held past its last access, a storage's last version lives on, unless the plan releases
    # it there (a tail).
    released = tailed
    at = [k for k, real in enumerate(real_of) if real is not None]  # real op -> virtual op
    freed = {current.get(s, s): at[op] for s, op in trace.freed_after.items() if s not in released}
    for g in tails:  # its recipe holds the producer's inputs until it dies
        for x in ix.recompute_inputs[g.sid]:
            if x not in released and x not in ix.retained:
                version = current.get(x, x)
                freed[version] = max(freed.get(version, at[g.b]), at[g.b])
    virtual = ActivationTrace(
        tuple(ops),
        sizes,
        retained,
        budget,
        trace.d2h_bandwidth_gbps,
        trace.h2d_bandwidth_gbps,
        trace.min_offload_bytes,
        freed,
    )
    return _Virtual(virtual, real_of, inserted, sid_of, dict(early), dict(spent))


def _map_back(v: _Virtual, vplan: ResidencySchedule) -> ResidencySchedule:
    """The virtual schedule on the real trace (see the module docstring)."""
    plan = ResidencySchedule()

    def moved(actions: list[Action], into: list[Action]) -> None:
        into.extend(_rename(a, v.sid_of) for a in actions)

    pending: list[Action] = []  # actions of inserted ops, waiting for the next real op
    for k, real in enumerate(v.real_of):
        if real is None:
            moved(vplan.pre.get(k, []), pending)
            pending.append(Action(v.inserted[k], ActionKind.RECOMPUTE))
            moved(vplan.post.get(k, []), pending)
            pending.extend(Action(x, ActionKind.RELEASE_DEVICE) for x in v.spent.get(k, ()))
            continue
        pre, pending = pending, []
        moved(vplan.pre.get(k, []), pre)
        post: list[Action] = []
        moved(vplan.post.get(k, []), post)
        post.extend(Action(s, ActionKind.RELEASE_DEVICE) for s in v.early.get(real, ()))
        if pre:
            plan.pre[real] = pre
        if post:
            plan.post[real] = post
    return _keep_host_for_tails(plan, v)


def _keep_host_for_tails(plan: ResidencySchedule, v: _Virtual) -> ResidencySchedule:
    """An early release of a storage the replay keeps no recipe for (copied out, never
    recomputed: a tail) must use its host copy: it goes before the ``RELEASE_HOST`` the
    placer put at the same op, which then has nothing left to do and goes."""
    kinds: dict[int, set[ActionKind]] = defaultdict(set)
    for _, _, action in plan.actions():
        kinds[action.storage_id].add(action.kind)
    for real, sids in v.early.items():
        post = plan.post.get(real, [])
        for sid in sids:
            if wants_recipe(kinds[sid]):
                continue
            release = Action(sid, ActionKind.RELEASE_DEVICE)
            drop = Action(sid, ActionKind.RELEASE_HOST)
            if drop in post:
                post.remove(release)
                post.insert(post.index(drop), release)
                post.remove(drop)
    return plan


def _rename(action: Action, sid_of: dict[int, int]) -> Action:
    sid = sid_of.get(action.storage_id)
    return action if sid is None else Action(sid, action.kind)


def virtual_plan(
    ix: TraceIndex, chosen: Iterable[Recompute], budget: int, place: Placer
) -> ResidencySchedule:
    """The real schedule for recomputing ``chosen`` and offloading what else the budget needs.

    Args:
        ix: The real trace's index.
        chosen: Recompute gaps (``recompute.recompute_gaps``).
        budget: Device bytes for activations.
        place: The offload placer, run on the virtual trace.
    """
    placed, revived = _place(ix, chosen)
    if not placed:
        return place(ix, budget)
    v = _virtual_trace(ix, placed, revived, budget)
    return _map_back(v, place(TraceIndex(v.trace), budget))
