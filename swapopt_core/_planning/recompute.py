"""Recompute instead of offload: which storages the timed planner regenerates.

A *recompute gap* is a gap ``(a, b)`` of a storage ``s`` (last access ``a``, next reader
``b``) whose producer may run again there (``docs/formats.md``, ``RECOMPUTE``): ``s`` is
released after ``a`` without a host copy and made again right before ``b``, at the price of
the producer's duration (and of the inputs it revives, ``chains.py``) on the compute stream
instead of two copies on the link. A *tail* is the stretch after the last access of a storage
the caller holds longer (``ActivationTrace.freed_after``): released there without a copy, it
never comes back, at no cost. ``chains.py`` places chosen gaps (pulling and reviving the
inputs they need) and turns them into a virtual trace the offload placer plans.

**Choice.** Three searches share one cache of trials, each a full placement replayed by the
simulator, and the plan is the best trial (in budget first, then the shortest simulated
step):

- *Greedy.* Only gaps where the budget binds somewhere inside count, and only those cheaper
  than moving their bytes. They are batched per op kind and gap (the op name with its digits
  ignored and the gap's rank among the storage's gaps, so one batch per layer-independent
  place) and tried cheapest first (milliseconds per byte, longer gaps first among equals); a
  batch stays when the replayed schedule's time falls. Then each kept batch sheds its gaps
  that offloading hides best (largest link slack first, a half, else a quarter) while that
  helps, and each rejected batch is tried again on its gaps the link hides worst. It stops
  early once the overhead is negligible or its trials are spent (``MAX_TRIALS``, fewer on
  long traces).
- *Checkpoint-like choices* (``segments.py``): everything the forward makes and the backward
  reads, recomputed from segment inputs found in the trace, for a few segment sizes. Per-block
  activation checkpointing is one of them, so the planner never ends worse than it.
- *Refinement* of the best checkpoint-like choice: it stops recomputing whole batches of it
  (the costliest per byte first), else halves of one, in passes while that helps
  (``REFINE_TRIALS``).
"""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from swapopt_core._planning.chains import (
    Placer,
    has_tail,
    recover_limits,
    revive_cost,
    virtual_plan,
)
from swapopt_core._planning.ir import ResidencySchedule
from swapopt_core._planning.segments import checkpoint_choices
from swapopt_core._planning.simulate import TraceIndex, simulate

logger = logging.getLogger(__name__)

__all__ = ["RecomputeGap", "plan_with_recompute", "recompute_gaps", "virtual_plan"]


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
        tail: The gap runs from the storage's last access to its death (the caller held it
            past its last access, ``ActivationTrace.freed_after``): released without a copy,
            it never comes back, so nothing is recomputed and ``cost_ms`` is ``0``.
    """

    sid: int
    a: int
    b: int
    producer: int
    cost_ms: float
    size: int
    kind: str
    slack: float
    tail: bool = False


def recompute_gaps(
    ix: TraceIndex, budget: int | None = None, *, everything: bool = False
) -> list[RecomputeGap]:
    """Every gap of every storage where the contract allows a recompute before the reader.

    The storage must be recomputable at ``b`` (``chains.recover_limits``: nothing after its
    producer writes it or an input before ``b``, and each input alive at ``b`` or revived
    there). A storage the caller holds past its last access also gets its *tail* (see
    ``RecomputeGap.tail``) where its inputs are intact at that access. Left out, unless
    ``everything``: gaps whose recompute (the producer and what it revives) costs more than
    moving the bytes out and back (offloading never costs more), and with a ``budget``, gaps
    during which the budget never binds (nothing to win).
    """
    trace = ix.trace
    bw_out, bw_in = trace.d2h_bandwidth_gbps * 1e6, trace.h2d_bandwidth_gbps * 1e6
    over = [0]  # over[i]: ops before op i where the budget binds
    for resident in ix.natural:
        over.append(over[-1] + (budget is not None and resident > budget))
    limits = recover_limits(ix)
    found: list[RecomputeGap] = []
    for sid, producer in ix.producer.items():
        size = ix.sizes[sid]
        cost = ix.durations[producer]
        move = size / bw_out + size / bw_in
        if size <= 0:
            continue
        name = re.sub(r"\d+", "#", trace.ops[producer].name)
        last, end = ix.last[sid], ix.end[sid]
        binds = budget is None or over[end + 1] > over[last + 1] or everything
        if has_tail(ix, sid, limits) and binds:
            kind = f"{name} tail"  # released for good after its last access: free
            found.append(RecomputeGap(sid, last, end, producer, 0.0, size, kind, math.inf, True))
        if cost >= move and not everything:
            continue
        accesses = ix.by_storage[sid]
        pairs = [(a, b) for (a, _), (b, _) in zip(accesses, accesses[1:], strict=False)]
        for k, (a, b) in enumerate((a, b) for a, b in pairs if b - a >= 2):
            if b > limits[sid]:
                continue
            if budget is not None and over[b] == over[a + 1] and not everything:
                continue
            total = cost + revive_cost(ix, sid, b)
            if total >= move and not everything:
                continue
            idle = ix.starts[b] - ix.starts[a] - ix.durations[a]
            slack = idle - move
            kind = f"{name} gap {k}"  # the same gap of the same op in every layer
            found.append(RecomputeGap(sid, a, b, producer, total, size, kind, slack))
    return found


@dataclass
class _Trial:
    chosen: frozenset[RecomputeGap]
    schedule: ResidencySchedule
    peak: float
    over_budget: bool
    total_ms: float
    overhead: float

    def better_than(self, other: _Trial) -> bool:
        if self.over_budget != other.over_budget:
            return other.over_budget
        if self.over_budget:  # neither fits: the lower peak
            return self.peak < other.peak
        return self.total_ms < other.total_ms - 1e-9


#: The trials run so far, by the gaps they recompute.
_Seen = dict[frozenset[RecomputeGap], _Trial]
#: Runs (or looks up) the trial of recomputing a set of gaps.
_TrialFn = Callable[[frozenset[RecomputeGap]], _Trial]

#: Trials (each a full offload placement and replay) one plan may spend on the choice...
MAX_TRIALS = 32
#: ...and ops placed over all trials, so that long traces stay quick to plan (at least 4).
MAX_TRIAL_OPS = 60_000
#: Trials more for improving on the best checkpoint-like choice.
REFINE_TRIALS = 40
#: Cut strides of the checkpoint-like choices (``segments.py``): every cut kept, every
#: second (per block, in a transformer), third, fourth.
STRIDES = (1, 2, 3, 4)
#: An overhead below this (share of the compute time) leaves nothing worth searching for.
NEGLIGIBLE = 1e-3


def plan_with_recompute(ix: TraceIndex, budget: int, place: Placer) -> ResidencySchedule:
    """Choose recompute gaps by replayed cost and return the best schedule found.

    Three searches share one cache of trials: the greedy choice by batches (the module
    docstring), the checkpoint-like choices (``segments.py``), and a refinement of the best
    of those that stops recomputing whole batches of it (the costliest per byte first) while
    that helps.

    Args:
        ix: The real trace's index.
        budget: Device bytes for activations.
        place: The offload placer (the timed planner's search).

    Returns:
        The schedule with the lowest simulated time among those tried (offload only and the
        checkpoint-like choices included), preferring ones whose peak fits the budget (the
        lowest peak when none does).
    """
    gaps = recompute_gaps(ix, budget)
    seen: _Seen = {}
    trials = max(4, min(MAX_TRIALS, MAX_TRIAL_OPS // max(1, ix.n)))

    def trial(chosen: frozenset[RecomputeGap]) -> _Trial:
        if chosen not in seen:
            ordered: list[RecomputeGap] = sorted(chosen, key=_order)
            schedule = virtual_plan(ix, ordered, budget, place)
            try:
                result = simulate(ix.trace, schedule, record=False, index=ix)
            except ValueError as error:  # a mapping the replay refuses: never chosen
                logger.debug("recompute trial of %d gaps refused: %s", len(chosen), error)
                refused = _Trial(chosen, schedule, math.inf, True, math.inf, math.inf)
                seen[chosen] = refused
                return refused
            logger.debug(
                "recompute trial: %d gaps, overhead %.2f %%, peak/budget %.3f",
                len(chosen),
                100 * result.overhead,
                result.peak_bytes / budget,
            )
            over = result.peak_bytes > budget
            seen[chosen] = _Trial(
                chosen, schedule, result.peak_bytes, over, result.total_ms, result.overhead
            )
        return seen[chosen]

    best = greedy = _greedy(gaps, trial, seen, trials)
    if not _settled(best, seen, math.inf):
        every = recompute_gaps(ix, everything=True)
        choices = [trial(frozenset(checkpoint_choices(ix, every, s))) for s in STRIDES]
        checkpointed = choices[0]
        for candidate in choices[1:]:
            if candidate.better_than(checkpointed):
                checkpointed = candidate
        refined = _refine(checkpointed, every, trial, seen, len(seen) + REFINE_TRIALS)
        if refined.better_than(best):
            best = refined
    logger.debug(
        "recompute: %d gaps chosen after %d trials, overhead %.1f %%%s",
        len(best.chosen),
        len(seen),
        100 * best.overhead,
        "" if best is greedy else " (from a checkpoint-like choice)",
    )
    return best.schedule


def _batches(gaps: list[RecomputeGap]) -> dict[str, list[RecomputeGap]]:
    batches: dict[str, list[RecomputeGap]] = defaultdict(list)
    for g in gaps:
        batches[g.kind].append(g)
    return batches


def _greedy(gaps: list[RecomputeGap], trial: _TrialFn, seen: _Seen, trials: int) -> _Trial:
    """Batches added cheapest per byte first, then partly shed or added (module docstring)."""
    best = trial(frozenset())
    batches = _batches(gaps)
    order = sorted(batches, key=lambda k: _price(batches[k]))
    kept: list[str] = []
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
    return best


def _refine(
    best: _Trial, gaps: list[RecomputeGap], trial: _TrialFn, seen: _Seen, trials: int
) -> _Trial:
    """Improve ``best`` batch by batch of ``gaps``: stop recomputing a batch it recomputes
    (the costliest per byte first; all of it, else the half the link hides best), then start
    recomputing the rest of one (the cheapest first; all, else the half the link hides
    worst), keeping each move that helps, in passes while one does."""
    improved = True
    while improved and not _settled(best, seen, trials):
        improved = False
        kept = _batches([g for g in gaps if g in best.chosen])
        left = _batches([g for g in gaps if g not in best.chosen])
        moves = [(kept[k], True) for k in sorted(kept, key=lambda k: -_price(kept[k])[0])]
        moves += [(left[k], False) for k in sorted(left, key=lambda k: _price(left[k]))]
        for batch, shed in moves:
            ranked = sorted(batch, key=lambda g: -g.slack if shed else g.slack)
            for part in (ranked, ranked[: len(ranked) // 2]):
                if _settled(best, seen, trials) or not part:
                    break
                change = frozenset(part)
                candidate = trial(best.chosen - change if shed else best.chosen | change)
                if candidate.better_than(best):
                    best, improved = candidate, True
                    break
    return best


def _settled(best: _Trial, seen: _Seen, trials: float) -> bool:
    """No more trials: ``trials`` have run, or nothing is left to win."""
    return len(seen) >= trials or (not best.over_budget and best.overhead < NEGLIGIBLE)


def _order(g: RecomputeGap) -> tuple[int, int, int]:
    return (g.producer, g.sid, g.a)


def _price(gaps: list[RecomputeGap]) -> tuple[float, float]:
    """Milliseconds of recompute per byte freed; longer gaps first among equals."""
    freed = max(1, sum(g.size for g in gaps))
    return (sum(g.cost_ms for g in gaps) / freed, -sum(g.b - g.a for g in gaps) / len(gaps))
