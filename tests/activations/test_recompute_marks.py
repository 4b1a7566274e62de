"""The recompute marks a replay trusts: inputs made under ``torch.inference_mode()`` are
recomputed from (they have no version counter), and a trace edited to mark an op the tracer
never would is refused at ``load_plan`` or, where only the live op tells, kept or copied
instead of recomputed: never other bits."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from swapopt_core import ActivationTrace, OffloadConfig, OffloadSession
from swapopt_core._activations.recording import check_marks
from swapopt_core._planning.ir import ActionKind
from swapopt_core._planning.simulate import simulate
from tests.activations.conftest import RecomputeEveryGap
from tests.activations.test_recompute import _plan


@torch.library.custom_op("swapopt_test::silu", mutates_args=())
def _noisy_silu(x: torch.Tensor) -> torch.Tensor:
    """A custom op that the trace names ``silu.default``, like aten's, but draws noise."""
    return F.silu(x) + torch.rand_like(x)


@_noisy_silu.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class FromInference(torch.nn.Module):
    """Reads an inference-mode input and an inference-mode buffer through ops whose outputs
    are saved for backward; ``bump`` writes the buffer in place inside inference mode."""

    def __init__(self, bump: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bias = torch.nn.Parameter(torch.randn(64))
        self.gain = torch.nn.Parameter(torch.randn(64))
        self.lin = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 4)
        with torch.inference_mode():
            self.register_buffer("shift", torch.randn(64))
        self.bump = bump

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.bias  # saved by the SiLU: recomputed from the inference input
        m = self.shift + self.gain  # saved by the multiply: recomputed from the buffer
        if self.bump:
            with torch.inference_mode():
                self.shift.add_(1.0)  # the only way an inference tensor changes
        a = F.silu(h) * m
        return self.out(self.lin(a))


def _inference_batch(step: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.randn(32, 64, generator=torch.Generator().manual_seed(step))


def _same_steps(reference, replayed, session, batch, steps: int = 3, reseed: bool = False) -> None:
    """Run ``steps`` steps of both models (the second inside ``session``): same bits. With
    ``reseed``, both runs of a step start from the same random state."""
    for step in range(steps):
        x = batch(step)
        if reseed:
            torch.manual_seed(step)
        ref_loss = reference(x).square().mean()
        ref_loss.backward()
        if reseed:
            torch.manual_seed(step)
        with session:
            loss = replayed(x).square().mean()
            loss.backward()
        assert torch.equal(loss, ref_loss)
        for a, b in zip(reference.parameters(), replayed.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
            a.grad = b.grad = None


def test_inputs_made_in_inference_mode_are_recomputed_from(manager, runtime_name: str) -> None:
    config = OffloadConfig(runtime=runtime_name, planner="recompute-every-gap", min_offload_kib=0)
    session = OffloadSession(config, plugin_manager=manager)
    _same_steps(FromInference(), FromInference(), session, _inference_batch)
    stats = session.stats()
    assert (stats.warmups, stats.replays, stats.retraces) == (1, 2, 0)
    adds = [op for op in session.trace.ops if op.name == "add.Tensor"]
    assert [op.recompute for op in adds[:2]] == [True, True]  # x + bias, shift + gain
    assert stats.recomputes >= 2 * 2  # both adds' outputs, in each replay


def test_an_inference_input_written_later_in_the_step_is_not_recomputed_from(
    manager, runtime_name: str
) -> None:
    config = OffloadConfig(runtime=runtime_name, planner="recompute-every-gap", min_offload_kib=0)
    session = OffloadSession(config, plugin_manager=manager)
    _same_steps(FromInference(bump=True), FromInference(bump=True), session, _inference_batch)
    stats = session.stats()
    assert (stats.warmups, stats.replays, stats.retraces) == (1, 2, 0)
    adds = [op for op in session.trace.ops if op.name == "add.Tensor"]
    assert [op.recompute for op in adds[:2]] == [True, False]  # x + bias, shift + gain
    assert stats.recomputes >= 2  # the first add's output still is


# ---- marks a trace may not carry ---------------------------------------------------------


class Noisy(torch.nn.Module):
    """``rand_like`` noise, a view and an in-place op around saved activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 64)
        self.out = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        noisy = h * torch.rand_like(h)
        flat = noisy.view(-1).view(32, 64)
        flat = flat.relu_()
        return self.out(F.silu(flat))


def _recorded(model: torch.nn.Module, x: torch.Tensor) -> ActivationTrace:
    session = OffloadSession(OffloadConfig(runtime="loopback"))
    with session:
        model(x).square().mean().backward()
    return session.trace


def _marked(trace: ActivationTrace, name: str) -> tuple[ActivationTrace, int]:
    """``trace`` with its first op called ``name`` marked recompute, and that op's index."""
    index = next(i for i, op in enumerate(trace.ops) if op.name == name)
    ops = list(trace.ops)
    ops[index] = dataclasses.replace(ops[index], recompute=True)
    return dataclasses.replace(trace, ops=tuple(ops)), index


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("rand_like.default", "draws random numbers"),
        ("view.default", "returns a view of an input"),
        ("relu_.default", "writes its arguments in place"),
    ],
)
def test_load_plan_refuses_marks_the_tracer_never_makes(name: str, why: str) -> None:
    trace = _recorded(Noisy(), torch.randn(32, 16))
    assert not any(op.recompute for op in trace.ops if op.name == name)
    edited, index = _marked(trace, name)
    edited = ActivationTrace.from_json(edited.to_json())  # as a user's edited file
    session = OffloadSession(OffloadConfig(runtime="loopback"))
    with pytest.raises(ValueError, match=rf"op {index} \({name}\) recompute.*{why}"):
        session.load_plan(edited, RecomputeEveryGap().plan(edited))
    assert session.schedule is None  # nothing adopted


def test_load_plan_refuses_unknown_ops_and_in_place_writes_of_marked_ops() -> None:
    trace = _recorded(Noisy(), torch.randn(32, 16))
    renamed = dataclasses.replace(trace.ops[0], name="my_fused_thing.default", recompute=True)
    with pytest.raises(ValueError, match=r"op 0 \(my_fused_thing.default\).*not an aten op"):
        check_marks(dataclasses.replace(trace, ops=(renamed, *trace.ops[1:])))
    index = next(i for i, op in enumerate(trace.ops) if op.name == "relu_.default")
    disguised = dataclasses.replace(trace.ops[index], name="relu.default", recompute=True)
    ops = (*trace.ops[:index], disguised, *trace.ops[index + 1 :])
    with pytest.raises(ValueError, match=rf"op {index} \(relu.default\).*writes storage"):
        check_marks(dataclasses.replace(trace, ops=ops))


class CustomNoise(torch.nn.Module):
    """A custom op that the trace cannot tell from aten's SiLU by name; its output is saved
    for the weight gradient of the next linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noisy = torch.ops.swapopt_test.silu(x)
        return self.out(F.silu(self.lin(noisy)))


def test_a_mark_only_the_live_op_refutes_is_copied_not_recomputed(
    runtime_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    batch = lambda step: torch.randn(32, 64, generator=torch.Generator().manual_seed(step))  # noqa: E731
    trace = _recorded(CustomNoise(), batch(0))
    edited, index = _marked(trace, "silu.default")  # the custom op comes first
    check_marks(edited)  # by its name it is aten's SiLU: only the live op tells
    schedule = _plan(edited)
    assert simulate(edited, schedule).recomputes > 0
    made = [a.storage_id for a in edited.ops[index].accesses if a.output is not None]
    assert any(
        a.kind is ActionKind.RECOMPUTE and a.storage_id in made for _, _, a in schedule.actions()
    )
    session = OffloadSession(OffloadConfig(runtime=runtime_name, min_offload_kib=0))
    session.load_plan(edited, schedule)
    reference, replayed = CustomNoise(), CustomNoise()
    with caplog.at_level(logging.DEBUG, logger="swapopt_core._activations.recipe"):
        _same_steps(reference, replayed, session, batch, steps=2, reseed=True)  # the noise
    assert "swapopt_test.silu" in caplog.text and "namespace" in caplog.text
    assert session.stats().replays == 2
