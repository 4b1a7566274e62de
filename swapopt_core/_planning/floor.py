"""Feasibility: the smallest budget any schedule can keep, why, and sizes for messages."""

from __future__ import annotations

from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.ir import ActivationTrace

__all__ = ["feasible", "floor_reason", "format_bytes", "min_feasible_budget", "retained_bytes"]


def retained_bytes(ix: TraceIndex) -> int:
    """Bytes of the retained storages the step creates: all on the device at its end."""
    return sum(ix.sizes[sid] for sid in ix.retained if sid in ix.first)


def min_feasible_budget(trace: ActivationTrace, *, index: TraceIndex | None = None) -> int:
    """The smallest budget any schedule can keep: the bytes some op touches or creates by
    itself, or the retained storages, which are all on the device when the step ends."""
    ix = index if index is not None else TraceIndex(trace)
    return max(max(ix.working, default=0), retained_bytes(ix))


def feasible(trace: ActivationTrace, *, index: TraceIndex | None = None) -> bool:
    """Whether some schedule keeps ``trace`` within its ``memory_limit_bytes``."""
    if trace.memory_limit_bytes is None:
        return True
    return trace.memory_limit_bytes >= min_feasible_budget(trace, index=index)


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1: ``512 B``, ``7.5 KiB``,
    ``43.4 MiB``, ``1.20 GiB`` (never ``0.0 MiB`` for a few bytes)."""
    if abs(nbytes) < 1024:
        return f"{int(nbytes)} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:,.2f} {unit}" if value < 10 else f"{value:,.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def floor_reason(trace: ActivationTrace, *, index: TraceIndex | None = None) -> str:
    """Why no schedule fits under ``min_feasible_budget``: the op that touches the most bytes
    by itself (index, name, its storages), or the retained storages when they weigh more.

    A sentence fragment for a warning, e.g. ``"op 12 (mm.default) reads and writes 43.4 MiB
    of activations by itself (3 storages, the largest 40.0 MiB)"``.
    """
    ix = index if index is not None else TraceIndex(trace)
    kept = retained_bytes(ix)
    op = max(range(ix.n), key=ix.working.__getitem__, default=None)
    if op is None or kept > ix.working[op]:
        count = sum(1 for sid in ix.retained if sid in ix.first)
        return (
            f"the {count} retained storage{'s' if count != 1 else ''} (outputs kept after the "
            f"step) need {format_bytes(kept)} on the device together when the step ends"
        )
    own = sorted((ix.sizes[sid] for sid, _ in ix.accesses[op]), reverse=True)
    largest = f", the largest {format_bytes(own[0])}" if len(own) > 1 else ""
    return (
        f"op {op} ({trace.ops[op].name}) reads and writes {format_bytes(ix.working[op])} of "
        f"activations by itself ({len(own)} storage{'s' if len(own) != 1 else ''}{largest})"
    )
