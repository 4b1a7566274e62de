"""The built-in time-aware planner: where it puts each action, that it keeps the budget, and
how close it gets to the lower bound on a synthetic Llama step."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest

from swapopt_core._planning.bounds import (
    feasible,
    min_feasible_budget,
    overhead_lower_bound,
)
from swapopt_core._planning.interface import DEFAULT_PLANNER, resolve_planner
from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.simulate import TraceIndex, simulate
from swapopt_core._planning.synthetic import SHAPES, llama_training_trace
from swapopt_core._planning.timed import TimedPlanner
from swapopt_core._plugins import new_plugin_manager, residency_planners

MB = 10**6
D2H, RELEASE, H2D, RELEASE_HOST = (
    ActionKind.COPY_D2H,
    ActionKind.RELEASE_DEVICE,
    ActionKind.COPY_H2D,
    ActionKind.RELEASE_HOST,
)


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


def placed(plan: ResidencySchedule) -> dict[tuple[int, ActionKind], list[tuple[str, int]]]:
    """``(sid, kind) -> [(side, op), ...]`` in op order."""
    found: dict[tuple[int, ActionKind], list[tuple[str, int]]] = {}
    for side, op, action in plan.actions():
        found.setdefault((action.storage_id, action.kind), []).append((side, op))
    return found


def check(trace: ActivationTrace, plan: ResidencySchedule, budget: int | None = None):
    """Replay ``plan``; it must be clean and within ``budget`` (default: the trace's).

    The only fetches no action asked for are those of kept outputs at the end of the step
    (where the last op leaves no room for them before its own frees)."""
    result = simulate(trace, plan)
    kept = trace.retained_sids
    asked = sum(1 for _, _, a in plan.actions() if a.kind is H2D and a.storage_id not in kept)
    assert sum(1 for c in result.copies if c.direction == "H2D" and c.storage_id not in kept) == (
        asked
    )
    assert result.demand_recomputes == 0
    assert result.ignored_actions == 0
    assert result.peak_bytes <= (budget if budget is not None else trace.memory_limit_bytes)
    ix = TraceIndex(trace)
    # Storages made again after their last access (a recompute revives them for a chain):
    # a recipe holds them, so the plan releases them there and after each revival.
    revived = {
        a.storage_id
        for _, op, a in plan.actions()
        if a.kind is ActionKind.RECOMPUTE and op > ix.last[a.storage_id]
    }
    for side, op, action in plan.actions():
        sid = action.storage_id
        if action.kind is RELEASE and sid not in revived:
            assert op != ix.last[sid] or side == "pre", "released at its last access"
            assert (op if side == "post" else op - 1) < ix.last[sid] or sid in kept
    return result


# Storage 1 lives from op 0 to op 7; storage 2 (ops 2-4) makes the budget bind.
LONG = make_trace(
    [{1: "W"}, {}, {2: "W"}, {2: "R"}, {2: "R"}, {}, {}, {1: "R"}, {}],
    {1: MB, 2: MB},
    limit=MB,
)


def test_no_budget_or_room_to_spare_plans_nothing():
    assert len(TimedPlanner().plan(LONG.with_limit(None))) == 0
    assert len(TimedPlanner().plan(LONG.with_limit(2 * MB))) == 0


def test_a_long_gap_is_offloaded_out_of_the_way():
    plan = TimedPlanner().plan(any_size(LONG))
    where = placed(plan)
    assert where[(1, D2H)] == [("post", 0)]  # right after the write
    ((side, release),) = where[(1, RELEASE)]
    ((h2d_side, reload),) = where[(1, H2D)]
    assert side == h2d_side == "pre"
    assert 1 <= release <= 2 and 5 <= reload <= 7  # away while storage 2 lives
    assert where[(1, RELEASE_HOST)] == [("post", 7)]  # after its reader
    result = check(LONG, plan)
    assert result.overhead == 0.0  # 1 ms of copy each way fits in the idle ops


def test_reload_is_issued_just_early_enough():
    # Reader at op 7; a 1 ms copy fits behind op 6, so the reload is issued before op 6
    # (not before op 5, which would hold the memory longer for nothing).
    assert placed(TimedPlanner().plan(any_size(LONG)))[(1, H2D)] == [("pre", 6)]
    # A 2 ms copy needs two ops in front of the reader.
    slow = LONG.with_limit(MB)
    slow = ActivationTrace(slow.ops, slow.storage_sizes, slow.retained_sids, MB, 1.0, 0.5)
    assert placed(TimedPlanner().plan(any_size(slow)))[(1, H2D)] == [("pre", 5)]


def test_copy_out_follows_the_last_write_before_the_gap():
    # Written at 0, read at 1, rewritten in place at 2, idle, read at 8.
    ops = [{1: "W"}, {1: "R"}, {1: "W"}, {2: "W"}, {2: "R"}, {2: "R"}, {}, {}, {1: "R"}]
    trace = make_trace(ops, {1: MB, 2: MB}, limit=MB)
    plan = TimedPlanner().plan(any_size(trace))
    assert placed(plan)[(1, D2H)] == [("post", 2)]
    check(trace, plan)


def test_a_kept_output_is_offloaded_when_that_is_the_only_way_to_fit():
    # Storage 3 is kept by the caller after op 0 and storage 2 needs its room at ops 2-3: it
    # leaves after op 0 and comes back once storage 2 is gone, before the end of the step.
    ops = [{3: "W"}, {}, {2: "W"}, {2: "R"}, {}, {}, {}]
    trace = make_trace(ops, {2: MB, 3: MB}, retained={3}, limit=MB)
    plan = TimedPlanner().plan(any_size(trace))
    where = placed(plan)
    assert where[(3, D2H)] == [("post", 0)]
    assert where[(3, RELEASE)] == [("pre", 2)]
    ((side, reload),) = where[(3, H2D)]
    assert side == "pre" and reload >= 4 or side == "post"
    result = check(trace, plan)
    assert result.demand_fetches == 0  # back on the device by the end, as planned


def test_a_kept_output_stays_when_there_is_room():
    ops = [{1: "W"}, {3: "W"}, {2: "W"}, {2: "R"}, {}, {}, {1: "R"}]
    trace = make_trace(ops, {1: MB, 2: MB, 3: MB}, retained={3}, limit=3 * MB)
    assert len(TimedPlanner().plan(any_size(trace))) == 0


def test_small_storages_only_when_nothing_else_fits():
    ops = [{2: "W"}, {1: "W"}, {3: "W"}, {3: "R"}, {}, {1: "R"}, {2: "R"}]
    sizes = {1: 10 * 2**10, 2: 2 * 2**20, 3: 2 * 2**20}
    trace = make_trace(ops, sizes, limit=2 * 2**20 + 10 * 2**10, bw=100.0)
    plan = TimedPlanner().plan(trace)
    moved = {action.storage_id for _, _, action in plan.actions()}
    assert moved == {2}
    check(trace, plan)
    tight = trace.with_limit(2 * 2**20)  # now the big one alone is not enough
    plan = TimedPlanner().plan(tight)
    assert {action.storage_id for _, _, action in plan.actions()} == {1, 2}
    check(tight, plan)


def test_an_infeasible_budget_is_reported_and_the_floor_is_kept(caplog):
    trace = LONG.with_limit(MB // 2)
    assert not feasible(trace)
    with caplog.at_level(logging.WARNING, logger="swapopt_core._planning.timed"):
        plan = TimedPlanner().plan(any_size(trace))
    assert "infeasible" in caplog.text
    check(trace, plan, budget=min_feasible_budget(trace))


def test_plans_are_deterministic_and_serialise():
    trace = llama_training_trace(SHAPES["tiny"]).with_limit(None)
    trace = trace.with_limit(int(0.5 * TraceIndex(trace).natural_peak))
    first, second = TimedPlanner().plan(trace), TimedPlanner().plan(trace)
    assert first.to_json() == second.to_json()
    assert ResidencySchedule.from_json(first.to_json()).to_json() == first.to_json()


def test_registered_as_the_default_planner():
    planners = residency_planners(new_plugin_manager(load_entrypoints=False))
    assert isinstance(planners["timed"], TimedPlanner)
    assert resolve_planner("auto", planners) is planners[DEFAULT_PLANNER] is planners["timed"]
    assert planners["timed"].recompute and not planners["offload-only"].recompute


def test_an_unknown_planner_name_lists_the_registered_ones():
    planners = residency_planners(new_plugin_manager(load_entrypoints=False))
    with pytest.raises(ValueError, match=r"^--x='psychic' is not a registered planner\. .*'auto'"):
        resolve_planner("psychic", planners, label="--x")
    with pytest.raises(ValueError, match="it means 'timed', which no plugin registers"):
        resolve_planner("auto", {})


def test_the_size_threshold_comes_from_the_trace():
    # Storage 3 (1 MB) has more slack than storage 1 (2 MB); either one makes room at op 4.
    ops = [{1: "W"}, {3: "W"}, {}, {}, {2: "W"}, {2: "R"}, {}, {1: "R"}, {3: "R"}]
    trace = make_trace(ops, {1: 2 * MB, 2: MB, 3: MB}, limit=3 * MB)
    assert trace.min_offload_bytes == 2**20 > MB  # storage 3 counts as small by default

    def moved(trace: ActivationTrace) -> set[int]:
        return {a.storage_id for _, _, a in TimedPlanner().plan(trace).actions()}

    assert moved(trace) == {1}
    assert moved(any_size(trace)) == {3}


@pytest.mark.parametrize("seed", range(4))
def test_random_traces_stay_within_budget(seed):
    rng = random.Random(seed)
    for _ in range(25):
        n_ops, n_storages = rng.randint(3, 60), rng.randint(1, 30)
        ops: list[dict[int, str]] = [{} for _ in range(n_ops)]
        sizes = {}
        for sid in range(n_storages):
            created = rng.randrange(n_ops - 1)
            sizes[sid] = rng.choice([rng.randint(1, 12) * 2**20, rng.randint(1, 900) * 2**10])
            ops[created][sid] = "W"
            count = min(rng.randint(0, 4), n_ops - created - 1)
            for op in rng.sample(range(created + 1, n_ops), count):
                ops[op][sid] = rng.choice("RRRW")
        trace = make_trace(
            ops, sizes, retained=rng.sample(range(n_storages), 1), bw=rng.uniform(1, 50)
        )
        trace = ActivationTrace(
            tuple(
                TraceOp(op.name, rng.choice([0.0, rng.uniform(0.01, 3.0)]), op.accesses)
                for op in trace.ops
            ),
            trace.storage_sizes,
            trace.retained_sids,
            None,
            trace.d2h_bandwidth_gbps,
            rng.uniform(1, 50),
        )
        peak = TraceIndex(trace).natural_peak
        for fraction in (0.8, 0.5, 0.3):
            limited = trace.with_limit(int(fraction * peak))
            if not feasible(limited):
                continue
            plan = TimedPlanner().plan(limited)
            result = check(limited, plan)
            assert result.overhead >= overhead_lower_bound(limited) - 1e-9


@pytest.mark.parametrize("fraction", [0.7, 0.5, 0.35])
def test_synthetic_llama_step_is_close_to_the_offload_only_bound(fraction):
    base = llama_training_trace(SHAPES["tiny"])
    trace = base.with_limit(int(fraction * TraceIndex(base).natural_peak))
    plan = TimedPlanner(recompute=False).plan(trace)
    result = check(trace, plan)
    bound = overhead_lower_bound(trace, recompute=False)
    assert result.peak_bytes <= 1.05 * trace.memory_limit_bytes
    assert bound <= result.overhead <= bound + 0.10
    where = placed(plan)
    ix = TraceIndex(trace)
    for (sid, kind), spots in where.items():
        accesses = ix.by_storage[sid]
        if kind is D2H:  # right after a write
            assert all(dict(accesses).get(op) is True for _, op in spots)
        if kind is H2D:  # before an op that reads it, after the release
            for _, op in spots:
                releases = [r for _, r in where[(sid, RELEASE)] if r < op]
                reader = min(a for a, _ in accesses if a >= op)
                assert releases and reader >= op
        if kind is RELEASE_HOST:  # after the last reader that needed the host copy
            for _, op in spots:
                reloads = [r for _, r in where[(sid, H2D)]]
                assert op >= max(reloads)
