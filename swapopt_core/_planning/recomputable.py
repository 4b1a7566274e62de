"""When the simulator may make a storage again by re-running its producer.

The rule **Recomputable** of ``simulate.py``'s contract, which states it. The ``Machine``
asks; the rule reads only the trace's index and what the machine tells it: the last op that
has run, the storages that died and those whose recipe is live.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Container

from swapopt_core._planning.index import TraceIndex

__all__ = ["needed_until", "recomputable"]


def recomputable(
    ix: TraceIndex,
    sid: int,
    *,
    done: int,
    dead: Container[int],
    recipes: Container[int],
    upto: int | None = None,
) -> bool:
    """Whether re-running ``sid``'s producer gives its bytes now (``upto=None``), or at any
    point until op ``upto`` starts its successor (what a release needs: nothing may spoil
    the recipe before the storage is read again).

    Args:
        ix: The trace's index.
        sid: The storage.
        done: The last op that has run (``-1`` before the first).
        dead: The storages that have died.
        recipes: The storages whose recipe is live (it keeps the producer's inputs alive).
        upto: The last op the storage must stay recomputable through; ``None`` for now.
    """
    op = ix.producer.get(sid)
    if op is None or op > done or sid in dead:
        return False
    until = done if upto is None else upto
    if _written(ix, sid, op, until):
        return False
    held = sid in recipes  # its recipe keeps the inputs alive
    for x in ix.recompute_inputs[sid]:
        if x in dead or _written(ix, x, op, until):
            return False
        if upto is not None and not held and x not in ix.retained and ix.end[x] <= upto:
            return False  # freed before the storage is needed again
    return True


def needed_until(ix: TraceIndex, sid: int, done: int) -> int:
    """The op before the next access of ``sid`` after op ``done`` (the last op for a kept
    output; ``done`` itself for a storage past its last access that only recipes hold)."""
    ops = [op for op, _ in ix.by_storage.get(sid, ())]
    k = bisect_right(ops, done)
    if k < len(ops):
        return ops[k] - 1
    return ix.n - 1 if sid in ix.retained else done


def _written(ix: TraceIndex, sid: int, after: int, upto: int) -> bool:
    """Whether an op in ``after+1 .. upto`` writes ``sid``."""
    ops = ix.writes.get(sid, ())
    return bisect_right(ops, upto) > bisect_right(ops, after)
