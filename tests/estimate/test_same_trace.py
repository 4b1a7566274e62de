"""The estimate's fake-tensor trace is the trace a session's warmup records of the same step
on CPU: one recorder (``WarmupEntry``), so the same ops (views included), storages, sizes,
marks and gradients (issue 31, item 7)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._estimate import DeviceProfile, model_spec
from swapopt_core._estimate.breakdown import trace_fake_step
from swapopt_core._estimate.costs import activation_trace
from swapopt_core._estimate.models import loss_of

TINY = str(Path(__file__).parent / "data" / "tiny_llama.json")
PROFILE = DeviceProfile("test", 1.0, 0.5, 10.0, 5.0, 4.0, 5.0)


@pytest.mark.parametrize(
    ("model", "batch", "seq"),
    [
        (TINY, 2, 16),
        (TINY, 1, 24),
        ("tests.estimate.factories:cnn", 4, 1),
        ("tests.estimate.factories:mlp_output", 3, 1),
    ],
)
def test_the_fake_trace_is_the_warmups_trace_on_cpu(model: str, batch: int, seq: int) -> None:
    spec = model_spec(model)
    torch.manual_seed(0)
    built, inputs = spec.build(batch, seq)
    built.train()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=2**20, runtime="loopback"))
    with session:
        out, loss = loss_of(built, inputs, model)
        loss.backward()
    real = session.trace
    assert real is not None

    traced = trace_fake_step(spec, batch, seq, on_cpu=True)
    fake = activation_trace(traced.step, PROFILE)

    assert [op.name for op in fake.ops] == [op.name for op in real.ops]
    assert any(op.name == "view.default" for op in fake.ops) or model.endswith("mlp_output")
    assert [op.accesses for op in fake.ops] == [op.accesses for op in real.ops]
    assert fake.storage_sizes == real.storage_sizes
    assert fake.retained_sids == real.retained_sids
    assert fake.freed_after == real.freed_after
    assert [op.recompute for op in fake.ops] == [op.recompute for op in real.ops]
    assert traced.step.gradients == session._executor.gradient_ready
    del out, loss


def test_an_accelerator_profile_unmarks_what_only_the_cpu_repeats() -> None:
    cpu = trace_fake_step(model_spec(TINY), 2, 16, on_cpu=True).step
    device = trace_fake_step(model_spec(TINY), 2, 16, on_cpu=False).step
    assert [op.name for op in cpu.ops] == [op.name for op in device.ops]
    marked = {op.name for op, other in zip(cpu.ops, device.ops, strict=True) if op.recompute}
    kept = {op.name for op, other in zip(cpu.ops, device.ops, strict=True) if other.recompute}
    assert "mm.default" in marked and "mm.default" not in kept
    assert kept and kept < marked
