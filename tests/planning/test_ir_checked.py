"""Hostile trace and schedule JSON (issue 10): every bad value is named by its JSON path.

Before, ``Infinity`` sizes ended in ``OverflowError``, deep nesting in ``RecursionError``,
and negative sizes or NaN / negative durations were read and planned into nonsense.
"""

from __future__ import annotations

import copy
import json

import pytest

from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)

R, W = AccessKind.READ, AccessKind.WRITE
GOOD = json.loads(
    ActivationTrace(
        (
            TraceOp("mm", 0.5, (Access(100, R), Access(1, W))),
            TraceOp("relu", 0.25, (Access(1, R), Access(2, W, 0))),
        ),
        {1: 4096, 2: 4096},
        frozenset({2}),
        8192,
    ).to_json()
)


def _edit(path: tuple, value: object) -> str:
    data = copy.deepcopy(GOOD)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return json.dumps(data)


INF, NAN = float("inf"), float("nan")

BAD_TRACES = [
    (("storage_sizes", "1"), INF, "storage_sizes['1']=Infinity is invalid"),
    (("storage_sizes", "1"), -5, "storage_sizes['1']=-5 is invalid"),
    (("storage_sizes", "1"), 1.5, "storage_sizes['1']=1.5 is invalid"),
    (("storage_sizes", "1"), 2**64, "fits in int64"),
    (("storage_sizes", "1"), True, "storage_sizes['1']=true"),
    (("storage_sizes", "1"), "4096", "storage_sizes['1']=\"4096\""),
    (("storage_sizes",), [], "storage_sizes=[] is invalid; expected a JSON object"),
    (("ops", 1, "duration_ms"), NAN, "ops[1].duration_ms=NaN is invalid; expected a finite"),
    (("ops", 1, "duration_ms"), INF, "ops[1].duration_ms=Infinity"),
    (("ops", 1, "duration_ms"), -1, "ops[1].duration_ms=-1 is invalid"),
    (("ops", 1, "duration_ms"), "1", 'ops[1].duration_ms="1"'),
    (("ops", 0, "name"), 3, "ops[0].name=3 is invalid; expected a string"),
    (("ops", 0, "accesses", 1, "kind"), "TOUCH", 'ops[0].accesses[1].kind="TOUCH"'),
    (("ops", 0, "accesses", 1, "storage_id"), 1.0, "ops[0].accesses[1].storage_id=1.0"),
    (("ops", 1, "accesses", 1, "output"), -1, "ops[1].accesses[1].output=-1"),
    (("ops", 1, "accesses"), {"a": 1}, "ops[1].accesses="),
    (("ops", 1), [1], "ops[1]=[1] is invalid; expected a JSON object"),
    (("retained_sids", 0), 7, "retained_sids[0]=7 is invalid; expected a storage id listed"),
    (("memory_limit_bytes",), -1, "memory_limit_bytes=-1"),
    (("memory_limit_bytes",), INF, "memory_limit_bytes=Infinity"),
    (("d2h_bandwidth_gbps",), 0, "d2h_bandwidth_gbps=0 is invalid; expected a finite number > 0"),
    (("h2d_bandwidth_gbps",), NAN, "h2d_bandwidth_gbps=NaN"),
    (("h2d_bandwidth_gbps",), INF, "h2d_bandwidth_gbps=Infinity"),
    (("min_offload_bytes",), INF, "min_offload_bytes=Infinity"),
]


@pytest.mark.parametrize(("path", "value", "words"), BAD_TRACES)
def test_bad_trace_values_are_named(path: tuple, value: object, words: str) -> None:
    with pytest.raises(ValueError) as info:
        ActivationTrace.from_json(_edit(path, value))
    assert words in str(info.value)


def test_a_bad_storage_id_key_is_named() -> None:
    text = json.dumps({"ops": [], "storage_sizes": {"one": 4}})
    with pytest.raises(ValueError, match=r"storage_sizes\['one'\]=\"one\" is invalid"):
        ActivationTrace.from_json(text)


@pytest.mark.parametrize("what", ["trace", "schedule"])
@pytest.mark.parametrize("opening", ["[", '{"a": '])
def test_deeply_nested_json_is_refused_in_one_line(what: str, opening: str) -> None:
    text = opening * 100_000 + "1" + ("]" if opening == "[" else "}") * 100_000
    read = ActivationTrace.from_json if what == "trace" else ResidencySchedule.from_json
    with pytest.raises(ValueError, match=f"The {what} nests JSON"):
        read(text)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"pre": {"-1": []}}', "pre['-1']=\"-1\" is invalid"),
        ('{"pre": {"1e3": []}}', "pre['1e3']"),
        ('{"post": {"0": {}}}', "post['0']={} is invalid; expected a JSON array"),
        ('{"post": {"0": [{"kind": "COPY_D2H"}]}}', "an action with a 'storage_id'"),
        ('{"post": {"0": [{"storage_id": Infinity, "kind": "COPY_D2H"}]}}', "storage_id=Infinity"),
        ('{"post": {"0": [{"storage_id": 1, "kind": "MOVE"}]}}', "post['0'][0].kind=\"MOVE\""),
        ('{"pre": []}', "pre=[] is invalid; expected a JSON object"),
    ],
)
def test_bad_schedule_values_are_named(text: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        ResidencySchedule.from_json(text)
    assert words in str(info.value)


def test_the_good_trace_still_reads() -> None:
    trace = ActivationTrace.from_json(json.dumps(GOOD))
    assert json.loads(trace.to_json()) == GOOD
