"""Recompute chains through storages the trace frees early, recipes that hold their inputs,
tails of storages the caller holds, and checkpoint-like choices: worked out by hand, and the
planner never worse than checkpointing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from swapopt_core._planning.chains import virtual_plan
from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.recompute import recompute_gaps
from swapopt_core._planning.segments import checkpoint_choices, cuts, turn
from swapopt_core._planning.simulate import TraceIndex, simulate
from swapopt_core._planning.synthetic import SHAPES, llama_training_trace
from swapopt_core._planning.timed import TimedPlanner

from .test_planner import check

MB = 10**6
RECOMPUTE, RELEASE = ActionKind.RECOMPUTE, ActionKind.RELEASE_DEVICE


def op(name, reads=(), writes=(), *, pure=True, ms=1.0) -> TraceOp:
    accesses = [Access(s, AccessKind.READ) for s in reads]
    accesses += [Access(s, AccessKind.WRITE) for s in writes]
    return TraceOp(name, ms, tuple(accesses), pure)


def trace_of(ops, sizes, *, limit=None, freed_after=None) -> ActivationTrace:
    """Copies at 0.1 GB/s: a megabyte takes 10 ms each way, ten times an op."""
    return ActivationTrace(tuple(ops), sizes, frozenset(), limit, 0.1, 0.1, 0, freed_after or {})


# An attention-like block: the projection ``1`` dies once both heads are cloned from it; the
# clones are saved for the backward, across 3 MB of other work.
ATTENTION = [
    op("embed", writes=(0,), pure=False),
    op("qkv", reads=(0,), writes=(1,)),
    op("clone_q", reads=(1,), writes=(2,)),
    op("clone_k", reads=(1,), writes=(3,)),
    *[op(f"work{k}", writes=(10 + k,), pure=False) for k in range(4)],
    op("q_bwd", reads=(2,)),
    op("k_bwd", reads=(3, 0)),
]
ATTENTION_SIZES = {0: MB, 1: MB, 2: MB, 3: MB, **{10 + k: 3 * MB for k in range(4)}}


def test_a_recompute_revives_an_input_the_trace_freed():
    """``clone_q`` reads the projection, which the trace frees after ``clone_k``: the plan
    releases it there and makes it again right before the clone's recompute."""
    schedule = ResidencySchedule()
    schedule.add_post(2, 2, RELEASE)
    schedule.add_post(3, 1, RELEASE)
    schedule.add_pre(8, 1, RECOMPUTE)
    schedule.add_pre(8, 2, RECOMPUTE)
    schedule.add_pre(8, 1, RELEASE)
    trace = trace_of(ATTENTION, ATTENTION_SIZES)
    result = simulate(trace, schedule)
    assert (result.recomputes, result.demand_recomputes, result.ignored_actions) == (2, 0, 0)
    assert result.peak_bytes == 5 * MB  # x, k and a work temporary: the clone and qkv are away
    assert result.recompute_ms == 2.0


def test_a_recipe_holds_its_inputs_alive():
    """Without the release after ``clone_k``, the recipe of the released clone keeps the
    projection on the device through the work (the replay holds a reference to it)."""
    schedule = ResidencySchedule()
    schedule.add_post(2, 2, RELEASE)
    schedule.add_pre(8, 2, RECOMPUTE)
    result = simulate(trace_of(ATTENTION, ATTENTION_SIZES), schedule)
    assert result.recomputes == 1 and result.ignored_actions == 0
    assert result.peak_bytes == 6 * MB  # the projection stays: held, never revived


def test_the_planner_revives_rather_than_moving_the_clone():
    trace = trace_of(ATTENTION, ATTENTION_SIZES, limit=5 * MB)
    plan = TimedPlanner().plan(trace)
    result = check(trace, plan)
    regenerated = [(i, a.storage_id) for _, i, a in plan.actions() if a.kind is RECOMPUTE]
    assert (8, 1) in regenerated and ((8, 2) in regenerated or (9, 3) in regenerated)
    assert result.overhead <= 0.25  # two 1 ms ops again, against 20 ms on the link
    assert result.d2h_bytes == 0


def test_a_tail_is_released_for_good():
    """Storage 1 is read last by op 2 but freed after op 6 (the caller held it): the planner
    releases it after op 2 without a copy and never makes it again."""
    ops = [
        op("make", writes=(0,), pure=False),
        op("act", reads=(0,), writes=(1,)),
        op("use", reads=(1,)),
        *[op(f"work{k}", writes=(10 + k,), pure=False) for k in range(4)],
        op("end", reads=(0,)),
    ]
    sizes = {0: MB, 1: 2 * MB, **{10 + k: MB for k in range(4)}}
    trace = trace_of(ops, sizes, limit=3 * MB, freed_after={1: 6})
    assert TraceIndex(trace).natural_peak == 4 * MB  # during the work, held
    plan = TimedPlanner().plan(trace)
    result = simulate(trace, plan)
    assert result.peak_bytes == 3 * MB  # while ``act`` runs
    assert (result.overhead, result.recomputes, result.d2h_bytes) == (0.0, 0, 0)
    assert [(side, i, a.kind) for side, i, a in plan.actions() if a.storage_id == 1] == [
        ("post", 2, RELEASE)
    ]
    tail = [g for g in recompute_gaps(TraceIndex(trace), 3 * MB) if g.tail]
    assert [(g.sid, g.a, g.b, g.cost_ms) for g in tail] == [(1, 2, 6, 0.0)]


def test_freed_after_round_trips_and_is_checked():
    trace = trace_of(ATTENTION, ATTENTION_SIZES, freed_after={1: 7})
    again = ActivationTrace.from_json(trace.to_json())
    assert again.freed_after == {1: 7}
    assert TraceIndex(again).end[1] == 7
    text = trace.to_json().replace('"freed_after": {"1": 7}', '"freed_after": {"99": 7}')
    with pytest.raises(ValueError, match=r"freed_after\['99'\]"):
        ActivationTrace.from_json(text)


# ---- checkpoint-like choices ---------------------------------------------------------------


def blocks(count: int) -> ActivationTrace:
    """``count`` residual blocks (norm, a projection that dies, an activation the backward
    reads, the residual add), a loss, then the backward in reverse."""
    ops, sizes = [op("embed", writes=(0,), pure=False)], {0: MB}
    sid = 1
    saved = []
    x = 0
    for _ in range(count):
        norm, proj, act, out = sid, sid + 1, sid + 2, sid + 3
        sid += 4
        sizes.update({norm: MB, proj: 2 * MB, act: 2 * MB, out: MB})
        ops += [
            op("norm", reads=(x,), writes=(norm,), ms=0.5),
            op("proj", reads=(norm,), writes=(proj,), ms=3.0),
            op("act", reads=(proj,), writes=(act,), ms=0.5),
            op("add", reads=(x, act), writes=(out,), ms=0.5),
        ]
        saved.append((x, norm, act))
        x = out
    sizes[sid] = 4 * MB
    ops.append(op("loss", reads=(x,), writes=(sid,), pure=False))
    ops.append(op("loss_bwd", reads=(sid,), pure=False))
    for x, norm, act in reversed(saved):
        ops += [
            op("act_bwd", reads=(act,), pure=False, ms=1.0),
            op("proj_bwd", reads=(norm,), pure=False, ms=6.0),
            op("norm_bwd", reads=(x,), pure=False, ms=1.0),
        ]
    return trace_of(ops, sizes)


def test_cuts_are_the_residual_stream():
    ix = TraceIndex(blocks(4))
    assert ix.trace.ops[turn(ix)].name in ("loss", "loss_bwd")
    assert cuts(ix) == [0, 4, 8, 12]  # the inputs of the four blocks (the last add's output
    # is read by the loss only, before the turn: nothing to keep)


def test_checkpoint_choices_recompute_each_segment_from_its_input():
    ix = TraceIndex(blocks(4))
    every = recompute_gaps(ix, everything=True)
    per_block = {g.sid for g in checkpoint_choices(ix, every, 1)}
    assert per_block == {1, 3, 5, 7, 9, 11, 13, 15}  # norms and activations, not the inputs
    coarse = {g.sid for g in checkpoint_choices(ix, every, 2)}
    assert {4, 12} <= coarse and not {0, 8} & coarse
    plan = virtual_plan(ix, checkpoint_choices(ix, every, 1), 1 << 40, _keep)
    result = simulate(ix.trace, plan)
    assert result.recomputes == 12  # norm, projection (revived), activation per block
    assert result.peak_bytes < ix.natural_peak


def _keep(index: TraceIndex, budget: int) -> ResidencySchedule:
    return ResidencySchedule()


@pytest.mark.parametrize("stride", [1, 2])
def test_the_planner_is_never_worse_than_a_checkpoint_like_choice(stride):
    base = blocks(6)
    ix = TraceIndex(base)
    choice = checkpoint_choices(ix, recompute_gaps(ix, everything=True), stride)
    checkpointed = simulate(base, virtual_plan(ix, choice, 1 << 40, _keep))
    trace = base.with_limit(checkpointed.peak_bytes)
    result = check(trace, TimedPlanner().plan(trace))
    assert result.total_ms <= checkpointed.total_ms + 1e-9


def _benchmark_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "activation_planner.py"
    spec = importlib.util.spec_from_file_location("activation_planner_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_per_layer_checkpointing_of_a_llama_step_never_beats_the_planner():
    """The benchmark's per-layer checkpointing of the tiny Llama step, simulated: under the
    bytes it holds at its peak, the planner's plan is no slower."""
    from swapopt_core._planning import ir

    bench = _benchmark_module()
    base = llama_training_trace(SHAPES["tiny"])
    index = TraceIndex(base)
    checkpointed = simulate(bench.checkpointed_trace(base, ir), None, record=False)
    trace = base.with_limit(checkpointed.peak_bytes)
    result = check(trace, TimedPlanner().plan(trace))
    assert result.total_ms <= checkpointed.total_ms
    assert checkpointed.total_ms > index.total_ms  # checkpointing costs something here


def test_a_storage_released_for_good_is_never_needed_where_it_cannot_be_made_again():
    """``y = f(x)`` is held by the caller past its last access (a tail) and ``z = g(y)`` is
    read again late. Released for good after ``g``, ``y`` can be made again only while ``x``
    lives: a recompute of ``z`` after that would need ``y`` back from nothing. Such a gap is
    never offered, so every gap offered can be placed together with every tail."""
    ops = [
        op("make_x", writes=(0,), pure=False),
        op("f", reads=(0,), writes=(1,)),
        op("g", reads=(1,), writes=(2,)),
        op("use_x", reads=(0,)),
        *[op(f"work{k}", writes=(10 + k,), pure=False) for k in range(4)],
        op("read_z", reads=(2,)),
        op("end"),
    ]
    sizes = {0: MB, 1: MB, 2: MB, **{10 + k: 2 * MB for k in range(4)}}
    trace = trace_of(ops, sizes, limit=3 * MB, freed_after={1: 9})
    ix = TraceIndex(trace)
    gaps = recompute_gaps(ix, everything=True)
    assert any(g.tail and g.sid == 1 for g in gaps)
    assert not any(g.sid == 2 and g.b > 3 for g in gaps)  # y cannot be made after use_x
    # Before: the placement asked for y back at read_z and failed on x (KeyError).
    virtual_plan(ix, gaps, 3 * MB, lambda ix, budget: ResidencySchedule())
    check(trace, TimedPlanner().plan(trace))
