"""An optimizer swapopt cannot serve, through the integrations' automatic paths, for real.

LBFGS (its closure re-evaluates every parameter, so no batch of its state can be swapped
alone) under the Lightning callback and Accelerate's ``prepare``: the run goes on unswapped
with one ``SwapOptWarning`` naming it, and ends bit for bit where the same run without
swapopt ends; an optimizer beside it is still swapped. ``SWAPOPT_STRICT=1`` makes it raise.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("lightning")
pytest.importorskip("accelerate")
import _lightning_models as M  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from torch import nn  # noqa: E402

from swapopt_core import (  # noqa: E402
    SwapOptimizerConfig,
    SwapOptWarning,
    UnsupportedOptimizerError,
    is_swap_optimizer,
    swap_optimizer,
)
from swapopt_core._automatic import STRICT_ENV  # noqa: E402
from swapopt_core.options import ENV_VARS  # noqa: E402
from swapopt_plugins.accelerate import SwapAccelerator, SwapOptimizerPlugin  # noqa: E402


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch):
    """No SWAPOPT_* from the caller's shell, fresh Accelerate singletons."""
    for name in [*ENV_VARS.values(), STRICT_ENV]:
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _refusals(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, SwapOptWarning)]


def _recorded(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = run()
    return result, _refusals(record)


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), f"parameter {name} differs"


def _one_refusal(said: list[str]) -> None:
    assert len(said) == 1, said
    assert "torch.optim.lbfgs.LBFGS" in said[0] and "SWAPOPT_STRICT=1" in said[0]
    assert "without swapping this optimizer" in said[0]


# ---- Lightning -------------------------------------------------------------------------------


class LBFGSOnly:
    """Automatic optimization with LBFGS: Lightning steps it with its closure."""

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.05, max_iter=3)


class AdamWAndLBFGS:
    """Manual optimization: AdamW (served) on the body, LBFGS (not served) on a head."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.head = nn.Linear(4, 4)
        self.swapped: list[tuple[bool, bool]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        adamw, lbfgs = self.optimizers()
        x, y = batch
        adamw.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        adamw.step()

        def closure() -> torch.Tensor:
            lbfgs.zero_grad()
            loss = nn.functional.mse_loss(self.head(self.net(x).detach()), y)
            self.manual_backward(loss)
            return loss

        lbfgs.step(closure=closure)
        self.swapped.append(tuple(is_swap_optimizer(o.optimizer) for o in (adamw, lbfgs)))

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.AdamW(self.net.parameters(), lr=1e-2),
            torch.optim.LBFGS(self.head.parameters(), lr=0.05, max_iter=2),
        ]


class NoOptimizer:
    def configure_optimizers(self) -> None:
        return None


@pytest.mark.parametrize("package", list(M.PACKAGES.values()), ids=list(M.PACKAGES))
def test_lightning_lbfgs_trains_unswapped_with_one_warning(tmp_path, package) -> None:
    make = package.model(LBFGSOnly)
    plain = M.fit(tmp_path / "plain", make=make, package=package)
    callback = package.callback(M.LOOPBACK)
    swapped, said = _recorded(
        lambda: M.fit(tmp_path / "swap", [callback], make=make, **{"package": package})
    )
    _one_refusal(said)
    assert swapped.trainer.global_step == plain.trainer.global_step == 6
    _assert_same(plain, swapped)
    (opt,) = swapped.trainer.optimizers
    assert not is_swap_optimizer(opt) and callback.swapped == []


def test_lightning_swaps_the_served_optimizer_beside_lbfgs(tmp_path) -> None:
    make = M.PL.model(AdamWAndLBFGS)
    plain = M.fit(tmp_path / "plain", make=make)
    swapped, said = _recorded(
        lambda: M.fit(tmp_path / "swap", [M.PL.callback(M.LOOPBACK)], make=make)
    )
    _one_refusal(said)
    # AdamW swapped at every batch, LBFGS never (the plain run swapped neither).
    assert plain.swapped == [(False, False)] * 3 and swapped.swapped == [(True, False)] * 3
    _assert_same(plain, swapped)
    adamw, lbfgs = swapped.trainer.optimizers
    assert not is_swap_optimizer(adamw)  # unswapped at teardown
    for a, b in zip(plain.trainer.optimizers, swapped.trainer.optimizers, strict=True):
        for sa, sb in zip(a.state.values(), b.state.values(), strict=True):
            assert all(torch.equal(sa[k], sb[k]) for k in sa if torch.is_tensor(sa[k]))


def test_lightning_device_budget_with_lbfgs_runs_as_plain(tmp_path) -> None:
    make = M.PL.model(LBFGSOnly)
    plain = M.fit(tmp_path / "plain", make=make)
    callback = M.PL.callback(M.LOOPBACK, device_budget_mb=1.0)
    swapped, said = _recorded(lambda: M.fit(tmp_path / "swap", [callback], make=make))
    _one_refusal(said)
    assert callback.offload_sessions == {}  # the budget plans a swapped optimizer's step
    _assert_same(plain, swapped)


def test_lightning_strict_raises(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "ON")
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS"):
        M.fit(tmp_path, [M.PL.callback(M.LOOPBACK)], make=M.PL.model(LBFGSOnly))


@pytest.mark.parametrize("value", ["sometimes", "2"])
def test_lightning_bad_strict_value_is_named(tmp_path, monkeypatch, value) -> None:
    monkeypatch.setenv(STRICT_ENV, value)
    with pytest.raises(ValueError, match=rf"SWAPOPT_STRICT='{value}'.*1/true/yes"):
        M.fit(tmp_path, [M.PL.callback(M.LOOPBACK)], make=M.PL.model(LBFGSOnly))


def test_lightning_without_optimizer_needs_nothing(tmp_path) -> None:
    make = M.PL.model(NoOptimizer)
    plain = M.fit(tmp_path / "plain", make=make)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SwapOptWarning)
        swapped = M.fit(tmp_path / "swap", [M.PL.callback(M.LOOPBACK)], make=make)
    assert swapped.trainer.global_step == 6
    _assert_same(plain, swapped)


# ---- Accelerate ------------------------------------------------------------------------------


def _accelerate_lbfgs(accelerator: Accelerator) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.05, max_iter=3)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    model, prepared = accelerator.prepare(model, lbfgs)
    for _ in range(4):

        def closure() -> torch.Tensor:
            prepared.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            return loss

        prepared.step(closure)
    return model, prepared.optimizer


def test_accelerate_prepare_leaves_lbfgs_unswapped() -> None:
    plain, _ = _accelerate_lbfgs(Accelerator(cpu=True))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugin = SwapOptimizerPlugin(offload_optimizer_device="cpu", runtime="loopback", min_numel=0)
    accelerator = SwapAccelerator(cpu=True, swap_plugin=plugin)
    (swapped, opt), said = _recorded(lambda: _accelerate_lbfgs(accelerator))
    _one_refusal(said)
    assert not is_swap_optimizer(opt)
    _assert_same(plain, swapped)
    accelerator.free_memory()  # unswaps what it swapped: nothing here, and no error


def test_explicit_swap_still_raises() -> None:
    opt = torch.optim.LBFGS([nn.Parameter(torch.zeros(4))])
    with pytest.raises(UnsupportedOptimizerError, match="cannot swap torch.optim.lbfgs.LBFGS"):
        swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback"))


# ---- Transformers ----------------------------------------------------------------------------


class UndeclaredMomentum(torch.optim.Optimizer):
    """A third-party optimizer that does not declare its update per parameter."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    p.add_(buf.mul_(0.9).add_(p.grad), alpha=-group["lr"])


def test_transformers_trainer_with_an_unserved_optimizer(tmp_path) -> None:
    pytest.importorskip("transformers")
    import _transformers_tiny as tiny

    from swapopt_plugins.transformers import SwapOptimizerCallback

    def train(out: str, callbacks: list) -> Any:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        model = tiny.model()
        trainer = tiny.Trainer(
            model=model,
            args=tiny.arguments(tmp_path / out),
            train_dataset=tiny.Tokens(),
            callbacks=callbacks,
            optimizers=(UndeclaredMomentum(model.parameters(), lr=1e-2), None),
        )
        trainer.train()
        return trainer

    plain = train("plain", [])
    swapped, said = _recorded(lambda: train("swap", [SwapOptimizerCallback(M.LOOPBACK)]))
    assert len(said) == 1 and f"{__name__}.UndeclaredMomentum" in said[0], said
    _assert_same(plain.model, swapped.model)
    a, b = plain.optimizer.state_dict()["state"], swapped.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[i]["buf"], b[i]["buf"]) for i in a)
