"""The activation trace and residency schedule: JSON round trips and what they refuse."""

from __future__ import annotations

import json

import pytest

from swapopt_core._planning.ir import (
    DEFAULT_MIN_OFFLOAD_BYTES,
    Access,
    AccessKind,
    Action,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.synthetic import SHAPES, llama_training_trace

R, W = AccessKind.READ, AccessKind.WRITE
TRACE = ActivationTrace(
    (
        TraceOp("aten.mm.default", 0.5, (Access(100, R), Access(1, W))),
        TraceOp("aten.relu.default", 0.25, (Access(1, R), Access(2, W))),
        TraceOp("aten.empty.memory_format", 0.0),
    ),
    {1: 4 * 2**20, 2: 4 * 2**20},
    frozenset({2}),
    8 * 2**20,
    12.5,
    24.0,
)


def test_trace_round_trip():
    again = ActivationTrace.from_json(TRACE.to_json())
    assert again == TRACE
    assert again.to_json() == TRACE.to_json()


def test_synthetic_trace_round_trip():
    trace = llama_training_trace(SHAPES["tiny"], memory_limit_bytes=10**8)
    assert ActivationTrace.from_json(trace.to_json()) == trace


def test_trace_json_uses_string_keys_and_defaults():
    data = json.loads(TRACE.to_json())
    assert data["storage_sizes"] == {"1": 4 * 2**20, "2": 4 * 2**20}
    assert data["retained_sids"] == [2]
    minimal = ActivationTrace.from_json('{"ops": [], "storage_sizes": {}}')
    assert minimal.memory_limit_bytes is None and minimal.retained_sids == frozenset()
    assert minimal.d2h_bandwidth_gbps == minimal.h2d_bandwidth_gbps == 16.0


def test_output_positions_and_the_size_threshold_round_trip():
    made = ActivationTrace(
        (TraceOp("aten.split.Tensor", 0.5, (Access(100, R), Access(1, W, 1), Access(2, W, 0))),),
        {1: 64, 2: 64},
        min_offload_bytes=4096,
    )
    data = json.loads(made.to_json())
    assert data["ops"][0]["accesses"] == [
        {"storage_id": 100, "kind": "READ"},  # no position: not created by this op
        {"storage_id": 1, "kind": "WRITE", "output": 1},
        {"storage_id": 2, "kind": "WRITE", "output": 0},
    ]
    assert data["min_offload_bytes"] == 4096
    assert ActivationTrace.from_json(made.to_json()) == made


def test_traces_written_before_positions_and_threshold_still_read():
    old = json.loads(TRACE.to_json())
    del old["min_offload_bytes"]
    again = ActivationTrace.from_json(json.dumps(old))
    assert again.min_offload_bytes == DEFAULT_MIN_OFFLOAD_BYTES == 2**20
    assert all(a.output is None for op in again.ops for a in op.accesses)
    assert again == TRACE


def test_with_limit_keeps_everything_else():
    other = TRACE.with_limit(None)
    assert other.memory_limit_bytes is None
    assert other.ops == TRACE.ops and other.storage_sizes == TRACE.storage_sizes
    assert (other.d2h_bandwidth_gbps, other.h2d_bandwidth_gbps) == (12.5, 24.0)
    assert other.min_offload_bytes == TRACE.min_offload_bytes


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"storage_sizes": {}}',
        '{"ops": [{"name": "x", "duration_ms": 1, '
        '"accesses": [{"storage_id": 1, "kind": "TOUCH"}]}], "storage_sizes": {}}',
        '{"ops": [], "storage_sizes": {}, "d2h_bandwidth_gbps": 0}',
        '{"ops": [], "storage_sizes": {}, "memory_limit_bytes": -1}',
        '{"ops": [], "storage_sizes": {}, "min_offload_bytes": -1}',
        '{"ops": [{"name": "x", "duration_ms": 1, '
        '"accesses": [{"storage_id": 1, "kind": "WRITE", "output": -1}]}], "storage_sizes": {}}',
    ],
)
def test_bad_traces_are_refused(text):
    with pytest.raises(ValueError):
        ActivationTrace.from_json(text)


def test_schedule_round_trip_and_order():
    schedule = ResidencySchedule()
    schedule.add_post(0, 1, ActionKind.COPY_D2H)
    schedule.add_post(0, 1, ActionKind.RELEASE_DEVICE)
    schedule.add_pre(1, 1, ActionKind.COPY_H2D)
    schedule.add_post(1, 1, ActionKind.RELEASE_HOST)
    again = ResidencySchedule.from_json(schedule.to_json())
    assert again == schedule and len(again) == 4
    assert list(again.actions()) == [
        ("post", 0, Action(1, ActionKind.COPY_D2H)),
        ("post", 0, Action(1, ActionKind.RELEASE_DEVICE)),
        ("pre", 1, Action(1, ActionKind.COPY_H2D)),
        ("post", 1, Action(1, ActionKind.RELEASE_HOST)),
    ]
    assert ResidencySchedule.from_json("{}") == ResidencySchedule()


@pytest.mark.parametrize(
    "text",
    ["[1]", '{"pre": {"x": []}}', '{"post": {"0": [{"storage_id": 1, "kind": "MOVE"}]}}'],
)
def test_bad_schedules_are_refused(text):
    with pytest.raises(ValueError):
        ResidencySchedule.from_json(text)
