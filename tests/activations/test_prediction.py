"""``fresh_bytes``: the bytes of new storage an op will allocate, from the op run on meta
tensors (what the warmup makes room for before the op runs)."""

from __future__ import annotations

import torch

from swapopt_core._activations.prediction import fresh_bytes

aten = torch.ops.aten


def test_fresh_bytes_counts_new_storages_only() -> None:
    x = torch.randn(8, 16)
    assert fresh_bytes(aten.mm.default, (x, torch.randn(16, 32)), {}) == 8 * 32 * 4
    assert fresh_bytes(aten.view.default, (x, [128]), {}) == 0  # a view of its input
    assert fresh_bytes(aten.add_.Tensor, (x, x), {}) == 0  # in place
    out = torch.empty(8, 16)
    assert fresh_bytes(aten.add.out, (x, x), {"out": out}) == 0  # into its out= argument
    # Several outputs: each new storage once.
    made = fresh_bytes(aten.native_layer_norm.default, (x, [16], None, None, 1e-5), {})
    assert made == 8 * 16 * 4 + 2 * 8 * 4
    # A factory on the device it names.
    assert fresh_bytes(aten.arange.default, (10,), {"device": torch.device("cpu")}) == 80
    # Sizes that depend on the data, or no meta kernel: nothing predicted.
    assert fresh_bytes(aten.nonzero.default, (x,), {}) == 0
    assert fresh_bytes(aten._local_scalar_dense.default, (x.sum(),), {}) == 0


def test_fresh_bytes_draws_no_random_numbers() -> None:
    x = torch.randn(64, 64)
    state = torch.get_rng_state()
    assert fresh_bytes(aten.native_dropout.default, (x, 0.5, True), {}) == 64 * 64 * 5
    assert torch.equal(state, torch.get_rng_state())


def test_fresh_bytes_tells_calls_apart_by_argument_type() -> None:
    x = torch.arange(8)  # int64
    assert fresh_bytes(aten.add.Tensor, (x, torch.ones(8, dtype=torch.int32)), {}) == 64
    assert fresh_bytes(aten.mul.Scalar, (x, 2), {}) == 64
    assert fresh_bytes(aten.mul.Scalar, (x, 2.0), {}) == 32  # promoted to float32
    assert fresh_bytes(aten.mul.Scalar, (x, 2), {}) == 64  # a cached answer per type
