"""Recompute instead of offload: which storages the timed planner regenerates, and how.

A *recompute gap* is a gap ``(a, b)`` of a storage ``s`` (last access ``a``, next reader
``b``) whose producer may run again there (``docs/formats.md``, ``RECOMPUTE``): ``s`` is
released after ``a`` without a host copy and made again right before ``b``, at the price of
the producer's duration on the compute stream instead of two copies on the link.

**Virtual trace.** A set of chosen gaps becomes a trace in which each of them is an inserted
op right before ``b``, with the producer's duration, that reads the producer's inputs and
creates a fresh storage (a new *version* of ``s``, same size) used by the later accesses of
``s``; the old version dies at ``a``. The offload placer plans that trace as any other: it
keeps the recompute's inputs on the device at the inserted op (they are accessed there) and
offloads whatever else the budget needs. The schedule maps back: the inserted op's actions
around ``RECOMPUTE(s)`` in ``pre[b]``, ``RELEASE_DEVICE(s)`` in ``post[a]`` for the early
death, actions on versions to ``s``.

**Chains.** When a recompute needs an input that is itself released for a recompute at that
point (the gated multiply reads the SiLU output), the input's recompute moves to the same
place, ordered first (producers in trace order).

**Choice.** Only gaps where the budget binds somewhere inside count. They are batched per
op kind and gap (the op name with its digits ignored and the gap's rank among the storage's
gaps, so one batch per layer-independent place) and tried cheapest first (producer
milliseconds per byte, longer gaps first among equals); a batch stays when the replayed
schedule's time falls. Then each kept batch sheds its gaps that offloading hides best
(largest link slack first, a half, else a quarter) while that helps, and each rejected batch
is tried again on its gaps the link hides worst. The search stops early once the overhead is
negligible or its trials are spent (``MAX_TRIALS``, fewer on long traces).
"""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    Action,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.simulate import TraceIndex, simulate

logger = logging.getLogger(__name__)

__all__ = ["RecomputeGap", "plan_with_recompute", "recompute_gaps", "virtual_plan"]

#: Places offloads on a (virtual) trace under a budget: what the timed planner's search does.
Placer = Callable[[TraceIndex, int], ResidencySchedule]


@dataclass(frozen=True)
class RecomputeGap:
    """A gap of one storage where releasing it and running its producer again is allowed.

    Attributes:
        sid: The storage.
        a: Its last access before the gap (released after it).
        b: The reader after the gap (recomputed before it).
        producer: The op that made the storage and runs again.
        cost_ms: The producer's duration.
        size: The storage's bytes.
        kind: The producer's name with digits ignored and the gap's rank among the storage's
            gaps: one batch per kind of op and gap, across layers.
        slack: The gap's offload slack: idle time minus the two copies (ms).
    """

    sid: int
    a: int
    b: int
    producer: int
    cost_ms: float
    size: int
    kind: str
    slack: float


def recompute_gaps(ix: TraceIndex, budget: int | None = None) -> list[RecomputeGap]:
    """Every gap of every storage where the contract allows a recompute before the reader.

    The storage must be recomputable at ``b - 1`` (nothing after its producer writes it or an
    input before ``b``) and every input must still be alive at ``b``. Left out: gaps whose
    recompute costs more than moving the bytes out and back (offloading never costs more),
    and with a ``budget``, gaps during which the budget never binds (nothing to win).
    """
    trace = ix.trace
    bw_out, bw_in = trace.d2h_bandwidth_gbps * 1e6, trace.h2d_bandwidth_gbps * 1e6
    over = [0]  # over[i]: ops before op i where the budget binds
    for resident in ix.natural:
        over.append(over[-1] + (budget is not None and resident > budget))
    found: list[RecomputeGap] = []
    for sid, producer in ix.producer.items():
        size = ix.sizes[sid]
        cost = ix.durations[producer]
        if size <= 0 or cost >= size / bw_out + size / bw_in:
            continue
        inputs = ix.recompute_inputs[sid]
        # The first op after the producer that writes the storage or one of its inputs.
        spoiled = min(
            (op for x in (sid, *inputs) for op in ix.writes.get(x, ()) if op > producer),
            default=ix.n,
        )
        alive = min(
            (ix.n if x in ix.retained else ix.last.get(x, -1) for x in inputs), default=ix.n
        )
        name = re.sub(r"\d+", "#", trace.ops[producer].name)
        accesses = ix.by_storage[sid]
        pairs = [(a, b) for (a, _), (b, _) in zip(accesses, accesses[1:], strict=False)]
        for k, (a, b) in enumerate((a, b) for a, b in pairs if b - a >= 2):
            if b > spoiled or b > alive:
                continue
            if budget is not None and over[b] == over[a + 1]:
                continue
            idle = ix.starts[b] - ix.starts[a] - ix.durations[a]
            slack = idle - size / bw_out - size / bw_in
            kind = f"{name} gap {k}"  # the same gap of the same op in every layer
            found.append(RecomputeGap(sid, a, b, producer, cost, size, kind, slack))
    return found


def _positions(ix: TraceIndex, chosen: list[RecomputeGap]) -> dict[RecomputeGap, int]:
    """Where each chosen recompute runs (before which real op), chains pulled forward.

    A recompute at ``p`` needs its inputs there: an input released by a chosen gap
    ``(a, b)`` with ``a < p <= b`` is recomputed at ``p`` too. Dependents have later
    producers, so one pass in decreasing producer order settles every position. A gap whose
    recompute would come right after its release is dropped (the storage stays).
    """
    by_sid: dict[int, list[RecomputeGap]] = defaultdict(list)
    for g in chosen:
        by_sid[g.sid].append(g)
    where = {g: g.b for g in chosen}
    for g in sorted(chosen, key=lambda g: (-g.producer, g.sid, g.a)):
        p = where[g]
        if p <= g.a + 1:
            continue
        for x in ix.recompute_inputs[g.sid]:
            for other in by_sid.get(x, ()):
                if other.a < p <= where[other]:
                    where[other] = p
    return {g: p for g, p in where.items() if p > g.a + 1}


@dataclass
class _Virtual:
    trace: ActivationTrace
    real_of: list[int | None]  # virtual op -> real op (None: an inserted recompute)
    inserted: dict[int, RecomputeGap]  # virtual op -> the recompute it stands for
    sid_of: dict[int, int]  # virtual storage id -> real one
    early: dict[int, list[int]]  # real op -> storages whose version dies after it


def _virtual_trace(ix: TraceIndex, placed: dict[RecomputeGap, int], budget: int) -> _Virtual:
    trace = ix.trace
    seen = [a.storage_id for op in trace.ops for a in op.accesses]
    fresh = max([*seen, *ix.sizes, -1]) + 1
    before: dict[int, list[RecomputeGap]] = defaultdict(list)
    for g, p in placed.items():
        before[p].append(g)
    current: dict[int, int] = {}  # real sid -> its live version
    sizes = dict(ix.sizes)
    sid_of: dict[int, int] = {}
    ops: list[TraceOp] = []
    real_of: list[int | None] = []
    inserted: dict[int, RecomputeGap] = {}
    early: dict[int, list[int]] = defaultdict(list)
    for g in placed:
        early[g.a].append(g.sid)
    for i, op in enumerate(trace.ops):
        for g in sorted(before.get(i, ()), key=lambda g: (g.producer, g.sid)):
            reads = [Access(current.get(x, x), AccessKind.READ) for x in ix.recompute_inputs[g.sid]]
            version, fresh = fresh, fresh + 1
            sizes[version] = g.size
            sid_of[version] = g.sid
            current[g.sid] = version
            inserted[len(ops)] = g
            real_of.append(None)
            name = f"recompute {trace.ops[g.producer].name}"
            accesses = (*reads, Access(version, AccessKind.WRITE))
            ops.append(TraceOp(name, ix.durations[g.producer], accesses))
        accesses = tuple(
            Access(current.get(a.storage_id, a.storage_id), a.kind) for a in op.accesses
        )
        ops.append(TraceOp(op.name, op.duration_ms, accesses))
        real_of.append(i)
    retained = frozenset(current.get(s, s) for s in trace.retained_sids)
    virtual = ActivationTrace(
        tuple(ops),
        sizes,
        retained,
        budget,
        trace.d2h_bandwidth_gbps,
        trace.h2d_bandwidth_gbps,
        trace.min_offload_bytes,
    )
    return _Virtual(virtual, real_of, inserted, sid_of, dict(early))


def _map_back(v: _Virtual, vplan: ResidencySchedule) -> ResidencySchedule:
    """The virtual schedule on the real trace (see the module docstring)."""
    plan = ResidencySchedule()

    def moved(actions: list[Action], into: list[Action]) -> None:
        into.extend(_rename(a, v.sid_of) for a in actions)

    pending: list[Action] = []  # actions of inserted ops, waiting for the next real op
    for k, real in enumerate(v.real_of):
        if real is None:
            g = v.inserted[k]
            moved(vplan.pre.get(k, []), pending)
            pending.append(Action(g.sid, ActionKind.RECOMPUTE))
            moved(vplan.post.get(k, []), pending)
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
    return plan


def _rename(action: Action, sid_of: dict[int, int]) -> Action:
    sid = sid_of.get(action.storage_id)
    return action if sid is None else Action(sid, action.kind)


def virtual_plan(
    ix: TraceIndex, chosen: list[RecomputeGap], budget: int, place: Placer
) -> ResidencySchedule:
    """The real schedule for recomputing ``chosen`` and offloading what else the budget needs.

    Args:
        ix: The real trace's index.
        chosen: Recompute gaps from :func:`recompute_gaps`.
        budget: Device bytes for activations.
        place: The offload placer, run on the virtual trace.
    """
    placed = _positions(ix, chosen)
    if not placed:
        return place(ix, budget)
    v = _virtual_trace(ix, placed, budget)
    return _map_back(v, place(TraceIndex(v.trace), budget))


@dataclass
class _Trial:
    chosen: frozenset[RecomputeGap]
    schedule: ResidencySchedule
    over_budget: bool
    total_ms: float
    overhead: float

    def better_than(self, other: _Trial) -> bool:
        if self.over_budget != other.over_budget:
            return other.over_budget
        return self.total_ms < other.total_ms - 1e-9


#: Trials (each a full offload placement and replay) one plan may spend on the choice...
MAX_TRIALS = 32
#: ...and ops placed over all trials, so that long traces stay quick to plan (at least 4).
MAX_TRIAL_OPS = 60_000
#: An overhead below this (share of the compute time) leaves nothing worth searching for.
NEGLIGIBLE = 1e-3


def plan_with_recompute(ix: TraceIndex, budget: int, place: Placer) -> ResidencySchedule:
    """Choose recompute gaps by replayed cost and return the best schedule found.

    Args:
        ix: The real trace's index.
        budget: Device bytes for activations.
        place: The offload placer (the timed planner's search).

    Returns:
        The schedule with the lowest simulated time among those tried (offload only
        included), preferring ones whose peak fits the budget.
    """
    gaps = recompute_gaps(ix, budget)
    seen: dict[frozenset[RecomputeGap], _Trial] = {}
    trials = max(4, min(MAX_TRIALS, MAX_TRIAL_OPS // max(1, ix.n)))

    def trial(chosen: frozenset[RecomputeGap]) -> _Trial:
        if chosen not in seen:
            schedule = virtual_plan(ix, sorted(chosen, key=_order), budget, place)
            try:
                result = simulate(ix.trace, schedule, record=False, index=ix)
            except ValueError as error:  # a mapping the replay refuses: never chosen
                logger.debug("recompute trial of %d gaps refused: %s", len(chosen), error)
                seen[chosen] = _Trial(chosen, schedule, True, math.inf, math.inf)
                return seen[chosen]
            logger.debug(
                "recompute trial: %d gaps, overhead %.2f %%, peak/budget %.3f",
                len(chosen),
                100 * result.overhead,
                result.peak_bytes / budget,
            )
            over = result.peak_bytes > budget
            seen[chosen] = _Trial(chosen, schedule, over, result.total_ms, result.overhead)
        return seen[chosen]

    best = trial(frozenset())
    batches: dict[str, list[RecomputeGap]] = defaultdict(list)
    for g in gaps:
        batches[g.kind].append(g)
    order = sorted(batches, key=lambda k: _price(batches[k]))
    kept = []
    for kind in order:  # whole batches, cheapest per byte first
        if _settled(best, seen, trials):
            break
        candidate = trial(best.chosen | frozenset(batches[kind]))
        if candidate.better_than(best):
            best = candidate
            kept.append(kind)
    # Shed the gaps of kept batches that the link hides best (most expensive batch first),
    # then add the gaps of rejected batches that it hides worst.
    moves = [(kind, True) for kind in reversed(kept)]
    moves += [(kind, False) for kind in order if kind not in kept]
    for kind, shed in moves:
        ranked = sorted(batches[kind], key=lambda g: -g.slack if shed else g.slack)
        for share in (2, 4):
            part = frozenset(ranked[: len(ranked) // share])
            if _settled(best, seen, trials) or not part:
                break
            candidate = trial(best.chosen - part if shed else best.chosen | part)
            if candidate.better_than(best):
                best = candidate
                break
    logger.debug(
        "recompute: %d of %d gaps chosen after %d trials, overhead %.1f %%",
        len(best.chosen),
        len(gaps),
        len(seen),
        100 * best.overhead,
    )
    return best.schedule


def _settled(best: _Trial, seen: dict, trials: int) -> bool:
    """No more trials: ``trials`` have run, or nothing is left to win."""
    return len(seen) >= trials or (not best.over_budget and best.overhead < NEGLIGIBLE)


def _order(g: RecomputeGap) -> tuple[int, int, int]:
    return (g.producer, g.sid, g.a)


def _price(gaps: list[RecomputeGap]) -> tuple[float, float]:
    """Milliseconds of recompute per byte freed; longer gaps first among equals."""
    freed = max(1, sum(g.size for g in gaps))
    return (sum(g.cost_ms for g in gaps) / freed, -sum(g.b - g.a for g in gaps) / len(gaps))
