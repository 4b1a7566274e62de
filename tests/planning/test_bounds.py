"""The overhead lower bound: hand-computed cases, a brute-force reference, and validity
against many schedules replayed by the simulator (offload, kept outputs moved and brought
back by the end, recomputation). The floor has its own tests in ``test_floor.py``."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swapopt_core._planning.bounds import (
    _sweep,
    feasible,
    overhead_lower_bound,
    stall_lower_bound_ms,
)
from swapopt_core._planning.ir import ActivationTrace
from swapopt_core._planning.simulate import TraceIndex, simulate
from swapopt_core._planning.timed import TimedPlanner
from tests.planning.bound_cases import (
    MB,
    RECOMPUTE,
    RELEASE,
    any_size,
    floor_schedule,
    long_gap,
    make_trace,
    random_schedule,
    random_trace,
    schedule,
)

# (trace, expected stall in ms): each is also reached by the planner, so the bound is tight.
CASES = {
    # Op 1 needs storage 1 away, but its copy can only start when op 0 ends: 1 ms out.
    "out": (long_gap({1: {2: "W"}, 2: {2: "R"}}, {2: MB}, MB), 1.0),
    # Op 4 needs it away and op 5 reads it: the reload cannot start before op 4 ends.
    "in": (long_gap({3: {2: "W"}, 4: {2: "R"}}, {2: MB}, MB), 1.0),
    # Both, at different ops: the two stalls do not overlap and add up.
    "both": (long_gap({1: {2: "W"}, 4: {3: "W"}}, {2: MB, 3: MB}, MB), 2.0),
    # Nothing forces a stall: the gap is long enough both ways.
    "free": (long_gap({2: {2: "W"}, 3: {2: "R"}}, {2: MB}, MB), 0.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hand_computed_bounds_and_the_planner_reaches_them(name):
    trace, stall = CASES[name]
    assert stall_lower_bound_ms(trace) == pytest.approx(stall)
    assert overhead_lower_bound(trace) == pytest.approx(stall / 6)
    result = simulate(trace, TimedPlanner().plan(any_size(trace)))
    assert result.peak_bytes <= trace.memory_limit_bytes
    assert result.stall_ms == pytest.approx(stall)


def test_a_late_producer_tightens_the_plain_bound():
    # At op 4 two storages (2 MB) must be away; storage 2 only exists after op 3 ends, so
    # 1 MB has to cross the link between the end of op 3 and the start of op 4. The plain
    # bound (2 MB / bw - S_4 = -2 ms) sees nothing.
    ops = [{1: "W"}, {}, {}, {2: "W"}, {3: "W"}, {}, {}, {}, {}, {1: "R", 2: "R"}]
    trace = make_trace(ops, {1: MB, 2: MB, 3: 2 * MB}, limit=2 * MB)
    assert stall_lower_bound_ms(trace) == pytest.approx(1.0)
    result = simulate(trace, TimedPlanner().plan(any_size(trace)))
    assert result.stall_ms == pytest.approx(1.0)
    assert result.peak_bytes <= 2 * MB


def test_no_budget_or_a_fitting_budget_costs_nothing():
    trace, _ = CASES["out"]
    assert overhead_lower_bound(trace.with_limit(None)) == 0.0
    assert overhead_lower_bound(trace.with_limit(2 * MB)) == 0.0


# ---- recomputation ----------------------------------------------------------------------------


def test_recomputing_a_cheap_storage_beats_the_link_and_is_reached():
    # The "out" case with op 0 marked recompute and lasting 0.25 ms: releasing storage 1
    # without a copy before op 1 and making it again before op 5 costs 0.25 ms, not 1 ms.
    trace = long_gap({1: {2: "W"}, 2: {2: "R"}}, {2: MB}, MB, ms=[0.25] + [1.0] * 5, pure={0})
    assert stall_lower_bound_ms(trace, recompute=False) == pytest.approx(1.0)
    assert stall_lower_bound_ms(trace) == pytest.approx(0.25)
    plan = schedule(pre=[(1, 1, RELEASE), (5, 1, RECOMPUTE)])
    result = simulate(trace, plan)
    assert (result.recomputes, result.peak_bytes) == (1, MB)
    assert result.stall_ms == pytest.approx(0.25)


def test_an_expensive_producer_leaves_the_link_bound():
    # Recomputing would cost 3 ms: the link's 1 ms stays the bound.
    trace = long_gap({1: {2: "W"}, 2: {2: "R"}}, {2: MB}, MB, ms=[3.0] + [1.0] * 5, pure={0})
    assert stall_lower_bound_ms(trace) == pytest.approx(1.0)


def test_recompute_and_reload_overlap_after_the_op():
    # The "in" case (reload after op 4, before op 5) with storage 1 worth 0.5 ms to make
    # again: the recompute and the reload share the window after op 4 (they overlap), so
    # the bound takes the split where both last as long: x / 1 MB * 0.5 ms = (1 MB - x) / bw,
    # x = 2/3 MB, 1/3 ms.
    trace = long_gap({3: {2: "W"}, 4: {2: "R"}}, {2: MB}, MB, ms=[0.5] + [1.0] * 5, pure={0})
    assert stall_lower_bound_ms(trace, recompute=False) == pytest.approx(1.0)
    assert stall_lower_bound_ms(trace) == pytest.approx(1 / 3)
    # A whole storage is either copied or recomputed: the real schedule pays 0.5 ms.
    plan = schedule(pre=[(1, 1, RELEASE), (5, 1, RECOMPUTE)])
    assert simulate(trace, plan).stall_ms == pytest.approx(0.5)


def test_a_storage_whose_input_is_gone_cannot_be_recomputed():
    # Storage 2 is made by op 1 (pure) from storage 1, which is freed after op 1: after
    # that, storage 2 can only travel over the link.
    ops = [{1: "W"}, {1: "R", 2: "W"}, {3: "W"}, {3: "R"}, {}, {2: "R"}]
    sizes = {1: MB, 2: MB, 3: 2 * MB}
    trace = make_trace(ops, sizes, limit=2 * MB, ms=[1, 0.1, 1, 1, 1, 1], pure={1})
    assert stall_lower_bound_ms(trace) == stall_lower_bound_ms(trace, recompute=False) > 0
    # Kept alive (retained) the input allows it.
    kept = dataclasses.replace(trace, retained_sids=frozenset({1}), memory_limit_bytes=2 * MB)
    assert stall_lower_bound_ms(kept) < stall_lower_bound_ms(kept, recompute=False)


# ---- a brute-force reference and random traces --------------------------------------------


def _next_use(ix: TraceIndex, sid: int, i: int) -> int | None:
    """The next access of ``sid`` after op ``i``; ``n`` (the end) for a kept output."""
    later = [op for op, _ in ix.by_storage[sid] if op > i]
    return later[0] if later else (ix.n if sid in ix.retained else None)


def _recomputable_after(ix: TraceIndex, sid: int, i: int) -> bool:
    """The contract's rule, read literally: made by an op marked recompute, and neither it
    nor the producer's inputs written in ``producer+1 .. i``, the inputs alive after ``i``."""
    producer, wrote = ix.by_storage[sid][0]
    if not (wrote and ix.trace.ops[producer].recompute):
        return False
    inputs = [x for x, _ in ix.accesses[producer] if ix.first[x] < producer]
    for x in [sid, *inputs]:
        if any(wrote and producer < op <= i for op, wrote in ix.by_storage[x]):
            return False
    return all(x in ix.retained or ix.last[x] >= i for x in inputs)


def reference_op(ix: TraceIndex, i: int, excess: int, recompute: bool) -> tuple[float, ...]:
    """Op ``i``'s least stall before it, after it, and both at one split, from the
    definitions; the best split by trying every kink of the piecewise linear cost."""
    trace, sizes, n = ix.trace, ix.sizes, ix.n
    bw_out, bw_in = trace.d2h_bandwidth_gbps * 1e6, trace.h2d_bandwidth_gbps * 1e6
    starts = [*ix.starts, ix.total_ms]
    touched = {sid for sid, _ in ix.accesses[i]}
    movable = [
        sid
        for sid in ix.first
        if ix.first[sid] < i and sid not in touched and _next_use(ix, sid, i) is not None
    ]
    if sum(sizes[s] for s in movable) < excess:
        return math.inf, math.inf, math.inf
    end_i = ix.starts[i] + ix.durations[i]
    created_before = [sum(sizes[s] for s in movable if ix.first[s] < f) for f in range(i)]
    read_after = {
        r: sum(sizes[s] for s in movable if _next_use(ix, s, i) > r) for r in range(i + 1, n + 1)
    }

    def out_line(x):  # before the clip at 0, with x bytes recomputed
        terms = (
            (excess - x - a) / bw_out - (ix.starts[i] - ix.starts[f] - ix.durations[f])
            for f, a in enumerate(created_before)
        )
        return max(terms, default=-math.inf)

    def back_line(x):
        return max((excess - x - z) / bw_in - (starts[r] - end_i) for r, z in read_after.items())

    pool = [s for s in movable if recompute and sizes[s] and _recomputable_after(ix, s, i)]
    pool.sort(key=lambda s: ix.durations[ix.first[s]] / sizes[s])
    cap = min(excess, sum(sizes[s] for s in pool))

    def cost(x):
        spent = 0.0
        for s in pool:
            take = min(sizes[s], x)
            spent += take * ix.durations[ix.first[s]] / sizes[s]
            x -= take
        return spent

    def zero(x):
        return 0.0

    # Every term is affine between whole storages: the kinks are there, where the out and
    # back lines reach 0, and where the back line meets the recompute cost.
    points, done = {0.0, float(cap)}, 0
    for s in pool:
        done += sizes[s]
        points.add(float(min(cap, done)))
    for lo, hi in zip(sorted(points), sorted(points)[1:], strict=False):
        for line, other in ((out_line, zero), (back_line, zero), (back_line, cost)):
            da, db = line(lo) - other(lo), line(hi) - other(hi)
            if math.isfinite(da) and (da > 0) != (db > 0):
                points.add(lo + (hi - lo) * da / (da - db))

    def after(x):
        return max(0.0, back_line(x), cost(x))

    return (
        max(0.0, out_line(cap)),
        min(after(x) for x in points),
        min(max(0.0, out_line(x)) + after(x) for x in points),
    )


def reference_stall(trace: ActivationTrace, recompute: bool = True) -> float:
    """The module docstring's formulas, evaluated over every op pair without shortcuts."""
    ix = TraceIndex(trace)
    budget, n = trace.memory_limit_bytes, ix.n
    if budget is None or ix.natural_peak <= budget:
        return 0.0
    if sum(ix.sizes[s] for s in ix.retained if s in ix.first) > budget:
        return math.inf
    per_op = [
        reference_op(ix, i, ix.natural[i] - budget, recompute)
        if ix.natural[i] > budget
        else (0.0, 0.0, 0.0)
        for i in range(n)
    ]
    pairs = (per_op[i][0] + per_op[j][1] for j in range(n) for i in range(j))
    return max(max(op[2] for op in per_op), max(pairs, default=0.0))


def check_schedules(trace: ActivationTrace, plans) -> int:
    """Replay each plan that runs; those within budget never beat the bound (the offload-only
    one neither when nothing was recomputed). Returns how many were compared."""
    bound = stall_lower_bound_ms(trace)
    offload_only = stall_lower_bound_ms(trace, recompute=False)
    assert bound <= offload_only + 1e-12
    compared = 0
    for plan in plans:
        try:
            result = simulate(trace, plan, record=False)
        except ValueError:
            continue  # a random recompute whose recipe was spoiled: not a schedule
        if result.peak_bytes <= trace.memory_limit_bytes:
            assert result.stall_ms >= bound - 1e-9
            if result.recomputes + result.demand_recomputes == 0:
                assert result.stall_ms >= offload_only - 1e-9
            compared += 1
    return compared


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_brute_force_reference(seed):
    rng = random.Random(seed)
    for _ in range(12):
        trace = random_trace(rng, rng.randint(3, 16), rng.randint(1, 9), pure=0.5)
        peak = TraceIndex(trace).natural_peak
        for fraction in (0.8, 0.6, 0.4):
            limited = trace.with_limit(int(fraction * peak))
            for recompute in (False, True):
                got = stall_lower_bound_ms(limited, recompute=recompute)
                assert got == pytest.approx(reference_stall(limited, recompute), abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_no_schedule_beats_the_bound(seed):
    rng = random.Random(100 + seed)
    checked = 0
    for _ in range(30):
        trace = random_trace(rng, rng.randint(4, 30), rng.randint(2, 14), pure=0.6)
        peak = TraceIndex(trace).natural_peak
        for fraction in (0.9, 0.7, 0.5):
            limited = trace.with_limit(int(fraction * peak))
            if not feasible(limited):
                continue
            plans = [TimedPlanner().plan(any_size(limited)), floor_schedule(limited)]
            plans += [random_schedule(rng, limited) for _ in range(10)]
            checked += check_schedules(limited, plans)
    assert checked >= 20


PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(
    st.randoms(use_true_random=False), st.integers(3, 14), st.integers(1, 8), st.floats(0.2, 0.95)
)
def test_recomputation_only_lowers_the_bound_and_no_schedule_beats_it(
    rng, n_ops, n_storages, fraction
):
    trace = random_trace(rng, n_ops, n_storages, kept=rng.randint(0, 3), pure=rng.random())
    limited = trace.with_limit(int(fraction * TraceIndex(trace).natural_peak))
    assert stall_lower_bound_ms(limited) <= stall_lower_bound_ms(limited, recompute=False) + 1e-12
    if feasible(limited):
        check_schedules(
            limited, [floor_schedule(limited)] + [random_schedule(rng, limited) for _ in range(6)]
        )


# ---- the near-linear sweep against the quadratic one it replaced (issue 10) ----------------


def quadratic_bounds_per_op(ix: TraceIndex, budget: int) -> tuple[list[float], list[float]]:
    """The offload-only per-op ``out_i`` / ``in_i`` as computed before issue 10, kept outputs
    movable after their last access (read again at the end): every op with an excess walks
    every live storage (``O(ops x live storages)``)."""
    from itertools import accumulate

    trace = ix.trace
    bw_d2h, bw_h2d = trace.d2h_bandwidth_gbps * 1e6, trace.h2d_bandwidth_gbps * 1e6
    sizes, starts = ix.sizes, [*ix.starts, ix.total_ms]
    ends = [s + d for s, d in zip(ix.starts, ix.durations, strict=True)]
    alive: dict[int, float] = {}
    upcoming: dict[int, int] = {}
    position = {sid: 0 for sid in ix.by_storage}
    outs, ins = [0.0] * ix.n, [0.0] * ix.n
    for i in range(ix.n):
        for sid in ix.created_at[i]:
            alive[sid] = ends[i]
        excess = ix.natural[i] - budget
        if excess > 0:
            touched = {sid for sid, _ in ix.accesses[i]}
            movable = [sid for sid in alive if sid not in touched and sid in upcoming]
            total = sum(sizes[sid] for sid in movable)
            if total < excess:
                outs[i] = ins[i] = math.inf
            else:
                before = accumulate((sizes[sid] for sid in movable), initial=0)
                best = max(
                    alive[sid] - done / bw_d2h for sid, done in zip(movable, before, strict=False)
                )
                outs[i] = max(0.0, excess / bw_d2h - starts[i] + best)
                readers = sorted((upcoming[sid], sizes[sid]) for sid in movable)
                back = accumulate(size for _, size in readers)
                best = max(
                    done / bw_h2d - starts[r] for (r, _), done in zip(readers, back, strict=True)
                )
                ins[i] = max(0.0, (excess - total) / bw_h2d + ends[i] + best)
        for sid, _ in ix.accesses[i]:
            accesses = ix.by_storage[sid]
            position[sid] += 1
            if position[sid] < len(accesses):
                upcoming[sid] = accesses[position[sid]][0]
            elif sid in ix.retained:
                upcoming[sid] = ix.n
            else:
                upcoming.pop(sid, None)
        for sid in ix.freed_at[i]:
            alive.pop(sid, None)
    return outs, ins


@pytest.mark.parametrize("seed", range(8))
def test_the_sweep_equals_the_quadratic_walk(seed):
    rng = random.Random(1000 + seed)
    compared = 0
    for _ in range(25):
        trace = random_trace(rng, rng.randint(2, 40), rng.randint(1, 25))
        ix = TraceIndex(trace)
        for fraction in (0.95, 0.7, 0.5, 0.2, 0.0):
            budget = int(fraction * ix.natural_peak)
            fast, slow = _sweep(ix, budget, False)[:2], quadratic_bounds_per_op(ix, budget)
            for got, want in zip(fast, slow, strict=True):
                assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
            compared += 1
    assert compared == 125


def test_a_long_chain_bounds_equal_the_quadratic_walk():
    # 600 forward ops keep their activations for the backward: every op sees ~600 live
    # storages, the case the quadratic walk was slow on.
    n = 600
    ops = [{k: "W", **({k - 1: "R"} if k else {})} for k in range(n)]
    ops += [
        {k: "R", n + k: "W", **({n + k + 1: "R"} if k < n - 1 else {})} for k in reversed(range(n))
    ]
    sizes = {sid: MB for sid in range(2 * n)}
    pure = set(range(0, n, 3))  # a third of the forward can be made again
    trace = make_trace(ops, sizes, limit=n * MB // 2, bw=0.05, pure=pure)
    ix = TraceIndex(trace)
    fast, slow = _sweep(ix, n * MB // 2, False)[:2], quadratic_bounds_per_op(ix, n * MB // 2)
    assert fast[0] == pytest.approx(slow[0]) and fast[1] == pytest.approx(slow[1])
    assert max(fast[0]) > 0 and max(fast[1]) > 0  # both bounds bind somewhere
    assert 0 < overhead_lower_bound(trace) < overhead_lower_bound(trace, recompute=False) < math.inf
