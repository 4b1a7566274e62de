"""The timed planner with recomputation: its plans replay cleanly within the budget, beat
offloading alone where the link is the limit, never regenerate what an unmarked op made, and
regenerate chains in order."""

from __future__ import annotations

import random

import pytest

from swapopt_core._planning.bounds import feasible, overhead_lower_bound
from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.recompute import recompute_gaps, virtual_plan
from swapopt_core._planning.simulate import TraceIndex, simulate
from swapopt_core._planning.synthetic import SHAPES, llama_training_trace
from swapopt_core._planning.timed import TimedPlanner

from .test_planner import check

MB = 10**6
RECOMPUTE, RELEASE = ActionKind.RECOMPUTE, ActionKind.RELEASE_DEVICE


def op(name: str, reads=(), writes=(), *, pure: bool = True, ms: float = 1.0) -> TraceOp:
    accesses = [Access(s, AccessKind.READ) for s in reads]
    accesses += [Access(s, AccessKind.WRITE) for s in writes]
    return TraceOp(name, ms, tuple(accesses), pure)


def trace_of(ops, sizes, *, limit=None, bw=0.1, retained=()) -> ActivationTrace:
    """Copies at ``bw`` GB/s: 0.1 moves a megabyte in 10 ms, ten times an op's 1 ms."""
    return ActivationTrace(tuple(ops), sizes, frozenset(retained), limit, bw, bw, 0)


def recomputed(plan: ResidencySchedule) -> list[tuple[int, int]]:
    """``(op, sid)`` of every ``RECOMPUTE``, in issue order."""
    return [(i, a.storage_id) for _, i, a in plan.actions() if a.kind is RECOMPUTE]


def pressure(first_sid: int, count: int) -> list[TraceOp]:
    """``count`` ops that each make and drop a 1 MB temporary (the forward's other work)."""
    return [op(f"work{k}", writes=(first_sid + k,), pure=False) for k in range(count)]


# A forward of norm -> dropout -> silu, busy work, then a backward reading all three in
# reverse. The dropout draws random numbers: never marked, never recomputed.
DROPOUT_OPS = [
    op("embed", writes=(0,), pure=False),
    op("norm", reads=(0,), writes=(1,)),
    op("dropout", reads=(1,), writes=(2,), pure=False),
    op("silu", reads=(2,), writes=(3,)),
    *pressure(10, 4),
    op("silu_bwd", reads=(3, 2)),
    op("dropout_bwd", reads=(2,)),
    op("norm_bwd", reads=(1, 0)),
    op("embed_bwd", reads=(0,)),
]
DROPOUT_SIZES = {0: MB, 1: MB, 2: MB, 3: MB, **{10 + k: MB for k in range(4)}}


def test_an_unmarked_op_is_never_recomputed_and_marked_ones_beat_the_link():
    trace = trace_of(DROPOUT_OPS, DROPOUT_SIZES, limit=3 * MB)
    assert feasible(trace)
    plan = TimedPlanner().plan(trace)
    result = check(trace, plan)
    regenerated = {sid for _, sid in recomputed(plan)}
    assert 2 not in regenerated and 0 not in regenerated
    assert regenerated  # the norm or the SiLU output: 1 ms against 20 ms on the link
    offload_only = simulate(trace, TimedPlanner(recompute=False).plan(trace))
    assert result.overhead < offload_only.overhead
    assert result.recomputes == len(recomputed(plan))


def test_offload_only_never_recomputes():
    trace = trace_of(DROPOUT_OPS, DROPOUT_SIZES, limit=3 * MB)
    plan = TimedPlanner(recompute=False).plan(trace)
    assert not recomputed(plan)
    check(trace, plan)


# The gated MLP: g and u come from unmarked loads, a = silu(g), m = a * u, then 2 MB of other
# forward work at a time. The backward reads m first, then a and u, then g: recomputing m
# needs a back first.
MLP_OPS = [
    op("load_g", writes=(1,), pure=False),
    op("load_u", writes=(2,), pure=False),
    op("silu", reads=(1,), writes=(3,)),
    op("mul", reads=(3, 2), writes=(4,)),
    *pressure(10, 4),
    op("down_bwd", reads=(4,)),
    op("work", pure=False),
    op("mul_bwd", reads=(3, 2)),
    op("silu_bwd", reads=(1,)),
]
MLP_SIZES = {1: MB, 2: MB, 3: MB, 4: MB, **{10 + k: 2 * MB for k in range(4)}}


def test_a_chain_is_recomputed_inputs_first():
    trace = trace_of(MLP_OPS, MLP_SIZES, limit=10 * MB)
    ix = TraceIndex(trace)
    gaps = {g.sid: g for g in recompute_gaps(ix)}
    assert set(gaps) == {3, 4}  # the loads are unmarked

    def keep_everything_else(index: TraceIndex, budget: int) -> ResidencySchedule:
        return ResidencySchedule()

    plan = virtual_plan(ix, [gaps[4], gaps[3]], 10 * MB, keep_everything_else)
    # Both leave after the forward's mul; the SiLU output comes back first, right before the
    # mul's recompute that reads it, and stays for mul_bwd.
    assert [(a.storage_id, a.kind) for a in plan.pre[8]] == [(3, RECOMPUTE), (4, RECOMPUTE)]
    assert {(a.storage_id, a.kind) for a in plan.post[3]} == {(3, RELEASE), (4, RELEASE)}
    assert len(plan) == 4
    result = simulate(trace, plan)
    assert result.recomputes == 2 and result.demand_recomputes == 0
    assert result.recompute_ms == 2.0


def test_the_planner_recomputes_the_chain_when_memory_is_tight():
    # 4 MB: during the other work, two of g, u, a, m must be off the device. Recomputing a
    # and m costs 2 ms; any copy takes 10 ms each way.
    trace = trace_of(MLP_OPS, MLP_SIZES, limit=4 * MB)
    plan = TimedPlanner().plan(trace)
    result = check(trace, plan)
    assert recomputed(plan) == [(8, 3), (8, 4)]
    assert result.overhead == pytest.approx(2.0 / 12.0)


@pytest.mark.parametrize("fraction", [0.5, 0.35])
def test_recompute_beats_offload_only_on_the_tiny_llama(fraction):
    base = llama_training_trace(SHAPES["tiny"])
    trace = base.with_limit(int(fraction * TraceIndex(base).natural_peak))
    plan = TimedPlanner().plan(trace)
    result = check(trace, plan)
    assert result.recomputes > 0
    offload_bound = overhead_lower_bound(trace, recompute=False)
    assert result.overhead <= 0.5 * offload_bound
    assert result.overhead >= overhead_lower_bound(trace) - 1e-9
    ix = TraceIndex(trace)
    for i, sid in recomputed(plan):
        assert trace.ops[ix.producer[sid]].recompute
        assert i > ix.producer[sid]


@pytest.mark.parametrize("seed", range(3))
def test_random_traces_with_marked_ops_replay_within_budget(seed):
    rng = random.Random(seed)
    for _ in range(12):
        n_ops, n_storages = rng.randint(4, 40), rng.randint(2, 20)
        accesses: list[dict[int, AccessKind]] = [{} for _ in range(n_ops)]
        sizes = {}
        for sid in range(n_storages):
            created = rng.randrange(n_ops - 1)
            sizes[sid] = rng.randint(1, 8) * MB
            accesses[created][sid] = AccessKind.WRITE
            count = min(rng.randint(0, 4), n_ops - created - 1)
            for i in rng.sample(range(created + 1, n_ops), count):
                accesses[i].setdefault(sid, rng.choice([AccessKind.READ] * 3 + [AccessKind.WRITE]))
        ops = [
            TraceOp(
                f"op{i}",
                rng.choice([0.0, rng.uniform(0.01, 3.0)]),
                tuple(Access(s, k) for s, k in acc.items()),
                rng.random() < 0.6,
            )
            for i, acc in enumerate(accesses)
        ]
        bw = rng.uniform(0.2, 20)
        trace = trace_of(ops, sizes, bw=bw, retained=rng.sample(range(n_storages), 1))
        peak = TraceIndex(trace).natural_peak
        for fraction in (0.7, 0.4):
            limited = trace.with_limit(int(fraction * peak))
            if not feasible(limited):
                continue
            plan = TimedPlanner().plan(limited)
            result = check(limited, plan)
            assert result.overhead >= overhead_lower_bound(limited) - 1e-9
            ix = TraceIndex(limited)
            for _, sid in recomputed(plan):
                assert limited.ops[ix.producer[sid]].recompute
