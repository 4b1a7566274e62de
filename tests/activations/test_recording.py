"""The warmup marks the ops that can be recomputed (``TraceOp.recompute``): pure,
deterministic, no random numbers, no in-place write, no view, no device transfer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swapopt_core import ActivationTrace, OffloadConfig, OffloadSession
from swapopt_core._activations.recording import call_devices, fresh_outputs

aten = torch.ops.aten


def _trace(fn, *args: torch.Tensor) -> ActivationTrace:
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1024))
    with session:
        fn(*args)
    assert session.trace is not None
    return session.trace


def _marks(trace: ActivationTrace) -> dict[str, set[bool]]:
    """Op name -> the marks its calls got."""
    marks: dict[str, set[bool]] = {}
    for op in trace.ops:
        marks.setdefault(op.name, set()).add(op.recompute)
    return marks


def _pure_step(x: torch.Tensor, w: torch.Tensor) -> None:
    h = torch.relu(x) + F.gelu(x) + F.silu(x)
    h = F.layer_norm(h, (h.shape[-1],))
    rms = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm, piece by piece
    torch.mm(rms, w).sum()


def test_pure_ops_are_marked() -> None:
    x, w = torch.randn(16, 32), torch.randn(32, 8)
    marks = _marks(_trace(_pure_step, x, w))
    for name in (
        "relu.default",
        "gelu.default",
        "silu.default",
        "add.Tensor",
        "native_layer_norm.default",
        "pow.Tensor_Scalar",
        "mean.dim",
        "rsqrt.default",
        "mul.Tensor",
        "mm.default",
        "sum.default",
    ):
        assert marks.get(name) == {True}, (name, marks.get(name))


def _impure_step(x: torch.Tensor) -> None:
    generator = torch.Generator().manual_seed(3)
    y = x * 2  # a fresh activation to write in place
    y.relu_()
    y.add_(1.0)
    y.view(-1)
    y.t()
    y.transpose(0, 1).expand(2, -1, -1)
    z = torch.zeros_like(y)
    z.copy_(y)
    F.dropout(y, 0.5, training=True)
    torch.bernoulli(torch.full_like(y, 0.5))
    torch.rand(4, generator=generator)
    torch.randn(4, generator=generator)
    torch.normal(torch.zeros(4), torch.ones(4), generator=generator)
    y.new_empty(3)
    torch.matmul(y.unsqueeze(0).expand(2, -1, -1), torch.ones(32, 4))  # ends in _unsafe_view


def test_impure_ops_are_not_marked() -> None:
    marks = _marks(_trace(_impure_step, torch.randn(16, 32)))
    for name in (
        "relu_.default",
        "add_.Tensor",
        "view.default",
        "t.default",
        "transpose.int",
        "expand.default",
        "copy_.default",
        "bernoulli.default",
        "rand.generator",
        "randn.generator",
        "normal.Tensor_Tensor",
        "new_empty.default",
        "_unsafe_view.default",
    ):
        assert marks.get(name) == {False}, (name, marks.get(name))


def test_dropout_model_leaves_its_random_ops_unmarked() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.Dropout(0.2),
        torch.nn.GELU(),
        torch.nn.BatchNorm1d(64),
        torch.nn.Linear(64, 4),
    )
    trace = _trace(lambda x: model(x).square().mean().backward(), torch.randn(8, 32))
    random = [op for op in trace.ops if op.name.startswith(("bernoulli", "native_dropout."))]
    assert random, [op.name for op in trace.ops]
    assert not any(op.recompute for op in random)
    # The mask's storage was made by an op that cannot repeat it: never marked.
    for op in trace.ops:
        if op.name.startswith(("empty", "native_batch_norm")):
            assert not op.recompute, op.name
    assert any(op.recompute for op in trace.ops if op.name.startswith("gelu"))


def test_json_round_trip_keeps_the_marks() -> None:
    trace = _trace(_pure_step, torch.randn(4, 8), torch.randn(8, 2))
    trace = ActivationTrace(
        (*trace.ops, *_trace(_impure_step, torch.randn(16, 32)).ops), trace.storage_sizes
    )
    again = ActivationTrace.from_json(trace.to_json())
    assert [op.recompute for op in again.ops] == [op.recompute for op in trace.ops]
    assert {op.recompute for op in again.ops} == {True, False}


# ---- the checks themselves, on tensors of another device type (meta) ---------------------


def test_a_transfer_to_another_device_type_is_not_marked() -> None:
    x = torch.randn(4)
    devices = call_devices(aten._to_copy.default, (x,), {"device": torch.device("meta")})
    assert devices == frozenset({"cpu"})
    out = aten._to_copy.default(x, device=torch.device("meta"))
    assert not fresh_outputs(out, devices, {x.untyped_storage()}, {}, ())


def test_an_output_in_an_input_storage_is_not_fresh() -> None:
    x = torch.randn(4, 4)
    out = aten._unsafe_view.default(x, [16])
    assert call_devices(aten._unsafe_view.default, (x, [16]), {}) == frozenset({"cpu"})
    assert not fresh_outputs(out, frozenset({"cpu"}), {x.untyped_storage()}, {}, ())
    assert fresh_outputs(torch.relu(x), frozenset({"cpu"}), {x.untyped_storage()}, {}, ())


def test_ops_that_may_differ_off_the_cpu_need_deterministic_algorithms() -> None:
    x = torch.zeros(8, device="meta")
    index = torch.zeros(8, dtype=torch.long, device="meta")
    args = (x, 0, index, x)
    assert call_devices(aten.relu.default, (x,), {}) == frozenset({"meta"})
    assert call_devices(aten.mm.default, (x.view(2, 4), x.view(4, 2)), {}) is None
    assert call_devices(aten.scatter_add.default, args, {}) is None
    cpu = (torch.zeros(8), 0, torch.zeros(8, dtype=torch.long), torch.zeros(8))
    assert call_devices(aten.scatter_add.default, cpu, {}) == frozenset({"cpu"})
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert call_devices(aten.scatter_add.default, args, {}) == frozenset({"meta"})
    finally:
        torch.use_deterministic_algorithms(before)


def test_hidden_state_and_sparse_inputs_are_not_marked() -> None:
    x = torch.randn(4, 3)
    stats = (torch.zeros(3), torch.ones(3))
    bn = (x, None, None, *stats, True, 0.1, 1e-5)
    assert call_devices(aten.native_batch_norm.default, bn, {}) is None
    assert call_devices(aten.empty_like.default, (x,), {}) is None
    assert call_devices(aten.relu.default, (x.to_sparse(),), {}) is None
