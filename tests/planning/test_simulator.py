"""The schedule simulator on hand-made traces whose timings are worked out by hand.

Every trace here copies at 1 GB/s = 10**6 bytes per ms, so a storage of ``MB`` bytes takes
exactly 1 ms to copy, and every op lasts 1 ms unless said otherwise.
"""

from __future__ import annotations

import pytest

from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.simulate import CopySpan, simulate

MB = 10**6
R, W = AccessKind.READ, AccessKind.WRITE
D2H, RELEASE, H2D, RELEASE_HOST = (
    ActionKind.COPY_D2H,
    ActionKind.RELEASE_DEVICE,
    ActionKind.COPY_H2D,
    ActionKind.RELEASE_HOST,
)


def make_trace(ops, sizes, *, retained=(), limit=None, bw=1.0) -> ActivationTrace:
    """``ops``: one ``{sid: "R" | "W"}`` per op (1 ms each) or ``(duration, {sid: kind})``."""
    built = []
    for index, op in enumerate(ops):
        duration, accesses = op if isinstance(op, tuple) else (1.0, op)
        kinds = tuple(Access(sid, R if kind == "R" else W) for sid, kind in accesses.items())
        built.append(TraceOp(f"op{index}", duration, kinds))
    return ActivationTrace(tuple(built), sizes, frozenset(retained), limit, bw, bw)


def schedule(pre=(), post=()) -> ResidencySchedule:
    """``pre``/``post``: ``(op, sid, kind)`` triples in issue order."""
    result = ResidencySchedule()
    for op, sid, kind in pre:
        result.add_pre(op, sid, kind)
    for op, sid, kind in post:
        result.add_post(op, sid, kind)
    return result


# Storage 1 is written by op 0 and read by op 5; storage 2 lives during ops 2 and 3.
GAP = make_trace([{1: "W"}, {}, {2: "W"}, {2: "R"}, {}, {1: "R"}], {1: MB, 2: MB})


def test_no_actions_is_the_natural_run():
    result = simulate(GAP)
    assert result.total_ms == result.compute_ms == 6.0
    assert result.overhead == 0.0 and result.stall_ms == 0.0
    assert result.peak_bytes == result.natural_peak_bytes == 2 * MB
    assert result.timeline == ((0.0, MB), (2.0, 2 * MB), (4.0, MB), (6.0, 0))
    assert result.copies == () and result.demand_fetches == 0
    assert result.op_start_ms == (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)


def test_copies_at_the_gap_ends_stall_twice():
    # D2H runs 1..2 and the release waits for it; ops 1-4 run 2..6; the reload is issued
    # at 6, runs 6..7, and op 5 waits for it: 8 ms for 6 ms of compute.
    plan = schedule(pre=[(5, 1, H2D)], post=[(0, 1, D2H), (0, 1, RELEASE)])
    result = simulate(GAP, plan)
    assert result.total_ms == pytest.approx(8.0)
    assert result.overhead == pytest.approx(2 / 6)
    assert result.release_wait_ms == pytest.approx(1.0)
    assert result.reload_wait_ms == pytest.approx(1.0)
    assert result.peak_bytes == MB
    assert result.copies == (CopySpan("D2H", 1, 1.0, 2.0, MB), CopySpan("H2D", 1, 6.0, 7.0, MB))
    assert result.timeline == ((0.0, MB), (2.0, 0), (3.0, MB), (5.0, 0), (6.0, MB), (8.0, 0))


def test_well_placed_copies_hide_behind_compute():
    # Release before op 2 (the copy ended at 2), reload before op 4 (runs 4..5): no stall,
    # and storage 1 is away while storage 2 lives.
    plan = schedule(pre=[(2, 1, RELEASE), (4, 1, H2D)], post=[(0, 1, D2H)])
    result = simulate(GAP, plan)
    assert result.total_ms == pytest.approx(6.0) and result.overhead == 0.0
    assert result.peak_bytes == MB and result.natural_peak_bytes == 2 * MB
    assert result.d2h_bytes == result.h2d_bytes == MB


def test_reload_allocates_when_issued():
    early = schedule(pre=[(2, 1, RELEASE), (3, 1, H2D)], post=[(0, 1, D2H)])
    result = simulate(GAP, early)
    assert result.peak_bytes == 2 * MB  # issued before op 3, while storage 2 is alive
    assert (3.0, 2 * MB) in result.timeline
    assert result.overhead == 0.0


def test_one_stream_per_direction_serialises_copies():
    trace = make_trace([{1: "W", 2: "W"}, {}, {1: "R", 2: "R"}], {1: MB, 2: MB})
    plan = schedule(
        pre=[(1, 1, RELEASE), (1, 2, RELEASE), (2, 1, H2D), (2, 2, H2D)],
        post=[(0, 1, D2H), (0, 2, D2H)],
    )
    result = simulate(trace, plan)
    d2h = [(c.start_ms, c.end_ms) for c in result.copies if c.direction == "D2H"]
    h2d = [(c.start_ms, c.end_ms) for c in result.copies if c.direction == "H2D"]
    assert d2h == [(1.0, 2.0), (2.0, 3.0)]  # the second waits for the first
    # Releases wait until 3; op 1 runs 3..4; reloads run 4..5 and 5..6; op 2 runs 6..7.
    assert h2d == [(4.0, 5.0), (5.0, 6.0)]
    assert result.release_wait_ms == pytest.approx(2.0)
    assert result.total_ms == pytest.approx(7.0)


def test_directions_overlap_each_other():
    # Storage 1 goes out while storage 2 comes back: both links busy at once.
    trace = make_trace([{1: "W", 2: "W"}, {}, {}, {}, {1: "R"}, {2: "R"}], {1: MB, 2: MB})
    plan = schedule(
        pre=[(2, 2, RELEASE), (3, 2, H2D), (4, 1, H2D)],
        post=[(0, 2, D2H), (2, 1, D2H), (2, 1, RELEASE)],
    )
    result = simulate(trace, plan)
    spans = {(c.direction, c.storage_id): (c.start_ms, c.end_ms) for c in result.copies}
    assert spans[("D2H", 2)] == (1.0, 2.0)
    assert spans[("D2H", 1)] == (3.0, 4.0)
    assert spans[("H2D", 2)] == (4.0, 5.0)  # issued at 4 (after the release wait), overlaps
    assert result.release_wait_ms == pytest.approx(1.0)


def test_release_waits_for_a_running_reload():
    plan = schedule(pre=[(2, 1, RELEASE), (3, 1, H2D), (3, 1, RELEASE)], post=[(0, 1, D2H)])
    result = simulate(GAP, plan)
    assert result.release_wait_ms == pytest.approx(1.0)  # the reload runs 3..4
    assert result.demand_fetches == 1  # nothing brought it back before op 5


def test_demand_fetch_runs_on_the_h2d_stream_and_stalls():
    plan = schedule(pre=[(2, 1, RELEASE)], post=[(0, 1, D2H)])
    result = simulate(GAP, plan)
    assert result.demand_fetches == 1
    assert result.demand_fetch_ms == pytest.approx(1.0)
    assert result.total_ms == pytest.approx(7.0)
    assert result.copies[-1] == CopySpan("H2D", 1, 5.0, 6.0, MB)
    assert result.h2d_bytes == MB


def test_a_write_makes_the_host_copy_stale():
    trace = make_trace([{1: "W"}, {1: "W"}, {}, {1: "R"}], {1: MB})
    plan = schedule(post=[(0, 1, D2H), (1, 1, RELEASE)])
    result = simulate(trace, plan)
    assert result.op_start_ms[1] == pytest.approx(2.0)  # the writer waits for the copy out
    assert result.ignored_actions == 1  # the release has no valid host copy: nothing happens
    assert result.peak_bytes == MB and result.demand_fetches == 0
    # A fresh copy out after the write makes the release effective again.
    plan = schedule(post=[(0, 1, D2H), (1, 1, D2H), (1, 1, RELEASE)], pre=[(3, 1, H2D)])
    result = simulate(trace, plan)
    assert result.ignored_actions == 0 and result.d2h_bytes == 2 * MB
    assert result.release_wait_ms == pytest.approx(1.0)  # the second copy runs 3..4


def test_redundant_actions_are_ignored():
    plan = schedule(
        pre=[(2, 1, RELEASE), (2, 1, RELEASE), (4, 1, H2D), (4, 1, H2D)],
        post=[(0, 1, D2H), (0, 1, D2H)],
    )
    result = simulate(GAP, plan)
    assert result.ignored_actions == 3
    assert result.d2h_bytes == result.h2d_bytes == MB


def test_host_bytes_follow_copies_and_frees():
    trace = make_trace([{1: "W"}, {}, {1: "R"}, {1: "R"}], {1: MB})
    plan = schedule(post=[(0, 1, D2H), (2, 1, RELEASE_HOST)])
    assert simulate(trace, plan).peak_host_bytes == MB
    # Without RELEASE_HOST the host copy goes with the natural free.
    assert simulate(trace, schedule(post=[(0, 1, D2H)])).peak_host_bytes == MB


def test_retained_storages_are_not_freed_and_params_do_not_count():
    trace = make_trace([{1: "W", 100: "R"}, {1: "R", 2: "W"}, {}], {1: MB, 2: 3 * MB}, retained={2})
    result = simulate(trace)
    assert result.peak_bytes == 4 * MB
    assert result.timeline[-1] == (2.0, 3 * MB)  # storage 1 freed after op 1, 2 kept


def test_record_off_keeps_the_figures():
    plan = schedule(pre=[(5, 1, H2D)], post=[(0, 1, D2H), (0, 1, RELEASE)])
    full, lean = simulate(GAP, plan), simulate(GAP, plan, record=False)
    assert (lean.total_ms, lean.peak_bytes) == (full.total_ms, full.peak_bytes)
    assert lean.timeline == () and lean.copies == ()


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (schedule(post=[(0, 99, D2H)]), "storage 99"),
        (schedule(pre=[(0, 2, D2H)]), "not on the device"),
        (schedule(pre=[(4, 2, H2D)]), "no valid host copy"),  # freed after op 3
        (schedule(pre=[(1, 2, H2D)]), "no valid host copy"),
        (schedule(post=[(6, 1, D2H)]), "op 6"),
        (schedule(pre=[(-1, 1, D2H)]), "op -1"),
    ],
)
def test_invalid_schedules_are_refused(plan, message):
    with pytest.raises(ValueError, match=message):
        simulate(GAP, plan)


def test_error_names_the_op():
    with pytest.raises(ValueError, match="before op 1: storage 2"):
        simulate(GAP, schedule(pre=[(1, 2, D2H)]))


def test_zero_duration_ops_and_empty_trace():
    assert simulate(make_trace([], {})).overhead == 0.0
    result = simulate(make_trace([(0.0, {1: "W"}), (0.0, {1: "R"})], {1: MB}))
    assert result.total_ms == 0.0 and result.overhead == 0.0 and result.peak_bytes == MB


# ---- recompute -------------------------------------------------------------------------------

RECOMPUTE = ActionKind.RECOMPUTE


def pure(trace: ActivationTrace, *ops: int, duration: float | None = None) -> ActivationTrace:
    """``trace`` with ``ops`` marked recomputable (and lasting ``duration`` if given)."""
    marked = list(trace.ops)
    for i in ops:
        op = marked[i]
        marked[i] = TraceOp(
            op.name, op.duration_ms if duration is None else duration, op.accesses, True
        )
    return ActivationTrace(
        tuple(marked),
        trace.storage_sizes,
        trace.retained_sids,
        trace.memory_limit_bytes,
        trace.d2h_bandwidth_gbps,
        trace.h2d_bandwidth_gbps,
    )


# Storage 1 (input, kept) is read by op 1, which makes storage 2; both are read again by op 5.
CHAIN = make_trace([{1: "W"}, {1: "R", 2: "W"}, {}, {}, {}, {1: "R", 2: "R"}], {1: MB, 2: 4 * MB})


def test_a_recomputable_storage_is_released_without_a_host_copy_and_made_again():
    trace = pure(CHAIN, 1, duration=0.5)
    plan = schedule(post=[(1, 2, RELEASE)], pre=[(5, 2, RECOMPUTE)])
    result = simulate(trace, plan)
    assert result.ignored_actions == 0 and result.d2h_bytes == 0 and result.h2d_bytes == 0
    assert result.recomputes == 1 and result.demand_recomputes == 0
    assert result.recompute_ms == pytest.approx(0.5)
    assert result.total_ms == pytest.approx(result.compute_ms + 0.5)
    assert result.op_start_ms[5] == pytest.approx(5.0)  # op 1 lasts 0.5: 4.5 + the recompute
    assert result.peak_bytes == 5 * MB  # back for op 5 only
    assert result.recomputed[0].storage_id == 2 and result.recomputed[0].op == 1
    assert (result.recomputed[0].start_ms, result.recomputed[0].end_ms) == (4.5, 5.0)
    # From op 1's end until the recompute only the input is resident.
    assert [b for t, b in result.timeline if 1.5 <= t < 4.5] == [MB]


def test_without_a_recompute_action_the_access_recomputes_on_demand():
    trace = pure(CHAIN, 1, duration=0.5)
    result = simulate(trace, schedule(post=[(1, 2, RELEASE)]))
    assert result.recomputes == 0 and result.demand_recomputes == 1
    assert result.total_ms == pytest.approx(6.0)  # 5.5 of compute, 0.5 recomputing


def test_an_op_not_marked_recompute_keeps_its_storage_without_a_host_copy():
    result = simulate(CHAIN, schedule(post=[(1, 2, RELEASE)]))
    assert result.ignored_actions == 1 and result.peak_bytes == 5 * MB
    with pytest.raises(ValueError, match="storage 2 cannot be recomputed"):
        simulate(CHAIN, schedule(pre=[(5, 2, RECOMPUTE)], post=[(1, 2, D2H), (2, 2, RELEASE)]))


def test_a_recompute_needs_its_inputs_unchanged_and_on_the_device():
    written = make_trace(
        [{1: "W"}, {1: "R", 2: "W"}, {1: "W"}, {}, {}, {1: "R", 2: "R"}], {1: MB, 2: 4 * MB}
    )
    trace = pure(written, 1)
    result = simulate(trace, schedule(post=[(1, 2, RELEASE)]))
    assert result.ignored_actions == 1  # not released: its input changes at op 2
    # Released with a host copy, it cannot be made again after its input changed.
    away = schedule(post=[(1, 2, D2H), (1, 2, RELEASE)], pre=[(5, 2, RECOMPUTE)])
    with pytest.raises(ValueError, match="storage 2 cannot be recomputed"):
        simulate(trace, away)
    trace = pure(CHAIN, 1)
    away = schedule(post=[(1, 1, D2H), (1, 2, RELEASE), (2, 1, RELEASE)], pre=[(5, 2, RECOMPUTE)])
    with pytest.raises(ValueError, match="needs storage 1"):
        simulate(trace, away)
    # Brought back first, the recompute waits for that copy.
    back = schedule(
        post=[(1, 1, D2H), (1, 2, RELEASE), (2, 1, RELEASE)],
        pre=[(5, 1, H2D), (5, 2, RECOMPUTE)],
    )
    result = simulate(trace, back)
    assert result.recomputes == 1 and result.reload_wait_ms == pytest.approx(1.0)
    # On demand, the input is fetched first, then the storage recomputed.
    result = simulate(trace, schedule(post=[(1, 1, D2H), (1, 2, RELEASE), (2, 1, RELEASE)]))
    assert result.demand_fetches == 1 and result.demand_recomputes == 1


def test_a_chain_is_recomputed_in_order():
    chain = make_trace(
        [{1: "W"}, {1: "R", 2: "W"}, {2: "R", 3: "W"}, {}, {}, {1: "R", 2: "R", 3: "R"}],
        {1: MB, 2: 2 * MB, 3: 4 * MB},
    )
    trace = pure(chain, 1, 2, duration=0.25)
    plan = schedule(
        post=[(2, 2, RELEASE), (2, 3, RELEASE)], pre=[(5, 2, RECOMPUTE), (5, 3, RECOMPUTE)]
    )
    result = simulate(trace, plan)
    assert result.recomputes == 2 and result.total_ms == pytest.approx(4.5 + 0.5)
    with pytest.raises(ValueError, match="needs storage 2"):
        simulate(trace, schedule(post=[(2, 2, RELEASE), (2, 3, RELEASE)], pre=[(5, 3, RECOMPUTE)]))


def test_a_free_waits_for_the_copy_out_still_reading_the_storage():
    # Storage 1 lives for op 0 only; its copy out (4 ms) outlasts it, storage 2 comes at op 1.
    trace = make_trace([{1: "W"}, {2: "W"}, {2: "R"}], {1: 4 * MB, 2: MB})
    result = simulate(trace, schedule(post=[(0, 1, D2H)]))
    assert result.peak_bytes == 5 * MB  # the natural run peaks at 4 MB
    assert result.natural_peak_bytes == 4 * MB


def test_a_kept_output_offloaded_comes_back_before_the_step_ends():
    trace = make_trace([{1: "W"}, {2: "W"}, {2: "R"}], {1: MB, 2: MB}, retained=[1])
    plan = schedule(post=[(0, 1, D2H), (1, 1, RELEASE)])
    result = simulate(trace, plan)
    assert result.demand_fetches == 1 and result.total_ms == pytest.approx(4.0)
    plan = schedule(post=[(0, 1, D2H), (1, 1, RELEASE), (1, 1, H2D)])
    result = simulate(trace, plan)
    assert result.demand_fetches == 0 and result.total_ms == pytest.approx(3.0)
