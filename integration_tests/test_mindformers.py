"""``SwapOptimizerCallback`` and the ``swap_optimizer:`` YAML section with MindFormers' pynative
Trainer on CPU (loopback runtime).

The launcher runs in subprocesses (MindFormers writes ``./output``, so each runs in a temporary
folder); registry, YAML parsing and ``CallbackHandler`` run in this process. Every equality of
weights or optimizer moments is ``np.array_equal``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# MindFormers opens its log folder under the working directory at import; keep it out of the repo.
os.environ.setdefault("LOG_MF_PATH", os.path.join(tempfile.gettempdir(), "swapopt-mindformers-log"))
pytest.importorskip("mindformers")

import _mindformers_tiny as T  # noqa: E402
import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from mindformers.core.optim.adamw import AdamW  # noqa: E402
from mindformers.pynative.callback import CallbackHandler  # noqa: E402
from mindformers.pynative.config import TrainConfig  # noqa: E402
from mindformers.pynative.trainer.train_state import TrainerState  # noqa: E402
from mindformers.pynative.trainer.utils import _build_callback  # noqa: E402
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from swapopt_core import (  # noqa: E402
    SwapOptError,
    SwapOptimizerConfig,
    is_swap_optimizer,
    swap_stats,
)
from swapopt_plugins.mindformers import (  # noqa: E402
    SwapOptimizerCallback,
    SwapOptimizerSection,
    build_trainer_config,
    main,
)

pytestmark = pytest.mark.mindspore

REPO = Path(__file__).resolve().parents[1]
SWAP = {"enable": True, "swap_times": 2, "runtime": "loopback", "min_numel": 0}
CALLBACK = {
    "type": "SwapOptimizerCallback",
    "swap_times": 3,
    "runtime": "loopback",
    "min_numel": 0,
    "packed_swap": False,
}
STEPS, SAVE_EVERY = 12, 6
STATS_LINE = re.compile(r"swapopt stats at train end: (\{.*\})")


@pytest.fixture(autouse=True)
def _pynative_cpu() -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


# ---- registry and constructor ------------------------------------------------------------------


def test_registered_and_built_from_cfg() -> None:
    assert MindFormerRegister.get_cls("callback", "SwapOptimizerCallback") is SwapOptimizerCallback
    built = MindFormerRegister.get_instance_from_cfg(
        {"type": "SwapOptimizerCallback", "swap_times": 8}, MindFormerModuleType.CALLBACK
    )
    assert isinstance(built, SwapOptimizerCallback)
    assert built.config == SwapOptimizerConfig(swap_times=8)


def test_entry_survives_trainconfig(tmp_path) -> None:
    """The callbacks entry the launcher appends builds the same config inside MindFormers."""
    section = SwapOptimizerSection(
        swap_times=3, state_keys=("exp_avg",), min_numel=0, packed_swap=False, runtime="loopback"
    )
    yaml_config = T.train_config(tmp_path / "d", tmp_path / "c", steps=2, save_every=1)
    config = TrainConfig.from_dict(
        build_trainer_config({**yaml_config, "swap_optimizer": section.to_yaml()})
    )
    (entry,) = config.callbacks
    assert _build_callback(entry).config == section.to_config()


# Text is read as the environment's is ("8", "yes"): see test_text_values_are_read.
BAD_OPTIONS = [
    ("swap_times", 0, "an integer >= 1"),
    ("swap_times", "eight", "an integer >= 1"),
    ("swap_times", True, "an integer >= 1"),
    ("min_numel", -1, "an integer >= 0"),
    ("state_keys", ["exp_avg", "m"], "'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'"),
    ("state_keys", [], "null, or distinct names"),
    ("state_keys", ["exp_avg", "exp_avg"], "distinct"),
    ("include_master_params", 1, "a boolean (1/true/yes"),
    ("packed_swap", "sometimes", "'auto' or null for the runtime's default, or a boolean"),
    ("runtime", "tpu", "'loopback'"),
    ("runtime", "cuda", "mindspore runtimes ["),  # a torch runtime
]


@pytest.mark.parametrize(("key", "value", "accepted"), BAD_OPTIONS)
def test_callback_rejects_bad_value(key, value, accepted) -> None:
    with pytest.raises(ValueError) as info:
        SwapOptimizerCallback(**{key: value})
    assert f"SwapOptimizerCallback.{key}={value!r}" in str(info.value)
    assert accepted in str(info.value)
    # The same message reaches a YAML user through MindFormers' registry.
    with pytest.raises(ValueError, match=re.escape(f"{key}={value!r}")):
        MindFormerRegister.get_instance_from_cfg(
            {"type": "SwapOptimizerCallback", key: value}, MindFormerModuleType.CALLBACK
        )


def test_callback_rejects_unknown_key() -> None:
    with pytest.raises(ValueError, match=r"no option 'swaptimes'; accepted options: \[.*'swap_"):
        SwapOptimizerCallback(swaptimes=8)


def test_text_values_are_read() -> None:
    """The section and the callback read text with the vocabulary of the environment."""
    options = {"swap_times": "8", "packed_swap": "yes", "state_keys": "exp_avg, exp_avg_sq"}
    want = SwapOptimizerConfig(swap_times=8, packed_swap=True, state_keys=("exp_avg", "exp_avg_sq"))
    assert SwapOptimizerCallback(**options).config == want
    section = SwapOptimizerSection.from_yaml({"enable": "off", **options})
    assert section.to_config() == want and section.enable is False


# ---- the YAML section ------------------------------------------------------------------------


def test_section_round_trip(tmp_path) -> None:
    sections = [
        SwapOptimizerSection(),
        SwapOptimizerSection(enable=False),
        SwapOptimizerSection(
            swap_times=4,
            state_keys=("exp_avg_sq", "exp_avg"),
            min_numel=0,
            include_master_params=True,
            packed_swap=False,
            runtime="loopback",
        ),
    ]
    for section in sections:
        assert SwapOptimizerSection.from_yaml(section.to_yaml()) == section
        path = tmp_path / "train.yaml"
        path.write_text(yaml.safe_dump({"swap_optimizer": section.to_yaml()}))
        assert (
            SwapOptimizerSection.from_yaml(yaml.safe_load(path.read_text())["swap_optimizer"])
            == section
        )
    assert sections[2].to_config() == SwapOptimizerConfig(
        swap_times=4,
        state_keys=("exp_avg_sq", "exp_avg"),
        min_numel=0,
        include_master_params=True,
        packed_swap=False,
        runtime="loopback",
    )
    assert SwapOptimizerSection.from_yaml({"packed_swap": "auto"}).packed_swap is None
    assert SwapOptimizerSection.from_yaml({"state_keys": "exp_avg"}).state_keys == ("exp_avg",)
    assert SwapOptimizerSection().to_config() == SwapOptimizerConfig()


@pytest.mark.parametrize(
    ("key", "value", "accepted"), [*BAD_OPTIONS, ("enable", "maybe", "a boolean (1/true/yes")]
)
def test_section_rejects_bad_value(key, value, accepted) -> None:
    with pytest.raises(ValueError) as info:
        build_trainer_config({"swap_optimizer": {key: value}})
    assert f"swap_optimizer.{key}={value!r}" in str(info.value)
    assert accepted in str(info.value)


def test_section_rejects_unknown_key_and_non_mapping() -> None:
    with pytest.raises(
        ValueError,
        match=r"swap_optimizer has no option 'swap_time'; accepted options: "
        r"\['device_budget_mb', 'enable', .*'swap_times'",
    ):
        build_trainer_config({"swap_optimizer": {"enable": True, "swap_time": 8}})
    with pytest.raises(ValueError, match="swap_optimizer must be a mapping of settings, got None"):
        build_trainer_config({"swap_optimizer": None})


def test_trainer_config_without_section_is_unchanged(tmp_path) -> None:
    config = T.train_config(tmp_path / "d", tmp_path / "c", steps=2, save_every=1)
    config["callbacks"] = [{"type": "MaxLogitsMonitor"}]
    before = json.dumps(config, sort_keys=True)
    out = build_trainer_config(config)
    assert out == config and out is not config
    assert json.dumps(config, sort_keys=True) == before
    assert build_trainer_config({**config, "swap_optimizer": {"enable": False}}) == config


def test_trainer_config_with_section() -> None:
    out = build_trainer_config(
        {"callbacks": [{"type": "MaxLogitsMonitor"}], "swap_optimizer": {"swap_times": 8}}
    )
    assert out == {
        "callbacks": [
            {"type": "MaxLogitsMonitor"},
            {
                "type": "SwapOptimizerCallback",
                "swap_times": 8,
                "state_keys": None,
                "min_numel": 1024,
                "include_master_params": False,
                "packed_swap": None,
                "runtime": "auto",
                "prefetch_during_backward": True,
                "resident_state_fraction": 0.0,
                "prefetch_batches": 2,
            },
        ]
    }


def test_section_and_explicit_callback_conflict() -> None:
    both = {"callbacks": [{"type": "SwapOptimizerCallback"}], "swap_optimizer": {"enable": True}}
    with pytest.raises(ValueError, match="Configure the swap in one place"):
        build_trainer_config(both)
    # A disabled section leaves the explicit entry in charge.
    assert build_trainer_config({**both, "swap_optimizer": {"enable": False}}) == {
        "callbacks": [{"type": "SwapOptimizerCallback"}]
    }


def test_launcher_reports_invalid_yaml(tmp_path, capsys) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"swap_optimizer": {"swap_times": 0}}))
    assert main(["--config", str(path)]) == 2
    assert "swap_optimizer.swap_times=0 is invalid" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"context": {"mode": 0}}))
    assert main(["--config", str(path)]) == 2
    assert "swap: True" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("context: CPU", "context='CPU' must be a mapping"),
        ("context: {device_target: 3}", "context.device_target=3 must be a device name"),
        ("1: 2\nswap_optimizer: {swap_times: 2}", "YAML key 1 at the top level is not a string"),
        ("trainer: {swap_optimizer: {swap_times: 8}}", "misplaced at trainer.swap_optimizer"),
        ("swap_optimizer: {state_keys: [[exp_avg]]}", "swap_optimizer.state_keys=[['exp_avg']]"),
        ("swap_optimizer: {swap_times: 2}\ncallbacks: 0", "callbacks=0 must be a list"),
        (
            "callbacks: [{type: SwapOptimizerCallback, state_keys: [[exp_avg]]}]",
            "callbacks[0].state_keys=[['exp_avg']] is invalid",
        ),
        ("a: " + "[" * 5000 + "]" * 5000, "nests lists or mappings too deeply"),
    ],
)
def test_launcher_reports_hostile_yaml_in_one_line(tmp_path, capsys, text, words) -> None:
    # Issue 10: these were TypeError / AttributeError tracebacks, or silently ignored.
    path = tmp_path / "train.yaml"
    path.write_text(text)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and err[0].startswith("python -m swapopt_plugins")


def test_import_without_mindformers_names_the_extra(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "swapopt_plugins.mindformers")
    monkeypatch.setitem(sys.modules, "mindformers.pynative.callback", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'swapopt[mindformers]'")):
        importlib.import_module("swapopt_plugins.mindformers")


# ---- MindFormers' CallbackHandler in this process --------------------------------------------


def _train(optimizer: AdamW, model: T.TinyLM, steps: int) -> None:
    grad_fn = ms.value_and_grad(
        lambda ids, labels: model(ids, labels)[0], None, optimizer.parameters
    )
    rng = np.random.default_rng(1)
    for _ in range(steps):
        ids = ms.Tensor(rng.integers(0, T.VOCAB, (4, T.SEQ)).astype(np.int32))
        _, grads = grad_fn(ids, ids)
        optimizer(grads)


def _tiny() -> tuple[T.TinyLM, AdamW]:
    ms.set_seed(3)
    model = T.TinyLM(T.TinyConfig())
    return model, AdamW(model.trainable_params(), learning_rate=1e-3, weight_decay=0.01)


def test_callback_handler_installs_on_the_same_optimizer(caplog) -> None:
    model, optimizer = _tiny()
    plain_model, plain = _tiny()
    callback = SwapOptimizerCallback(runtime="loopback", min_numel=0, swap_times=2)
    handler = CallbackHandler(callbacks=[callback], model=model, optimizer=optimizer)
    state = TrainerState(max_steps=3)
    handler.on_train_begin(None, state)
    assert handler.optimizer is optimizer and is_swap_optimizer(optimizer)
    _train(optimizer, model, 3)
    _train(plain, plain_model, 3)
    for a, b in zip(plain.get_parameters(), optimizer.get_parameters(), strict=True):
        assert a.name == b.name and np.array_equal(a.asnumpy(), b.asnumpy()), a.name
    with caplog.at_level("INFO", logger="swapopt_plugins.mindformers"):
        handler.on_train_end(None, state)
    stats = json.loads(STATS_LINE.search(caplog.text).group(1))
    assert stats["steps"] == 3 and stats["h2d_bytes"] > 0
    assert stats == json.loads(json.dumps(vars(swap_stats(optimizer)), sort_keys=True))


def test_callback_with_a_device_budget_keeps_what_fits_resident_and_stays_exact() -> None:
    model, optimizer = _tiny()
    plain_model, plain = _tiny()
    options = {"runtime": "loopback", "min_numel": 0, "swap_times": 8}
    probe_model, probe = _tiny()
    SwapOptimizerCallback(**options).on_train_begin(None, TrainerState(), optimizer=probe)
    state = swap_stats(probe).total_state_bytes
    budget_mb = 0.75 * state / 2**20  # r * S + 3 * (1 - r) * S / 8 = 0.75 * S -> r = 0.6
    callback = SwapOptimizerCallback(**options, device_budget_mb=budget_mb)
    CallbackHandler(callbacks=[callback], model=model, optimizer=optimizer).on_train_begin(
        None, TrainerState(max_steps=3)
    )
    engine = optimizer._swapopt_engine
    assert engine.config.resident_state_fraction == pytest.approx(0.6)
    resident = engine.resident_indices()
    assert resident and not {slot.index for slot in engine.slots.values()} & resident
    _train(optimizer, model, 3)
    _train(plain, plain_model, 3)
    for a, b in zip(plain.get_parameters(), optimizer.get_parameters(), strict=True):
        assert a.name == b.name and np.array_equal(a.asnumpy(), b.asnumpy()), a.name
    with pytest.raises(ValueError, match=r"swap_optimizer.device_budget_mb=0.001 is below the"):
        SwapOptimizerCallback(**options, device_budget_mb=0.001).on_train_begin(
            None, TrainerState(), optimizer=plain
        )


def test_callback_refuses_without_optimizer_or_in_graph_mode() -> None:
    callback = SwapOptimizerCallback(runtime="loopback")
    with pytest.raises(SwapOptError, match="no optimizer"):
        CallbackHandler(callbacks=[callback]).on_train_begin(None, TrainerState())
    _, optimizer = _tiny()
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(SwapOptError, match=r"PyNative mode.*optimizer: \{type: AdamW, swap"):
            callback.on_train_begin(None, TrainerState(), optimizer=optimizer)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert not is_swap_optimizer(optimizer)


# ---- the launcher: MindFormers' pynative Trainer in a subprocess ----------------------------


def _launch(folder: Path, config: dict, *extra: str) -> subprocess.Popen:
    folder.mkdir()
    (folder / "train.yaml").write_text(yaml.safe_dump(config))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    )
    env.pop("LOG_MF_PATH", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swapopt_plugins.mindformers",
            "--config",
            "train.yaml",
            "--register",
            "_mindformers_tiny",
            *extra,
        ],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-5000:]
    return out


def _checkpoint(folder: Path, step: int) -> dict[str, np.ndarray]:
    tensors = {}
    for part in ("model", "opt"):
        tensors.update(
            load_file(
                str(
                    folder
                    / f"iteration_{step:08d}"
                    / f"checkpoint-{part}-0000000-0000001.safetensors"
                )
            )
        )
    return tensors


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Plain; swapped by the ``swap_optimizer:`` section; and swapped by a ``callbacks:``
    entry (per-tensor mode), resumed with ``--checkpoint`` from the plain run's middle
    checkpoint."""
    root = tmp_path_factory.mktemp("mindformers")
    data = T.write_dataset(root / "data.mindrecord")

    def config(name: str, **extra: object) -> dict:
        return {**T.train_config(data, root / name / "ckpt", STEPS, SAVE_EVERY), **extra}

    procs = {
        "plain": _launch(root / "plain", config("plain")),
        "swapped": _launch(root / "swapped", config("swapped", swap_optimizer=SWAP)),
    }
    outputs = {name: _finish(proc) for name, proc in procs.items()}
    start = root / "resumed" / "start"
    (start / f"iteration_{SAVE_EVERY:08d}").mkdir(parents=True)
    for file in (root / "plain" / "ckpt" / f"iteration_{SAVE_EVERY:08d}").iterdir():
        (start / f"iteration_{SAVE_EVERY:08d}" / file.name).write_bytes(file.read_bytes())
    (start / "latest_checkpointed_iteration.txt").write_text(str(SAVE_EVERY))
    resumed = root / "resumed"
    resumed_proc = _launch(
        resumed / "run", config("resumed/run", callbacks=[CALLBACK]), "--checkpoint", str(start)
    )
    outputs["resumed"] = _finish(resumed_proc)
    return {
        name: (root / name / ("run" if name == "resumed" else "") / "ckpt", out)
        for name, out in outputs.items()
    }


def _stats(output: str) -> dict:
    lines = STATS_LINE.findall(output)
    assert len(lines) == 1, output[-3000:]
    return json.loads(lines[0])


@pytest.mark.slow
def test_launcher_plain_run_adds_nothing(runs) -> None:
    _, output = runs["plain"]
    assert "SwapOptimizerCallback" not in output and not STATS_LINE.search(output)
    assert f"step:[   {STEPS}/   {STEPS}]" in output


@pytest.mark.slow
@pytest.mark.parametrize("name", ["swapped", "resumed"])
def test_launcher_swapped_run_is_bit_identical(runs, name) -> None:
    folder, output = runs[name]
    # Checkpoints are written while the state is swapped out: mid-run and at the end.
    for step in (STEPS,) if name == "resumed" else (SAVE_EVERY, STEPS):
        plain, swapped = _checkpoint(runs["plain"][0], step), _checkpoint(folder, step)
        assert sorted(swapped) == sorted(plain)
        assert any(key.startswith("adam_v.") for key in plain)
        for key, value in plain.items():
            assert np.array_equal(value, swapped[key]), (step, key)
    stats = _stats(output)
    assert stats["steps"] == (STEPS - SAVE_EVERY if name == "resumed" else STEPS)
    if name == "resumed":
        assert stats["packed"] is False and stats["batches"] == 3
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0
    assert stats["swapped_tensors"] == 6 and stats["runtime"] == "loopback"
