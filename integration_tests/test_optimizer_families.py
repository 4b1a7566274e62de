"""Optimizers other than Adam in the real frameworks: swapped equals plain, bit for bit.

The generic path (``PerParameterAdapter``: the optimizer's own ``step`` on one batch of
parameters at a time) under a real ``Trainer.fit`` (SGD with momentum and nesterov, RMSprop,
Adagrad; Muon and Adafactor under manual optimization; an SGD checkpoint resumed), a real
``Accelerator(cpu=True)`` (Adagrad with accumulation through a ``save_state``/``load_state``
round trip; SGD through the GradScaler path, which patches ``step`` on the instance) and a
real ``transformers.Trainer`` (its own Adafactor, resumed from a checkpoint too, and an SGD
passed in ``optimizers=``). Every run uses the loopback runtime, so the whole swap runs; each
must end with parameters and optimizer state equal (``torch.equal``) to the same run without
swapopt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import _lightning_models as M  # noqa: E402
import _transformers_tiny as tiny  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from swapopt_core import SwapOptimizerConfig, is_swap_optimizer, swap_stats  # noqa: E402
from swapopt_core.options import ENV_VARS  # noqa: E402
from swapopt_plugins.accelerate import SwapAccelerator, SwapOptimizerPlugin  # noqa: E402
from swapopt_plugins.transformers import SwapOptimizerCallback  # noqa: E402


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch):
    """No SWAPOPT_* from the caller's shell, and fresh Accelerate singletons around each test."""
    for name in ENV_VARS.values():
        monkeypatch.delenv(name, raising=False)
    _reset()
    yield
    _reset()


def _reset() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def assert_same_state(a: Mapping, b: Mapping, what: str) -> int:
    """Two ``optimizer.state``s (or state-dict ``state``s), in order: same keys, equal values;
    returns how many tensors were compared."""
    assert len(a) == len(b) > 0, f"{what}: {len(a)} vs {len(b)} entries"
    compared = 0
    for index, (sa, sb) in enumerate(zip(a.values(), b.values(), strict=True)):
        assert sa.keys() == sb.keys(), f"{what}: entry {index} keys {sorted(sa)} vs {sorted(sb)}"
        for key in sa:
            va, vb = sa[key], sb[key]
            if torch.is_tensor(va):
                assert torch.equal(va, vb), f"{what}: state {index}.{key} differs"
                compared += 1
            else:
                assert va == vb, f"{what}: state {index}.{key} {va!r} vs {vb!r}"
    return compared


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), f"{what}: parameter {name} differs"


# ---- Lightning ------------------------------------------------------------------------------


class Probe(pl.Callback):
    """How many tensors each optimizer had swapped, after every training batch."""

    def __init__(self) -> None:
        self.swapped: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        optimizers = trainer.optimizers
        self.swapped.append(
            [swap_stats(o).swapped_tensors if is_swap_optimizer(o) else -1 for o in optimizers]
        )


class NoLog:
    """Without ``self.log`` (not needed here; keeps the run short)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


class SgdNesterov:
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(
            self.parameters(), lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class RmspropCentered:
    def configure_optimizers(self) -> Any:
        return torch.optim.RMSprop(self.parameters(), lr=1e-2, momentum=0.5, centered=True)


class AdagradDecay:
    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adagrad(self.parameters(), lr=5e-2, lr_decay=0.01, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class MuonAndAdafactor:
    """Manual optimization: Muon on the 2-D weights, torch's Adafactor on the biases."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        optimizers = self.optimizers()
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(torch.nn.functional.mse_loss(self.net(x), y))
        for opt in optimizers:
            opt.step()

    def configure_optimizers(self) -> Any:
        weights = [p for p in self.parameters() if p.ndim == 2]
        biases = [p for p in self.parameters() if p.ndim != 2]
        return [
            torch.optim.Muon(weights, lr=2e-2, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
            torch.optim.Adafactor(biases, lr=1e-2, weight_decay=0.01),
        ]


LIGHTNING_CASES = {
    "sgd-nesterov-accumulate-clip": (
        (SgdNesterov, NoLog),
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    ),
    "rmsprop-centered": ((RmspropCentered, NoLog), {}),
    "adagrad-epoch-scheduler": ((AdagradDecay, NoLog), {"max_steps": 9}),
    "manual-muon-adafactor": ((MuonAndAdafactor,), {}),
}


@pytest.mark.parametrize("case", list(LIGHTNING_CASES))
def test_lightning_fit_equals_plain(tmp_path: Path, case: str) -> None:
    mixins, options = LIGHTNING_CASES[case]
    make = M.PL.model(*mixins)
    plain = M.fit(tmp_path / "plain", make=make, **options)
    probe = Probe()
    swapped = M.fit(tmp_path / "swap", [M.PL.callback(M.LOOPBACK), probe], make=make, **options)
    assert_same_params(plain, swapped, case)
    # Every optimizer was swapped at every batch (its state, created by its first step, in
    # host memory from then on), and is plain again at the end.
    assert probe.swapped and all(n >= 0 for seen in probe.swapped for n in seen), probe.swapped
    assert all(n > 0 for n in probe.swapped[-1]), probe.swapped
    for a, b in zip(plain.trainer.optimizers, swapped.trainer.optimizers, strict=True):
        assert not is_swap_optimizer(b)
        assert type(a) is type(b)
        assert_same_state(a.state, b.state, f"{case}: {type(a).__name__}")


def test_lightning_package_callback_with_sgd(tmp_path: Path) -> None:
    """``lightning.pytorch``'s Trainer and callback class serve SGD the same way."""
    make = M.LP.model(SgdNesterov, NoLog)
    plain = M.fit(tmp_path / "plain", make=make, package=M.LP)
    swapped = M.fit(tmp_path / "swap", [M.LP.callback(M.LOOPBACK)], make=make, package=M.LP)
    assert_same_params(plain, swapped, "lightning.pytorch SGD")
    (a,), (b,) = plain.trainer.optimizers, swapped.trainer.optimizers
    assert_same_state(a.state, b.state, "lightning.pytorch SGD")


def test_lightning_sgd_resume_equals_plain_resume(tmp_path: Path) -> None:
    """A checkpoint of a swapped SGD run holds its momentum buffers as CPU tensors; resuming
    it with the callback gives the bits of resuming it without."""
    make = M.PL.model(SgdNesterov, NoLog)
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2
    )
    callbacks = [M.PL.callback(M.LOOPBACK), ckpt]
    M.fit(tmp_path / "first", callbacks, make=make, max_steps=4, enable_checkpointing=True)
    last = str(tmp_path / "ckpt" / "last.ckpt")
    (saved,) = torch.load(last, weights_only=True)["optimizer_states"]
    buffers = [s["momentum_buffer"] for s in saved["state"].values()]
    assert len(buffers) == 6 and all(b.device.type == "cpu" for b in buffers)
    plain = M.fit(tmp_path / "plain", make=make, ckpt_path=last, max_steps=8)
    probe = Probe()
    callbacks = [M.PL.callback(M.LOOPBACK), probe]
    resumed = M.fit(tmp_path / "swap", callbacks, make=make, ckpt_path=last, max_steps=8)
    assert probe.swapped and all(n > 0 for seen in probe.swapped for n in seen), probe.swapped
    assert_same_params(plain, resumed, "SGD resume")
    (a,), (b,) = plain.trainer.optimizers, resumed.trainer.optimizers
    assert_same_state(a.state, b.state, "SGD resume")


# ---- Accelerate ---------------------------------------------------------------------------

BATCHES, HALF = 12, 6


def _accelerate_objects() -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=5e-2, lr_decay=0.01, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * BATCHES, 8, generator=gen), torch.randn(4 * BATCHES, 4, generator=gen)
    )
    return model, optimizer, torch.utils.data.DataLoader(data, batch_size=4), scheduler


def _accelerator(swap: bool, accumulation: int = 2) -> Accelerator:
    _reset()
    if not swap:
        return Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    plugin = SwapOptimizerPlugin(
        offload_optimizer_device="cpu", runtime="loopback", min_numel=0, swap_times=3
    )
    return SwapAccelerator(cpu=True, gradient_accumulation_steps=accumulation, swap_plugin=plugin)


def _accelerate_train(
    swap: bool, start: int, stop: int, *, load: Path | None = None, save: Path | None = None
) -> dict:
    """Train micro-batches [start, stop) on fresh prepared objects (loading ``load`` first),
    saving the accelerator's state to ``save`` at the end; returns what it ended with."""
    accelerator = _accelerator(swap)
    model, optimizer, loader, scheduler = accelerator.prepare(*_accelerate_objects())
    if load is not None:
        accelerator.load_state(str(load))
        if swap:  # the load moved state back; the swap offloaded it again right after
            assert swap_stats(optimizer.optimizer).resident_state_bytes == 0
    for index, (x, y) in enumerate(loader):
        if not start <= index < stop:
            continue
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    if save is not None:
        accelerator.save_state(str(save))
    swapped = is_swap_optimizer(optimizer.optimizer)
    stats = swap_stats(optimizer.optimizer) if swapped else None
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optimizer": optimizer.state_dict(),
        "stats": stats,
    }


def _assert_same_run(a: dict, b: dict, what: str) -> None:
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"{what}: {name} differs"
    assert_same_state(a["optimizer"]["state"], b["optimizer"]["state"], what)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"], what


def test_accelerate_adagrad_accumulation_and_resume(tmp_path: Path) -> None:
    whole = _accelerate_train(False, 0, BATCHES)
    swapped = _accelerate_train(True, 0, BATCHES)
    _assert_same_run(whole, swapped, "swapped Adagrad vs plain")
    stats = swapped["stats"]
    assert stats.steps == BATCHES // 2 and stats.swapped_tensors == 4
    assert stats.resident_state_bytes == 0 and stats.host_state_bytes > 0

    # Half, save_state; a fresh swapped accelerator loads it and trains the other half.
    first = _accelerate_train(True, 0, HALF, save=tmp_path / "swap")
    plain_first = _accelerate_train(False, 0, HALF, save=tmp_path / "plain")
    _assert_same_run(plain_first, first, "first half")
    saved = torch.load(tmp_path / "swap" / "optimizer.bin", weights_only=True)
    reference = torch.load(tmp_path / "plain" / "optimizer.bin", weights_only=True)
    assert_same_state(reference["state"], saved["state"], "optimizer.bin")
    resumed = _accelerate_train(True, HALF, BATCHES, load=tmp_path / "swap")
    assert resumed["stats"].steps == (BATCHES - HALF) // 2
    _assert_same_run(whole, resumed, "swapped resume vs uninterrupted plain")
    # The swapped run's checkpoint resumes a plain accelerator too.
    plain_resumed = _accelerate_train(False, HALF, BATCHES, load=tmp_path / "swap")
    _assert_same_run(whole, plain_resumed, "plain resume from the swapped checkpoint")


def _scaler_run(swap: bool) -> tuple[torch.nn.Module, Any, int]:
    # Accelerate makes no GradScaler on the CPU: attach one before prepare, so the
    # AcceleratedOptimizer patches the optimizer's step on the instance and goes through
    # scaler.step/update. A huge initial scale makes the first steps overflow (skipped).
    accelerator = _accelerator(swap, accumulation=1)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**125, growth_interval=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, nesterov=True)
    loader = _accelerate_objects()[2]
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    skipped = 0
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y) * 1e3)
        optimizer.step()
        skipped += optimizer.step_was_skipped
        optimizer.zero_grad()
    return model, optimizer, skipped


def test_accelerate_grad_scaler_sgd_skips_as_plain() -> None:
    plain, plain_opt, plain_skipped = _scaler_run(False)
    model, optimizer, skipped = _scaler_run(True)
    assert skipped == plain_skipped > 0
    assert swap_stats(optimizer.optimizer).steps == BATCHES - skipped
    assert_same_params(plain, model, "SGD through the GradScaler path")
    assert_same_state(plain_opt.optimizer.state, optimizer.optimizer.state, "GradScaler SGD")


# ---- transformers.Trainer ----------------------------------------------------------------

HF_LOOPBACK = SwapOptimizerConfig(runtime="loopback", min_numel=0, swap_times=3)


class SwappedAtStep(TrainerCallback):
    """``swap_stats(...).swapped_tensors`` of the Trainer's optimizer after each step."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs) -> None:
        inner = optimizer.optimizer
        self.seen.append(swap_stats(inner).swapped_tensors if is_swap_optimizer(inner) else -1)


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9, dampening=0.1)


def _hf_run(
    out: Path,
    swap: bool,
    optimizer: Callable[[torch.nn.Module], Any] | None,
    resume: Path | None = None,
    **overrides: Any,
) -> dict:
    _reset()
    model = tiny.model()
    probe = SwappedAtStep()
    callbacks = [SwapOptimizerCallback(HF_LOOPBACK), probe] if swap else [probe]
    optimizers = (optimizer(model), None) if optimizer is not None else (None, None)
    run = Trainer(
        model=model,
        args=tiny.arguments(out, **overrides),
        train_dataset=tiny.Tokens(),
        callbacks=callbacks,
        optimizers=optimizers,
    )
    run.train(resume_from_checkpoint=None if resume is None else str(resume))
    return {
        "params": {k: v.detach().clone() for k, v in run.model.named_parameters()},
        "optimizer": run.optimizer.state_dict(),
        "inner": run.optimizer.optimizer,
        "swapped": probe.seen,
    }


HF_CASES: dict[str, tuple[Callable | None, dict]] = {
    "adafactor": (None, {"optim": "adafactor"}),
    "sgd-optimizers-arg": (_sgd, {}),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_transformers_trainer_equals_plain(tmp_path: Path, case: str) -> None:
    optimizer, overrides = HF_CASES[case]
    plain = _hf_run(tmp_path / "plain", False, optimizer, **overrides)
    swapped = _hf_run(tmp_path / "swap", True, optimizer, **overrides)
    if case == "adafactor":
        from transformers.optimization import Adafactor

        assert type(swapped["inner"]) is Adafactor
    assert plain["swapped"] == [-1] * 6
    assert len(swapped["swapped"]) == 6 and all(n > 0 for n in swapped["swapped"])
    assert not is_swap_optimizer(swapped["inner"])  # plain again once train() returned
    _assert_same_run(plain, swapped, f"transformers.Trainer {case}")


def test_transformers_adafactor_resumes_from_a_swapped_checkpoint(tmp_path: Path) -> None:
    """transformers' Adafactor (factored row/column state, a 0-dim ``RMS``, an int ``step``):
    a swapped run saves a checkpoint mid-run, a fresh swapped Trainer resumes from it and ends
    as the uninterrupted plain run."""
    plain = _hf_run(tmp_path / "plain", False, None, optim="adafactor")
    saving = {"optim": "adafactor", "save_strategy": "steps", "save_steps": 3}
    first = _hf_run(tmp_path / "first", True, None, **saving)
    _assert_same_run(plain, first, "swapped Adafactor with checkpoints")
    saved = torch.load(tmp_path / "first" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    tensors = [v for s in saved["state"].values() for v in s.values() if torch.is_tensor(v)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    resumed = _hf_run(
        tmp_path / "resumed",
        True,
        None,
        resume=tmp_path / "first" / "checkpoint-3",
        optim="adafactor",
    )
    assert len(resumed["swapped"]) == 3 and all(n > 0 for n in resumed["swapped"])
    _assert_same_run(plain, resumed, "swapped Adafactor resumed vs uninterrupted plain")
