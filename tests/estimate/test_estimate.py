"""``swapopt_core._estimate``: the fake-tensor trace against a real CPU step, pricing, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from swapopt_core._estimate import DeviceProfile, estimate, model_spec
from swapopt_core._estimate.breakdown import trace_fake_step
from swapopt_core._estimate.costs import OPTIMIZERS, activation_trace, optimizer_costs
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ResidencySchedule

TINY = str(Path(__file__).parent / "data" / "tiny_llama.json")
#: A made-up device, so that no test measures this machine.
PROFILE = DeviceProfile("test", 1.0, 0.5, 10.0, 5.0, 4.0, 5.0)


class _Nothing(ResidencyPlanner):
    name = "nothing"

    def plan(self, trace: Any) -> ResidencySchedule:
        return ResidencySchedule()


def _measured_peak(model: torch.nn.Module, run: Any) -> int:
    """The whole-step peak of real CPU training, counted by torch's MemTracker (steady
    state: the optimizer's state exists). The loop holds the model's output through the
    step, as ``out = model(...)`` does (and as the estimate assumes)."""
    optimizer = torch.optim.AdamW(model.parameters())

    def step() -> None:
        out, loss = run(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        del out

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_tiny_llama_plain_peak_is_a_real_cpu_steps() -> None:
    import transformers

    config = json.loads(Path(TINY).read_text())
    config.pop("torch_dtype")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)
    )
    ids = torch.randint(0, config["vocab_size"], (2, 64))

    def run(m: torch.nn.Module) -> tuple[Any, torch.Tensor]:
        out = m(input_ids=ids, labels=ids)
        return out, out.loss

    measured = _measured_peak(model, run)
    found = estimate(model_spec(TINY), 2, 64, PROFILE, _Nothing())
    params = sum(p.numel() for p in model.parameters())
    assert found.plain.params_bytes == sum(p.nbytes for p in model.parameters()) + sum(
        b.nbytes for b in model.buffers()
    )
    assert found.plain.grads_bytes == 4 * params
    assert found.plain.optimizer_state_bytes == 2 * 4 * params
    # MemTracker also counts AdamW's 4-byte step counters; nothing else may differ.
    assert abs(found.plain.peak_bytes - measured) <= 4 * len(list(model.parameters()))
    assert found.plan is None


def test_factory_cnn_plain_peak_is_a_real_cpu_steps() -> None:
    from tests.estimate import factories

    torch.manual_seed(0)
    model, example = factories.cnn()
    images, labels = example(8, 1)
    measured = _measured_peak(model, lambda m: (None, m(images, labels)))
    found = estimate(model_spec("tests.estimate.factories:cnn"), 8, 1, PROFILE, _Nothing())
    assert abs(found.plain.peak_bytes - measured) <= 4 * len(list(model.parameters()))


def test_trace_shape_and_pricing() -> None:
    traced = trace_fake_step(model_spec(TINY), 2, 64, on_cpu=True)
    step = traced.step
    assert 0 < step.backward_start < len(step.ops)
    names = {op.name for op in step.ops}
    assert "mm.default" in names
    assert {"view.default", "t.default"} <= names  # views, as a warmup records them
    assert "device.default" not in names  # a query only fake tensors dispatch
    views = [
        op for op in step.ops if op.name in ("view.default", "t.default", "_unsafe_view.default")
    ]
    assert views and not any(op.kernel or op.nbytes or op.flops for op in views)
    assert step.retained  # the loss and the logits the output holds
    assert len(step.gradients) == len(traced.params)
    flops = sum(op.flops for op in step.ops)
    assert flops > 0
    trace = activation_trace(step, PROFILE)
    assert trace.h2d_bandwidth_gbps == 5.0 and trace.d2h_bandwidth_gbps == 4.0
    for op, priced in zip(step.ops, trace.ops, strict=True):
        rate = 1e12 if op.low_precision else 0.5e12
        expected = max(op.flops / rate, op.nbytes / 10e9) * 1e3 + 5e-3 if op.kernel else 0.0
        assert priced.duration_ms == pytest.approx(expected)
    # Gradients are not activations.
    made = {a.storage_id for op in step.ops for a in op.accesses if a.output is not None}
    assert set(trace.storage_sizes) < made


def test_optimizer_costs_split_fixed_and_swappable() -> None:
    costs = optimizer_costs([(2048, 4), (10, 4), (4096, 2)], OPTIMIZERS["adamw"], PROFILE)
    assert costs.unit_bytes == (2 * 2048 * 4, 2 * 4096 * 2)
    assert costs.fixed_state_bytes == 2 * 10 * 4
    state = 2 * (2048 * 4 + 10 * 4 + 4096 * 2)
    moved = 20 * (2048 * 4 + 10 * 4 + 4096 * 2)
    assert costs.update_ms_per_byte * state == pytest.approx(moved / 10e9 * 1e3)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rmsprop", "muon"])
def test_one_state_families(optimizer: str) -> None:
    found = estimate(model_spec(TINY), 1, 16, PROFILE, _Nothing(), optimizer=optimizer)
    assert found.plain.optimizer_state_bytes == found.plain.grads_bytes


def test_dtype_flag_builds_bf16() -> None:
    found = estimate(model_spec(TINY, "bfloat16"), 1, 16, PROFILE, _Nothing())
    fp32 = estimate(model_spec(TINY), 1, 16, PROFILE, _Nothing())
    assert found.plain.params_bytes * 2 == pytest.approx(fp32.plain.params_bytes, abs=64)


def test_unknown_optimizer() -> None:
    with pytest.raises(ValueError, match="--optimizer lion: expected one of adamw"):
        estimate(model_spec(TINY), 1, 16, PROFILE, _Nothing(), optimizer="lion")


def test_builtin_profiles() -> None:
    from swapopt_core._estimate import profile_named

    h200 = profile_named(" H200 ")
    assert (
        h200.name == "h200" and h200.mem_bandwidth_gbps > profile_named("h100").mem_bandwidth_gbps
    )
    # Compute-bound, memory-bound, and the launch overhead alone.
    assert h200.op_ms(690e12, 0, True) == pytest.approx(1e3 + 4e-3)
    assert h200.op_ms(0, 4320e9, False) == pytest.approx(1e3 + 4e-3)
    assert h200.op_ms(0, 0, False) == pytest.approx(4e-3)
    cpu = profile_named("cpu")  # measured here, once per process
    assert cpu is profile_named("cpu")
    values = [v for v in cpu.to_dict().values() if not isinstance(v, str)]
    assert all(v > 0 for v in values)
