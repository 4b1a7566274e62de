"""A real ``transformers.Trainer`` on CPU: ``SwapOptimizerCallback`` equals the plain Trainer.

A tiny GPT-2 from a config (no downloads), random tokens, gradient accumulation 2,
``max_grad_norm=1.0`` and a linear schedule with warmup. The swap uses the loopback runtime,
which moves optimizer state between two CPU buffers as the CUDA runtime moves it between
device and host, so the whole swap runs. Parameters and optimizer state are compared with
``torch.equal``.
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
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import _transformers_tiny as tiny  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from swapopt_core import (  # noqa: E402
    OffloadConfig,
    SwapOptimizerConfig,
    is_swap_optimizer,
    swap_stats,
)
from swapopt_core._figures import OFFLOAD_KEYS, SWAP_KEYS  # noqa: E402
from swapopt_core.options import ENV_VARS  # noqa: E402
from swapopt_plugins.transformers import SwapOptimizerCallback  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = SwapOptimizerConfig(runtime="loopback", min_numel=0, swap_times=3)
ACTIVATIONS = OffloadConfig(max_resident_activation_mb=0.01, min_offload_kib=0, runtime="loopback")


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


def _result(trainer) -> dict:
    return {
        "params": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
        "optimizer": trainer.optimizer.state_dict(),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for index in sa:
        assert sa[index].keys() == sb[index].keys()
        for key in sa[index]:
            assert torch.equal(sa[index][key], sb[index][key]), (index, key)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The plain Trainer run every swapped run must equal."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run = tiny.trainer(tmp_path_factory.mktemp("plain"))
    run.train()
    return _result(run)


def test_callback_equals_plain_trainer_and_resumes(tmp_path: Path, plain: dict) -> None:
    cb = SwapOptimizerCallback(LOOPBACK)
    run = tiny.trainer(tmp_path, [cb], save_strategy="steps", save_steps=3)
    logs, between = Logs(), Between()
    run.add_callback(logs)
    run.add_callback(between)
    run.train()
    _assert_same(plain, _result(run))
    # The state lived in host memory and is back on the optimizer, unswapped, at the end.
    inner = run.optimizer.optimizer
    assert not is_swap_optimizer(inner)
    (stats,) = cb.stats
    assert stats.steps == 6 and stats.swapped_tensors == 2 * len(plain["params"])
    assert stats.host_state_bytes == stats.total_state_bytes > 0
    assert stats.resident_state_bytes == 0
    assert any(
        log.get("swapopt/state_host_mib") == stats.host_state_bytes / 2**20 for log in logs.seen
    )
    # Between optimizer steps no swapped state is on the device.
    assert len(between.seen) == 6
    assert all(s.resident_state_bytes == 0 and s.host_state_bytes > 0 for s in between.seen)

    # A fresh Trainer resumed from the mid-run checkpoint ends as the uninterrupted run.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    cb2 = SwapOptimizerCallback(LOOPBACK)
    resumed = tiny.trainer(tmp_path / "resumed", [cb2])
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    _assert_same(plain, _result(resumed))
    (stats2,) = cb2.stats
    assert stats2.steps == 3 and stats2.resident_state_bytes == 0


class Between(TrainerCallback):
    """``swap_stats`` of the Trainer's optimizer after every optimizer step."""

    def __init__(self) -> None:
        self.seen: list = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs) -> None:
        self.seen.append(swap_stats(optimizer.optimizer))


class Logs(TrainerCallback):
    """Keeps a copy of every log the Trainer's callbacks see."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_log(self, args, state, control, logs: dict | None = None, **kwargs) -> None:
        self.seen.append(dict(logs or {}))


def test_activation_offload_equals_plain_trainer(tmp_path: Path, plain: dict) -> None:
    cb = SwapOptimizerCallback(LOOPBACK, activation_offload=ACTIVATIONS)
    run = tiny.trainer(tmp_path, [cb])
    run.train()
    _assert_same(plain, _result(run))
    # One session entry per optimizer step: both accumulation substeps inside it.
    stats = cb.offload_session.stats()
    assert (stats.warmups, stats.replays, stats.retraces) == (1, 5, 0)
    assert stats.d2h_bytes > 0


def test_logs_carry_swap_and_activation_figures(
    tmp_path: Path, plain: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """``on_log`` adds the ``swapopt/...`` figures of the swap and the activation session;
    ``on_train_end`` logs the summary line."""
    cb, logs = SwapOptimizerCallback(LOOPBACK, activation_offload=ACTIVATIONS), Logs()
    run = tiny.trainer(tmp_path, [cb])
    run.add_callback(logs)
    with caplog.at_level(logging.INFO, logger="swapopt_core.callbacks"):
        run.train()
    _assert_same(plain, _result(run))
    logged = [log for log in logs.seen if "swapopt/activation_peak_mib" in log]
    assert len(logged) >= 2  # logging_steps=3 of 6, and the final train log
    assert set(logged[-1]) >= {*SWAP_KEYS, *OFFLOAD_KEYS}
    (stats,), (offload,) = cb.stats, cb.offload_stats
    assert cb.stats is cb.swap_stats
    assert logged[-1]["swapopt/state_host_mib"] == stats.host_state_bytes / 2**20
    assert (
        logged[-1]["swapopt/activation_peak_mib"] == offload.peak_resident_activation_bytes / 2**20
    )
    assert logged[-1]["swapopt/activation_budget_mib"] == offload.activation_budget_bytes / 2**20
    assert logged[-1]["swapopt/activation_offloaded_mib_per_step"] > 0
    assert f"swapopt: {stats}; {offload}" in caplog.messages
    # After train(), an evaluation's logs carry no stale figures.
    logs.seen.clear()
    run.log({"eval_loss": 1.0})
    assert not any(key.startswith("swapopt/") for key in logs.seen[0])


def test_install_message_counts_the_swap_the_accelerate_patch_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under ``swapopt run`` the Accelerate patch swaps at prepare(); the callback keeps that
    swap and says so, rather than "optimizer swap on 0 of 1 optimizers"."""
    import transformers.trainer as hf_trainer

    from swapopt_plugins import accelerate as swap_accelerate
    from swapopt_plugins import transformers as swap_transformers

    monkeypatch.setattr(hf_trainer, "DEFAULT_CALLBACKS", list(hf_trainer.DEFAULT_CALLBACKS))
    for name, value in [("OFFLOAD_OPTIMIZER_DEVICE", "cpu"), ("RUNTIME", "loopback")]:
        monkeypatch.setenv(f"SWAPOPT_{name}", value)
    monkeypatch.setenv("SWAPOPT_MIN_NUMEL", "0")
    assert swap_accelerate.install_globally() and swap_transformers.install_globally()
    try:
        run = tiny.trainer(tmp_path, max_steps=2)
        with caplog.at_level(logging.INFO, logger="swapopt_core.callbacks"):
            run.train()
    finally:
        swap_accelerate.uninstall_globally()
    said = [m for m in caplog.messages if "optimizer swap on" in m]
    assert len(said) == 1
    assert said[0].startswith(
        "swapopt: optimizer swap on 1 of 1 optimizers (0 swapped here, 1 swapped before and kept)"
    )


def test_bad_config_names_the_argument() -> None:
    with pytest.raises(TypeError, match=r"SwapOptimizerCallback\(config=...\)"):
        SwapOptimizerCallback(OffloadConfig())  # type: ignore[arg-type]


def test_install_globally_swaps_a_trainer_without_the_callback(
    tmp_path: Path, plain: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers.trainer as hf_trainer

    from swapopt_plugins.transformers import install_globally

    monkeypatch.setattr(hf_trainer, "DEFAULT_CALLBACKS", list(hf_trainer.DEFAULT_CALLBACKS))
    assert not install_globally()  # nothing asked for
    for name, value in [("OFFLOAD_OPTIMIZER_DEVICE", "cpu"), ("RUNTIME", "loopback")]:
        monkeypatch.setenv(f"SWAPOPT_{name}", value)
    monkeypatch.setenv("SWAPOPT_MIN_NUMEL", "0")
    monkeypatch.setenv("SWAPOPT_ACTIVATION_BUDGET_MB", "0.01")
    monkeypatch.setenv("SWAPOPT_ACTIVATION_RUNTIME", "loopback")
    assert install_globally() and install_globally()  # idempotent
    run = tiny.trainer(tmp_path)
    (cb,) = [c for c in run.callback_handler.callbacks if isinstance(c, SwapOptimizerCallback)]
    run.train()
    _assert_same(plain, _result(run))
    (stats,) = cb.stats
    assert stats.steps == 6 and stats.host_state_bytes == stats.total_state_bytes > 0
    offload = cb.offload_session.stats()
    assert (offload.warmups, offload.replays, offload.retraces) == (1, 5, 0)


class Swapped(TrainerCallback):
    """Whether the Trainer's optimizer was swapped at each optimizer step."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs) -> None:
        self.seen.append(is_swap_optimizer(optimizer.optimizer))


@pytest.mark.parametrize("way", ["callback", "swapopt run"])
def test_plain_after_train_and_swapped_again_by_the_next(
    tmp_path: Path, plain: dict, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """``swapopt run``'s setting, in this process: the Accelerate patch swaps at prepare()
    and the callback every Trainer gets keeps that swap; after train() the optimizer is
    plain, as docs/transformers.md says, and a second train() (a resume) swaps again."""
    import transformers.trainer as hf_trainer

    from swapopt_plugins import accelerate as swap_accelerate
    from swapopt_plugins import transformers as swap_transformers

    callbacks = [SwapOptimizerCallback(LOOPBACK)] if way == "callback" else []
    if way == "swapopt run":
        monkeypatch.setattr(hf_trainer, "DEFAULT_CALLBACKS", list(hf_trainer.DEFAULT_CALLBACKS))
        for name, value in [("OFFLOAD_OPTIMIZER_DEVICE", "cpu"), ("RUNTIME", "loopback")]:
            monkeypatch.setenv(f"SWAPOPT_{name}", value)
        monkeypatch.setenv("SWAPOPT_MIN_NUMEL", "0")
        assert swap_accelerate.install_globally() and swap_transformers.install_globally()
    try:
        run = tiny.trainer(tmp_path, callbacks, save_strategy="steps", save_steps=3)
        swapped = Swapped()
        run.add_callback(swapped)
        run.train()
        assert swapped.seen == [True] * 6
        assert not is_swap_optimizer(run.optimizer.optimizer)
        _assert_same(plain, _result(run))
        swapped.seen.clear()
        run.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
        assert swapped.seen == [True] * 3
        assert not is_swap_optimizer(run.optimizer.optimizer)
        _assert_same(plain, _result(run))
    finally:
        swap_accelerate.uninstall_globally()


class Boom(TrainerCallback):
    """Raises after the second optimizer step while armed."""

    armed = True

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.armed and state.global_step == 2:
            raise RuntimeError("boom")


def test_after_an_exception_the_next_train_installs_again(tmp_path: Path) -> None:
    cb, boom = SwapOptimizerCallback(LOOPBACK), Boom()
    run = tiny.trainer(tmp_path, [cb, boom])
    with pytest.raises(RuntimeError, match="boom"):
        run.train()
    # No Trainer event follows an exception: the optimizer stays swapped, and works.
    assert is_swap_optimizer(run.optimizer.optimizer)
    boom.armed = False
    run.train()
    assert not is_swap_optimizer(run.optimizer.optimizer)
    assert cb.stats[0].steps == 6


def _swapopt_run() -> Path:
    swapopt = Path(sys.executable).parent / "swapopt"
    usage = subprocess.run([str(swapopt), "-h"], capture_output=True, text=True, check=False)
    if not re.search(r"\brun\b", usage.stdout):
        pytest.skip("this checkout's swapopt has no `run` command yet")
    return swapopt


@pytest.mark.slow
def test_swapopt_run_swaps_an_unmodified_trainer_script(tmp_path: Path, plain: dict) -> None:
    swapopt = _swapopt_run()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWAPOPT_")}
    env.update(
        SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE="cpu",
        SWAPOPT_RUNTIME="loopback",
        SWAPOPT_MIN_NUMEL="0",
        PYTHONPATH=str(REPO),
    )
    script = Path(tiny.__file__)
    subprocess.run(
        [str(swapopt), "run", str(script), str(tmp_path)], env=env, check=True, timeout=300
    )
    results = torch.load(tmp_path / "result.pt", weights_only=False)
    for name, steps in [("whole", 6), ("again", 3), ("resumed", 3)]:
        result = results[name]
        assert result["swapped"], f"swapopt run did not swap the {name} run's optimizer"
        # As docs/transformers.md says: a plain optimizer again once train() returned.
        assert not result["swapped_after"], f"the {name} run's optimizer stayed swapped"
        stats = result["stats"]
        assert stats["steps"] == steps and stats["resident_state_bytes"] == 0
        assert stats["host_state_bytes"] == stats["total_state_bytes"] > 0
        _assert_same(plain, result)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
