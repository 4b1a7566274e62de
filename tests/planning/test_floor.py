"""The feasible floor with kept outputs movable (issue 12): hand-made and random traces whose
floor a schedule reaches, the reason the warning gives, and sizes in a fitting unit."""

from __future__ import annotations

import logging
import math
import random

import pytest

from swapopt_core._planning.bounds import (
    feasible,
    floor_reason,
    format_bytes,
    min_feasible_budget,
    overhead_lower_bound,
    stall_lower_bound_ms,
)
from swapopt_core._planning.simulate import TraceIndex, simulate
from swapopt_core._planning.timed import TimedPlanner
from tests.planning.bound_cases import (
    D2H,
    MB,
    RELEASE,
    any_size,
    floor_schedule,
    make_trace,
    old_floor,
    random_trace,
    schedule,
)


def test_kept_outputs_move_and_the_floor_drops():
    # Op 1 touches 1 and 2 (3 MB); storage 2 (2 MB) is kept: the old floor held it during
    # op 3 as well (4 MB). Moved out after op 1 and back at the end, 3 MB hold.
    trace = make_trace(
        [{1: "W"}, {1: "R", 2: "W"}, {3: "W"}, {3: "R", 1: "R"}],
        {1: MB, 2: 2 * MB, 3: MB},
        retained={2},
    )
    assert old_floor(TraceIndex(trace)) == 4 * MB
    assert min_feasible_budget(trace) == 3 * MB
    assert feasible(trace.with_limit(3 * MB)) and feasible(trace.with_limit(None))
    assert not feasible(trace.with_limit(3 * MB - 1))
    assert overhead_lower_bound(trace.with_limit(3 * MB - 1)) == math.inf
    limited = trace.with_limit(3 * MB)
    plan = schedule(post=[(1, 2, D2H)], pre=[(2, 2, RELEASE)])  # back on demand at the end
    result = simulate(limited, plan)
    assert result.peak_bytes == 3 * MB
    assert result.stall_ms >= stall_lower_bound_ms(limited) > 0
    # (A COPY_H2D in post[3] would land before op 3's natural frees: 4 MB.)
    assert simulate(limited, floor_schedule(limited)).peak_bytes == 3 * MB


def test_kept_outputs_together_set_the_floor():
    # Every op touches 1 MB, but the two kept outputs are both on the device at the end.
    trace = make_trace([{1: "W"}, {2: "W"}, {3: "W"}], {1: MB, 2: MB, 3: MB}, retained={1, 2})
    assert min_feasible_budget(trace) == 2 * MB
    assert "2 retained storages" in floor_reason(trace)
    assert stall_lower_bound_ms(trace.with_limit(2 * MB - 1)) == math.inf
    assert simulate(trace.with_limit(2 * MB), floor_schedule(trace)).peak_bytes == 2 * MB


@pytest.mark.parametrize("seed", range(3))
def test_random_traces_with_kept_outputs_reach_the_new_floor(seed):
    rng = random.Random(500 + seed)
    lowered = 0
    for _ in range(40):
        trace = random_trace(rng, rng.randint(3, 16), rng.randint(2, 10), kept=3)
        ix = TraceIndex(trace)
        floor = min_feasible_budget(trace, index=ix)
        result = simulate(trace, floor_schedule(trace))
        assert result.peak_bytes == floor <= old_floor(ix)
        lowered += floor < old_floor(ix)
    assert lowered >= 5  # budgets the old floor called infeasible, reached by a schedule


def test_floor_reason_names_the_op_and_its_bytes():
    trace = make_trace(
        [{1: "W"}, {1: "R", 2: "W"}, {3: "W"}], {1: 100, 2: 3 * 2**20, 3: 10}, retained={3}
    )
    reason = floor_reason(trace)
    assert reason.startswith("op 1 (op1) reads and writes 3.00 MiB")
    assert "2 storages, the largest 3.00 MiB" in reason
    tiny = make_trace([{1: "W"}], {1: 100})
    assert (
        floor_reason(tiny)
        == "op 0 (op0) reads and writes 100 B of activations by itself (1 storage)"
    )


def test_the_infeasible_budget_warning_names_the_op_and_the_floor(caplog):
    ops = [{1: "W"}, {1: "R", 2: "W"}, {3: "W"}, {3: "R"}, {}, {2: "R"}]
    trace = make_trace(ops, {1: 300, 2: 3 * 2**20, 3: 2**20}, limit=0)
    with caplog.at_level(logging.WARNING, logger="swapopt_core._planning.timed"):
        TimedPlanner().plan(any_size(trace))
    assert "Activation budget 0 B is infeasible: no schedule holds less than 3.00 MiB" in (
        caplog.text
    )
    assert "op 1 (op1) reads and writes 3.00 MiB of activations by itself" in caplog.text
    assert "0.0 MiB" not in caplog.text


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (46 * 2**20, "46.0 MiB"),
        (3 * 2**30, "3.00 GiB"),
    ],
)
def test_sizes_are_written_in_a_unit_that_fits(nbytes, text):
    assert format_bytes(nbytes) == text
