"""Replay runs on the serialised contract: a trace and a schedule read back from JSON."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swapopt_core import (
    ActivationTrace,
    OffloadConfig,
    OffloadSession,
    ResidencySchedule,
)
from swapopt_core._cli.main import main
from swapopt_core._planning.ir import ActionKind
from swapopt_core._planning.simulate import simulate
from swapopt_core._planning.synthetic import SHAPES, llama_training_trace
from tests.activations.test_session import Net, Wide, _batch, _grads, _step


def _every_gap(runtime: str) -> OffloadConfig:
    return OffloadConfig(
        max_resident_activation_mb=0.25, runtime=runtime, planner="every-gap", min_offload_kib=0
    )


def _through_json(
    trace: ActivationTrace, schedule: ResidencySchedule
) -> tuple[ActivationTrace, ResidencySchedule]:
    return ActivationTrace.from_json(trace.to_json()), ResidencySchedule.from_json(
        schedule.to_json()
    )


def test_a_session_replays_bit_exactly_from_a_plan_read_back_from_json(
    manager, runtime_name: str
) -> None:
    config = _every_gap(runtime_name)
    recorder, model, x = OffloadSession(config, plugin_manager=manager), Net(), _batch(0)
    with recorder:
        _step(model, x, seed=0)
    trace, schedule = _through_json(recorder.trace, recorder.schedule)
    assert {a.kind for _, _, a in schedule.actions()} == set(ActionKind) - {ActionKind.RECOMPUTE}

    reference, replayed = Net(), Net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    opt = torch.optim.SGD(replayed.parameters(), lr=0.05)
    session = OffloadSession(config, plugin_manager=manager)
    session.load_plan(trace, schedule)
    assert session.trace is trace and session.schedule is schedule
    for step in range(1, 4):
        x = _batch(step)
        ref_loss, ref_logits = _step(reference, x, seed=step)
        with session:
            loss, logits = _step(replayed, x, seed=step)
        assert torch.equal(loss, ref_loss) and torch.equal(logits, ref_logits)
        for a, b in zip(_grads(reference), _grads(replayed), strict=True):
            assert torch.equal(a, b)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    stats = session.stats()
    assert (stats.warmups, stats.replays, stats.retraces) == (0, 3, 0)
    assert stats.d2h_bytes > 0 and stats.h2d_bytes > 0  # the loaded plan moved bytes
    assert stats.planned_actions == len(schedule)


def test_swapopt_plan_plans_a_session_trace_as_the_session_did(
    tmp_path: Path, runtime_name: str
) -> None:
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, runtime=runtime_name))
    model = Wide()
    with probe:
        model(x).backward()
    budget_mb = 0.5 * simulate(probe.trace).natural_peak_bytes / 2**20
    config = OffloadConfig(
        max_resident_activation_mb=budget_mb, runtime=runtime_name, min_offload_kib=64
    )
    recorder = OffloadSession(config)
    model.zero_grad()
    with recorder:
        model(x).backward()
    assert recorder.trace.min_offload_bytes == 64 * 2**10
    trace_file, plan_file = tmp_path / "trace.json", tmp_path / "plan.json"
    trace_file.write_text(recorder.trace.to_json())
    argv = ["plan", "--trace", str(trace_file), "--budget-mb", repr(budget_mb)]
    assert main([*argv, "--out", str(plan_file)]) == 0
    assert plan_file.read_text() == recorder.schedule.to_json()  # same budget, same threshold

    reference, replayed = Wide(), Wide()
    session = OffloadSession(config)
    session.load_plan(
        ActivationTrace.from_json(trace_file.read_text()),
        ResidencySchedule.from_json(plan_file.read_text()),
    )
    for step in range(2):
        for model in (reference, replayed):
            model.zero_grad()
        inputs = x * (step + 1)
        reference(inputs).backward()
        with session:
            replayed(inputs).backward()
        for a, b in zip(reference.parameters(), replayed.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
    stats = session.stats()
    assert (stats.warmups, stats.replays) == (0, 2) and stats.d2h_bytes > 0


def test_a_loaded_plan_for_another_step_is_traced_again(manager, runtime_name: str) -> None:
    config = _every_gap(runtime_name)
    recorder, model, x = OffloadSession(config, plugin_manager=manager), Net(), _batch(0)
    with recorder:
        _step(model, x, seed=0)
    session = OffloadSession(config, plugin_manager=manager)
    session.load_plan(*_through_json(recorder.trace, recorder.schedule))
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    reference, model = Wide(), Wide()
    reference(x.exp()).backward()
    with session:  # another op first: a full warmup that re-plans
        model(x.exp()).backward()
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    stats = session.stats()
    assert (stats.warmups, stats.retraces, stats.replays) == (1, 1, 0)
    assert session.trace is not None and session.trace.ops[0].name != recorder.trace.ops[0].name


def test_a_plan_that_cannot_drive_a_replay_is_refused(manager, runtime_name: str) -> None:
    session = OffloadSession(_every_gap(runtime_name), plugin_manager=manager)
    synthetic = llama_training_trace(SHAPES["tiny"])  # planned and simulated, never recorded
    with pytest.raises(
        ValueError, match=r"cannot drive a replay: storage \d+ .*no output position"
    ):
        session.load_plan(synthetic, ResidencySchedule())
    with session:
        _step(Net(), _batch(0), seed=0)
    trace = session.trace
    alien = ResidencySchedule()
    alien.add_pre(len(trace.ops), min(trace.storage_sizes), ActionKind.COPY_H2D)
    with pytest.raises(ValueError, match=rf"does not fit the trace: pre op {len(trace.ops)} "):
        session.load_plan(trace, alien)
    with pytest.raises(TypeError, match="schedule must be a ResidencySchedule, got str"):
        session.load_plan(trace, "plan.json")  # type: ignore[arg-type]
    assert session.schedule is not alien  # the session's own plan stays
