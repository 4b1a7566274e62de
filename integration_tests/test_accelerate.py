"""HF Accelerate for real on CPU: ``SwapAccelerator`` and ``prepare`` equal plain Accelerate.

Every run uses ``Accelerator(cpu=True)`` and the loopback runtime, which moves optimizer state
between two CPU buffers exactly as the CUDA runtime moves it between device and host, so the
whole swap runs. Parameters are compared with ``torch.equal``.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedType, patch_environment  # noqa: E402

from swapopt_core import OffloadConfig, is_swap_optimizer, swap_stats  # noqa: E402
from swapopt_core._figures import OFFLOAD_KEYS, SWAP_KEYS  # noqa: E402
from swapopt_core.options import ENV_VARS  # noqa: E402
from swapopt_plugins import accelerate as swap_accelerate  # noqa: E402
from swapopt_plugins.accelerate import SwapAccelerator, SwapOptimizerPlugin  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("_accelerate_launch_script.py")
BATCHES = 12  # micro-batches per epoch


def _plugin(**overrides: object) -> SwapOptimizerPlugin:
    fields = dict(offload_optimizer_device="cpu", runtime="loopback", min_numel=0, swap_times=3)
    fields.update(overrides)
    return SwapOptimizerPlugin(**fields)


def _reset() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch):
    """No SWAPOPT_* from the caller's shell, and fresh Accelerate singletons around each test."""
    for name in ENV_VARS.values():
        monkeypatch.delenv(name, raising=False)
    _reset()
    yield
    _reset()


def _objects(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * BATCHES, 8, generator=gen), torch.randn(4 * BATCHES, 4, generator=gen)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    return model, optimizer, loader, scheduler


def _train(
    accelerator: Accelerator,
    *,
    function_form: SwapOptimizerPlugin | None = None,
    clip: float | None = None,
    start: int = 0,
    stop: int = BATCHES,
    checkpoint: Path | None = None,
    session: bool = False,
):
    """Prepare fresh objects, optionally load ``checkpoint``, train batches [start, stop)."""
    objects = _objects()
    if function_form is not None:
        prepared = swap_accelerate.prepare(accelerator, *objects, plugin=function_form)
    else:
        prepared = accelerator.prepare(*objects)
    model, optimizer, loader, scheduler = prepared
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
    for index, (x, y) in enumerate(loader):
        if not start <= index < stop:
            continue
        with accelerator.accumulate(model):
            if session:
                with accelerator.offload_session():
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                    accelerator.backward(loss)
            else:
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return model, optimizer


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the plain run"


CASES = {
    "default": ({}, {}),
    "accumulate+clip": ({"gradient_accumulation_steps": 2}, {"clip": 0.05}),
    "bf16": ({"mixed_precision": "bf16"}, {}),
    "function-form": ({"gradient_accumulation_steps": 3}, {"function_form": True}),
}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
@pytest.mark.parametrize("case", list(CASES))
def test_training_equals_plain(case: str, packed: bool) -> None:
    acc_kwargs, train_kwargs = CASES[case]
    clip = train_kwargs.get("clip")
    plain_model, _ = _train(Accelerator(cpu=True, **acc_kwargs), clip=clip)
    want = _params(plain_model)
    _reset()
    plugin = _plugin(packed_swap=packed)
    if train_kwargs.get("function_form"):
        accelerator = Accelerator(cpu=True, **acc_kwargs)
        model, optimizer = _train(accelerator, function_form=plugin, clip=clip)
    else:
        accelerator = SwapAccelerator(cpu=True, swap_plugin=plugin, **acc_kwargs)
        model, optimizer = _train(accelerator, clip=clip)
    _assert_equal(_params(model), want)
    assert is_swap_optimizer(optimizer.optimizer)
    stats = swap_stats(optimizer.optimizer)
    # AcceleratedOptimizer calls the inner step only on real (synchronised) steps.
    assert stats.steps == BATCHES // acc_kwargs.get("gradient_accumulation_steps", 1)
    assert stats.packed is packed and stats.swapped_tensors == 4 * 2
    assert stats.resident_state_bytes == 0 and stats.host_state_bytes > 0


def _train_with_scaler(accelerator: Accelerator):
    # Accelerate creates no GradScaler on the CPU, so attach a CPU one before prepare: the
    # AcceleratedOptimizer then takes its scaler path (patched step, scaler.step/update).
    # A huge initial scale makes the first steps overflow, so some steps are skipped.
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**125, growth_interval=2)
    model, optimizer, loader, _ = _objects()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    skipped = 0
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y) * 1e3)
        optimizer.step()
        skipped += optimizer.step_was_skipped
        optimizer.zero_grad()
    return model, optimizer, skipped


def test_grad_scaler_path_with_skipped_steps() -> None:
    plain_model, _, plain_skipped = _train_with_scaler(Accelerator(cpu=True))
    _reset()
    model, optimizer, skipped = _train_with_scaler(SwapAccelerator(cpu=True, swap_plugin=_plugin()))
    assert skipped == plain_skipped > 0
    _assert_equal(_params(model), _params(plain_model))
    assert swap_stats(optimizer.optimizer).steps == BATCHES - skipped


def test_prepare_installs_once() -> None:
    accelerator = SwapAccelerator(cpu=True, swap_plugin=_plugin())
    model, optimizer = accelerator.prepare(*_objects()[:2])
    assert accelerator.prepare(optimizer) is optimizer
    swap_accelerate.prepare(accelerator, optimizer, plugin=_plugin(swap_times=5))
    assert accelerator._swapopt.optimizers == [optimizer]
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    assert swap_stats(optimizer.optimizer).batches == 3  # still swap_times=3, not 5


def test_resume_equals_plain_resume(tmp_path: Path) -> None:
    ckpt, half = tmp_path / "ckpt", BATCHES // 2
    accelerator = SwapAccelerator(cpu=True, swap_plugin=_plugin())
    _, swapped_opt = _train(accelerator, stop=half)
    accelerator.save_state(str(ckpt))
    accelerator.save_state(str(tmp_path / "again"))  # saving leaves the swap working
    _reset()
    plain_acc = Accelerator(cpu=True)
    _train(plain_acc, stop=half)
    plain_acc.save_state(str(tmp_path / "plain"))

    # The checkpoint is the standard format with CPU tensors; a plain optimizer loads it.
    saved = torch.load(ckpt / "optimizer.bin", weights_only=True)
    reference = torch.load(tmp_path / "plain" / "optimizer.bin", weights_only=True)
    tensors = [v for s in saved["state"].values() for v in s.values() if torch.is_tensor(v)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    for index, state in reference["state"].items():
        for key, value in state.items():
            assert torch.equal(saved["state"][index][key], value), (index, key)
    _, plain_opt, _, _ = _objects()
    plain_opt.load_state_dict(saved)

    _reset()
    accelerator = SwapAccelerator(cpu=True, swap_plugin=_plugin())
    objects = accelerator.prepare(*_objects())
    accelerator.load_state(str(ckpt))
    assert swap_stats(objects[1].optimizer).resident_state_bytes == 0  # offloaded again
    accelerator.free_memory()
    _reset()
    resumed, _ = _train(
        SwapAccelerator(cpu=True, swap_plugin=_plugin()), start=half, checkpoint=ckpt
    )
    _reset()
    plain_resumed, _ = _train(Accelerator(cpu=True), start=half, checkpoint=ckpt)
    _reset()
    uninterrupted, _ = _train(Accelerator(cpu=True))
    _assert_equal(_params(resumed), _params(plain_resumed))
    _assert_equal(_params(resumed), _params(uninterrupted))
    assert swapped_opt.optimizer is not None


def test_function_form_resume_with_offload_call(tmp_path: Path) -> None:
    from swapopt_core import offload_optimizer_state

    accelerator = Accelerator(cpu=True)
    _, optimizer = _train(accelerator, function_form=_plugin(), stop=4)
    accelerator.save_state(str(tmp_path))
    accelerator.load_state(str(tmp_path))
    assert offload_optimizer_state(optimizer.optimizer) >= 0
    assert swap_stats(optimizer.optimizer).resident_state_bytes == 0
    # The function of the same name as SwapAccelerator.load_state does both steps.
    swap_accelerate.load_state(accelerator, str(tmp_path))
    assert swap_stats(optimizer.optimizer).resident_state_bytes == 0


def test_one_state_object_for_both_forms() -> None:
    """Both forms keep everything under one attribute and share it."""
    plugin = _plugin(activation_budget_mb=1)
    swapping = SwapAccelerator(cpu=True, swap_plugin=plugin)
    _, optimizer = _train(swapping, stop=1)
    assert [k for k in vars(swapping) if "swapopt" in k] == ["_swapopt"]
    state = swapping._swapopt
    assert state.plugin is swapping.swap_plugin is plugin and state.optimizers == [optimizer]
    assert swap_accelerate.offload_session(swapping) is swapping.offload_session()
    swap_accelerate.prepare(swapping, optimizer)  # the function on a SwapAccelerator: no-op
    assert swapping._swapopt is state and state.optimizers == [optimizer]
    _reset()
    plain = Accelerator(cpu=True)
    _, optimizer = _train(plain, function_form=plugin, stop=1)
    assert [k for k in vars(plain) if "swapopt" in k] == ["_swapopt"]
    assert plain._swapopt.plugin is plugin and plain._swapopt.optimizers == [optimizer]
    assert not hasattr(optimizer, "_swapopt_prepared")


def test_free_memory_unswaps_and_drops() -> None:
    accelerator = SwapAccelerator(cpu=True, swap_plugin=_plugin())
    model, optimizer = _train(accelerator, stop=3)
    inner = optimizer.optimizer
    accelerator.free_memory()
    assert not is_swap_optimizer(inner) and accelerator._optimizers == []
    inner.step()  # a plain optimizer again, with its state
    assert all(len(s) == 3 for s in inner.state.values())

    accelerator = Accelerator(cpu=True)
    _, optimizer = _train(accelerator, function_form=_plugin(), stop=2)
    swap_accelerate.free_memory(accelerator)
    assert not is_swap_optimizer(optimizer.optimizer) and accelerator._optimizers == []


def test_env_flag_switches_it_on() -> None:
    with patch_environment(
        SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE="cpu",
        SWAPOPT_RUNTIME="loopback",
        SWAPOPT_MIN_NUMEL="0",
        SWAPOPT_SWAP_TIMES="2",
        SWAPOPT_PACKED_SWAP="false",
    ):
        accelerator = SwapAccelerator(cpu=True)
        assert accelerator.swap_plugin == SwapOptimizerPlugin(
            offload_optimizer_device="cpu",
            swap_times=2,
            min_numel=0,
            packed_swap=False,
            runtime="loopback",
            activation_budget_mb="none",
        )
        _, optimizer = _train(accelerator, stop=2)
    stats = swap_stats(optimizer.optimizer)
    assert stats.steps == 2 and stats.batches == 2 and not stats.packed
    _reset()
    _, optimizer = _train(SwapAccelerator(cpu=True), stop=2)  # no variable: off
    assert not is_swap_optimizer(optimizer.optimizer)


def test_fields_override_env() -> None:
    with patch_environment(SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE="cpu", SWAPOPT_SWAP_TIMES="7"):
        plugin = SwapOptimizerPlugin(offload_optimizer_device="none", packed_swap="auto")
    assert not plugin.enabled and plugin.swap_times == 7 and plugin.packed_swap is None
    assert plugin.swap_config().swap_times == 7 and plugin.offload_config() is None


def test_activation_runtime_is_its_own_setting() -> None:
    """SWAPOPT_RUNTIME is the optimizer swap's; the activations follow their own variable."""
    with patch_environment(SWAPOPT_RUNTIME="loopback", SWAPOPT_ACTIVATION_BUDGET_MB="2"):
        plugin = SwapOptimizerPlugin()
    assert plugin.swap_config().runtime == "loopback" and plugin.activation_runtime == "auto"
    assert plugin.offload_config() == OffloadConfig(max_resident_activation_mb=2, runtime="auto")
    with patch_environment(SWAPOPT_ACTIVATION_RUNTIME="loopback"):
        plugin = SwapOptimizerPlugin(activation_budget_mb=1)
    assert plugin.offload_config().runtime == "loopback" and plugin.runtime == "auto"


@pytest.mark.parametrize(
    ("variable", "value", "accepted"),
    [
        ("SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE", "gpu", "'none' or 'cpu'"),
        ("SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE", "nvme", "'none' or 'cpu'"),
        ("SWAPOPT_SWAP_TIMES", "0", "an integer >= 1"),
        ("SWAPOPT_SWAP_TIMES", "eight", "an integer >= 1"),
        ("SWAPOPT_MIN_NUMEL", "-1", "an integer >= 0"),
        ("SWAPOPT_MIN_NUMEL", "1.5", "an integer >= 0"),
        ("SWAPOPT_PACKED_SWAP", "maybe", "'auto'"),
        ("SWAPOPT_RUNTIME", "tpu", "'loopback'"),
        ("SWAPOPT_ACTIVATION_BUDGET_MB", "lots", "MiB >= 0"),
        ("SWAPOPT_ACTIVATION_BUDGET_MB", "-5", "MiB >= 0"),
        ("SWAPOPT_ACTIVATION_RUNTIME", "ascend", "['auto', 'cuda', 'loopback', 'loopback-async']"),
    ],
)
def test_invalid_env_value_is_named(variable: str, value: str, accepted: str) -> None:
    with patch_environment(**{variable: value}), pytest.raises(ValueError) as error:
        SwapAccelerator(cpu=True)
    message = str(error.value)
    assert f"environment variable {variable}={value!r}" in message and accepted in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("offload_optimizer_device", "disk"),
        ("swap_times", 0),
        ("swap_times", True),
        ("min_numel", -3),
        ("packed_swap", 2),
        ("runtime", "gpu"),
        ("activation_budget_mb", -1.0),
        ("activation_runtime", "gpu"),
    ],
)
def test_invalid_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"SwapOptimizerPlugin.{field}={value!r}")):
        SwapOptimizerPlugin(**{field: value})


def test_activation_session_equals_plain() -> None:
    plain_model, _ = _train(Accelerator(cpu=True), stop=3)
    _reset()
    with patch_environment(SWAPOPT_ACTIVATION_BUDGET_MB="0.001"):
        accelerator = SwapAccelerator(cpu=True, swap_plugin=_plugin())
    model, _ = _train(accelerator, stop=3, session=True)
    _assert_equal(_params(model), _params(plain_model))
    stats = accelerator.offload_session().stats()
    assert stats.warmups == 1 and stats.warmups + stats.replays + stats.retraces == 3
    assert stats.d2h_bytes > 0  # the tiny budget really moved activations out
    _reset()
    with pytest.raises(ValueError, match="No activation or device budget is set"):
        SwapAccelerator(cpu=True, swap_plugin=_plugin()).offload_session()


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the TensorBoard event files under ``folder``: tag -> step -> value."""
    from tensorboardX.proto.event_pb2 import Event

    seen: dict[str, dict[int, float]] = {}
    for path in folder.rglob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at < len(data):  # TFRecord: length (8), its CRC (4), the record, its CRC (4)
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 16 + length
            for value in event.summary.value:
                seen.setdefault(value.tag, {})[event.step] = value.simple_value
    return seen


def test_tracker_gets_the_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tracker (TensorBoard, written to a folder), the ``swapopt/...`` figures reach it
    every N optimizer steps on the main process; ``log_figures`` logs them at once."""
    pytest.importorskip("tensorboardX")
    from swapopt_core import swaps

    plain, _ = _train(Accelerator(cpu=True))
    _reset()
    monkeypatch.setattr(swaps, "REPORT_EVERY_N_STEPS", 4)  # BATCHES=12 steps: 3 reports
    accelerator = SwapAccelerator(
        cpu=True, swap_plugin=_plugin(), log_with="tensorboard", project_dir=tmp_path
    )
    accelerator.init_trackers("run")
    model, optimizer = _train(accelerator)
    _assert_equal(_params(model), _params(plain))
    (stats,) = swap_accelerate.stats(accelerator)
    assert stats.steps == BATCHES
    now = swap_accelerate.log_figures(accelerator, step=100)
    assert set(now) == set(SWAP_KEYS) and now == swap_accelerate.figures(accelerator)
    accelerator.end_training()
    scalars = _scalars(tmp_path)
    assert set(scalars) >= set(SWAP_KEYS)
    host = scalars["swapopt/state_host_mib"]
    assert sorted(host) == [4, 8, 12, 100]
    assert host[12] == pytest.approx(stats.host_state_bytes / 2**20, rel=1e-6)  # float32
    assert scalars["swapopt/optimizer_steps"][8] == 8
    # Without trackers, log_figures logs nothing (the figures are still there to read).
    _reset()
    untracked = SwapAccelerator(cpu=True, swap_plugin=_plugin())
    _train(untracked)
    assert swap_accelerate.log_figures(untracked) == {}
    assert swap_accelerate.figures(untracked)["swapopt/optimizer_steps"] == BATCHES


def test_tracker_gets_activation_figures(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    plugin = _plugin(activation_budget_mb=0.001, activation_runtime="loopback")
    accelerator = SwapAccelerator(
        cpu=True, swap_plugin=plugin, log_with="tensorboard", project_dir=tmp_path
    )
    accelerator.init_trackers("run")
    _train(accelerator, session=True, stop=3)
    logged = accelerator.log_figures()
    accelerator.end_training()
    assert set(logged) == {*SWAP_KEYS, *OFFLOAD_KEYS}
    offload = swap_accelerate.offload_session(accelerator).stats()
    assert logged["swapopt/activation_steps"] == 3 == offload.warmups + offload.replays
    assert _scalars(tmp_path)["swapopt/activation_peak_mib"][3] == pytest.approx(
        offload.peak_resident_activation_bytes / 2**20, rel=1e-6
    )


def test_deepspeed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSpeed is not needed: the distributed type is faked on the shared Accelerate state,
    # which is what both SwapAccelerator.prepare and prepare() consult.
    accelerator = SwapAccelerator(cpu=True, swap_plugin=_plugin())
    plain = Accelerator(cpu=True)
    monkeypatch.setattr(accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    assert plain.distributed_type == DistributedType.DEEPSPEED
    with pytest.raises(ValueError, match="DEEPSPEED.*offload_optimizer_device: cpu"):
        accelerator.prepare(*_objects()[:2])
    with pytest.raises(ValueError, match="DEEPSPEED"):
        swap_accelerate.prepare(plain, *_objects()[:2], plugin=_plugin())
    # Switched off, the plugin stays out of the way (nothing to refuse).
    swap_accelerate._check_supported(plain, _plugin(offload_optimizer_device="none"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_process_launch(tmp_path: Path) -> None:
    launcher = Path(sys.executable).with_name("accelerate")
    if not launcher.exists():
        pytest.skip(f"no accelerate launcher next to {sys.executable}")
    runs = {}
    for device in ("cpu", "none"):
        out = tmp_path / device
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWAPOPT_")}
        env.update(
            SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=device,
            SWAPOPT_RUNTIME="loopback",
            SWAPOPT_MIN_NUMEL="0",
            SWAPOPT_SWAP_TIMES="2",
            ACCELERATE_USE_CPU="true",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        )
        # Accelerate 1.x: "--cpu --num_processes 2" starts one process unless an MPI hostfile
        # is given; the torchrun launcher ("--multi_gpu") with ACCELERATE_USE_CPU gives two
        # gloo ranks on the CPU (distributed type MULTI_CPU).
        command = [
            str(launcher),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(_free_port()),
            str(SCRIPT),
            str(out),
        ]
        runs[device] = (
            out,
            subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            ),
        )
    results = {}
    for device, (out, proc) in runs.items():
        log, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"launch with {device} failed:\n{log[-6000:]}"
        results[device] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for rank in (0, 1):
        swapped, plain = results["cpu"][rank], results["none"][rank]
        assert swapped["distributed_type"] == "MULTI_CPU" and swapped["num_processes"] == 2
        assert swapped["swapped"] and swapped["steps"] == 4 and not plain["swapped"]
        _assert_equal(swapped["params"], plain["params"])
    _assert_equal(results["cpu"][0]["params"], results["cpu"][1]["params"])
