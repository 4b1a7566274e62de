"""The budget covers activations only: the warmup finds parameter gradients, reports them
apart (``stats().gradient_bytes``), leaves them out of the trace and never moves them; and it
keeps the budget when only storages below ``min_offload_kib`` can make room."""

from __future__ import annotations

import pytest
import torch

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._planning.bounds import min_feasible_budget
from swapopt_core._planning.simulate import TraceIndex

MIB = 2**20


def _linear_stack() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(384, 384), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(384, 10)), torch.randn(32, 384)


def _conv_net() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 8 * 8, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    return model, torch.randn(4, 3, 16, 16)


def _small_mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    """Every activation is 256 KiB: below the default ``min_offload_kib`` of 1024."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(10):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers), torch.randn(256, 256)


def _backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _reference(build) -> list[torch.Tensor]:
    model, x = build()
    _backward(model, x)
    return _grads(model)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _made(session: OffloadSession) -> int:
    """The most bytes one op of the trace creates."""
    index = TraceIndex(session.trace)
    return max(sum(index.sizes[s] for s in sids) for sids in index.created_at)


def _natural(build, **config) -> tuple[int, int, int]:
    """Natural activation peak, feasible floor and gradient bytes, from an unbounded warmup."""
    model, x = build()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1e4, **config))
    with session:
        _backward(model, x)
    trace = session.trace
    return (
        TraceIndex(trace).natural_peak,
        min_feasible_budget(trace),
        session.stats().gradient_bytes,
    )


@pytest.mark.parametrize("build", [_linear_stack, _conv_net], ids=["linear", "conv"])
@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_gradients_do_not_count_toward_the_budget(build, fraction: float) -> None:
    reference = _reference(build)
    natural, floor, gradient_bytes = _natural(build, min_offload_kib=0)
    model, x = build()
    assert gradient_bytes == _param_bytes(model)
    # With the gradients in the trace the floor could not be below them (all exist at the
    # end of backward); without them it is what an op needs.
    assert floor < gradient_bytes / 2
    budget = fraction * natural
    session = OffloadSession(
        OffloadConfig(max_resident_activation_mb=budget / MIB, min_offload_kib=0)
    )
    for step in range(3):  # the warmup, then two replays
        model.zero_grad(set_to_none=True)
        with session:
            _backward(model, x)
        for a, b in zip(reference, _grads(model), strict=True):
            assert torch.equal(a, b)
        stats = session.stats()
        assert stats.gradient_bytes == gradient_bytes
        peak = stats.last_peak_resident_activation_bytes
        # A replay within its plan; a warmup over the budget by at most one op's outputs.
        limit = 1.15 * max(budget, floor) if step else max(budget + _made(session), floor)
        assert peak <= limit, (step, peak, budget, floor)
        assert peak < gradient_bytes / 2, (step, peak, gradient_bytes)
    assert (stats.warmups, stats.replays) == (1, 2)
    assert min_feasible_budget(session.trace) == floor


def test_gradients_that_exist_before_the_entry_are_accumulated_in_place() -> None:
    reference_model, x = _linear_stack()
    for _ in range(2):
        _backward(reference_model, x)
    model, x = _linear_stack()
    _backward(model, x)  # .grad exists before the session
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.1, min_offload_kib=0))
    with session:
        _backward(model, x)
    for a, b in zip(_grads(reference_model), _grads(model), strict=True):
        assert torch.equal(a, b)
    assert session.stats().gradient_bytes == 0


def test_two_backward_passes_in_one_entry_find_each_gradient_once() -> None:
    reference_model, x = _conv_net()
    for _ in range(2):
        _backward(reference_model, x)
    model, x = _conv_net()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.2, min_offload_kib=0))
    with session:
        _backward(model, x)
        _backward(model, x)
    for a, b in zip(_grads(reference_model), _grads(model), strict=True):
        assert torch.equal(a, b)
    assert session.stats().gradient_bytes == _param_bytes(model)
    # The hooks are gone with the entry.
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


def test_the_warmup_evicts_small_storages_when_nothing_else_makes_room() -> None:
    reference = _reference(_small_mlp)
    natural, floor, _ = _natural(_small_mlp)  # the default min_offload_kib: 1024
    model, x = _small_mlp()
    budget = max(natural / 4, floor)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    with session:
        _backward(model, x)
    for a, b in zip(reference, _grads(model), strict=True):
        assert torch.equal(a, b)
    made = _made(session)
    peak = session.stats().last_peak_resident_activation_bytes
    # Over the budget by at most what one op makes (the warmup cannot know it before).
    assert peak <= max(budget + made, floor), (peak, budget, made, floor)
    assert peak < natural / 2
    assert all(size < 1024 * 1024 for size in session.trace.storage_sizes.values())
