"""One device budget through every way in: Lightning, Transformers, Accelerate, ``swapopt run``
on CPU with the loopback runtimes. The examples of ``docs/device_budget.md``, ``swapopt run``'s
included, run in ``tests/docs``.

The runs under a budget need ``OffloadSession(config, optimizer=opt)``, which plans the whole
step; until the session takes an optimizer they are skipped. The settings' rules (exclusive
budgets, one optimizer, the variable reaching each integration) are checked either way.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import _lightning_models as M  # noqa: E402
import _transformers_tiny as tiny  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from swapopt_core import (  # noqa: E402
    OffloadConfig,
    SwapOptimizerConfig,
    is_swap_optimizer,
)
from swapopt_core.options import ENV_VARS  # noqa: E402
from swapopt_plugins import transformers as swap_transformers  # noqa: E402
from swapopt_plugins.accelerate import SwapAccelerator, SwapOptimizerPlugin  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "device_budget.md"
BUDGET_MB = 64
ACTIVATION_RUNTIME = OffloadConfig(runtime="loopback", min_offload_kib=0)
LOOPBACK = SwapOptimizerConfig(runtime="loopback", min_numel=0, swap_times=3)

pytestmark = pytest.mark.filterwarnings("ignore:SWAPOPT_DEVICE_BUDGET_MB")


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch):
    """No SWAPOPT_* from the caller's shell, and fresh Accelerate singletons around each test."""
    for name in ENV_VARS.values():
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), f"parameter {name} differs"


def assert_within_budget(sessions) -> None:
    for session in sessions:
        stats = session.stats()
        assert 0 < stats.step_peak_device_bytes <= BUDGET_MB * 2**20


# ---- the settings, checked without the planner ------------------------------------------------


def test_lightning_budget_beside_an_activation_budget_is_refused() -> None:
    with pytest.raises(ValueError, match=r"device_budget_mb=64 and activation_offload"):
        M.PL.callback(
            LOOPBACK,
            activation_offload=OffloadConfig(max_resident_activation_mb=1),
            device_budget_mb=BUDGET_MB,
        )
    callback = M.LP.callback(LOOPBACK, activation_offload=ACTIVATION_RUNTIME, device_budget_mb=64)
    assert callback.activation_offload == OffloadConfig(
        device_budget_mb=64, runtime="loopback", min_offload_kib=0
    )


def test_lightning_budget_with_two_optimizers_is_refused_and_unswaps(tmp_path) -> None:
    package = M.PL
    callback = package.callback(LOOPBACK, device_budget_mb=BUDGET_MB)
    with pytest.raises(ValueError, match=r"plans one optimizer's step, but this fit has 2"):
        M.fit(tmp_path, [callback], make=package.two_optimizer_net, package=package)
    assert not callback.swapped


def test_transformers_callback_reads_the_budget_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("SWAPOPT_DEVICE_BUDGET_MB", "64")
    monkeypatch.setenv("SWAPOPT_ACTIVATION_RUNTIME", "loopback")
    callback = swap_transformers._EnvSwapOptimizerCallback()
    assert callback.swap_enabled and callback.device_budget_mb == 64
    assert callback.activation_offload == OffloadConfig(device_budget_mb=64, runtime="loopback")
    with pytest.raises(ValueError, match=r"device_budget_mb=64 and activation_offload"):
        swap_transformers.SwapOptimizerCallback(
            activation_offload=OffloadConfig(max_resident_activation_mb=1), device_budget_mb=64
        )


def test_accelerate_budget_from_the_environment_swaps_at_prepare(monkeypatch) -> None:
    monkeypatch.setenv("SWAPOPT_DEVICE_BUDGET_MB", "64")
    monkeypatch.setenv("SWAPOPT_RUNTIME", "loopback")
    accelerator = SwapAccelerator(cpu=True)
    assert accelerator.swap_plugin.enabled and accelerator.swap_plugin.device_budget_mb == 64
    model = torch.nn.Linear(64, 64)
    one = torch.optim.AdamW(model.parameters())
    two = torch.optim.AdamW(model.parameters())
    _, one, two = accelerator.prepare(model, one, two)
    assert is_swap_optimizer(one.optimizer) and is_swap_optimizer(two.optimizer)
    with pytest.raises(ValueError, match=r"plans one optimizer's step, but 2 optimizers"):
        accelerator.offload_session()
    accelerator.free_memory()


def test_accelerate_plugin_refuses_both_budgets() -> None:
    with pytest.raises(ValueError, match=r"SwapOptimizerPlugin.activation_budget_mb=2 and Swap"):
        SwapOptimizerPlugin(activation_budget_mb=2, device_budget_mb=64)


def _script(tmp_path: Path) -> Path:
    (block,) = [b for b in _blocks("python") if b.startswith("# train.py")]
    path = tmp_path / "train.py"
    path.write_text(block)
    return path


def _swapopt_run(tmp_path: Path, **variables: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS.values()}
    env.update(variables, PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "swapopt_core", "run", str(_script(tmp_path))],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_swapopt_run_refuses_both_budgets_before_the_script_starts(tmp_path) -> None:
    done = _swapopt_run(tmp_path, SWAPOPT_DEVICE_BUDGET_MB="64", SWAPOPT_ACTIVATION_BUDGET_MB="8")
    assert done.returncode == 2, done.stderr
    assert "SWAPOPT_ACTIVATION_BUDGET_MB=8" in done.stderr
    assert "SWAPOPT_DEVICE_BUDGET_MB=64" in done.stderr


# ---- training under the budget ----------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_under_a_budget_equals_plain(tmp_path, accumulate) -> None:
    package = M.PL
    options = {"accumulate_grad_batches": accumulate, "max_steps": 5, "package": package}
    plain = M.fit(tmp_path / "plain", **options)
    callback = package.callback(
        LOOPBACK, activation_offload=ACTIVATION_RUNTIME, device_budget_mb=BUDGET_MB
    )
    swapped = M.fit(tmp_path / "swap", [callback], **options)
    assert_same(plain, swapped)
    assert callback.offload_sessions and not callback.swapped  # unswapped at teardown
    assert_within_budget(callback.offload_sessions.values())


def test_transformers_under_a_budget_equals_plain(tmp_path) -> None:
    plain = tiny.trainer(tmp_path / "plain")
    plain.train()
    callback = swap_transformers.SwapOptimizerCallback(
        LOOPBACK, activation_offload=ACTIVATION_RUNTIME, device_budget_mb=BUDGET_MB
    )
    swapped = tiny.trainer(tmp_path / "swap", [callback])
    swapped.train()
    assert_same(plain.model, swapped.model)
    assert_within_budget([callback.offload_session])


def test_accelerate_under_a_budget_equals_plain() -> None:
    def train(accelerator) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 1)
        )
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        session = (
            accelerator.offload_session() if isinstance(accelerator, SwapAccelerator) else None
        )
        for step in range(4):
            torch.manual_seed(100 + step)
            x, y = torch.randn(16, 32), torch.randn(16, 1)
            if session is None:
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            else:
                with session:
                    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if session is not None:
            assert_within_budget([session])
        return model

    from accelerate import Accelerator

    plain = train(Accelerator(cpu=True))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugin = SwapOptimizerPlugin(
        device_budget_mb=BUDGET_MB, runtime="loopback", min_numel=0, activation_runtime="loopback"
    )
    assert_same(plain, train(SwapAccelerator(cpu=True, swap_plugin=plugin)))


class NoOptimizer:
    """``configure_optimizers`` returns None: Lightning trains with a stand-in optimizer."""

    def configure_optimizers(self) -> None:
        return None


def _big_batches() -> torch.utils.data.DataLoader:
    """Batches whose activations (512 x 64 floats each) do not fit the small budget below."""
    gen = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(
        torch.randn(2048, 32, generator=gen), torch.randn(2048, 4, generator=gen)
    )
    return torch.utils.data.DataLoader(data, batch_size=512)


@pytest.mark.parametrize("way", ["callback", "environment"])
def test_lightning_without_an_optimizer_keeps_activations_under_the_budget(
    tmp_path, monkeypatch, caplog, way
) -> None:
    # With no optimizer the budget minus the parameters and their gradients is the
    # activation budget (docs/lightning.md); it was refused as "0 optimizers" before.
    package, budget_mb = M.LP, 0.5
    if way == "callback":
        callbacks = [
            package.callback(
                LOOPBACK, activation_offload=ACTIVATION_RUNTIME, device_budget_mb=budget_mb
            )
        ]
    else:  # what `SWAPOPT_DEVICE_BUDGET_MB=0.5 swapopt run train.py` sets up
        monkeypatch.setenv("SWAPOPT_LIGHTNING_AUTO", "1")
        monkeypatch.setenv("SWAPOPT_DEVICE_BUDGET_MB", str(budget_mb))
        monkeypatch.setenv("SWAPOPT_RUNTIME", "loopback")
        monkeypatch.setenv("SWAPOPT_ACTIVATION_RUNTIME", "loopback")
        callbacks = []
    package.module.seed_everything(0, verbose=False)
    model = package.model(NoOptimizer)()
    trainer = M.trainer(tmp_path, callbacks, package, max_steps=3)
    (callback,) = [c for c in trainer.callbacks if isinstance(c, package.callback)]
    with caplog.at_level(logging.INFO, logger="swapopt_core"):
        trainer.fit(model, _big_batches())
    assert trainer.global_step == 3
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    activations = budget_mb * 2**20 - 2 * params  # the parameters and their gradients
    (session,) = callback.offload_sessions.values()
    assert session.config.device_budget_mb is None
    assert session.config.max_resident_activation_mb == activations / 2**20
    stats = session.stats()
    assert stats.d2h_bytes > 0  # the activations did not fit: some were offloaded
    assert 0 < stats.peak_resident_activation_bytes <= activations
    said = [r.getMessage() for r in caplog.records if "keeps activations alone" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("swapopt: no optimizer, so the device budget")


def test_lightning_without_an_optimizer_refuses_a_budget_below_its_parameters(tmp_path) -> None:
    callback = M.LP.callback(LOOPBACK, device_budget_mb=0.01)
    with pytest.raises(ValueError, match=r"cannot hold a step with no optimizer: parameters"):
        M.fit(tmp_path, [callback], make=M.LP.model(NoOptimizer), package=M.LP, max_steps=1)


# ---- the docs ---------------------------------------------------------------------------------


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_docs_open_with_the_users_sentence() -> None:
    first = DOC.read_text().split("\n\n")[1]
    assert first.startswith("Say how much memory the step may use")
