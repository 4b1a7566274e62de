"""What no schedule can beat: a lower bound on the time offloading adds, and feasibility.

Notation (no stall anywhere): op ``i`` starts at ``S_i`` and runs ``d_i`` ms, the step takes
``T``; ``R_i`` is the natural resident bytes during op ``i`` (every storage from the start of
its first access to the end of its last, retained ones to the end); ``B`` the budget; copies
move ``bw`` bytes per ms in each direction.

During op ``i`` at least ``E_i = max(0, R_i - B)`` bytes must be off the device. They can only
be storages alive at ``i`` that op ``i`` does not touch (the *offloadable* set ``O_i``; retained
storages past their last access stay on the device, nobody releases them).

**Out-bound.** A storage is off the device only after its copy out has finished (a copy in
flight still occupies the device), and a copy starts after the op that created the storage.
Take any op ``f``: of the ``E_i`` bytes, at most ``A_f`` (the bytes of ``O_i`` created before
op ``f``) can have started moving before op ``f``; the rest, at least ``E_i - A_f``, moved on
the one D2H stream between the start of ``f`` and the start of ``i``. That window lasts
``S_i - S_f`` plus whatever stall falls inside it, so the stall before op ``i`` is at least
``out_i = max_f (E_i - A_f) / bw_d2h - (S_i - S_f)``. With ``f = 0`` this is the plain
``E_i / bw_d2h - S_i``.

**In-bound.** A storage off the device during op ``j`` is copied back after op ``j`` (a reload
allocates when issued) and before its next reader starts. Take any op ``r > j``: the bytes of
``O_j`` read next at or before ``r`` (all but ``Z_r``, those read later) must be back by the
start of op ``r``, so at least ``E_j - Z_r`` bytes cross the H2D stream between the end of
op ``j`` and the start of op ``r``: the stall after op ``j`` is at least
``in_j = max_r (E_j - Z_r) / bw_h2d - (S_r - S_j - d_j)``.

**Combined.** The stall counted by ``out_i`` lies before op ``i`` starts and the one counted by
``in_j`` after op ``j`` ends, so for ``i <= j`` they are disjoint and add up:
``stall >= max_{i <= j} (max(0, out_i) + max(0, in_j))``. The overhead bound is that over ``T``.
It ignores everything but link throughput and memory, so real schedules sit above it.
"""

from __future__ import annotations

import math

from swapopt_core._planning.ir import ActivationTrace
from swapopt_core._planning.simulate import TraceIndex

__all__ = [
    "feasible",
    "min_feasible_budget",
    "overhead_lower_bound",
    "plain_overhead_lower_bound",
    "stall_lower_bound_ms",
]


def min_feasible_budget(trace: ActivationTrace, *, index: TraceIndex | None = None) -> int:
    """The smallest budget any schedule can keep: the bytes that must be on the device
    during some op (what it touches or creates, plus retained storages it outlived)."""
    ix = index if index is not None else TraceIndex(trace)
    return max((w + r for w, r in zip(ix.working, ix.idle_retained, strict=True)), default=0)


def feasible(trace: ActivationTrace, *, index: TraceIndex | None = None) -> bool:
    """Whether some schedule keeps ``trace`` within its ``memory_limit_bytes``."""
    if trace.memory_limit_bytes is None:
        return True
    return trace.memory_limit_bytes >= min_feasible_budget(trace, index=index)


class _PrefixMax:
    """Bytes at positions ``0..n-1`` and ``max_p (value_p + sign * below_p / bw)`` over the
    positions holding bytes, where ``below_p`` is the bytes strictly below ``p`` (``sign``
    -1) or at and below ``p`` (``sign`` +1). A bottom-up segment tree: ``add`` and ``best``
    take ``O(log n)``, so ``_bounds_per_op`` is ``O((n + accesses) log n)``, not quadratic.
    """

    def __init__(self, values: list[float], sign: int, bw: float) -> None:
        self.size = 1 << max(0, len(values) - 1).bit_length()
        self.values = values
        self.sign, self.bw = sign, bw
        self.bytes = [0] * (2 * self.size)
        self.top = [-math.inf] * (2 * self.size)

    def add(self, position: int, nbytes: int) -> None:
        node = position + self.size
        held = self.bytes[node] + nbytes
        self.bytes[node] = held
        if not held:
            self.top[node] = -math.inf
        elif self.sign > 0:  # the leaf's own bytes count as "at and below"
            self.top[node] = held / self.bw + self.values[position]
        else:
            self.top[node] = self.values[position]
        held_bytes, top, bw, sign = self.bytes, self.top, self.bw, self.sign
        node >>= 1
        while node:  # a parent: the right child's terms shift by the left child's bytes
            left, right = 2 * node, 2 * node + 1
            held_bytes[node] = held_bytes[left] + held_bytes[right]
            top[node] = max(top[left], top[right] + sign * held_bytes[left] / bw)
            node >>= 1

    def best(self) -> float:
        return self.top[1]

    def total(self) -> int:
        return self.bytes[1]


def _bounds_per_op(ix: TraceIndex, budget: int) -> tuple[list[float], list[float]]:
    """``out_i`` and ``in_i`` (ms, clipped at 0; ``inf`` where the budget cannot hold).

    Storage ``s`` is offloadable during op ``i`` when ``i`` lies strictly inside a gap
    between two of its accesses. Sweeping ``i`` forward, a gap's bytes enter two trees
    when it opens and leave when it closes: one keyed by the op that created ``s`` (for
    ``out_i``: ``max_f end_f - A_f / bw``), one keyed by the gap's closing reader (for
    ``in_i``: ``max_r (E_i - Z_r) / bw - window``). Each op with an excess reads both roots.
    """
    trace = ix.trace
    bw_d2h = trace.d2h_bandwidth_gbps * 1e6
    bw_h2d = trace.h2d_bandwidth_gbps * 1e6
    starts, durations = ix.starts, ix.durations
    ends = [s + d for s, d in zip(starts, durations, strict=True)]
    created = _PrefixMax(ends, -1, bw_d2h)  # keyed by creation op: out_i
    readers = _PrefixMax([-s for s in starts], +1, bw_h2d)  # keyed by the next reader: in_i
    opening: list[list[tuple[int, int, int]]] = [[] for _ in range(ix.n + 1)]
    closing: list[list[tuple[int, int, int]]] = [[] for _ in range(ix.n + 1)]
    for sid, accesses in ix.by_storage.items():
        first, size = ix.first[sid], ix.sizes[sid]
        for (a, _), (b, _) in zip(accesses, accesses[1:], strict=False):
            if b > a + 1:  # offloadable during ops a+1 .. b-1
                opening[a + 1].append((first, b, size))
                closing[b].append((first, b, size))
    outs, ins = [0.0] * ix.n, [0.0] * ix.n
    for i in range(ix.n):
        for first, reader, size in closing[i]:
            created.add(first, -size)
            readers.add(reader, -size)
        for first, reader, size in opening[i]:
            created.add(first, size)
            readers.add(reader, size)
        excess = ix.natural[i] - budget
        if excess <= 0:
            continue
        total = created.total()
        if total < excess:
            outs[i] = ins[i] = math.inf
            continue
        # Out: max over creation ops f of (E - bytes created before f) / bw - window.
        outs[i] = max(0.0, excess / bw_d2h - starts[i] + created.best())
        # In: max over readers r of (E - bytes read after r) / bw - window.
        ins[i] = max(0.0, (excess - total) / bw_h2d + ends[i] + readers.best())
    return outs, ins


def stall_lower_bound_ms(trace: ActivationTrace, *, index: TraceIndex | None = None) -> float:
    """The least stall (ms) any schedule adds under ``trace.memory_limit_bytes``.

    ``0`` without a budget or when the natural peak fits; ``inf`` when the budget is
    infeasible. See the module docstring for the derivation.
    """
    ix = index if index is not None else TraceIndex(trace)
    budget = trace.memory_limit_bytes
    if budget is None or ix.natural_peak <= budget:
        return 0.0
    outs, ins = _bounds_per_op(ix, budget)
    best, out_so_far = 0.0, 0.0
    for out, back in zip(outs, ins, strict=True):
        out_so_far = max(out_so_far, out)
        best = max(best, out_so_far + back)
    return best


def overhead_lower_bound(trace: ActivationTrace, *, index: TraceIndex | None = None) -> float:
    """The least ``(total - compute) / compute`` any schedule reaches (see the module
    docstring); ``inf`` when the budget is infeasible."""
    ix = index if index is not None else TraceIndex(trace)
    stall = stall_lower_bound_ms(trace, index=ix)
    return stall / ix.total_ms if ix.total_ms > 0 else 0.0


def plain_overhead_lower_bound(trace: ActivationTrace, *, index: TraceIndex | None = None) -> float:
    """The simpler bound the tighter one refines: ``max(0, max_i out_i, max_i in_i) / T``
    with ``out_i = E_i / bw_d2h - S_i`` and ``in_i = E_i / bw_h2d - (T - S_i - d_i)``.

    Valid but loose: it lets a copy out start before its data exists, lets reloads use
    the whole rest of the step, and takes the larger of the two stalls instead of their
    sum. Reported next to ``overhead_lower_bound`` for comparison.
    """
    ix = index if index is not None else TraceIndex(trace)
    budget = trace.memory_limit_bytes
    if budget is None or ix.total_ms <= 0:
        return 0.0
    bw_d2h = trace.d2h_bandwidth_gbps * 1e6
    bw_h2d = trace.h2d_bandwidth_gbps * 1e6
    total = ix.total_ms
    worst = 0.0
    for resident, start, duration in zip(ix.natural, ix.starts, ix.durations, strict=True):
        excess = resident - budget
        if excess > 0:
            worst = max(
                worst, excess / bw_d2h - start, excess / bw_h2d - (total - start - duration)
            )
    return worst / total
