"""swapopt's Lightning callbacks in the real Trainers on CPU (loopback runtime).

Most tests run twice: ``pytorch_lightning.Trainer`` with ``SwapOptimizerCallback`` and
``lightning.pytorch.Trainer`` with ``LightningSwapOptimizerCallback`` (the ``package``
fixture). Every equality is ``torch.equal``: a run with the callback must give the bits of the
same run without it.
"""

from __future__ import annotations

import csv
import functools
import importlib
import json
import logging
import os
import pickle
import re
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("lightning")
import _lightning_models as M  # noqa: E402
import torch  # noqa: E402

from swapopt_core import (  # noqa: E402
    OffloadConfig,
    OffloadSession,
    SwapOptimizerConfig,
    is_swap_optimizer,
    swap_stats,
)
from swapopt_core._figures import OFFLOAD_KEYS, SWAP_KEYS, summary_line  # noqa: E402
from swapopt_plugins.lightning import SwapOptimizerCallback  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ACTIVATIONS = OffloadConfig(max_resident_activation_mb=0.01, min_offload_kib=0, runtime="loopback")


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), f"parameter {name} differs"


@pytest.fixture(params=list(M.PACKAGES))
def package(request: pytest.FixtureRequest) -> M.Package:
    """The Lightning package a test trains with, and swapopt's callback class for it."""
    return M.PACKAGES[request.param]


def _other(package: M.Package) -> M.Package:
    return next(p for p in M.PACKAGES.values() if p is not package)


class Probe(pl.Callback):
    """Records what the swap looks like while training runs.

    A ``pytorch_lightning`` callback; ``lightning.pytorch``'s Trainer runs its hooks too.
    """

    def __init__(self) -> None:
        self.swapped: list[bool] = []
        self.grads: list[list[torch.Tensor]] = []
        self.resident_at_start: list[int] = []
        self.optimizers: list[torch.optim.Optimizer] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.optimizers = list(trainer.optimizers)
        self.resident_at_start = [
            swap_stats(o).resident_state_bytes for o in trainer.optimizers if is_swap_optimizer(o)
        ]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append([p.grad.clone() for p in pl_module.parameters() if p.grad is not None])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.swapped.append(all(is_swap_optimizer(o) for o in trainer.optimizers))


class NoLog:
    """``self.log`` adds Lightning bookkeeping ops that differ between steps; leave it out."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


class SkipOddSteps:
    """Runs forward and backward but skips every other optimizer step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        if batch_idx % 2:
            optimizer_closure()
            return
        optimizer.step(closure=optimizer_closure)


# ---- single process: equality with a plain run ----------------------------------------------


@pytest.mark.parametrize(
    ("model", "options"),
    [
        (lambda P: P.net, {}),
        (lambda P: functools.partial(P.net, interval="epoch"), {"max_steps": 9}),
        (lambda P: P.net, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}),
        (lambda P: P.net, {"precision": "bf16-mixed"}),
        (lambda P: P.two_optimizer_net, {}),
    ],
    ids=["step-scheduler", "epoch-scheduler", "accumulate-clip", "bf16-mixed", "manual-2-opts"],
)
def test_fit_equals_plain(tmp_path, package, model, options) -> None:
    make, options = model(package), {**options, "package": package}
    plain = M.fit(tmp_path / "plain", make=make, **options)
    probe = Probe()
    swapped = M.fit(tmp_path / "swap", [package.callback(M.LOOPBACK), probe], make=make, **options)
    assert probe.swapped and all(probe.swapped)
    assert_same(plain, swapped)
    # Removed at teardown: the optimizers are plain again, state equal to the plain run's.
    for a, b in zip(plain.trainer.optimizers, swapped.trainer.optimizers, strict=True):
        assert not is_swap_optimizer(b)
        for sa, sb in zip(a.state.values(), b.state.values(), strict=True):
            assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_per_tensor_mode_and_lr_monitor(tmp_path, package) -> None:
    def run(name: str, callbacks: list) -> tuple[torch.nn.Module, dict]:
        monitor = package.module.callbacks.LearningRateMonitor(logging_interval="step")
        model = M.fit(
            tmp_path / name,
            [*callbacks, monitor],
            package=package,
            logger=package.module.loggers.CSVLogger(tmp_path / name),
            log_every_n_steps=1,
        )
        return model, monitor.lrs

    plain, lrs_plain = run("plain", [])
    config = SwapOptimizerConfig(runtime="loopback", min_numel=16, packed_swap=False)
    swapped, lrs_swap = run("swap", [package.callback(config)])
    assert_same(plain, swapped)
    assert lrs_swap == lrs_plain and list(lrs_swap) == ["lr-AdamW"]


def test_skipped_steps_and_activation_offload(tmp_path, package) -> None:
    make = package.model(SkipOddSteps)
    plain = M.fit(tmp_path / "plain", make=make, package=package)
    cb = package.callback(M.LOOPBACK, activation_offload=ACTIVATIONS)
    swapped = M.fit(tmp_path / "swap", [cb], make=make, package=package)
    assert_same(plain, swapped)
    with OffloadSession(ACTIVATIONS):  # every session was left: a new one may start
        pass


@pytest.mark.parametrize("accumulate", [1, 2])
def test_activation_offload_equals_plain(tmp_path, package, accumulate) -> None:
    plain_probe, probe = Probe(), Probe()
    options = {"accumulate_grad_batches": accumulate, "max_steps": 5, "package": package}
    make = package.model(NoLog)
    plain = M.fit(tmp_path / "plain", [plain_probe], make=make, **options)
    cb = package.callback(M.LOOPBACK, activation_offload=ACTIVATIONS)
    swapped = M.fit(tmp_path / "swap", [cb, probe], make=make, **options)
    assert_same(plain, swapped)
    for ga, gb in zip(plain_probe.grads, probe.grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
    # One session entry per optimizer step, also under accumulation.
    (session,) = cb.offload_sessions.values()
    stats = session.stats()
    assert (stats.warmups, stats.replays, stats.retraces) == (1, 4, 0)
    assert stats.d2h_bytes > 0


class _Lines(logging.Handler):
    """Keeps each message a logger emits."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_figures_reach_the_csv_logger_and_the_summary_line(tmp_path, package) -> None:
    """``swapopt/...`` columns in metrics.csv every log_every_n_steps, the stats readable
    after fit, one summary line through Lightning's rank_zero_info; bits as plain."""
    from lightning_utilities.core import rank_zero

    options = {"accumulate_grad_batches": 2, "max_steps": 4, "package": package}
    make = package.model(NoLog)
    plain = M.fit(tmp_path / "plain", make=make, **options)
    cb, lines = package.callback(M.LOOPBACK, activation_offload=ACTIVATIONS), _Lines()
    csv_logger = package.module.loggers.CSVLogger(tmp_path / "swap")
    rank_zero.log.addHandler(lines)  # the logger Lightning's own INFO lines go to
    try:
        swapped = M.fit(
            tmp_path / "swap", [cb], make=make, logger=csv_logger, log_every_n_steps=2, **options
        )
    finally:
        rank_zero.log.removeHandler(lines)
    assert_same(plain, swapped)
    assert not is_swap_optimizer(swapped.trainer.optimizers[0])
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row.get("swapopt/state_host_mib")]
    assert [int(row["step"]) for row in rows] == [1, 3]  # Lightning's log_every_n_steps=2
    assert set(rows[0]) >= {*SWAP_KEYS, *OFFLOAD_KEYS}
    (stats,) = cb.swap_stats
    assert stats.steps == 4 and stats.host_state_bytes > 0
    assert float(rows[-1]["swapopt/state_host_mib"]) == stats.host_state_bytes / 2**20
    assert float(rows[-1]["swapopt/optimizer_steps"]) == 4
    (offload,) = cb.offload_stats
    # Logging ran after each window closed: no logging op entered the session.
    assert (offload.warmups, offload.replays, offload.retraces) == (1, 3, 0)
    peak = float(rows[-1]["swapopt/activation_peak_mib"])
    assert peak == offload.peak_resident_activation_bytes / 2**20 > 0
    summary = [line for line in lines.lines if line.startswith("swapopt:")]
    assert summary == [summary_line(cb.swap_stats, cb.offload_stats)]
    assert "optimizer state kept off the device" in summary[0] and "activations: peak" in summary[0]


class Boom:
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_exception_unswaps_and_leaves_the_session(tmp_path, package) -> None:
    cb, probe = package.callback(M.LOOPBACK, activation_offload=ACTIVATIONS), Probe()
    with pytest.raises(RuntimeError, match="boom"):
        M.fit(tmp_path, [cb, probe], make=package.model(Boom), package=package)
    assert probe.swapped == [True, True]
    with OffloadSession(ACTIVATIONS):  # the session was left
        pass
    (opt,) = probe.optimizers
    assert not is_swap_optimizer(opt)


class NoOptimizer:
    """``configure_optimizers`` returns None: Lightning trains with a stand-in optimizer."""

    def configure_optimizers(self) -> None:
        return None


def test_module_without_optimizer_trains_and_says_so_once(tmp_path, package, caplog) -> None:
    make = package.model(NoOptimizer, NoLog)
    plain = M.fit(tmp_path / "plain", make=make, package=package)
    cb = package.callback(M.LOOPBACK, activation_offload=ACTIVATIONS)
    with caplog.at_level(logging.INFO, logger="swapopt_plugins"):
        swapped = M.fit(tmp_path / "swap", [cb], make=make, package=package)
    assert swapped.trainer.global_step == plain.trainer.global_step == 6
    assert_same(plain, swapped)
    said = [r for r in caplog.records if "nothing to swap" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "configure_optimizers returned None" in said[0].getMessage()
    # The activation offload still ran, one session entry per (stand-in) optimizer step:
    # each entry counts at least once (an entry that leaves its plan and records the rest
    # of the step counts as a warmup and a retrace), and the later ones replay.
    (session,) = cb.offload_sessions.values()
    stats = session.stats()
    assert stats.warmups + stats.replays + stats.retraces >= 6
    assert stats.replays >= 2


# ---- checkpoints ------------------------------------------------------------------------------


def test_resume_equals_plain_resume(tmp_path, monkeypatch, package) -> None:
    ckpt = package.module.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2
    )
    M.fit(
        tmp_path / "first",
        [package.callback(M.LOOPBACK), ckpt],
        package=package,
        max_steps=4,
        enable_checkpointing=True,
    )
    last = str(tmp_path / "ckpt" / "last.ckpt")

    # Standard format, CPU tensors, plain data only: loads without swapopt.
    checkpoint = torch.load(last, weights_only=True)
    (opt_state,) = checkpoint["optimizer_states"]
    tensors = [v for s in opt_state["state"].values() for v in s.values()]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    plain_opt = torch.optim.AdamW(M.Net().parameters())
    plain_opt.load_state_dict(opt_state)
    (cb_state,) = [v for k, v in checkpoint["callbacks"].items() if "SwapOptimizerCallback" in k]
    assert cb_state["optimizer_steps"] == 4

    plain = M.fit(tmp_path / "plain", ckpt_path=last, max_steps=8, package=package)
    # Lightning moves restored state to the device; stand in for a device move on CPU by
    # replacing every state tensor, so the re-offload at on_train_start has work to do.
    strategy_module = importlib.import_module(f"{package.name}.strategies.strategy")

    real_move = strategy_module._optimizer_to_device

    def move(optimizer, device):
        real_move(optimizer, device)
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":
                    state[key] = value.clone()

    monkeypatch.setattr(strategy_module, "_optimizer_to_device", move)
    cb, probe = package.callback(M.LOOPBACK), Probe()
    resumed = M.fit(tmp_path / "swap", [cb, probe], ckpt_path=last, max_steps=8, package=package)
    assert cb.reoffloaded_tensors > 0
    assert probe.resident_at_start == [0]
    assert_same(plain, resumed)


# ---- refusals, arguments, auto-registration --------------------------------------------------


def _setup(package: M.Package, strategy: object) -> None:
    trainer = types.SimpleNamespace(strategy=strategy, callbacks=[], is_global_zero=True)
    package.callback(M.LOOPBACK).setup(trainer, None, "fit")


def test_refuses_fsdp_cpu_offload_and_deepspeed(package) -> None:
    # Each class raises its own package's exception.
    error = importlib.import_module(f"{package.name}.utilities.exceptions")
    misconfiguration = error.MisconfigurationException
    with pytest.raises(misconfiguration, match="cpu_offload=False"):
        _setup(package, package.module.strategies.FSDPStrategy(cpu_offload=True))

    class DeepSpeedStrategy:  # stands in for the real one (deepspeed is not installed)
        config = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}

    with pytest.raises(misconfiguration, match="already offloads.*offload_optimizer=True"):
        _setup(package, DeepSpeedStrategy())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"config": "loopback"}, r"config=\.\.\.\) must be a SwapOptimizerConfig.*'loopback'"),
        ({"activation_offload": 512}, r"activation_offload=.*OffloadConfig or None, got 512"),
    ],
)
def test_invalid_arguments(package, kwargs, match) -> None:
    with pytest.raises(TypeError, match=match):
        package.callback(**kwargs)


def test_callbacks_pickle_by_name(package) -> None:
    """ddp_spawn pickles callbacks: each class is found again under its public name."""
    callback = package.callback(M.LOOPBACK, activation_offload=ACTIVATIONS)
    copy = pickle.loads(pickle.dumps(callback))
    assert type(copy) is package.callback and copy.__module__ == "swapopt_plugins.lightning"
    assert (copy.config, copy.activation_offload) == (M.LOOPBACK, ACTIVATIONS)
    assert isinstance(callback, package.module.Callback)


def test_other_package_callback_runs_bit_exact(tmp_path, package) -> None:
    """A Trainer runs the hooks of the other package's class too, with the same bits."""
    other, probe = _other(package).callback(M.LOOPBACK), Probe()
    plain = M.fit(tmp_path / "plain", package=package)
    swapped = M.fit(tmp_path / "swap", [other, probe], package=package)
    assert probe.swapped and all(probe.swapped)
    assert_same(plain, swapped)
    assert not any(is_swap_optimizer(o) for o in probe.optimizers)


def _auto(trainer, package: M.Package) -> list:
    return [c for c in trainer.callbacks if isinstance(c, package.callback)]


def test_auto_registration(tmp_path, monkeypatch, package) -> None:
    monkeypatch.delenv("SWAPOPT_LIGHTNING_AUTO", raising=False)
    assert _auto(M.trainer(tmp_path, package=package), package) == []
    monkeypatch.setenv("SWAPOPT_LIGHTNING_AUTO", "1")
    monkeypatch.setenv("SWAPOPT_RUNTIME", "loopback")
    monkeypatch.setenv("SWAPOPT_SWAP_TIMES", "3")
    monkeypatch.setenv("SWAPOPT_MIN_NUMEL", "16")
    monkeypatch.setenv("SWAPOPT_PACKED_SWAP", "no")
    monkeypatch.setenv("SWAPOPT_ACTIVATION_BUDGET_MB", "0.5")
    monkeypatch.setenv("SWAPOPT_ACTIVATION_RUNTIME", "loopback")
    (cb,) = _auto(M.trainer(tmp_path, package=package), package)
    assert cb.config == SwapOptimizerConfig(
        swap_times=3, min_numel=16, packed_swap=False, runtime="loopback"
    )
    assert cb.activation_offload == OffloadConfig(
        max_resident_activation_mb=0.5, runtime="loopback"
    )
    # It trains, and equals a plain run.
    make = package.model(NoLog)
    plain = M.fit(tmp_path / "plain", [], make=make, package=package)
    monkeypatch.setenv("SWAPOPT_LIGHTNING_AUTO", "1")
    assert_same(plain, M.fit(tmp_path / "auto", make=make, package=package))
    # An explicit callback wins; the auto-registered one stays idle.
    explicit = package.callback(M.LOOPBACK)
    trainer = M.trainer(tmp_path, [explicit], package=package)
    package.module.seed_everything(0, verbose=False)
    trainer.fit(make(), M.loader())
    assert [c.active for c in _auto(trainer, package)] == [True, False]
    # Also when the explicit one is the other package's class.
    explicit = _other(package).callback(M.LOOPBACK)
    trainer = M.trainer(tmp_path, [explicit], package=package)
    trainer.fit(make(), M.loader())
    (auto,) = _auto(trainer, package)
    assert explicit.active and not auto.active


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        ("SWAPOPT_LIGHTNING_AUTO", "maybe", "a boolean (1/true/yes"),
        ("SWAPOPT_SWAP_TIMES", "0", "an integer >= 1"),
        ("SWAPOPT_MIN_NUMEL", "lots", "an integer >= 0"),
        ("SWAPOPT_PACKED_SWAP", "sometimes", "'auto' or null for the runtime's default, or a bool"),
        ("SWAPOPT_RUNTIME", "tpu", "'loopback'"),
        ("SWAPOPT_ACTIVATION_BUDGET_MB", "-4", "a number of MiB >= 0"),
        ("SWAPOPT_ACTIVATION_RUNTIME", "ascend", "['auto', 'cuda', 'loopback', 'loopback-async']"),
    ],
)
def test_invalid_env(tmp_path, monkeypatch, package, name, value, accepted) -> None:
    monkeypatch.setenv("SWAPOPT_LIGHTNING_AUTO", "1")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}='{value}'.*{re.escape(accepted)}"):
        M.trainer(tmp_path, package=package)


# ---- two processes (gloo) -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ranks(tmp_path: Path, *args: str) -> None:
    """Run ``_lightning_models.py tmp_path *args`` as the two ranks of a torchrun-style launch."""
    port, procs = _free_port(), []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            WORLD_SIZE="2",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), str(Path(__file__).parent)]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(M.__file__)), str(tmp_path), *args],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]


@pytest.mark.slow
def test_ddp_two_processes(tmp_path) -> None:
    _ranks(tmp_path)
    plain, swap = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "swap.pt")
    assert all(torch.equal(plain[k], swap[k]) for k in plain)


@pytest.mark.slow
def test_ddp_figures_from_rank_zero_only(tmp_path) -> None:
    """Two DDP ranks: the figures reach metrics.csv and the summary line is logged on rank
    zero only; each rank's callback keeps its own stats."""
    _ranks(tmp_path, "figures")
    ranks = [json.loads((tmp_path / f"figures-{r}.json").read_text()) for r in range(2)]
    assert [len(r["summary"]) for r in ranks] == [1, 0]
    assert all(r["steps"] == 6 and r["host_state_bytes"] > 0 for r in ranks)
    (metrics,) = (tmp_path / "logs").rglob("metrics.csv")
    with open(metrics, newline="") as file:
        rows = [row for row in csv.DictReader(file) if row.get("swapopt/state_host_mib")]
    host = ranks[0]["host_state_bytes"] / 2**20
    assert len(rows) == 3 and all(float(row["swapopt/state_host_mib"]) == host for row in rows)


@pytest.mark.slow
def test_ddp_spawn_two_processes(tmp_path) -> None:
    options = {"strategy": "ddp_spawn", "devices": 2, "max_steps": 3}
    plain = M.fit(tmp_path / "plain", **options)
    swapped = M.fit(tmp_path / "swap", [SwapOptimizerCallback(M.LOOPBACK)], **options)
    assert_same(plain, swapped)
