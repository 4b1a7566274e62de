"""RECOMPUTE in a replay: storages released without a host copy come back by re-running the
op that made them, and every gradient stays the same bits as without the session."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from swapopt_core import ActivationTrace, OffloadConfig, OffloadSession, ResidencySchedule
from swapopt_core._activations.replay import Recipe
from swapopt_core._planning.ir import ActionKind
from swapopt_core._planning.simulate import simulate

#: The ops the tests mark recompute: a layer norm and a SiLU-times-up chain.
_MARKED = ("native_layer_norm.default", "silu.default", "mul.Tensor")


class Gated(torch.nn.Module):
    """Layer norm, dropout next to it, then a gated (SiLU x up) projection."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.drop = torch.nn.Dropout(0.2)
        self.gate = torch.nn.Linear(64, 64)
        self.up = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 4)

        self.detour = False  # an extra op after the norm: a replay leaves its plan there

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x))
        g = self.gate(h)
        if self.detour:
            g = g * 1.0
        a = F.silu(g) * self.up(self.drop(h))
        return self.out(a)


def _step(model: Gated, seed: int) -> torch.Tensor:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)  # dropout masks
    loss = model(x).square().mean()
    loss.backward()
    return loss


def _recorded(runtime: str) -> ActivationTrace:
    """A warmup's trace with only the forward ops of ``_MARKED`` marked recompute (the
    dropout's multiply by its mask too: the mask is an input, drawn once)."""
    session, model = OffloadSession(OffloadConfig(runtime=runtime)), Gated()
    with session:
        _step(model, seed=0)
    trace = session.trace
    backward = next(i for i, op in enumerate(trace.ops) if op.name.startswith("ones_like"))
    ops = tuple(
        dataclasses.replace(op, recompute=op.name in _MARKED and i < backward)
        for i, op in enumerate(trace.ops)
    )
    return dataclasses.replace(trace, ops=ops)


def _plan(trace: ActivationTrace, *, demand: bool = False) -> ResidencySchedule:
    """Release every storage a marked op made across each gap between its accesses, and
    recompute it (its released inputs first) before the next access, unless ``demand``."""
    sizes = trace.storage_sizes
    producer: dict[int, int] = {}
    inputs: dict[int, list[int]] = {}
    accesses: dict[int, list[int]] = {}
    for index, op in enumerate(trace.ops):
        made = {a.storage_id for a in op.accesses if a.output is not None}
        for access in op.accesses:
            sid = access.storage_id
            if sid not in sizes:
                continue
            if sid not in accesses and op.recompute and sid in made:
                producer[sid] = index
                inputs[sid] = [a.storage_id for a in op.accesses if a.storage_id not in made]
            accesses.setdefault(sid, []).append(index)
    schedule, released = ResidencySchedule(), set()

    def bring(sid: int, at: int) -> None:
        for source in inputs[sid]:
            if source in released:
                bring(source, at)
        schedule.add_pre(at, sid, ActionKind.RECOMPUTE)
        released.discard(sid)

    for index, op in enumerate(trace.ops):
        for access in op.accesses:
            if access.storage_id in released and not demand:
                bring(access.storage_id, index)
            released.discard(access.storage_id)
        for sid, seen in accesses.items():
            later = [i for i in seen if i > index]
            if sid in producer and index in seen and later and later[0] - index >= 2:
                schedule.add_post(index, sid, ActionKind.RELEASE_DEVICE)
                released.add(sid)
    return schedule


def _compare(session: OffloadSession, steps: int = 3) -> None:
    reference, replayed = Gated(), Gated()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, replayed)]
    for step in range(1, steps + 1):
        ref_loss = _step(reference, seed=step)
        with session:
            loss = _step(replayed, seed=step)
        assert torch.equal(loss, ref_loss)
        for a, b in zip(reference.parameters(), replayed.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for a, b in zip(reference.parameters(), replayed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_recomputed_norm_and_chain_give_the_same_bits(runtime_name: str) -> None:
    trace = _recorded(runtime_name)
    schedule = _plan(trace)
    kinds = [a.kind for _, _, a in schedule.actions()]
    assert ActionKind.RECOMPUTE in kinds
    result = simulate(trace, schedule)
    assert result.recomputes == kinds.count(ActionKind.RECOMPUTE)
    assert result.peak_bytes < result.natural_peak_bytes
    assert _mask(trace)[1] not in {a.storage_id for _, _, a in schedule.actions()}

    session = OffloadSession(OffloadConfig(runtime=runtime_name, min_offload_kib=0))
    session.load_plan(trace, schedule)
    _compare(session)
    stats = session.stats()
    assert (stats.replays, stats.retraces) == (3, 0)
    assert stats.recomputes == 3 * result.recomputes and stats.demand_recomputes == 0
    assert stats.last_peak_resident_activation_bytes <= 1.05 * result.peak_bytes


def test_releases_without_recompute_actions_recompute_on_demand(runtime_name: str) -> None:
    trace = _recorded(runtime_name)
    schedule = _plan(trace, demand=True)
    assert ActionKind.RECOMPUTE not in {a.kind for _, _, a in schedule.actions()}
    session = OffloadSession(OffloadConfig(runtime=runtime_name, min_offload_kib=0))
    session.load_plan(trace, schedule)
    _compare(session, steps=2)
    stats = session.stats()
    assert stats.recomputes > 0 and stats.demand_recomputes == stats.recomputes


def _mask(trace: ActivationTrace) -> tuple[int, int]:
    """The op that draws the dropout mask, and the mask's storage."""
    index = next(i for i, op in enumerate(trace.ops) if op.name.startswith("bernoulli_"))
    return index, trace.ops[index].accesses[0].storage_id


def test_a_release_of_what_cannot_be_recomputed_keeps_it(runtime_name: str) -> None:
    trace = _recorded(runtime_name)
    index, mask = _mask(trace)
    schedule = ResidencySchedule()
    schedule.add_post(index, mask, ActionKind.RELEASE_DEVICE)  # no host copy, no recipe
    assert simulate(trace, schedule).ignored_actions == 1
    session = OffloadSession(OffloadConfig(runtime=runtime_name, min_offload_kib=0))
    session.load_plan(trace, schedule)
    _compare(session, steps=2)
    assert session.stats().recomputes == 0


def test_a_recipe_refuses_inputs_changed_in_place() -> None:
    x = torch.randn(8)
    out = torch.ops.aten.silu.default(x)
    recipe = Recipe(1, "silu.default", torch.ops.aten.silu.default, (x,), {}, 0, ())
    target = torch.empty(0).untyped_storage()
    recipe.run_into(target, out.untyped_storage().nbytes())
    assert torch.equal(torch.empty(0).set_(target).view(-1)[:0], out[:0])
    assert bytes(target) == bytes(out.untyped_storage())
    x.add_(1)
    assert not recipe.intact()
    with pytest.raises(RuntimeError, match="modified in place"):
        recipe.run_into(target, out.untyped_storage().nbytes())


def test_a_replay_holds_its_plans_peak(runtime_name: str) -> None:
    """Tensors the caller keeps past their last access (the input batch, the loss) are live
    longer than the plan assumes: the replay evicts rather than overshoot."""
    probe, model = OffloadSession(OffloadConfig(runtime=runtime_name)), Gated()
    with probe:
        _step(model, seed=0)
    model.zero_grad()
    budget_mb = 0.6 * simulate(probe.trace).natural_peak_bytes / 2**20
    session = OffloadSession(
        OffloadConfig(max_resident_activation_mb=budget_mb, runtime=runtime_name, min_offload_kib=0)
    )
    reference = Gated()
    for step in range(3):
        ref_loss = _step(reference, seed=step)
        with session:
            loss = _step(model, seed=step)
        reference.zero_grad()
        model.zero_grad()
        assert torch.equal(loss, ref_loss)
        if step > 0:
            planned = simulate(session.trace, session.schedule).peak_bytes
            assert session.stats().last_peak_resident_activation_bytes <= 1.05 * planned
    assert session.stats().replays == 2


def test_a_replay_that_leaves_its_plan_recomputes_what_it_released(runtime_name: str) -> None:
    trace = _recorded(runtime_name)
    session = OffloadSession(OffloadConfig(runtime=runtime_name, min_offload_kib=0))
    session.load_plan(trace, _plan(trace))
    reference, replayed = Gated(), Gated()
    for model in (reference, replayed):
        model.detour = True
    ref_loss = _step(reference, seed=1)
    with session:
        loss = _step(replayed, seed=1)
    assert torch.equal(loss, ref_loss)
    for a, b in zip(reference.parameters(), replayed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    stats = session.stats()
    assert stats.retraces == 1 and stats.recomputes > 0  # the norm's outputs came back


def test_the_planners_recomputes_replay_bit_exactly_within_the_plans_peak(
    runtime_name: str,
) -> None:
    """The timed planner on the recorded trace over a slow link (so it prefers recomputing):
    its plan replays the same bits, recomputes what it planned, and stays within its peak."""
    from swapopt_core._planning.timed import TimedPlanner

    recorded = _recorded(runtime_name)
    slow = dataclasses.replace(
        recorded,
        d2h_bandwidth_gbps=0.001,
        h2d_bandwidth_gbps=0.001,
        memory_limit_bytes=int(0.5 * simulate(recorded).natural_peak_bytes),
        min_offload_bytes=0,
    )
    schedule = TimedPlanner().plan(slow)
    planned = simulate(slow, schedule)
    assert planned.recomputes > 0
    session = OffloadSession(OffloadConfig(runtime=runtime_name, min_offload_kib=0))
    session.load_plan(slow, schedule)
    _compare(session, steps=2)
    stats = session.stats()
    assert stats.recomputes == 2 * planned.recomputes and stats.demand_recomputes == 0
    assert stats.last_peak_resident_activation_bytes <= 1.05 * planned.peak_bytes
