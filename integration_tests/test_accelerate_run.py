"""A plain ``Accelerator()`` swaps once ``install_globally()`` ran, and equals the plain run.

The unmodified script ``_accelerate_plain_script.py`` runs as a real subprocess: with
``--install`` (it calls ``install_globally()``), through ``swapopt run``, and under
``accelerate launch`` with two gloo processes on the CPU. Each swapped run must show the swap
in its ``swap_stats`` and end, after a ``save_state``/``load_state`` round trip too, with
parameters and optimizer state equal (``torch.equal``) to the same script without the flag.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

import swapopt_core.swaps  # noqa: E402
from swapopt_core import is_swap_optimizer  # noqa: E402
from swapopt_core.options import ENV_VARS  # noqa: E402
from swapopt_plugins.accelerate import (  # noqa: E402
    SwapAccelerator,
    install_globally,
    installed_plugin,
    uninstall_globally,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("_accelerate_plain_script.py")
BIN = Path(sys.executable).parent
STEPS = 6  # real optimizer steps of the script's uninterrupted run (12 batches, accumulation 2)


def _reset() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch):
    """No SWAPOPT_* from the caller's shell, fresh Accelerate singletons, no patch left over."""
    for name in ENV_VARS.values():
        monkeypatch.delenv(name, raising=False)
    uninstall_globally()
    _reset()
    yield
    uninstall_globally()
    _reset()


def _flag_on(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _SWAP_ENV.items():
        monkeypatch.setenv(name, value)


_SWAP_ENV = {
    "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
    "SWAPOPT_RUNTIME": "loopback",
    "SWAPOPT_MIN_NUMEL": "0",
    "SWAPOPT_SWAP_TIMES": "2",
}


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_without_flag_nothing_is_patched() -> None:
    prepare, free_memory = Accelerator.__dict__["prepare"], Accelerator.__dict__["free_memory"]
    assert install_globally() is False
    assert Accelerator.__dict__["prepare"] is prepare
    assert Accelerator.__dict__["free_memory"] is free_memory
    _, optimizer = Accelerator(cpu=True).prepare(*_objects())
    assert not is_swap_optimizer(optimizer.optimizer)


def test_install_is_idempotent_and_undoable(monkeypatch: pytest.MonkeyPatch) -> None:
    prepare = Accelerator.__dict__["prepare"]
    _flag_on(monkeypatch)
    assert install_globally() is True and install_globally() is True
    assert Accelerator.__dict__["prepare"] is not prepare
    assert installed_plugin().swap_times == 2
    accelerator = Accelerator(cpu=True)
    _, optimizer = accelerator.prepare(*_objects())
    assert is_swap_optimizer(optimizer.optimizer)
    accelerator.prepare(optimizer)  # prepared again: still one swap, one entry
    assert len(accelerator._swapopt.optimizers) == 1
    accelerator.free_memory()  # the patched free_memory unswaps, as SwapAccelerator's does
    assert not is_swap_optimizer(optimizer.optimizer)
    assert uninstall_globally() is True and uninstall_globally() is False
    assert Accelerator.__dict__["prepare"] is prepare
    _reset()
    _, optimizer = Accelerator(cpu=True).prepare(*_objects())
    assert not is_swap_optimizer(optimizer.optimizer)


def test_swap_accelerator_keeps_its_own_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    _flag_on(monkeypatch)
    install_globally()
    from swapopt_plugins.accelerate import SwapOptimizerPlugin

    plugin = SwapOptimizerPlugin(offload_optimizer_device="none")
    _, optimizer = SwapAccelerator(cpu=True, swap_plugin=plugin).prepare(*_objects())
    assert not is_swap_optimizer(optimizer.optimizer)


def test_bad_setting_is_named_and_patches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _flag_on(monkeypatch)
    monkeypatch.setenv("SWAPOPT_SWAP_TIMES", "eight")
    prepare = Accelerator.__dict__["prepare"]
    with pytest.raises(ValueError, match="environment variable SWAPOPT_SWAP_TIMES='eight'"):
        install_globally()
    assert Accelerator.__dict__["prepare"] is prepare


def test_release_takes_back_only_a_swap_prepare_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the Trainer callback calls at the end of train() under ``swapopt run``."""
    import gc
    import weakref

    from swapopt_core import swap_optimizer, unswap_optimizer
    from swapopt_plugins import accelerate as swap_accelerate

    _flag_on(monkeypatch)
    install_globally()
    accelerator = Accelerator(cpu=True)
    _, optimizer = accelerator.prepare(*_objects())
    assert swap_accelerate.release(optimizer.optimizer) is True
    assert not is_swap_optimizer(optimizer.optimizer) and accelerator._swapopt.optimizers == []
    assert swap_accelerate.release(optimizer.optimizer) is False  # nothing left to take back
    accelerator.prepare(optimizer)  # prepared again: swapped again
    assert is_swap_optimizer(optimizer.optimizer)
    # A swap the user made before prepare() is theirs: release leaves it.
    model, mine = _objects()
    swap_optimizer(mine, swap_accelerate.SwapOptimizerPlugin().swap_config())
    _, prepared = accelerator.prepare(model, mine)
    assert swap_accelerate.release(mine) is False and is_swap_optimizer(mine)
    # The registry keeps neither the optimizer nor the accelerator alive (unswapped by hand
    # first: what keeps a dropped swapped optimizer alive is not this registry's concern).
    unswap_optimizer(optimizer.optimizer)
    unswap_optimizer(mine)
    inner, state = weakref.ref(optimizer.optimizer), weakref.ref(accelerator._swapopt)
    assert inner() in swapopt_core.swaps._swapped_by
    del accelerator, optimizer, prepared, mine, model
    _reset()
    gc.collect()
    assert inner() is None and state() is None


def test_deepspeed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _flag_on(monkeypatch)
    install_globally()
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    with pytest.raises(ValueError, match="DEEPSPEED.*offload_optimizer_device: cpu"):
        accelerator.prepare(*_objects())


def _env(flag: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWAPOPT_")}
    env.update(_SWAP_ENV)
    env["SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE"] = "cpu" if flag else "none"
    env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _run_all(commands: dict[str, list[str]], tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Start every command (key: name; ``OUT`` in it: its output folder) at once; wait."""
    procs = {}
    for name, command in commands.items():
        out = tmp_path / name
        out.mkdir()
        command = [str(out) if part == "OUT" else part for part in command]
        flag = not name.startswith("plain")
        procs[name] = (
            out,
            subprocess.Popen(
                command,
                cwd=REPO,
                env=_env(flag),
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            ),
        )
    done = {}
    for name, (out, proc) in procs.items():
        log, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{name} failed:\n{log[-6000:]}"
        done[name] = (out, log)
    return done


def _assert_equal(got: dict, want: dict, what: str) -> None:
    for name in want["params"]:
        assert torch.equal(got["params"][name], want["params"][name]), f"{what}: {name}"
    got_opt, want_opt = got["optimizer"], want["optimizer"]
    assert got_opt["param_groups"] == want_opt["param_groups"], what
    assert got_opt["state"].keys() == want_opt["state"].keys(), what
    for index, entries in want_opt["state"].items():
        for key, value in entries.items():
            assert torch.equal(got_opt["state"][index][key], value), f"{what}: state {index} {key}"


def _check(done: dict[str, tuple[Path, str]], swapped: str, plain: str, ranks: int) -> None:
    for rank in range(ranks):
        got = torch.load(done[swapped][0] / f"rank{rank}.pt", weights_only=True)
        want = torch.load(done[plain][0] / f"rank{rank}.pt", weights_only=True)
        assert got["num_processes"] == ranks
        assert want["first"]["stats"] is None and want["resumed"]["stats"] is None
        stats = got["first"]["stats"]
        assert stats is not None, f"{swapped}: rank {rank} was not swapped"
        assert stats["steps"] == STEPS and stats["swapped_tensors"] == 8
        assert stats["resident_state_bytes"] == 0 and stats["host_state_bytes"] > 0
        assert got["after_load"]["resident_state_bytes"] == 0  # loaded straight to host
        assert got["resumed"]["stats"]["steps"] == STEPS // 2
        _assert_equal(got["first"], want["first"], f"{swapped} rank {rank}")
        _assert_equal(got["resumed"], want["resumed"], f"{swapped} rank {rank} after load_state")
        assert f"rank{rank} swap_stats:" in done[swapped][1]


def _swapopt_run_exists() -> bool:
    swapopt = BIN / "swapopt"
    if not swapopt.exists():
        return False
    probe = subprocess.run([str(swapopt), "run", "--help"], capture_output=True, text=True)
    return probe.returncode == 0


def test_plain_script_swaps_and_equals_plain(tmp_path: Path) -> None:
    python = [sys.executable, str(SCRIPT), "--install", "OUT"]
    commands = {"plain": python, "install": python}
    if _swapopt_run_exists():
        commands["swapopt-run"] = [str(BIN / "swapopt"), "run", str(SCRIPT), "OUT"]
    done = _run_all(commands, tmp_path)
    assert "install_globally: False" in done["plain"][1]
    assert "install_globally: True" in done["install"][1]
    for name in commands:
        if name != "plain":
            _check(done, name, "plain", ranks=1)
    if "swapopt-run" not in commands:
        pytest.skip("`swapopt run` is not available yet; checked the install_globally() path")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_process_launch_swaps_and_equals_plain(tmp_path: Path) -> None:
    launcher = BIN / "accelerate"
    if not launcher.exists() or shutil.which("torchrun", path=str(BIN)) is None:
        pytest.skip(f"no accelerate launcher next to {sys.executable}")
    # Accelerate 1.x: "--multi_gpu" (the torchrun launcher) with ACCELERATE_USE_CPU=true gives
    # two gloo ranks on the CPU; "--cpu --num_processes 2" would start only one.
    launch = [str(launcher), "launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    script = [str(SCRIPT), "--install", "OUT"]
    commands = {"plain": [*launch, "--main_process_port", str(_free_port()), *script]}
    if _swapopt_run_exists():
        swapopt = ["--no_python", str(BIN / "swapopt"), "run", str(SCRIPT), "OUT"]
        commands["swapped"] = [*launch, "--main_process_port", str(_free_port()), *swapopt]
    else:
        commands["swapped"] = [*launch, "--main_process_port", str(_free_port()), *script]
    done = _run_all(commands, tmp_path)
    _check(done, "swapped", "plain", ranks=2)
    first = [torch.load(done["swapped"][0] / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert first[0]["distributed_type"] == "MULTI_CPU"
    for name, value in first[0]["first"]["params"].items():
        assert torch.equal(first[1]["first"]["params"][name], value), name


def test_trainer_swaps_through_the_accelerator_patch_alone(tmp_path: Path) -> None:
    """``transformers.Trainer`` prepares its optimizer through ``Accelerator.prepare``, so
    the patch alone swaps it; ends (and resumes from a checkpoint) as the plain Trainer."""
    pytest.importorskip("transformers")
    script = [sys.executable, str(SCRIPT.with_name("_accelerate_trainer_script.py")), "OUT"]
    done = _run_all({"plain": script, "swapped": script}, tmp_path)
    assert "install_globally: True" in done["swapped"][1]
    got = torch.load(done["swapped"][0] / "result.pt", weights_only=False)
    want = torch.load(done["plain"][0] / "result.pt", weights_only=False)
    for run in ("whole", "again", "resumed"):  # "again": a second train() of one Trainer
        assert got[run]["swapped"] and not want[run]["swapped"]
        assert got[run]["stats"]["steps"] > 0 and got[run]["stats"]["resident_state_bytes"] == 0
        _assert_equal(got[run], want[run], f"Trainer {run}")
