"""The generic per-parameter path by what an optimizer is: refusals (LBFGS,
differentiable=True, undeclared third-party optimizers and subclasses with a step of their
own), optimizers declared by an attribute or a plugin, and transformers' Adafactor."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest
import torch

from swapopt_core import (
    PerParameterAdapter,
    UnsupportedOptimizerError,
    hookimpl,
    is_swap_optimizer,
    new_plugin_manager,
    swap_optimizer,
    swap_stats,
)
from tests.torch_backend.per_parameter_cases import (
    FAMILIES,
    config,
    lockstep,
    make_net,
    make_opt,
    pair,
)

#: Each test runs on the synchronous loopback and on loopback-async with jitter.
pytestmark = pytest.mark.usefixtures("swap_runtime", "single_thread")

optim = torch.optim
PACKED = pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])


# ---- refusals ------------------------------------------------------------------------------


def test_lbfgs_is_refused_naming_it_and_why() -> None:
    opt = optim.LBFGS(make_net(optim.SGD).parameters())
    with pytest.raises(UnsupportedOptimizerError, match=r"torch\.optim\.lbfgs\.LBFGS.*closure"):
        swap_optimizer(opt, config())
    assert not is_swap_optimizer(opt)


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "RMSprop", "NAdam", "Rprop"])
def test_differentiable_is_refused(name: str) -> None:
    cls, kwargs = FAMILIES[name]
    opt = cls(make_net(cls).parameters(), differentiable=True, **kwargs)
    with pytest.raises(UnsupportedOptimizerError, match=r"differentiable=True"):
        swap_optimizer(opt, config())
    assert not is_swap_optimizer(opt)


class UndeclaredLion(optim.Optimizer):
    """Lion (sign of an interpolated momentum), a per-parameter optimizer outside torch."""

    def __init__(self, params: Any, lr: float = 1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                state["step"] += 1
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


class Lion(UndeclaredLion):
    swapopt_per_parameter = True


LION_KWARGS = {"lr": 0.01, "weight_decay": 0.1}


@PACKED
def test_a_declared_third_party_optimizer_is_served_exactly(packed: bool) -> None:
    plain_model, plain, model, opt = pair(Lion, LION_KWARGS, config(packed))
    lockstep(plain_model, plain, model, opt, 4)
    assert swap_stats(opt).swapped_tensors == 4  # exp_avg of fc1.weight, fc1.bias, fc2.weight, odd


def test_an_undeclared_third_party_optimizer_is_refused_saying_how_to_declare() -> None:
    opt = UndeclaredLion(make_net(optim.SGD).parameters())
    with pytest.raises(UnsupportedOptimizerError, match=r"UndeclaredLion") as caught:
        swap_optimizer(opt, config())
    assert "swapopt_per_parameter = True" in str(caught.value)
    assert not is_swap_optimizer(opt)


class LionPlugin:
    @hookimpl
    def swapopt_register_optimizer_adapters(self) -> list[PerParameterAdapter]:
        return [PerParameterAdapter(classes=(UndeclaredLion,))]


@PACKED
def test_a_plugin_registers_a_third_party_optimizer(packed: bool) -> None:
    manager = new_plugin_manager(load_entrypoints=False)
    manager.register(LionPlugin())
    plain_model = make_net(UndeclaredLion)
    model = copy.deepcopy(plain_model)
    plain = make_opt(UndeclaredLion, plain_model, LION_KWARGS)
    opt = make_opt(UndeclaredLion, model, LION_KWARGS)
    swap_optimizer(opt, config(packed), plugin_manager=manager)
    lockstep(plain_model, plain, model, opt, 4)


class LoggingSGD(optim.SGD):
    """An SGD whose ``step`` is its own: swapopt cannot know what it does."""

    calls = 0

    def step(self, closure: Any = None) -> Any:
        type(self).calls += 1
        return super().step(closure)


class DeclaredLoggingSGD(LoggingSGD):
    swapopt_per_parameter = True


def test_a_subclass_that_overrides_step_is_refused_unless_declared() -> None:
    kwargs = FAMILIES["SGD"][1]
    opt = LoggingSGD(make_net(optim.SGD).parameters(), **kwargs)
    with pytest.raises(UnsupportedOptimizerError, match=r"LoggingSGD.*swapopt_per_parameter"):
        swap_optimizer(opt, config())
    assert not is_swap_optimizer(opt)


class RenamedSGD(optim.SGD):
    """An SGD subclass that keeps torch's step: served without declaring anything."""


def test_a_subclass_that_keeps_step_is_served_exactly() -> None:
    plain_model, plain, model, opt = pair(RenamedSGD, FAMILIES["SGD"][1], config())
    lockstep(plain_model, plain, model, opt, 4)


#: The first instance of a subclass that only inherits ``step``, before any instance of its
#: family: torch then puts its hook wrapper of the inherited step on the subclass itself.
FIRST_INSTANCE = """
import torch
from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats

class RenamedAdagrad(torch.optim.Adagrad):
    pass

params = [torch.nn.Parameter(torch.randn(40, 40))]
opt = RenamedAdagrad(params, lr=0.1)
assert "step" in vars(RenamedAdagrad)
swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", min_numel=0))
plain_params = [p.detach().clone().requires_grad_() for p in params]
plain = torch.optim.Adagrad(plain_params, lr=0.1)
for seed in range(3):
    for p in (params[0], plain_params[0]):
        p.grad = torch.randn(40, 40, generator=torch.Generator().manual_seed(seed))
    opt.step()
    plain.step()
assert torch.equal(params[0], plain_params[0])
assert swap_stats(opt).swapped_tensors == 1
print("served")
"""


def test_the_first_instance_of_a_subclass_that_keeps_step_is_served() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FIRST_INSTANCE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "served", done.stderr[-2000:]


def test_a_declared_subclass_calling_the_parent_step_is_served_exactly() -> None:
    optim.SGD([torch.zeros(1, requires_grad=True)])  # torch wraps SGD.step with its hooks
    plain_model, plain, model, opt = pair(DeclaredLoggingSGD, FAMILIES["SGD"][1], config())
    lockstep(plain_model, plain, model, opt, 4)


# ---- transformers' Adafactor -------------------------------------------------------------

ADAFACTOR = {
    "relative_step": {},
    "no_scale_parameter": {"scale_parameter": False},
    "warmup_init": {"warmup_init": True},
    "beta1": {"beta1": 0.9, "weight_decay": 0.01},
    "fixed_lr": {"lr": 1e-2, "relative_step": False, "scale_parameter": False},
}


@PACKED
@pytest.mark.parametrize("setting", list(ADAFACTOR))
def test_transformers_adafactor(setting: str, packed: bool) -> None:
    transformers_optimization = pytest.importorskip("transformers.optimization")
    cls = transformers_optimization.Adafactor
    kwargs = ADAFACTOR[setting]

    def build(cls: type, model: torch.nn.Module, kwargs: dict[str, Any]) -> optim.Optimizer:
        first, second = model.groups()  # type: ignore[operator]
        return cls([{"params": first}, {"params": second, "clip_threshold": 0.5}], **kwargs)

    plain_model, plain, model, opt = pair(cls, kwargs, config(packed), build=build)
    lockstep(plain_model, plain, model, opt, 4)
