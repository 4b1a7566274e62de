"""Bitwise equivalence of a swapped Adam/AdamW with the plain optimizer, on the loopback runtime.

Every case steps a plain and a swapped copy of the same model side by side and, after every
step, checks parameters, hyperparameters and every optimizer state entry bit for bit, that no
swapped state stays resident between steps, and that the swap really holds the state.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from swapopt_core import swap_optimizer, swap_stats
from swapopt_core._swap.engine import engine_of
from tests.conftest import (
    assert_nothing_resident,
    assert_same,
    loopback,
    loss_of,
    make_model,
    train,
    twin,
)

#: Each test runs on the synchronous loopback and on loopback-async with jitter.
pytestmark = pytest.mark.usefixtures("swap_runtime")

OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}

FLAGS = {
    "defaults": {},
    "lr_float": {"lr": 0.01},
    "lr_tensor": {"lr": torch.tensor(0.01), "foreach": False},
    "amsgrad": {"amsgrad": True},
    "weight_decay": {"weight_decay": 0.1},
    "maximize": {"maximize": True},
    "amsgrad_wd_maximize": {"amsgrad": True, "weight_decay": 0.05, "maximize": True},
    "decoupled_weight_decay": {"decoupled_weight_decay": True, "weight_decay": 0.1},
    "betas_eps": {"betas": (0.8, 0.95), "eps": 1e-6},
    "betas_eps_large": {"betas": (0.0, 0.5), "eps": 1e-3},
    "foreach_false": {"foreach": False},
    "foreach": {"foreach": True},
    "foreach_amsgrad_wd": {"foreach": True, "amsgrad": True, "weight_decay": 0.1},
    "fused": {"fused": True},
    "fused_amsgrad_wd_maximize": {
        "fused": True,
        "amsgrad": True,
        "weight_decay": 0.1,
        "maximize": True,
    },
    "fused_lr_tensor": {"fused": True, "lr": torch.tensor(0.02)},
}


def expected_swapped(opt: torch.optim.Optimizer, min_numel: int, keys=None) -> int:
    """How many state tensors the swap should hold for ``opt``'s current state."""
    count = 0
    for group in opt.param_groups:
        group_keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        for p in group["params"]:
            state = opt.state.get(p)
            if state:
                count += sum(
                    1
                    for k in group_keys
                    if (keys is None or k in keys) and state[k].numel() >= min_numel
                )
    return count


def lockstep(
    ma,
    oa,
    mb,
    ob,
    steps: int = 10,
    *,
    start: int = 0,
    min_numel: int | None = None,
    keys=None,
    sched_a=None,
    sched_b=None,
    **train_kwargs,
) -> None:
    """Step both copies one step at a time and compare everything after each step."""
    for step in range(start, start + steps):
        ra = train(ma, oa, 1, start=step, scheduler=sched_a, **train_kwargs)
        rb = train(mb, ob, 1, start=step, scheduler=sched_b, **train_kwargs)
        assert ra == rb, f"step {step}: step() returned {rb}, plain returned {ra}"
        assert_nothing_resident(ob)
        assert_same(oa, ob, ma, mb)
        if min_numel is not None:
            stats = swap_stats(ob)
            assert stats.swapped_tensors == expected_swapped(ob, min_numel, keys) > 0
            assert stats.steps == step + 1
    assert swap_stats(ob).h2d_bytes > 0


# AdamW always decouples weight decay and does not take the flag.
CASES = [
    (name, flag)
    for name in OPTIMIZERS
    for flag in FLAGS
    if not (name == "AdamW" and "decoupled_weight_decay" in FLAGS[flag])
]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(("name", "flag"), CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_flags(make_pair, name, flag, packed):
    cls = OPTIMIZERS[name]
    flags = {"lr": 0.01, **FLAGS[flag]}

    def make_opt(model):
        kwargs = dict(flags)
        if isinstance(kwargs["lr"], torch.Tensor):
            kwargs["lr"] = kwargs["lr"].clone()
        return cls(model.parameters(), **kwargs)

    ma, oa, mb, ob = make_pair(make_opt, loopback(swap_times=3, min_numel=0, packed_swap=packed))
    lockstep(ma, oa, mb, ob, 10, min_numel=0)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("min_numel", [0, 1024])
@pytest.mark.parametrize("swap_times", [1, 3, 16])
def test_swap_times_and_min_numel(make_pair, swap_times, min_numel, packed):
    config = loopback(swap_times=swap_times, min_numel=min_numel, packed_swap=packed)
    ma, oa, mb, ob = make_pair(
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01), config
    )
    lockstep(ma, oa, mb, ob, 10, min_numel=min_numel)
    stats = swap_stats(ob)
    stepped = sum(1 for p in mb.parameters() if p.grad is not None)
    assert stats.batches == min(swap_times, stepped)
    if min_numel:
        # The tiny parameter's state stays where it is, as an ordinary state entry.
        engine = engine_of(ob)
        assert (id(mb.tiny), "exp_avg") not in engine.slots
        assert (id(mb.fc1.weight), "exp_avg") in engine.slots


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("keys", [("exp_avg",), ("exp_avg_sq",), ("max_exp_avg_sq",)])
def test_partial_state_keys(make_pair, keys, packed):
    config = loopback(swap_times=3, min_numel=0, packed_swap=packed, state_keys=keys)
    ma, oa, mb, ob = make_pair(
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True), config
    )
    lockstep(ma, oa, mb, ob, 10, min_numel=0, keys=keys)
    swapped = {key for _, key in engine_of(ob).slots}
    assert swapped == set(keys)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_param_groups_with_different_hyperparameters(make_pair, name, packed):
    cls = OPTIMIZERS[name]

    def make_opt(m):
        return cls(
            [
                {"params": [m.fc1.weight, m.fc1.bias], "lr": 0.02, "weight_decay": 0.0},
                {"params": [m.fc2.weight, m.odd.weight], "betas": (0.7, 0.9), "amsgrad": True},
                {
                    "params": [m.fc2.bias, m.fc3.weight, m.fc3.bias, m.tiny],
                    "weight_decay": 0.3,
                    "maximize": False,
                    "eps": 1e-4,
                },
                {"params": [m.unused, *m.frozen.parameters()], "lr": 0.5},
            ],
            lr=0.01,
        )

    config = loopback(swap_times=4, min_numel=0, packed_swap=packed)
    ma, oa, mb, ob = make_pair(make_opt, config)
    lockstep(ma, oa, mb, ob, 10, min_numel=0)
    assert "max_exp_avg_sq" in ob.state[mb.fc2.weight]
    assert "max_exp_avg_sq" not in ob.state[mb.fc1.weight]


class MixedPrecision(nn.Module):
    """A float32 model and a second model of another dtype, trained on one summed loss."""

    def __init__(self, other: torch.dtype) -> None:
        super().__init__()
        self.a = make_model(0)
        self.b = make_model(1, dtype=other)

    def forward(self, step: int) -> torch.Tensor:
        return loss_of(self.a, step) + loss_of(self.b, step).float()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(
    ("other", "flags"),
    [
        (torch.float64, {}),
        (torch.float64, {"foreach": True}),
        (torch.float64, {"fused": True}),
        (torch.bfloat16, {}),
        (torch.bfloat16, {"fused": True}),
    ],
    ids=["fp64", "fp64_foreach", "fp64_fused", "bf16", "bf16_fused"],
)
def test_param_groups_of_different_dtypes(other, flags, packed):
    ma = MixedPrecision(other)
    mb = twin(ma)

    def make_opt(m):
        return torch.optim.Adam(
            [{"params": m.a.parameters()}, {"params": m.b.parameters(), "lr": 0.03}],
            lr=0.01,
            **flags,
        )

    oa, ob = make_opt(ma), make_opt(mb)
    swap_optimizer(ob, loopback(swap_times=3, min_numel=0, packed_swap=packed))
    for step in range(10):
        for model, opt in ((ma, oa), (mb, ob)):
            opt.zero_grad()
            model(step).backward()
            opt.step()
        assert_nothing_resident(ob)
        assert_same(oa, ob, ma, mb)
    assert ob.state[mb.b.fc1.weight]["exp_avg"].dtype == other
    if packed:
        assert set(engine_of(ob).staging.buffers) == {torch.float32, other}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_frozen_gradless_and_tiny_params(make_pair, packed):
    config = loopback(swap_times=5, min_numel=1024, packed_swap=packed)
    ma, oa, mb, ob = make_pair(lambda m: torch.optim.Adam(m.parameters(), lr=0.01), config)
    lockstep(ma, oa, mb, ob, 1, min_numel=1024)
    # After one (even) step: the odd branch, the frozen layer and `unused` have no state.
    for p in (mb.odd.weight, mb.unused, *mb.frozen.parameters()):
        assert p not in ob.state or not ob.state[p]
    lockstep(ma, oa, mb, ob, 11, start=1, min_numel=1024)
    assert ob.state[mb.odd.weight]["exp_avg"].shape == mb.odd.weight.shape
    for p in (mb.unused, *mb.frozen.parameters()):
        assert not ob.state.get(p)
        assert p.grad is None


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_param_whose_grad_starts_later(make_pair, packed):
    """A frozen layer unfrozen mid-training gets its state in a later step."""
    config = loopback(swap_times=3, min_numel=0, packed_swap=packed)
    ma, oa, mb, ob = make_pair(lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), config)
    lockstep(ma, oa, mb, ob, 4, min_numel=0)
    ma.frozen.requires_grad_(True)
    mb.frozen.requires_grad_(True)
    for step in range(4, 14):
        ra = train(ma, oa, 1, start=step)
        rb = train(mb, ob, 1, start=step)
        assert ra == rb
        assert_nothing_resident(ob)
        assert_same(oa, ob, ma, mb)
    assert (id(mb.frozen.weight), "exp_avg_sq") in engine_of(ob).slots


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12),
}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("when", ["before_install", "after_install"])
@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_lr_schedulers(sched, when, packed):
    make_sched = SCHEDULERS[sched]
    ma = make_model()
    mb = twin(ma)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        oa = torch.optim.AdamW(ma.parameters(), lr=0.01)
        ob = torch.optim.AdamW(mb.parameters(), lr=0.01)
        config = loopback(swap_times=3, min_numel=0, packed_swap=packed)
        sa = make_sched(oa)
        if when == "before_install":
            sb = make_sched(ob)
            swap_optimizer(ob, config)
        else:
            swap_optimizer(ob, config)
            sb = make_sched(ob)
        lockstep(ma, oa, mb, ob, 12, min_numel=0, sched_a=sa, sched_b=sb)
    order = [w for w in caught if "lr_scheduler" in str(w.message)]
    assert not order, [str(w.message) for w in order]
    assert not [w for w in caught if issubclass(w.category, UserWarning)]
    assert sb.get_last_lr() == sa.get_last_lr()
    assert ob._opt_called


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(
    "flags", [{}, {"foreach": True}, {"fused": True}], ids=["for_loop", "foreach", "fused"]
)
def test_gradient_clipping(make_pair, flags, packed):
    config = loopback(swap_times=3, min_numel=0, packed_swap=packed)
    ma, oa, mb, ob = make_pair(lambda m: torch.optim.Adam(m.parameters(), lr=0.01, **flags), config)
    lockstep(ma, oa, mb, ob, 10, min_numel=0, clip=0.05)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_gradient_accumulation(make_pair, packed):
    config = loopback(swap_times=3, min_numel=0, packed_swap=packed)
    ma, oa, mb, ob = make_pair(
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True), config
    )
    lockstep(ma, oa, mb, ob, 10, min_numel=0, accumulate=2)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_step_with_closure_returns_the_loss(make_pair, packed):
    config = loopback(swap_times=3, min_numel=0, packed_swap=packed)
    ma, oa, mb, ob = make_pair(lambda m: torch.optim.Adam(m.parameters(), lr=0.01), config)
    losses = []
    for step in range(10):
        ra = train(ma, oa, 1, start=step, closure=True)
        rb = train(mb, ob, 1, start=step, closure=True)
        assert rb == ra and rb[0] is not None
        losses.append(rb[0])
        assert_nothing_resident(ob)
        assert_same(oa, ob, ma, mb)
    assert len(set(losses)) == len(losses)  # the closure ran on the live model every step


def test_closure_return_value_is_the_closure_result():
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    swap_optimizer(opt, loopback(min_numel=0))
    sentinel = torch.tensor(3.5)

    def closure():
        opt.zero_grad()
        loss_of(model, 0).backward()
        return sentinel

    assert opt.step(closure) is sentinel
    assert opt.step() is None


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_add_param_group_after_install(name, packed):
    cls = OPTIMIZERS[name]
    ma = make_model()
    mb = twin(ma)

    def first(m):
        return [*m.fc1.parameters(), *m.fc2.parameters()]

    def rest(m):
        return [*m.fc3.parameters(), m.odd.weight, m.tiny]

    oa = cls(first(ma), lr=0.01)
    ob = cls(first(mb), lr=0.01)
    swap_optimizer(ob, loopback(swap_times=3, min_numel=0, packed_swap=packed))
    lockstep(ma, oa, mb, ob, 3, min_numel=0)
    before = swap_stats(ob).swapped_tensors
    for m, o in ((ma, oa), (mb, ob)):
        o.add_param_group({"params": rest(m), "lr": 0.003, "amsgrad": True, "weight_decay": 0.1})
    for step in range(3, 13):
        assert train(ma, oa, 1, start=step) == train(mb, ob, 1, start=step)
        assert_nothing_resident(ob)
        assert_same(oa, ob, ma, mb)
    stats = swap_stats(ob)
    assert stats.swapped_tensors == expected_swapped(ob, 0) > before
    assert (id(mb.fc3.weight), "max_exp_avg_sq") in engine_of(ob).slots


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_install_after_some_plain_steps(packed):
    """State that exists at install time is taken into host memory and keeps matching."""
    ma = make_model()
    mb = twin(ma)
    oa = torch.optim.Adam(ma.parameters(), lr=0.01, amsgrad=True)
    ob = torch.optim.Adam(mb.parameters(), lr=0.01, amsgrad=True)
    train(ma, oa, 3)
    train(mb, ob, 3)
    swap_optimizer(ob, loopback(swap_times=3, min_numel=0, packed_swap=packed))
    assert swap_stats(ob).swapped_tensors == expected_swapped(ob, 0) > 0
    assert_same(oa, ob, ma, mb)
    for step in range(3, 13):
        assert train(ma, oa, 1, start=step) == train(mb, ob, 1, start=step)
        assert_nothing_resident(ob)
        assert_same(oa, ob, ma, mb)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("flags", [{}, {"foreach": True}], ids=["for_loop", "foreach"])
def test_unusual_parameter_layouts(flags, packed):
    """Channels-last, transposed, complex and empty parameters step exactly like torch; only
    the contiguous real state is swapped."""

    def params():
        torch.manual_seed(0)
        return {
            "conv": nn.Parameter(torch.randn(8, 3, 4, 4).to(memory_format=torch.channels_last)),
            "transposed": nn.Parameter(torch.randn(48, 32).t()),
            "complex": nn.Parameter(torch.randn(16, 16, dtype=torch.complex64)),
            "empty": nn.Parameter(torch.randn(0, 5)),
            "plain": nn.Parameter(torch.randn(32, 32)),
        }

    pa, pb = params(), params()
    oa = torch.optim.Adam(list(pa.values()), lr=0.01, **flags)
    ob = torch.optim.Adam(list(pb.values()), lr=0.01, **flags)
    swap_optimizer(ob, loopback(swap_times=3, min_numel=0, packed_swap=packed))
    for step in range(10):
        for ps, opt in ((pa, oa), (pb, ob)):
            gen = torch.Generator().manual_seed(step)
            opt.zero_grad()
            loss = sum(
                (p.abs() ** 2 * torch.rand(p.shape, generator=gen)).sum() for p in ps.values()
            )
            loss.backward()
            opt.step()
        assert_nothing_resident(ob)
        for name in pa:
            assert torch.equal(pa[name], pb[name]), name
            assert pb[name].is_contiguous() == pa[name].is_contiguous()
            for key, value in oa.state[pa[name]].items():
                assert torch.equal(ob.state[pb[name]][key], value), (name, key)
    slots = engine_of(ob).slots
    swapped = {name for name, p in pb.items() if (id(p), "exp_avg") in slots}
    assert {"plain", "empty"} <= swapped
    assert "complex" not in swapped
