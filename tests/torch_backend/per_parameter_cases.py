"""Models, optimizers and a lockstep loop shared by the generic per-parameter path's tests.

Each family gets a model of several parameters of different sizes: ``odd`` only has a
gradient on odd steps (so its state is created at step 1), and ``tiny`` (3 elements) stays
below ``MIN_NUMEL``, so its state stays resident. Muon takes matrices only; SparseAdam takes
sparse gradients only (embeddings with ``sparse=True``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats
from tests.conftest import assert_same, loopback

#: ``min_numel`` of every case: ``tiny`` (3) and the 8-element bias stay resident.
MIN_NUMEL = 16

#: One configuration with state per family (the database's defaults keep none for SGD).
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.01}),
    "Adadelta": (torch.optim.Adadelta, {"weight_decay": 0.1}),
    "Adamax": (torch.optim.Adamax, {}),
    "ASGD": (torch.optim.ASGD, {"t0": 1}),
    "NAdam": (torch.optim.NAdam, {"weight_decay": 0.1}),
    "RAdam": (torch.optim.RAdam, {}),
    "RMSprop": (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}),
    "Rprop": (torch.optim.Rprop, {}),
    "Adafactor": (torch.optim.Adafactor, {"lr": 0.01}),
    "Muon": (torch.optim.Muon, {}),
    "SparseAdam": (torch.optim.SparseAdam, {}),
    "Adam": (torch.optim.Adam, {"amsgrad": True}),
    "AdamW": (torch.optim.AdamW, {}),
}


def config(packed: bool = True, **kwargs: Any) -> SwapOptimizerConfig:
    """The cases' config on the test's loopback runtime (``tests.conftest.loopback``)."""
    return loopback(**{"swap_times": 3, "min_numel": MIN_NUMEL, "packed_swap": packed, **kwargs})


class DenseNet(nn.Module):
    """Linear layers of different sizes; with ``matrices_only`` every parameter is 2-D."""

    def __init__(self, *, matrices_only: bool = False, odd_parity: int = 1) -> None:
        super().__init__()
        self.odd_parity = odd_parity
        bias = not matrices_only
        self.fc1 = nn.Linear(16, 32, bias=bias)
        self.fc2 = nn.Linear(32, 8, bias=bias)
        self.odd = nn.Linear(32, 32, bias=False)
        self.tiny = nn.Parameter(torch.randn(1, 3) if matrices_only else torch.randn(3))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if step % 2 == self.odd_parity:
            h = h + torch.tanh(self.odd(h))
        return self.fc2(h) + 0.1 * self.tiny.sum()

    def loss(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 8, generator=gen)
        return nn.functional.mse_loss(self(x, step), y)

    def groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        first = (self.fc1.weight, self.fc1.bias, self.tiny)
        second = (self.fc2.weight, self.fc2.bias, self.odd.weight)
        return [p for p in first if p is not None], [p for p in second if p is not None]


class SparseNet(nn.Module):
    """Sparse embeddings of different sizes, for SparseAdam."""

    def __init__(self) -> None:
        super().__init__()
        self.emb1 = nn.Embedding(40, 8, sparse=True)
        self.emb2 = nn.Embedding(24, 8, sparse=True)
        self.odd = nn.Embedding(30, 8, sparse=True)
        self.tiny = nn.Embedding(1, 3, sparse=True)

    def loss(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(2000 + step)
        i1 = torch.randint(0, 40, (6,), generator=gen)
        i2 = torch.randint(0, 24, (6,), generator=gen)
        i3 = torch.randint(0, 30, (6,), generator=gen)
        y = torch.randn(6, 8, generator=gen)
        h = torch.tanh(self.emb1(i1)) * self.emb2(i2)
        if step % 2 == 1:
            h = h + self.odd(i3)
        h = h + 0.1 * self.tiny(torch.zeros(6, dtype=torch.long)).sum(-1, keepdim=True)
        return nn.functional.mse_loss(h, y)

    def groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return [self.emb1.weight, self.tiny.weight], [self.emb2.weight, self.odd.weight]


def make_net(cls: type, seed: int = 0, *, odd_parity: int = 1) -> nn.Module:
    """The model ``cls`` is tested on, its weights fixed by ``seed``; ``odd`` has a gradient
    on the steps of parity ``odd_parity`` (from step 1 on by default)."""
    torch.manual_seed(seed)
    if cls is torch.optim.SparseAdam:
        return SparseNet()
    return DenseNet(matrices_only=cls is torch.optim.Muon, odd_parity=odd_parity)


def _copied(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with tensors cloned: two optimizers must not share a tensor ``lr``."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def make_opt(
    cls: type, model: nn.Module, kwargs: dict[str, Any], *, groups: bool = True
) -> torch.optim.Optimizer:
    """``cls`` over ``model``; with ``groups``, a second group at half the learning rate."""
    kwargs = _copied(kwargs)
    if not groups:
        return cls(model.parameters(), **kwargs)
    first, second = model.groups()
    lr = kwargs.get("lr", cls([torch.zeros(2, 2, requires_grad=True)]).defaults["lr"])
    half = lr.clone() * 0.5 if isinstance(lr, torch.Tensor) else lr * 0.5
    return cls([{"params": first}, {"params": second, "lr": half}], **kwargs)


def step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    index: int,
    *,
    clip: float | None = None,
    scheduler: Any = None,
) -> None:
    """One training step (with ``clip``, the gradient norm clipped first)."""
    opt.zero_grad()
    model.loss(index).backward()  # type: ignore[operator]
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    if scheduler is not None:
        scheduler.step()


def pair(
    cls: type,
    kwargs: dict[str, Any],
    config: SwapOptimizerConfig,
    *,
    groups: bool = True,
    build: Callable[[type, nn.Module, dict[str, Any]], torch.optim.Optimizer] | None = None,
    odd_parity: int = 1,
) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    """A plain and a swapped copy of one setup: ``(plain_model, plain, model, swapped)``."""
    plain_model = make_net(cls, odd_parity=odd_parity)
    model = copy.deepcopy(plain_model)
    if build is None:
        plain = make_opt(cls, plain_model, kwargs, groups=groups)
        opt = make_opt(cls, model, kwargs, groups=groups)
    else:
        plain, opt = build(cls, plain_model, kwargs), build(cls, model, kwargs)
    assert swap_optimizer(opt, config) is opt
    return plain_model, plain, model, opt


def lockstep(
    plain_model: nn.Module,
    plain: torch.optim.Optimizer,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    start: int = 0,
    clip: float | None = None,
    schedulers: tuple[Any, Any] = (None, None),
    min_numel: int = MIN_NUMEL,
) -> None:
    """Step both copies and compare parameters, groups and every state entry after each;
    then check the swap holds what it should of ``opt``'s state (``min_numel`` as swapped)."""
    for index in range(start, start + steps):
        step(plain_model, plain, index, clip=clip, scheduler=schedulers[0])
        step(model, opt, index, clip=clip, scheduler=schedulers[1])
        assert_same(plain, opt, plain_model, model)
    stats = swap_stats(opt)
    assert stats.swapped_tensors == expected_swapped(plain, min_numel)
    if stats.swapped_tensors:
        assert stats.h2d_bytes > 0 and stats.d2h_bytes > 0


def expected_swapped(plain: torch.optim.Optimizer, min_numel: int = MIN_NUMEL) -> int:
    """How many entries of the unswapped ``plain``'s state the swap should hold: floating
    point tensors of at least one dimension and ``min_numel`` elements."""
    return sum(
        1
        for state in plain.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
        and value.dim() > 0
        and value.is_floating_point()
        and value.numel() >= min_numel
    )


def split(opt: torch.optim.Optimizer) -> dict[str, set[str]]:
    """The state keys seen swapped (host slots) and resident, over every parameter."""
    from swapopt_core._swap.engine import engine_of

    engine = engine_of(opt)
    seen: dict[str, set[str]] = {"swapped": set(), "resident": set()}
    for group in opt.param_groups:
        for param in group["params"]:
            for key in opt.state.get(param, {}):
                where = "swapped" if (id(param), key) in engine.slots else "resident"
                seen[where].add(key)
    return seen
