"""Checkpoint-like recompute plans, found from the trace alone.

Activation checkpointing keeps the input of each segment of the forward (a transformer
block, say) and runs the rest of the segment again before its backward. In the terms of
``recompute.py`` that is one particular choice of recompute gaps: every storage the forward
makes and the backward reads is recomputed across the turn from forward to backward, except
the segments' inputs, and the chains (``chains.py``) regenerate each segment from its input.
The planner tries such choices next to its own search, so it never ends worse than them.

**Segments.** The *turn* is the op where the natural residency peaks (the end of the
forward). Before it, a *cut* is a storage that alone carries the forward from the ops before
it to the ops after it: at some op, it is the only large storage made earlier and read later
before the turn (the residual stream between two blocks, and in the middle of one), and the
backward reads it too (else there is nothing to keep). Of the outputs of one op only the largest
is recomputed (the others, a norm's statistics, stay: each recompute runs the op). Storages
smaller than a sixteenth of the largest one crossing there (masks, position tables, norm
statistics) do not break a cut. Keeping every cut gives the finest segments; keeping every
``k``-th gives coarser ones, down to per-block checkpointing and beyond.
"""

from __future__ import annotations

from collections.abc import Sequence

from swapopt_core._planning.index import TraceIndex

__all__ = ["checkpoint_choices", "cuts", "turn"]

#: Storages under this share of the largest one crossing an op do not break a cut.
SMALL = 1 / 16


def turn(ix: TraceIndex) -> int:
    """The op where the natural residency peaks: where the forward turns into backward."""
    return ix.natural.index(ix.natural_peak) if ix.n else 0


def cuts(ix: TraceIndex, at: int | None = None) -> list[int]:
    """The cut storages of the forward (before op ``at``, default the turn), in order."""
    end = turn(ix) if at is None else at
    reads: dict[int, int] = {}  # storage -> its last access before the turn
    for sid, accesses in ix.by_storage.items():
        before = [op for op, _ in accesses if op < end]
        if before and before[-1] > ix.first[sid]:
            reads[sid] = before[-1]
    opens: list[list[int]] = [[] for _ in range(end + 1)]
    closes: list[list[int]] = [[] for _ in range(end + 1)]
    for sid, last in reads.items():
        opens[ix.first[sid] + 1].append(sid)  # crosses from after its producer ...
        closes[last].append(sid)  # ... to its last reader before the turn
    crossing: set[int] = set()
    found: list[int] = []
    for i in range(end):
        crossing.update(opens[i])
        if crossing:
            largest = max(ix.sizes[s] for s in crossing)
            large = [s for s in crossing if ix.sizes[s] >= SMALL * largest]
            cut = large[0] if len(large) == 1 else None
            if cut is not None and ix.last[cut] >= end and (not found or found[-1] != cut):
                found.append(cut)  # the backward reads it: keeping it keeps something
        crossing.difference_update(closes[i])
    return found


def checkpoint_choices(ix: TraceIndex, gaps: Sequence, every: int) -> list:
    """The gaps that checkpointing with every ``every``-th cut kept would recompute.

    Args:
        ix: The trace's index.
        gaps: Candidate recompute gaps (``recompute.recompute_gaps(..., everything=True)``).
        every: Keep every ``every``-th cut (1: all of them).

    Returns:
        The gaps of ``gaps`` that span the turn, of storages made before it, except the
        kept cuts.
    """
    end = turn(ix)
    kept = set(cuts(ix, end)[::every])
    largest: dict[int, int] = {}  # producer -> its largest output: the one recomputed
    for sid, producer in ix.producer.items():
        if ix.sizes[sid] > ix.sizes.get(largest.get(producer, -1), -1):
            largest[producer] = sid
    return [
        g
        for g in gaps
        if g.sid not in kept
        and g.a < end <= g.b
        and ix.first[g.sid] < end
        and largest[g.producer] == g.sid
    ]
