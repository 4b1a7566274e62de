"""Property tests (hypothesis) of the planning IR and the planner (issue 10).

* A trace and a schedule read back from their JSON equal what was written, and write the
  same JSON again.
* The default planner's schedule, replayed by the simulator, never holds more than the
  budget (or the feasible floor when the budget is below it), never fetches on demand (no
  reader runs before its reload), issues no action the simulator ignores, and every reload
  has a reader after it.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swapopt_core._planning.bounds import min_feasible_budget, overhead_lower_bound
from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    Action,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.simulate import TraceIndex, simulate
from swapopt_core._planning.timed import TimedPlanner

PROPERTY = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MB = 10**6

durations = st.one_of(st.just(0.0), st.floats(0.001, 5.0, allow_nan=False, allow_infinity=False))
bandwidths = st.floats(0.05, 100.0, allow_nan=False, allow_infinity=False)


@st.composite
def traces(draw, *, max_ops: int = 24, max_storages: int = 12) -> ActivationTrace:
    """Consistent small traces: each storage is written first, then read or written later."""
    n_ops = draw(st.integers(2, max_ops))
    n_storages = draw(st.integers(1, max_storages))
    accesses: list[dict[int, AccessKind]] = [{} for _ in range(n_ops)]
    sizes = {}
    for sid in range(n_storages):
        created = draw(st.integers(0, n_ops - 2))
        sizes[sid] = draw(st.sampled_from([MB // 4, MB // 2, MB, 3 * MB, 2**20, 7 * 2**10]))
        accesses[created][sid] = AccessKind.WRITE
        later = draw(st.lists(st.integers(created + 1, n_ops - 1), max_size=4, unique=True))
        for op in later:
            accesses[op][sid] = draw(st.sampled_from([AccessKind.READ, AccessKind.WRITE]))
    outside = draw(st.lists(st.integers(100, 103), max_size=3))  # parameters: not activations
    ops = tuple(
        TraceOp(
            draw(st.sampled_from(["aten.mm.default", "aten.relu.default", "op ü"])),
            draw(durations),
            tuple(Access(sid, kind) for sid, kind in op.items())
            + tuple(Access(p, AccessKind.READ) for p in outside if i % 2),
        )
        for i, op in enumerate(accesses)
    )
    retained = draw(st.frozensets(st.sampled_from(sorted(sizes)), max_size=2))
    return ActivationTrace(
        ops,
        sizes,
        retained,
        None,
        draw(bandwidths),
        draw(bandwidths),
        draw(st.sampled_from([0, 2**19, 2**20])),
    )


@st.composite
def json_traces(draw) -> ActivationTrace:
    """Any trace the JSON form can hold: outputs, limits and odd names included."""
    trace = draw(traces())
    ops = tuple(
        TraceOp(
            draw(st.text(max_size=12)),
            op.duration_ms,
            tuple(
                Access(a.storage_id, a.kind, draw(st.one_of(st.none(), st.integers(0, 9))))
                for a in op.accesses
            ),
        )
        for op in trace.ops
    )
    limit = draw(st.one_of(st.none(), st.integers(0, 2**63 - 1)))
    return ActivationTrace(
        ops,
        trace.storage_sizes,
        trace.retained_sids,
        limit,
        trace.d2h_bandwidth_gbps,
        trace.h2d_bandwidth_gbps,
        draw(st.integers(0, 2**40)),
    )


@PROPERTY
@given(json_traces())
def test_trace_json_round_trip(trace: ActivationTrace) -> None:
    text = trace.to_json()
    again = ActivationTrace.from_json(text)
    assert again == trace
    assert again.to_json() == text


actions = st.builds(Action, st.integers(-(2**63), 2**63 - 1), st.sampled_from(list(ActionKind)))
sides = st.dictionaries(st.integers(0, 10**6), st.lists(actions, min_size=1, max_size=4))


@PROPERTY
@given(sides, sides)
def test_schedule_json_round_trip(pre: dict, post: dict) -> None:
    schedule = ResidencySchedule(pre, post)
    text = schedule.to_json()
    again = ResidencySchedule.from_json(text)
    assert again == schedule
    assert again.to_json() == text
    assert list(again.actions()) == list(schedule.actions())


@PROPERTY
@given(traces(), st.floats(0.0, 1.0))
def test_the_planner_keeps_its_budget_and_reloads_before_the_reader(
    trace: ActivationTrace, fraction: float
) -> None:
    ix = TraceIndex(trace)
    limited = trace.with_limit(int(fraction * ix.natural_peak))
    schedule = TimedPlanner().plan(limited)
    result = simulate(limited, schedule)
    ceiling = max(limited.memory_limit_bytes, min_feasible_budget(limited))
    assert result.peak_bytes <= ceiling
    kept = limited.retained_sids  # a kept output may come back at the end, unread
    # No reader ran before its reload (kept outputs may be fetched when the step ends).
    assert result.demand_fetches <= len(kept)
    assert result.ignored_actions == 0
    for side, op, action in schedule.actions():
        if action.kind is ActionKind.COPY_H2D:
            first_use = op if side == "pre" else op + 1
            readers = [i for i, _ in ix.by_storage[action.storage_id] if i >= first_use]
            assert readers or action.storage_id in kept, f"{action} at {side} {op}, never read"
    bound = overhead_lower_bound(limited)
    if math.isfinite(bound) and result.peak_bytes <= limited.memory_limit_bytes:
        assert result.overhead >= bound - 1e-9
    assert ResidencySchedule.from_json(schedule.to_json()) == schedule
