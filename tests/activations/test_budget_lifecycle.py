"""The whole-step budget's life: its hooks, an aborted step, an unswap, every step metered."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from swapopt_core import (
    OffloadConfig,
    OffloadSession,
    SwapOptWarning,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._planning.step_types import BudgetTooSmall
from swapopt_core._step.hooks import StepHooks
from tests.activations.loops import backward, gpt, tokens

#: Holds the tiny GPT's whole step with room to spare: nothing moves after the first step.
ROOMY_MB = 64
MIB = 2**20


def _session(
    opt: torch.optim.Optimizer, budget_mb: float = ROOMY_MB, **config: object
) -> OffloadSession:
    return OffloadSession(
        OffloadConfig(device_budget_mb=budget_mb, runtime="loopback", **config), optimizer=opt
    )


def _step(
    session: OffloadSession,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    seed: int,
    length: int = 64,
    batch: int = 4,
) -> None:
    with session:
        backward(model, tokens(seed, length, batch))
    opt.step()
    opt.zero_grad()


def _hook_counts(opt: torch.optim.Optimizer) -> tuple[int, int]:
    return len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)


def test_collected_and_closed_sessions_leave_no_hooks_and_hold_nothing() -> None:
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = _session(opt)
    _step(session, model, opt, 0)
    hooks = _hook_counts(opt)
    assert StepHooks.find(opt) is not None and "budget" in StepHooks.find(opt).parts
    gone = weakref.ref(session._executor)
    del session
    gc.collect()
    assert gone() is None, "the optimizer kept the session's executor alive"
    assert "budget" not in StepHooks.find(opt).parts
    for seed in range(1, 12):  # a session per epoch, as loops make them
        session = _session(opt)
        _step(session, model, opt, seed)
        assert _hook_counts(opt) == hooks
    session.close()
    assert "budget" not in StepHooks.find(opt).parts
    assert _hook_counts(opt) == hooks  # swapopt's two hooks, whatever joined them
    session.close()  # idempotent
    opt.step()  # the swap goes on alone


def test_a_new_session_takes_over_a_live_ones_budget() -> None:
    """The newest session plans the step (a loop that rebinds ``session`` each epoch hears
    nothing); the old one says so if it is used again."""
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = _session(opt)
    _step(first, model, opt, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = _session(opt)
        _step(second, model, opt, 1)
    assert StepHooks.find(opt).holder("budget") is second._budget
    with pytest.warns(SwapOptWarning, match="took over"):
        _step(first, model, opt, 2)
    _step(second, model, opt, 3)
    assert second.stats().step_peak_device_bytes > 0


def test_unswap_ends_the_budget_with_a_warning_and_takes_its_hooks_off() -> None:
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = _session(opt)
    _step(session, model, opt, 0)
    unswap_optimizer(opt)
    with pytest.warns(SwapOptWarning, match="unswapped"):
        _step(session, model, opt, 1)
    assert StepHooks.find(opt) is None
    assert _hook_counts(opt) == (0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        _step(session, model, opt, 2)


class _Boom(RuntimeError):
    pass


def test_an_exception_inside_the_session_closes_the_steps_meter() -> None:
    """The aborted step's window closes with it: no meter stays pushed over later ops, and
    what is allocated before the retry is not billed to the retried step."""
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = _session(opt, meter_every_step=True)
    for seed in range(3):
        _step(session, model, opt, seed)
    normal = session.stats().last_step_peak_device_bytes
    assert normal > 0
    with pytest.raises(_Boom), session:
        model(tokens(3)[:, :-1]).sum()
        raise _Boom
    assert not _get_current_dispatch_mode_stack(), "a meter stayed pushed after the block"
    bystander = torch.empty(4 * normal, dtype=torch.uint8)  # made between abort and retry
    _step(session, model, opt, 3)
    retried = session.stats().last_step_peak_device_bytes
    assert retried < normal + bystander.numel() // 2, (retried, normal)


def test_an_exception_in_a_closure_closes_the_steps_meter() -> None:
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = _session(opt, meter_every_step=True)
    for seed in range(3):
        _step(session, model, opt, seed)

    def closure() -> torch.Tensor:
        with session:
            loss = backward(model, tokens(3))
        raise _Boom(loss)

    with pytest.raises(_Boom):
        opt.step(closure)
    assert not _get_current_dispatch_mode_stack()
    opt.zero_grad()
    _step(session, model, opt, 4)  # the next step works and is metered
    assert session.stats().last_step_peak_device_bytes > 0


@pytest.mark.parametrize("every", [True, False])
def test_meter_every_step_watches_every_step(every: bool) -> None:
    """With ``meter_every_step`` the storage-counting meter sees a step long after the plan
    (a longer sequence there shows in ``last_step_peak_device_bytes``); without it the
    loopback meter stops after the plan's first steps."""
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = _session(opt, meter_every_step=every)
    for seed in range(6):
        _step(session, model, opt, seed, length=32)
    settled = session.stats().last_step_peak_device_bytes
    _step(session, model, opt, 6, length=64)
    grown = session.stats().last_step_peak_device_bytes
    assert (grown > settled) is every
    assert swap_stats(opt).steps == 7


def _grown_run(budget_mb: float, lengths: list[int]) -> OffloadSession:
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = _session(opt, budget_mb, meter_every_step=True, min_offload_kib=0)
    for seed, length in enumerate(lengths):
        _step(session, model, opt, seed, length=length)
    return session


def test_a_batch_that_grows_under_a_plan_that_keeps_everything_is_planned_again() -> None:
    """The plan keeps every activation (entries run untraced); then the sequence grows step
    by step. The growth watch sees it, the step is traced and planned again, and every step
    after the one that grew keeps the budget."""
    settled = _grown_run(ROOMY_MB, [16, 16, 16]).stats()
    assert settled.activation_budget_bytes is None  # untraced from here on
    budget = settled.planned_step_peak_device_bytes * 1.6
    lengths = [16, 16, 16, 32, 48, 64, 64, 64]
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = _session(opt, budget / MIB, meter_every_step=True, min_offload_kib=0)
    peaks, planned = [], []
    for seed, length in enumerate(lengths):
        _step(session, model, opt, seed, length=length)
        peaks.append(session.stats().last_step_peak_device_bytes)
        planned.append(session.stats().planned_step_peak_device_bytes)
    stats = session.stats()
    assert stats.warmups >= 2, "the grown step was never traced again"
    assert planned[-1] > planned[2], "the plan was not made again for the grown step"
    assert planned[-1] <= budget
    assert max(peaks[-2:]) <= budget, [round(p / MIB, 2) for p in peaks]


def test_a_batch_that_outgrows_every_plan_is_refused_naming_the_growth() -> None:
    settled = _grown_run(ROOMY_MB, [16, 16, 16]).stats()
    budget = settled.planned_step_peak_device_bytes * 1.05
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = _session(opt, budget / MIB, min_offload_kib=0)
    for seed in range(3):
        _step(session, model, opt, seed, length=16)
    with pytest.raises(BudgetTooSmall, match="grew") as refused:
        for seed in range(3, 8):
            _step(session, model, opt, seed, length=64, batch=64)
    assert refused.value.floor_bytes > budget


def _mlp_step(
    session: OffloadSession | None, model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int
) -> None:
    torch.manual_seed(seed)
    batch = torch.randn(8192, 128)  # 4 MiB made before the session's window, read inside
    if session is None:
        model(batch).square().mean().backward()
    else:
        with session:
            model(batch).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Eight narrow layers on a wide batch: activations (about 32 MiB) far above what any
    one op needs at once, so the warmup's budget binds."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(128, 128), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_the_first_step_counts_the_batch_it_reads_from_outside_its_window() -> None:
    model, opt = _mlp()
    roomy = _session(opt, 1024, meter_every_step=True)
    for seed in range(3):
        _mlp_step(roomy, model, opt, seed)
    plain = roomy.stats().last_step_peak_device_bytes
    roomy.close()
    budget = int(plain * 0.5)
    model, opt = _mlp()
    session = _session(opt, budget / MIB, meter_every_step=True, min_offload_kib=0)
    _mlp_step(session, model, opt, 0)
    first = session.stats().last_step_peak_device_bytes
    assert first <= budget, (first / MIB, budget / MIB)


@pytest.mark.parametrize("runtime", ["loopback", "loopback-async"])
def test_a_budget_at_the_plain_peak_moves_nothing_from_the_first_step_on(runtime: str) -> None:
    """The plain peak measured by a roomy budget's meter, then exactly that as the budget:
    no byte of state or activation moves in any step, the first one included."""
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    roomy = OffloadSession(
        OffloadConfig(device_budget_mb=1 << 20, runtime=runtime, meter_every_step=True),
        optimizer=opt,
    )
    for seed in range(3):
        _step(roomy, model, opt, seed)
    plain = roomy.stats().step_peak_device_bytes
    roomy.close()
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = OffloadConfig(device_budget_mb=plain / MIB, runtime=runtime, meter_every_step=True)
    session = OffloadSession(config, optimizer=opt)
    for seed in range(4):
        _step(session, model, opt, seed)
        moved = swap_stats(opt)
        assert (moved.h2d_bytes, moved.d2h_bytes) == (0, 0), (seed, moved)
    stats = session.stats()
    assert (stats.h2d_bytes, stats.d2h_bytes) == (0, 0)
    assert stats.step_peak_device_bytes <= plain


def _deep() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Forty layers: 80 parameters, more than the planner's grid of pipeline batches."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(40):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_a_budget_the_first_step_kept_is_never_refused_after_it() -> None:
    """Tight budgets around the floor: each is refused up front, or after a first step that
    went over it, or kept by every step; never refused after a first step that kept it."""

    def run(budget: float) -> tuple[str, list[int]]:
        model, opt = _deep()
        try:
            session = _session(opt, budget / MIB, meter_every_step=True, min_offload_kib=0)
        except BudgetTooSmall:
            return "up front", []
        peaks: list[int] = []
        try:
            for seed in range(3):
                with session:
                    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(seed))
                    model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                peaks.append(session.stats().last_step_peak_device_bytes)
        except BudgetTooSmall:
            peaks.append(session.stats().last_step_peak_device_bytes)
            return "refused", peaks
        return "kept", peaks

    plain = run(1 << 30)[1][-1]
    outcomes = []
    for share in (0.2, 0.25, 0.3):
        budget = int(plain * share)
        outcome, peaks = run(budget)
        outcomes.append(outcome)
        if outcome == "refused":
            assert len(peaks) == 1 and peaks[0] > budget, (share, peaks, budget)
        elif outcome == "kept":
            assert max(peaks) <= budget, (share, peaks, budget)
    assert "kept" in outcomes


def test_a_plan_loaded_for_another_budget_is_planned_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plan made at a roomy activation budget, loaded into a session whose device budget
    leaves activations less: it replays planned for this session's room, not its own."""
    model = gpt()
    roomy = OffloadSession(OffloadConfig(max_resident_activation_mb=512, runtime="loopback"))
    with roomy:
        backward(model, tokens(0))
    trace, schedule = roomy.trace, roomy.schedule
    assert trace is not None and schedule is not None
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = _session(opt, 2.0, min_offload_kib=0)  # about half the tiny GPT's step
    _step(session, model, opt, 0)
    room = session._executor.budget_bytes
    assert trace.memory_limit_bytes > 64 * room
    with caplog.at_level("WARNING", logger="swapopt_core._activations.session"):
        session.load_plan(trace, schedule)
    assert "planned again" in caplog.text
    assert session.trace is not None and session.trace.memory_limit_bytes == room


def test_the_first_warmup_under_a_device_budget_plans_nothing_of_its_own() -> None:
    """The whole-step plan, made after the first update, replaces the first warmup's
    activation plan: the warmup makes none (nor warns that its budget is infeasible)."""
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = _session(opt, 2.0, min_offload_kib=0)
    planner = session._executor.planner
    calls = []
    real = planner.plan

    def counted(trace: object) -> object:
        calls.append(trace)
        return real(trace)  # type: ignore[arg-type]

    planner.plan = counted  # type: ignore[method-assign]
    with session:
        backward(model, tokens(0))
    assert calls == [], "the first warmup planned its activations itself"
    opt.step()
    assert calls, "the whole-step plan planned no activations"
    assert session.stats().planned_step_peak_device_bytes is not None
