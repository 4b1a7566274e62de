"""The overhead lower bound: hand-computed cases, a brute-force reference, and validity
against many schedules replayed by the simulator."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from swapopt_core._planning.bounds import (
    feasible,
    min_feasible_budget,
    overhead_lower_bound,
    stall_lower_bound_ms,
)
from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.simulate import TraceIndex, simulate
from swapopt_core._planning.timed import TimedPlanner

MB = 10**6


def any_size(trace: ActivationTrace) -> ActivationTrace:
    """``trace`` without a size threshold: storages of any size may be offloaded."""
    return dataclasses.replace(trace, min_offload_bytes=0)


def make_trace(ops, sizes, *, retained=(), limit=None, bw=1.0) -> ActivationTrace:
    """``ops``: one ``{sid: "R" | "W"}`` per op, 1 ms each; copies at 10**6 bytes per ms."""
    built = tuple(
        TraceOp(
            f"op{i}",
            1.0,
            tuple(
                Access(sid, AccessKind.READ if kind == "R" else AccessKind.WRITE)
                for sid, kind in op.items()
            ),
        )
        for i, op in enumerate(ops)
    )
    return ActivationTrace(built, sizes, frozenset(retained), limit, bw, bw)


def long_gap(extra: dict[int, dict[int, str]], sizes: dict[int, int], limit: int):
    """Storage 1 (1 MB) written by op 0 and read by op 5, plus ``extra`` accesses."""
    ops = [{1: "W"}, {}, {}, {}, {}, {1: "R"}]
    for op, accesses in extra.items():
        ops[op] = {**ops[op], **accesses}
    return make_trace(ops, {1: MB, **sizes}, limit=limit)


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


def test_feasibility_is_the_largest_working_set_plus_kept_outputs():
    trace = make_trace(
        [{1: "W"}, {1: "R", 2: "W"}, {3: "W"}, {3: "R", 1: "R"}],
        {1: MB, 2: 2 * MB, 3: MB},
        retained={2},
    )
    assert min_feasible_budget(trace) == 4 * MB  # op 3 touches 1 and 3; 2 is kept
    assert feasible(trace.with_limit(4 * MB)) and feasible(trace.with_limit(None))
    assert not feasible(trace.with_limit(4 * MB - 1))
    assert overhead_lower_bound(trace.with_limit(3 * MB)) == math.inf


# ---- a brute-force reference and random traces --------------------------------------------


def reference_stall(trace: ActivationTrace) -> float:
    """The module docstring's formulas, evaluated over every op pair without shortcuts."""
    ix = TraceIndex(trace)
    budget, sizes = trace.memory_limit_bytes, ix.sizes
    bw_out, bw_in = trace.d2h_bandwidth_gbps * 1e6, trace.h2d_bandwidth_gbps * 1e6
    outs, ins = [], []
    for i in range(ix.n):
        excess = ix.natural[i] - budget
        touched = {sid for sid, _ in ix.accesses[i]}
        movable = [
            sid
            for sid in sizes
            if sid in ix.first
            and ix.first[sid] < i
            and sid not in touched
            and any(op > i for op, _ in ix.by_storage[sid])
        ]
        if excess <= 0:
            outs.append(0.0)
            ins.append(0.0)
            continue
        if sum(sizes[s] for s in movable) < excess:
            return math.inf
        out = max(
            (excess - sum(sizes[s] for s in movable if ix.first[s] < f)) / bw_out
            - (ix.starts[i] - ix.starts[f] - ix.durations[f])
            for f in range(i)
        )
        end_i = ix.starts[i] + ix.durations[i]
        back = []
        for r in range(i + 1, ix.n):
            later = sum(
                sizes[s] for s in movable if min(op for op, _ in ix.by_storage[s] if op > i) > r
            )
            back.append((excess - later) / bw_in - (ix.starts[r] - end_i))
        outs.append(max(0.0, out))
        ins.append(max(0.0, *back))
    return max((max(outs[: j + 1]) + ins[j] for j in range(ix.n)), default=0.0)


def random_trace(rng: random.Random, n_ops: int, n_storages: int) -> ActivationTrace:
    ops: list[dict[int, str]] = [{} for _ in range(n_ops)]
    sizes = {}
    for sid in range(n_storages):
        created = rng.randrange(n_ops - 1)
        sizes[sid] = rng.randint(1, 8) * MB // 4
        ops[created][sid] = "W"
        for op in rng.sample(
            range(created + 1, n_ops), min(rng.randint(0, 3), n_ops - created - 1)
        ):
            ops[op][sid] = rng.choice("RRRW")
    built = tuple(
        TraceOp(
            f"op{i}",
            rng.choice([0.0, rng.uniform(0.05, 2.0)]),
            tuple(
                Access(s, AccessKind.READ if k == "R" else AccessKind.WRITE) for s, k in op.items()
            ),
        )
        for i, op in enumerate(ops)
    )
    retained = frozenset(rng.sample(range(n_storages), min(2, n_storages)))
    return ActivationTrace(
        built, sizes, retained, None, rng.uniform(0.2, 4.0), rng.uniform(0.2, 4.0)
    )


def random_schedule(rng: random.Random, trace: ActivationTrace) -> ResidencySchedule:
    """Offload random gaps with random (valid) release and reload points."""
    ix = TraceIndex(trace)
    plan = ResidencySchedule()
    for sid, accesses in ix.by_storage.items():
        last_write = accesses[0][0]
        for (a, wrote), (b, _) in zip(accesses, accesses[1:], strict=False):
            last_write = a if wrote else last_write
            if b - a < 2 or rng.random() < 0.4:
                continue
            release = rng.randint(a + 1, b - 1)
            reload = rng.randint(release + 1, b)
            plan.add_post(last_write, sid, ActionKind.COPY_D2H)
            plan.add_pre(release, sid, ActionKind.RELEASE_DEVICE)
            plan.add_pre(reload, sid, ActionKind.COPY_H2D)
    return plan


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_brute_force_reference(seed):
    rng = random.Random(seed)
    for _ in range(15):
        trace = random_trace(rng, rng.randint(3, 18), rng.randint(1, 10))
        peak = TraceIndex(trace).natural_peak
        for fraction in (0.8, 0.6, 0.4):
            limited = trace.with_limit(int(fraction * peak))
            assert stall_lower_bound_ms(limited) == pytest.approx(reference_stall(limited))


@pytest.mark.parametrize("seed", range(6))
def test_no_schedule_beats_the_bound(seed):
    rng = random.Random(100 + seed)
    checked = 0
    for _ in range(30):
        trace = random_trace(rng, rng.randint(4, 30), rng.randint(2, 14))
        peak = TraceIndex(trace).natural_peak
        for fraction in (0.9, 0.7, 0.5):
            limited = trace.with_limit(int(fraction * peak))
            if not feasible(limited):
                continue
            bound = stall_lower_bound_ms(limited)
            plans = [TimedPlanner().plan(any_size(limited))]
            plans += [random_schedule(rng, limited) for _ in range(10)]
            for plan in plans:
                result = simulate(limited, plan, record=False)
                if result.peak_bytes <= limited.memory_limit_bytes:
                    assert result.stall_ms >= bound - 1e-9
                    checked += 1
    assert checked >= 20


# ---- the near-linear sweep against the quadratic one it replaced (issue 10) ----------------


def quadratic_bounds_per_op(ix: TraceIndex, budget: int) -> tuple[list[float], list[float]]:
    """The per-op ``out_i`` / ``in_i`` as computed before issue 10: every op with an excess
    walks every live storage (``O(ops x live storages)``)."""
    from itertools import accumulate

    trace = ix.trace
    bw_d2h, bw_h2d = trace.d2h_bandwidth_gbps * 1e6, trace.h2d_bandwidth_gbps * 1e6
    sizes, starts = ix.sizes, ix.starts
    ends = [s + d for s, d in zip(starts, ix.durations, strict=True)]
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
            else:
                upcoming.pop(sid, None)
        for sid in ix.freed_at[i]:
            alive.pop(sid, None)
    return outs, ins


@pytest.mark.parametrize("seed", range(8))
def test_the_sweep_equals_the_quadratic_walk(seed):
    from swapopt_core._planning.bounds import _bounds_per_op

    rng = random.Random(1000 + seed)
    compared = 0
    for _ in range(25):
        trace = random_trace(rng, rng.randint(2, 40), rng.randint(1, 25))
        ix = TraceIndex(trace)
        for fraction in (0.95, 0.7, 0.5, 0.2, 0.0):
            budget = int(fraction * ix.natural_peak)
            fast, slow = _bounds_per_op(ix, budget), quadratic_bounds_per_op(ix, budget)
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
    trace = make_trace(ops, sizes, limit=n * MB // 2, bw=0.05)
    from swapopt_core._planning.bounds import _bounds_per_op

    ix = TraceIndex(trace)
    fast, slow = _bounds_per_op(ix, n * MB // 2), quadratic_bounds_per_op(ix, n * MB // 2)
    assert fast[0] == pytest.approx(slow[0]) and fast[1] == pytest.approx(slow[1])
    assert max(fast[0]) > 0 and max(fast[1]) > 0  # both bounds bind somewhere
    assert 0 < overhead_lower_bound(trace) < math.inf
