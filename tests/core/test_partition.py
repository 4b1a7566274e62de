"""The byte-balanced, order-preserving partition of a step into batches."""

from __future__ import annotations

import random

import pytest

from swapopt_core._planning.partition import partition


def _sums(costs: list[int], runs: list[range]) -> list[int]:
    return [sum(costs[i] for i in run) for run in runs]


def test_balances_bytes_and_keeps_order() -> None:
    costs = [16, 16, 16, 16, 16, 1, 16, 16, 4, 2, 4, 2]
    runs = partition(costs, 4)
    assert [list(r) for r in runs] == [[0, 1], [2, 3], [4, 5, 6], [7, 8, 9, 10, 11]]
    assert _sums(costs, runs) == [32, 32, 33, 28]


@pytest.mark.parametrize(
    ("costs", "parts", "expected"),
    [
        ([], 4, []),
        ([512, 16, 16], 2, [[0], [1, 2]]),
        ([0, 0, 0, 0], 2, [[0, 1], [2, 3]]),
        ([5, 5, 5], 8, [[0], [1], [2]]),
        ([7], 1, [[0]]),
        ([1, 1, 100], 3, [[0], [1], [2]]),
    ],
)
def test_edge_cases(costs: list[int], parts: int, expected: list[list[int]]) -> None:
    assert [list(r) for r in partition(costs, parts)] == expected


def test_equal_layers_split_evenly() -> None:
    runs = partition([1000] * 32, 8)
    assert [len(r) for r in runs] == [4] * 8


def test_random_inputs_cover_every_item_once_in_order() -> None:
    rng = random.Random(7)
    for _ in range(200):
        costs = [rng.choice([0, 1, 64, 4096, 10**6]) for _ in range(rng.randint(1, 40))]
        parts = rng.randint(1, 20)
        runs = partition(costs, parts)
        assert len(runs) == min(parts, len(costs))
        assert [i for run in runs for i in run] == list(range(len(costs)))
        assert all(len(run) > 0 for run in runs)


# ---- properties (hypothesis) ---------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from swapopt_core._swap.layout import plan_layout  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1 << 20), max_size=40), st.integers(1, 12))
def test_partition_property(costs: list[int], parts: int) -> None:
    runs = partition(costs, parts)
    assert [i for run in runs for i in run] == list(range(len(costs)))
    assert all(len(run) > 0 for run in runs)
    assert len(runs) == min(parts, len(costs))


class _FakeSlot:
    def __init__(self, dtype: str, numel: int) -> None:
        self.dtype, self.numel, self.offset, self.device = dtype, numel, -1, "dev"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["f16", "f32", "f64"]), st.integers(0, 64))))
def test_layout_plan_property(specs: list[tuple[str, int]]) -> None:
    slots = [_FakeSlot(dtype, numel) for dtype, numel in specs]
    plan = plan_layout(slots, (-1,), lambda s: (s.dtype, s.numel))
    assert plan is not None
    signature, totals = plan
    assert signature == tuple(id(s) for s in slots)
    for dtype in {d for d, _ in specs}:
        assert totals[dtype] == sum(n for d, n in specs if d == dtype)
