"""OffloadSession on the loopback runtimes (synchronous, and asynchronous with jitter): same
bits as without it, within the budget."""

from __future__ import annotations

import pytest
import torch

from swapopt_core import (
    ActivationTrace,
    OffloadConfig,
    OffloadSession,
    ResidencySchedule,
    skip_offload,
)
from swapopt_core._planning.bounds import min_feasible_budget
from swapopt_core._planning.ir import AccessKind, ActionKind


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(64, 256)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(256),
                torch.nn.Linear(256, 256),
                torch.nn.GELU(),
                torch.nn.Dropout(0.1),
            )
            for _ in range(3)
        )
        self.out = torch.nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for index, block in enumerate(self.blocks):
            h = h + (_opaque_block(block, h) if index == 1 else block(h))
            h.mul_(0.5)  # an in-place write between reads
        return self.out(h)


@skip_offload
def _opaque_block(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    return block(h)


def _batch(step: int, rows: int = 32) -> torch.Tensor:
    return torch.randn(rows, 64, generator=torch.Generator().manual_seed(step))


def _step(model: Net, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)  # dropout masks
    logits = model(x)
    loss = logits.square().mean()
    loss.backward()
    return loss, logits


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("planner", ["every-gap", "recompute-every-gap", "auto"])
@pytest.mark.parametrize("budget_mb", [0.25, 1.0, 64.0])
@pytest.mark.parametrize(
    ("rows", "counts"),
    [
        # Other sizes, same ops: every step replays (warmups, retraces, replays, replans).
        # A larger step re-plans once for its sizes; smaller ones replay the larger plan.
        ([32, 32, 32, 48, 32, 32], (1, 0, 5, 1)),
        ([32, 32, 48, 48, 16, 48], (1, 0, 5, 1)),
    ],
    ids=["one-off", "lasting"],
)
def test_grads_match_over_warmup_and_replays(
    manager,
    runtime_name: str,
    planner: str,
    budget_mb: float,
    rows: list[int],
    counts: tuple[int, int, int],
) -> None:
    reference, offloaded = Net(), Net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    off_opt = torch.optim.SGD(offloaded.parameters(), lr=0.05)
    config = OffloadConfig(
        max_resident_activation_mb=budget_mb,
        runtime=runtime_name,
        planner=planner,
        min_offload_kib=4,
    )
    session = OffloadSession(config, plugin_manager=manager)
    for step, n in enumerate(rows):
        x = _batch(step, n)
        ref_loss, ref_logits = _step(reference, x, seed=step)
        with session:
            loss, logits = _step(offloaded, x, seed=step)
        assert torch.equal(loss, ref_loss)
        assert torch.equal(logits, ref_logits)  # an output kept past the session
        for a, b in zip(_grads(reference), _grads(offloaded), strict=True):
            assert torch.equal(a, b)
        for opt in (ref_opt, off_opt):
            opt.step()  # parameters change between steps
            opt.zero_grad()
        if planner == "auto":
            # Within the budget, or within what some single op needs on the device anyway.
            floor = min_feasible_budget(session.trace)
            limit = 1.15 * max(budget_mb * 2**20, floor)
            assert session.stats().last_peak_resident_activation_bytes <= limit
    stats = session.stats()
    assert (stats.warmups, stats.retraces, stats.replays, stats.replans) == counts
    assert session.trace is not None and session.schedule is not None
    if planner == "recompute-every-gap":  # the replays regenerated storages, same bits
        assert stats.recomputes > 0


def test_every_action_runs_and_moves_bytes(manager, runtime_name: str) -> None:
    model = Net()
    config = OffloadConfig(
        max_resident_activation_mb=0.25,
        runtime=runtime_name,
        planner="every-gap",
        min_offload_kib=0,
    )
    session = OffloadSession(config, plugin_manager=manager)
    for step in range(2):
        model.zero_grad()  # grads accumulating into existing tensors would be other ops
        with session:
            _step(model, _batch(step), seed=step)
    stats = session.stats()
    kinds = {a.kind for _, _, a in session.schedule.actions()}
    assert kinds == set(ActionKind) - {ActionKind.RECOMPUTE}
    assert stats.replays == 1 and stats.d2h_bytes > 0 and stats.h2d_bytes > 0


def test_trace_and_schedule_round_trip_through_json(manager, runtime_name: str) -> None:
    session = OffloadSession(
        OffloadConfig(max_resident_activation_mb=0.25, runtime=runtime_name, planner="every-gap"),
        plugin_manager=manager,
    )
    with session:
        _step(Net(), _batch(0), seed=0)
    trace, schedule = session.trace, session.schedule
    assert ActivationTrace.from_json(trace.to_json()) == trace
    assert ResidencySchedule.from_json(schedule.to_json()) == schedule
    names = [op.name for op in trace.ops]
    assert "_opaque_block.forward" in names and "_opaque_block.backward" in names
    assert any(
        a.kind is AccessKind.WRITE and op.name.startswith("mul_")
        for op in trace.ops
        for a in op.accesses
    )
    assert trace.memory_limit_bytes == int(0.25 * 2**20)
    assert trace.d2h_bandwidth_gbps > 0 and trace.h2d_bandwidth_gbps > 0


def test_host_cap_keeps_data_on_the_device(manager, runtime_name: str) -> None:
    reference, offloaded = Net(), Net()
    config = OffloadConfig(
        max_resident_activation_mb=0.1,
        max_offload_activation_mb=0.05,
        runtime=runtime_name,
        planner="every-gap",
        min_offload_kib=0,
    )
    session = OffloadSession(config, plugin_manager=manager)
    for step in range(3):
        reference.zero_grad()
        offloaded.zero_grad()
        ref_loss, _ = _step(reference, _batch(step), seed=step)
        with session:
            loss, _ = _step(offloaded, _batch(step), seed=step)
        assert torch.equal(loss, ref_loss)
        for a, b in zip(_grads(reference), _grads(offloaded), strict=True):
            assert torch.equal(a, b)
    stats = session.stats()
    assert stats.host_cap_refusals > 0
    assert stats.host_peak_bytes <= 0.05 * 2**20


def test_exception_inside_the_session_restores_everything(manager, runtime_name: str) -> None:
    model = Net()
    session = OffloadSession(
        OffloadConfig(
            max_resident_activation_mb=0.1,
            runtime=runtime_name,
            planner="every-gap",
            min_offload_kib=0,
        ),
        plugin_manager=manager,
    )
    kept = None
    with pytest.raises(ValueError, match="boom"), session:
        kept = model(_batch(0))
        raise ValueError("boom")
    assert torch.isfinite(kept).all()  # paged back in when the session ended
    with session:  # still a warmup: the failed one planned nothing
        _step(model, _batch(1), seed=1)
    assert session.stats().warmups == 1


def test_sessions_do_not_nest(manager) -> None:
    outer = OffloadSession(
        OffloadConfig(runtime="loopback", planner="every-gap"), plugin_manager=manager
    )
    inner = OffloadSession(
        OffloadConfig(runtime="loopback", planner="every-gap"), plugin_manager=manager
    )
    with outer, pytest.raises(RuntimeError, match="do not nest"), inner:
        pass


def test_unknown_planner_is_named(manager) -> None:
    with pytest.raises(ValueError, match=r"planner='nope' is not a registered planner.*'auto'"):
        OffloadSession(OffloadConfig(planner="nope"), plugin_manager=manager)


def test_unknown_runtime_is_refused_when_the_session_is_created(manager) -> None:
    config = OffloadConfig(runtime="tpu")  # a plugin may register it: the config cannot know
    with pytest.raises(
        ValueError,
        match=r"OffloadConfig\.runtime='tpu' is not a registered activation runtime\. Choose "
        r"one of \['auto', 'cuda', 'loopback', 'loopback-async'\], or install or register "
        r"the plugin that provides it \(swapopt_register_runtimes\)",
    ):
        OffloadSession(config, plugin_manager=manager)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"max_resident_activation_mb": -1}, ValueError, "max_resident_activation_mb must be >= 0"),
        ({"max_offload_activation_mb": "x"}, TypeError, "max_offload_activation_mb must be a num"),
        ({"runtime": ""}, ValueError, "runtime must be an activation runtime name"),
        ({"runtime": None}, ValueError, "runtime must be an activation runtime name"),
        ({"planner": ""}, ValueError, "planner must be a planner name"),
    ],
)
def test_bad_config_values(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=rf"OffloadConfig\.{pattern}"):
        OffloadConfig(**kwargs)


def test_skip_offload_outside_a_session_just_calls() -> None:
    assert skip_offload(lambda a, b: a + b)(2, 3) == 5
    with pytest.raises(TypeError, match="needs a callable"):
        skip_offload(3)  # type: ignore[arg-type]


class Wide(torch.nn.Module):
    """Big activations next to small weights, so the budget is about activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_replays_stay_near_the_budget_with_the_default_planner(
    fraction: float, runtime_name: str
) -> None:
    from swapopt_core._planning.simulate import simulate

    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, runtime=runtime_name))
    model = Wide()
    with probe:
        model(x).backward()
    natural = simulate(probe.trace).natural_peak_bytes
    budget_mb = fraction * natural / 2**20
    reference, offloaded = Wide(), Wide()
    session = OffloadSession(
        OffloadConfig(
            max_resident_activation_mb=budget_mb, runtime=runtime_name, min_offload_kib=64
        )
    )
    for step in range(4):
        for m in (reference, offloaded):
            m.zero_grad()
        reference(x * (step + 1)).backward()
        with session:
            offloaded(x * (step + 1)).backward()
        for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
        if step:
            stats = session.stats()
            assert stats.last_peak_resident_activation_bytes <= 1.15 * budget_mb * 2**20
    assert session.stats().replays == 3 and session.stats().planned_actions > 0
    assert session.stats().d2h_bytes > 0


def test_a_step_with_fewer_ops_than_the_trace_keeps_the_plan_once(
    manager, runtime_name: str
) -> None:
    model = Net()
    session = OffloadSession(
        OffloadConfig(
            max_resident_activation_mb=0.25,
            runtime=runtime_name,
            planner="every-gap",
            min_offload_kib=0,
        ),
        plugin_manager=manager,
    )
    with session:
        _step(model, _batch(0), seed=0)
    model.zero_grad()
    with session:  # forward only: the backward half of the trace never comes
        kept = model(_batch(1))
    assert torch.isfinite(kept).all()
    stats = session.stats()
    assert (stats.replays, stats.retraces) == (0, 1)
    model.zero_grad()
    with session:  # a full step again: the kept plan fits
        _step(model, _batch(2), seed=2)
    stats = session.stats()
    assert (stats.warmups, stats.replays) == (1, 1)
