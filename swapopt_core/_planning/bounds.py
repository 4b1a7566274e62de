"""What no schedule can beat: a lower bound on the time residency actions add. Feasibility
(the smallest budget any schedule keeps) is in ``floor.py`` and re-exported here.

Notation (no stall anywhere): op ``i`` starts at ``S_i`` and runs ``d_i`` ms, the step takes
``T`` (``S_n = T`` stands for the end of the step); ``R_i`` is the natural resident bytes
during op ``i`` (every storage from the start of its first access to the end of its last,
retained ones to the end); ``B`` the budget; copies move ``bw`` bytes per ms in each
direction.

During op ``i`` at least ``E_i = max(0, R_i - B)`` bytes must be off the device. They can only
be storages alive at ``i`` that op ``i`` does not touch: the *offloadable* set ``O_i``. A
storage in ``O_i`` is back on the device before its next reader; a retained storage (a kept
output) after its last access has the end of the step as its reader: the step is over only
when every retained storage is on the device again.

**Feasibility.** With time unlimited, a schedule can keep on the device only what each op
touches (release everything else before it, bring back what it reads) and, at the end, the
retained storages. So the smallest budget is ``max(max_i W_i, K)``, ``W_i`` op ``i``'s own
bytes and ``K`` the retained bytes; below it no schedule exists.

**Out-bound.** A storage is off the device only after its copy out has finished (a copy in
flight still occupies the device), and a copy starts after the op that created the storage.
Say ``y`` bytes of ``O_i`` leave over the link for op ``i``. Take any op ``f``: at most ``A_f``
of them (the bytes of ``O_i`` created before op ``f``) existed before ``f``; the rest, at least
``y - A_f``, were created by op ``f`` or later and crossed the one D2H stream between the end
of ``f`` and the start of ``i``. That window lasts ``S_i - S_f - d_f`` plus whatever stall
falls inside it, so the stall before op ``i`` is at least
``out_i(y) = max_f (y - A_f) / bw_d2h - (S_i - S_f - d_f)``.

**In-bound.** A storage off the device during op ``j`` is copied back after op ``j`` (a reload
allocates when issued) and before its next reader starts. Take any reader ``r > j`` (``r = n``
for the end): the moved bytes read next at or before ``r`` (all but ``Z_r``, the bytes of
``O_j`` read later) must be back by the start of ``r``, so at least ``y - Z_r`` bytes cross
the H2D stream between the end of op ``j`` and the start of ``r``: the stall after op ``j`` is
at least ``in_j(y) = max_r (y - Z_r) / bw_h2d - (S_r - S_j - d_j)``.

**Recomputation.** A storage whose producer (the op that created it) is marked ``recompute``
can also leave the device without a copy and be made again by re-running its producer: no
link time, but the compute stream spends ``d_producer``, and that is stall. It is made again
after the op it was away for and before its reader, so for op ``i`` that time lies after op
``i`` ends, where the reloads of the in-bound run too. Only storages recomputable after op
``i`` count (``P_i``: neither they nor their producer's inputs written since the producer,
each input still alive or itself recomputable then; the cost of making a dead input again is
left out, which keeps the bound below any schedule). If ``x`` of the ``E_i`` bytes come back
by recomputation, the recompute time is at least ``C_i(x)``, the cheapest way to pick ``x``
bytes of ``P_i`` counting a fraction of a storage at its share of the cost (a fractional
knapsack: cheapest milliseconds per byte first, a lower bound on any whole choice). The
other ``E_i - x`` bytes use the link. Copies in and recomputes overlap (other streams), so
after op ``i`` the stall is at least the larger of the two, and before op ``i`` at least the
out-bound::

    stall >= min over 0 <= x <= min(E_i, |P_i|) of
             out_i(E_i - x) + max(in_i(E_i - x), C_i(x))

``out_i`` and ``in_i`` are affine in their argument before the clip at ``0`` and ``C_i`` is
convex, so the function of ``x`` is convex. It decreases until the recompute time meets the
reload time (``x*``: ``C_i(x) = in_i(E_i - x)``), then changes by ``rho(x) - 1/bw_d2h`` per
byte while the out-bound is positive (``rho`` the marginal milliseconds per byte) and by
``rho(x)`` after: the minimum is at ``max(x*, min(x_out, x_rho))`` clipped to the range, with
``x_out`` where the out-bound reaches ``0`` and ``x_rho`` the bytes of ``P_i`` cheaper to
recompute than to send out. A tree over ``P_i`` ordered by cost per byte answers ``C_i``,
``x*`` and ``x_rho`` in ``O(log n)``.

**Combined.** The stall counted by an out-bound lies before op ``i`` starts and the one after
op ``j`` (reloads and recomputes) after it ends, so for ``i < j`` they are disjoint and add up,
each at its own best split: ``stall >= max_{i < j} (min_x out_i + min_x max(in_j, C_j))``; for
``i = j`` the split is shared (the formula above). With no recomputable storage ``x = 0`` and
this is ``max_{i <= j} (out_i(E_i) + in_j(E_j))``, the offload-only bound
(``recompute=False`` gives it on any trace). The overhead bound is that over ``T``. It ignores
everything but link throughput, compute time spent recomputing and memory, so real schedules
sit above it.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right

from swapopt_core._planning.floor import (
    feasible,
    floor_reason,
    format_bytes,
    min_feasible_budget,
    retained_bytes,
)
from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.ir import ActivationTrace

__all__ = [
    "feasible",
    "floor_reason",
    "format_bytes",
    "min_feasible_budget",
    "overhead_lower_bound",
    "plain_overhead_lower_bound",
    "stall_lower_bound_ms",
]


class _PrefixMax:
    """Bytes at positions ``0..n-1`` and ``max_p (value_p + sign * below_p / bw)`` over the
    positions holding bytes, where ``below_p`` is the bytes strictly below ``p`` (``sign``
    -1) or at and below ``p`` (``sign`` +1). A bottom-up segment tree: ``add`` and ``best``
    take ``O(log n)``, so the sweep is ``O((n + accesses) log n)``, not quadratic.
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


class _Knapsack:
    """The recomputable storages present now, cheapest milliseconds per byte first.

    Each storage has a fixed rank (by cost per byte); two Fenwick trees over the ranks hold
    the bytes and the milliseconds present, so adding, removing and the three questions the
    bound asks (the cost of the cheapest ``x`` bytes, where that cost meets a falling line,
    the bytes cheaper than a rate) take ``O(log n)``.
    """

    def __init__(self, items: list[tuple[float, int]]) -> None:
        self.cost = [c for c, _ in items]  # (ms, bytes) per rank, by ms per byte ascending
        self.size = [s for _, s in items]
        self.rate = [c / s for c, s in items]
        self.n = len(items)
        self.top = 1 << max(0, self.n).bit_length()
        self.tree_bytes = [0] * (self.n + 1)
        self.tree_cost = [0.0] * (self.n + 1)
        self.total = 0

    def add(self, rank: int, sign: int) -> None:
        nbytes, cost = sign * self.size[rank], sign * self.cost[rank]
        self.total += nbytes
        k = rank + 1
        while k <= self.n:
            self.tree_bytes[k] += nbytes
            self.tree_cost[k] += cost
            k += k & -k

    def _descend(self, target: float, per_byte: float) -> float:
        """The bytes ``x`` at which ``C(x) + per_byte * x`` reaches ``target`` (capped at
        everything present), ``C(x)`` the cheapest cost of ``x`` bytes."""
        pos, got_bytes, got_key = 0, 0, 0.0
        step = self.top
        while step:
            nxt = pos + step
            if nxt <= self.n:
                key = got_key + self.tree_cost[nxt] + per_byte * self.tree_bytes[nxt]
                if key <= target:
                    pos, got_key = nxt, key
                    got_bytes += self.tree_bytes[nxt]
            step >>= 1
        if pos >= self.n:  # everything present fits under the target
            return float(got_bytes)
        size = self.size[pos]  # present: an absent rank adds nothing and was passed over
        slope = self.cost[pos] + per_byte * size
        return got_bytes + size * min(1.0, (target - got_key) / slope)

    def cost_of(self, x: float) -> float:
        """The least milliseconds recomputing ``x`` bytes takes (fractions at their share)."""
        if x <= 0:
            return 0.0
        pos, got_bytes, got_cost = 0, 0, 0.0
        step = self.top
        while step:
            nxt = pos + step
            if nxt <= self.n and got_bytes + self.tree_bytes[nxt] <= x:
                pos = nxt
                got_bytes += self.tree_bytes[nxt]
                got_cost += self.tree_cost[nxt]
            step >>= 1
        if pos >= self.n or got_bytes >= x:
            return got_cost
        return got_cost + (x - got_bytes) * self.rate[pos]

    def meets(self, level: float, per_byte: float) -> float:
        """The bytes ``x`` where ``C(x)`` meets the line ``level - per_byte * x``."""
        return self._descend(level, per_byte) if level > 0 else 0.0

    def cheaper_than(self, rate: float) -> int:
        """Bytes present whose cost per byte is below ``rate``."""
        k, got = bisect_left(self.rate, rate), 0
        while k > 0:
            got += self.tree_bytes[k]
            k -= k & -k
        return got


def _recompute_cuts(ix: TraceIndex) -> dict[int, tuple[int, int]]:
    """``sid -> (producer, cut)`` for storages an op marked ``recompute`` created: the storage
    can be made again after op ``i`` only for ``i < cut`` (no write to it or to an input of its
    producer up to ``i``, every input still alive after ``i`` or itself made again then: a
    replay's recipe holds its inputs, ``chains.py``)."""
    n = ix.n

    def next_write(sid: int, after: int) -> int:
        writes = ix.writes[sid]
        k = bisect_right(writes, after)
        return writes[k] if k < len(writes) else n + 1

    cuts: dict[int, tuple[int, int]] = {}
    for sid in sorted(ix.producer, key=lambda s: (ix.producer[s], s)):  # inputs first
        producer = ix.producer[sid]
        cut = next_write(sid, producer)
        for other in ix.recompute_inputs[sid]:
            cut = min(cut, next_write(other, producer))
            if other not in ix.retained:
                alive = ix.end[other] + 1
                cut = min(cut, max(alive, cuts.get(other, (0, alive))[1]))
        cuts[sid] = (producer, cut)
    return {sid: cut for sid, cut in cuts.items() if ix.sizes[sid] > 0}


def _sweep(ix: TraceIndex, budget: int, recompute: bool) -> tuple[list[float], ...]:
    """Per op: the least stall before it, the least after it, and the least of both for its
    best shared split (ms, clipped at 0; ``inf`` where the budget cannot hold).

    Storage ``s`` is offloadable during op ``i`` when ``i`` lies strictly inside a gap
    between two of its accesses (or after the last access of a retained storage, the end
    being its reader). Sweeping ``i`` forward, a gap's bytes enter two trees when it opens
    and leave when it closes: one keyed by the op that created ``s`` (for ``out_i``:
    ``max_f end_f - A_f / bw``), one keyed by the gap's closing reader (for ``in_i``:
    ``max_r (E_i - Z_r) / bw - window``); the part of the gap where ``s`` can be recomputed
    enters the knapsack. Each op with an excess reads the roots.
    """
    trace, n = ix.trace, ix.n
    bw_d2h = trace.d2h_bandwidth_gbps * 1e6
    bw_h2d = trace.h2d_bandwidth_gbps * 1e6
    starts = [*ix.starts, ix.total_ms]  # S_n: the end of the step
    ends = [s + d for s, d in zip(ix.starts, ix.durations, strict=True)]
    created = _PrefixMax(ends, -1, bw_d2h)  # keyed by creation op: out_i
    readers = _PrefixMax([-s for s in starts], +1, bw_h2d)  # keyed by the next reader: in_i
    cuts = _recompute_cuts(ix) if recompute else {}
    # Held past its last access (``freed_after``): released then, it never comes back, so
    # it needs no reader; with its recipe intact it leaves at no cost at all.
    tails = {
        sid: (ix.last[sid], ix.end[sid] + 1)
        for sid in ix.by_storage
        if sid not in ix.retained and ix.end[sid] > ix.last[sid]
    }
    items = [(ix.durations[cuts[sid][0]], ix.sizes[sid], sid, False) for sid in cuts]
    items += [
        (0.0, ix.sizes[sid], sid, True) for sid in tails if cuts.get(sid, (0, 0))[1] > ix.last[sid]
    ]
    items.sort(key=lambda item: (item[0] / max(item[1], 1), item[2], item[3]))
    rank = {(sid, tail): r for r, (_, _, sid, tail) in enumerate(items)}
    knapsack = _Knapsack([(cost, size) for cost, size, _, _ in items])
    opening: list[list[tuple[int, int | None, int]]] = [[] for _ in range(n + 1)]
    closing: list[list[tuple[int, int | None, int]]] = [[] for _ in range(n + 1)]
    knap_events: list[list[tuple[int, int]]] = [[] for _ in range(n + 1)]
    for sid, accesses in ix.by_storage.items():
        first, size = ix.first[sid], ix.sizes[sid]
        ops = [op for op, _ in accesses]
        if sid in ix.retained:
            ops.append(n)  # kept outputs are back by the end
        for a, b in zip(ops, ops[1:], strict=False):
            if b <= a + 1:
                continue  # offloadable during ops a+1 .. b-1
            opening[a + 1].append((first, b, size))
            closing[b].append((first, b, size))
            if (sid, False) in rank and min(b, cuts[sid][1]) > a + 1:
                knap_events[a + 1].append((rank[sid, False], 1))
                knap_events[min(b, cuts[sid][1])].append((rank[sid, False], -1))
        if sid in tails:  # offloadable during ops a+1 .. b-1, never read again
            a, b = tails[sid]
            opening[a + 1].append((first, None, size))
            closing[b].append((first, None, size))
            if (sid, True) in rank:
                knap_events[a + 1].append((rank[sid, True], 1))
                knap_events[b].append((rank[sid, True], -1))
    outs, backs, alone = [0.0] * n, [0.0] * n, [0.0] * n
    for i in range(n):
        for first, reader, size in closing[i]:
            created.add(first, -size)
            if reader is not None:
                readers.add(reader, -size)
        for first, reader, size in opening[i]:
            created.add(first, size)
            if reader is not None:
                readers.add(reader, size)
        for r, sign in knap_events[i]:
            knapsack.add(r, sign)
        excess = ix.natural[i] - budget
        if excess <= 0:
            continue
        total = created.total()
        if total < excess:
            outs[i] = backs[i] = alone[i] = math.inf
            continue
        # Out: max over creation ops f of (E - bytes created before f) / bw - window.
        out = excess / bw_d2h - starts[i] + created.best()
        # In: max over readers r of (E - bytes read after r) / bw - window.
        back = (excess - total) / bw_h2d + ends[i] + readers.best()
        if knapsack.total <= 0:
            outs[i], backs[i] = max(0.0, out), max(0.0, back)
            alone[i] = outs[i] + backs[i]
            continue
        cap = min(excess, knapsack.total)  # bytes that can come back by recomputation
        meet = min(knapsack.meets(back, 1 / bw_h2d), cap)
        backs[i] = max(0.0, back - meet / bw_h2d, knapsack.cost_of(meet))
        outs[i] = max(0.0, out - cap / bw_d2h)
        x = max(meet, min(out * bw_d2h, knapsack.cheaper_than(1 / bw_d2h)))
        x = min(max(x, 0.0), cap)
        alone[i] = max(0.0, out - x / bw_d2h) + max(0.0, back - x / bw_h2d, knapsack.cost_of(x))
    return outs, backs, alone


def stall_lower_bound_ms(
    trace: ActivationTrace, *, index: TraceIndex | None = None, recompute: bool = True
) -> float:
    """The least stall (ms) any schedule adds under ``trace.memory_limit_bytes``.

    Args:
        trace: The step and its budget.
        index: A ``TraceIndex`` of ``trace`` built earlier, to save rebuilding it.
        recompute: Let storages of ops marked ``recompute`` be made again instead of copied
            (the bound for schedules with ``RECOMPUTE``); ``False`` bounds offload-only
            schedules.

    Returns:
        ``0`` without a budget or when the natural peak fits; ``inf`` when the budget is
        infeasible. See the module docstring for the derivation.
    """
    ix = index if index is not None else TraceIndex(trace)
    budget = trace.memory_limit_bytes
    if budget is None or ix.natural_peak <= budget:
        return 0.0
    if retained_bytes(ix) > budget:
        return math.inf
    outs, backs, alone = _sweep(ix, budget, recompute)
    best, out_before = max(alone, default=0.0), 0.0
    for out, back in zip(outs, backs, strict=True):
        best = max(best, out_before + back)  # an earlier op's out-stall, this op's after it
        out_before = max(out_before, out)
    return best


def overhead_lower_bound(
    trace: ActivationTrace, *, index: TraceIndex | None = None, recompute: bool = True
) -> float:
    """The least ``(total - compute) / compute`` any schedule reaches (see the module
    docstring and ``stall_lower_bound_ms``); ``inf`` when the budget is infeasible."""
    ix = index if index is not None else TraceIndex(trace)
    stall = stall_lower_bound_ms(trace, index=ix, recompute=recompute)
    return stall / ix.total_ms if ix.total_ms > 0 else 0.0


def plain_overhead_lower_bound(trace: ActivationTrace, *, index: TraceIndex | None = None) -> float:
    """The simpler offload-only bound the tighter one refines:
    ``max(0, max_i out_i, max_i in_i) / T`` with ``out_i = E_i / bw_d2h - S_i`` and
    ``in_i = E_i / bw_h2d - (T - S_i - d_i)``.

    Valid for schedules without ``RECOMPUTE`` but loose: it lets a copy out start before its
    data exists, lets reloads use the whole rest of the step, and takes the larger of the two
    stalls instead of their sum. Reported next to ``overhead_lower_bound`` for comparison.
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
