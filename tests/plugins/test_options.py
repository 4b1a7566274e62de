"""The integrations' settings, read without any training framework.

``swapopt_core.options`` (the ``SWAPOPT_*`` variables, and ``SwapSettings``, the dataclass
Accelerate's ``SwapOptimizerPlugin`` is), the callback core and the MindFormers
``swap_optimizer:`` section import no framework: the last test reads them in a process where
Lightning, Accelerate, MindSpore and MindFormers cannot be imported. The others pin the rules
every integration shares.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from swapopt_core import OffloadConfig, SwapOptimizerConfig
from swapopt_core.mindformers_yaml import SwapOptimizerSection, build_trainer_config
from swapopt_core.options import (
    AUTO_ENV,
    ENV_VARS,
    NO,
    YES,
    auto_enabled,
    read_settings,
)
from swapopt_core.options import SwapSettings as SwapOptimizerPlugin

REPO = Path(__file__).resolve().parents[2]


def _read(environ: dict[str, str], **explicit: object):
    return read_settings(explicit, owner="Owner", environ=environ)


# ---- every variable ------------------------------------------------------------------------

BAD_VALUES = {
    "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": ("gpu", "'none' or 'cpu'"),
    "SWAPOPT_SWAP_TIMES": ("0", "an integer >= 1"),
    "SWAPOPT_MIN_NUMEL": ("1.5", "an integer >= 0"),
    "SWAPOPT_PACKED_SWAP": ("maybe", "'auto' or null for the runtime's default, or a boolean"),
    "SWAPOPT_RUNTIME": (
        "ascend",
        "one of the torch runtimes ['auto', 'cuda', 'loopback', 'loopback-async']",
    ),
    "SWAPOPT_ACTIVATION_BUDGET_MB": ("lots", "a number of MiB >= 0, or 'none'"),
    "SWAPOPT_ACTIVATION_RUNTIME": ("tpu", "one of ['auto', 'cuda', 'loopback', 'loopback-async']"),
    "SWAPOPT_DEVICE_BUDGET_MB": ("lots", "a number of MiB >= 0, or 'none' for no whole-step"),
    "SWAPOPT_RESIDENT_STATE_FRACTION": ("1.5", "a number in [0, 1]"),
    "SWAPOPT_PREFETCH_BATCHES": ("-1", "an integer >= 0"),
}


def test_every_variable_is_covered() -> None:
    assert set(BAD_VALUES) == set(ENV_VARS.values())


@pytest.mark.parametrize("variable", sorted(BAD_VALUES))
def test_bad_value_names_the_variable(variable: str) -> None:
    value, accepted = BAD_VALUES[variable]
    with pytest.raises(ValueError) as info:
        _read({variable: value})
    assert str(info.value).startswith(
        f"environment variable {variable}={value!r} is invalid; accepted: {accepted}"
    )


def test_lightning_auto_bad_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=rf"^environment variable {AUTO_ENV}='sometimes' is inv"):
        auto_enabled({AUTO_ENV: "sometimes"})


def test_defaults_without_variables() -> None:
    settings = _read({})
    assert settings.swap == SwapOptimizerConfig() and settings.activations is None
    assert not settings.enabled
    assert settings.values == {
        "offload_optimizer_device": "none",
        "swap_times": 16,
        "min_numel": 1024,
        "packed_swap": None,
        "runtime": "auto",
        "resident_state_fraction": 0.0,
        "prefetch_batches": 2,
        "activation_budget_mb": None,
        "activation_runtime": "auto",
        "device_budget_mb": None,
    }


def test_every_variable_is_read() -> None:
    settings = _read(
        {
            "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": " CPU ",
            "SWAPOPT_SWAP_TIMES": "3",
            "SWAPOPT_MIN_NUMEL": "0",
            "SWAPOPT_PACKED_SWAP": "off",
            "SWAPOPT_RUNTIME": "loopback",
            "SWAPOPT_ACTIVATION_BUDGET_MB": "0.5",
            "SWAPOPT_ACTIVATION_RUNTIME": "loopback",
        }
    )
    assert settings.enabled
    assert settings.swap == SwapOptimizerConfig(
        swap_times=3, min_numel=0, packed_swap=False, runtime="loopback"
    )
    assert settings.activations == OffloadConfig(max_resident_activation_mb=0.5, runtime="loopback")


# ---- words -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("word", "want"), [*((w, True) for w in YES), *((w, False) for w in NO)])
def test_yes_no_words_are_one_vocabulary(word: str, want: bool) -> None:
    assert _read({"SWAPOPT_PACKED_SWAP": word.upper()}).swap.packed_swap is want
    assert auto_enabled({AUTO_ENV: f" {word} "}) is want
    assert SwapOptimizerSection.from_yaml({"enable": word}).enable is want


@pytest.mark.parametrize("raw", ["", "  "])
def test_empty_lightning_auto_is_off(raw: str) -> None:
    assert auto_enabled({AUTO_ENV: raw}) is False and auto_enabled({}) is False


def test_auto_words() -> None:
    auto = {"SWAPOPT_PACKED_SWAP": "AUTO", "SWAPOPT_RUNTIME": "auto"}
    settings = _read({**auto, "SWAPOPT_ACTIVATION_RUNTIME": "auto"})
    assert settings.swap.packed_swap is None and settings.swap.runtime == "auto"
    assert settings.values["activation_runtime"] == "auto"
    assert SwapOptimizerPlugin(packed_swap="auto").packed_swap is None


def test_empty_variable_is_unset_but_switches_a_budget_off() -> None:
    assert _read({"SWAPOPT_SWAP_TIMES": "", "SWAPOPT_RUNTIME": " "}).swap == SwapOptimizerConfig()
    for off in ("", "none", "None"):
        assert _read({"SWAPOPT_ACTIVATION_BUDGET_MB": off}).activations is None


def test_comma_separated_state_keys() -> None:
    section = SwapOptimizerSection.from_yaml({"state_keys": "exp_avg_sq, max_exp_avg_sq"})
    assert section.state_keys == ("exp_avg_sq", "max_exp_avg_sq")
    assert section.to_yaml()["state_keys"] == ["exp_avg_sq", "max_exp_avg_sq"]
    with pytest.raises(ValueError, match=r"swap_optimizer.state_keys='exp_avg,m' is invalid"):
        SwapOptimizerSection.from_yaml({"state_keys": "exp_avg,m"})


# ---- keys ------------------------------------------------------------------------------------


def test_unknown_setting_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        _read({}, swaptimes=3)
    assert "Owner has no setting ['swaptimes']" in str(info.value)
    assert str(sorted(ENV_VARS)) in str(info.value)


def test_unknown_section_key_lists_the_accepted_ones() -> None:
    with pytest.raises(ValueError) as info:
        build_trainer_config({"swap_optimizer": {"swap_time": 8}})
    message = str(info.value)
    assert message.startswith("swap_optimizer has no option 'swap_time'; accepted options: ")
    for key in ("enable", "swap_times", "state_keys", "include_master_params", "runtime"):
        assert repr(key) in message


def test_section_accepts_mindspore_runtimes_only() -> None:
    assert SwapOptimizerSection(runtime="ascend").runtime == "ascend"
    with pytest.raises(ValueError, match=r"swap_optimizer.runtime='cuda'.*mindspore runtimes"):
        SwapOptimizerSection(runtime="cuda")


# ---- explicit values and the environment -----------------------------------------------------


def test_explicit_values_override_the_environment() -> None:
    environ = {"SWAPOPT_SWAP_TIMES": "7", "SWAPOPT_MIN_NUMEL": "0", "SWAPOPT_RUNTIME": "junk"}
    settings = _read(environ, swap_times="4", runtime="loopback")
    assert settings.swap == SwapOptimizerConfig(swap_times=4, min_numel=0, runtime="loopback")
    # An explicit bad value is named as the owner's field, not as the variable.
    with pytest.raises(ValueError, match=r"^Owner.swap_times=0 is invalid"):
        _read(environ, swap_times=0)
    # None means "read the variable".
    assert _read(environ, swap_times=None, runtime="auto").swap.swap_times == 7


def test_accelerate_plugin_fields_override_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    monkeypatch.setenv("SWAPOPT_SWAP_TIMES", "7")
    plugin = SwapOptimizerPlugin(offload_optimizer_device="none", min_numel=5)
    assert not plugin.enabled and (plugin.swap_times, plugin.min_numel) == (7, 5)
    # Resolved once: a variable set afterwards changes nothing; a field set afterwards does.
    monkeypatch.setenv("SWAPOPT_SWAP_TIMES", "2")
    assert plugin.swap_config().swap_times == 7
    plugin.swap_times = 3
    assert plugin.swap_config().swap_times == 3


# ---- SWAPOPT_ACTIVATION_RUNTIME ----------------------------------------------------------------


def test_activation_runtime_is_apart_from_the_swap_runtime() -> None:
    settings = _read({"SWAPOPT_RUNTIME": "loopback", "SWAPOPT_ACTIVATION_BUDGET_MB": "1"})
    assert settings.swap.runtime == "loopback"
    assert settings.activations == OffloadConfig(max_resident_activation_mb=1, runtime="auto")
    settings = _read({"SWAPOPT_ACTIVATION_RUNTIME": "cuda", "SWAPOPT_ACTIVATION_BUDGET_MB": "1"})
    assert settings.swap.runtime == "auto" and settings.activations.runtime == "cuda"


def test_activation_runtime_without_budget_is_checked_but_offloads_nothing() -> None:
    settings = _read({"SWAPOPT_ACTIVATION_RUNTIME": "loopback"})
    assert settings.activations is None and settings.values["activation_runtime"] == "loopback"
    with pytest.raises(ValueError, match=r"^Owner.activation_runtime='gpu' is invalid"):
        _read({}, activation_runtime="gpu")


# ---- no framework ----------------------------------------------------------------------------

_NO_FRAMEWORK = textwrap.dedent(
    """
    import importlib, json, sys

    BLOCKED = ("lightning", "pytorch_lightning", "accelerate", "mindspore", "mindformers")


    class NoFramework:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None


    sys.meta_path.insert(0, NoFramework())
    from swapopt_core.callbacks import SwapCallbackCore
    from swapopt_core.options import SwapSettings as SwapOptimizerPlugin
    from swapopt_core.options import auto_enabled, read_settings
    from swapopt_core.mindformers_yaml import SwapOptimizerSection, build_trainer_config

    environ = {"SWAPOPT_SWAP_TIMES": "3", "SWAPOPT_PACKED_SWAP": "yes",
               "SWAPOPT_ACTIVATION_BUDGET_MB": "2", "SWAPOPT_ACTIVATION_RUNTIME": "loopback"}
    settings = read_settings({"runtime": "loopback"}, owner="T", environ=environ)
    try:
        read_settings({}, owner="T", environ={"SWAPOPT_RUNTIME": "tpu"})
    except ValueError as error:
        bad = str(error)
    config = build_trainer_config({"swap_optimizer": {"state_keys": "exp_avg", "enable": "on"}})
    section = SwapOptimizerSection.from_yaml({"runtime": "ascend", "swap_times": "8"})
    missing = []
    for name in ("swapopt_plugins.lightning", "swapopt_plugins.mindformers"):
        try:
            importlib.import_module(name)
        except ImportError as error:
            missing.append(str(error))
    print(json.dumps({
        "swap": [settings.swap.swap_times, settings.swap.packed_swap, settings.swap.runtime],
        "activations": [settings.activations.max_resident_activation_mb,
                        settings.activations.runtime],
        "auto": auto_enabled({"SWAPOPT_LIGHTNING_AUTO": "on"}),
        "plugin": SwapOptimizerPlugin(swap_times="5").swap_config().swap_times,
        "bad": bad,
        "callbacks": config["callbacks"],
        "section": [section.runtime, section.swap_times],
        "missing": missing,
        "imported": sorted({m.split(".")[0] for m in sys.modules} & set(BLOCKED)),
    }))
    """
)


def test_parsing_needs_no_framework() -> None:
    """Every framework import fails in the child; the settings are read all the same."""
    out = subprocess.run(
        [sys.executable, "-c", _NO_FRAMEWORK],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["swap"] == [3, True, "loopback"]
    assert result["activations"] == [2.0, "loopback"]
    assert result["auto"] is True and result["plugin"] == 5
    assert result["bad"].startswith("environment variable SWAPOPT_RUNTIME='tpu' is invalid")
    (entry,) = result["callbacks"]
    assert entry["type"] == "SwapOptimizerCallback" and entry["state_keys"] == ["exp_avg"]
    assert result["section"] == ["ascend", 8]
    assert len(result["missing"]) == 2
    assert "pip install 'swapopt[lightning]'" in result["missing"][0]
    assert "pip install 'swapopt[mindformers]'" in result["missing"][1]
    assert result["imported"] == []


@pytest.mark.parametrize("value", ["inf", "1e308", "Infinity", "nan"])
def test_activation_budget_variable_refuses_sizes_beyond_int64_bytes(value: str) -> None:
    # Before issue 10, 1e308 was accepted and the session failed later with OverflowError.
    with pytest.raises(ValueError, match=rf"SWAPOPT_ACTIVATION_BUDGET_MB='{value}' is invalid"):
        _read({"SWAPOPT_ACTIVATION_BUDGET_MB": value})


# ---- SWAPOPT_DEVICE_BUDGET_MB ----------------------------------------------------------------


def test_device_budget_variable_turns_the_swap_on_and_plans_the_step() -> None:
    settings = _read({"SWAPOPT_DEVICE_BUDGET_MB": "96", "SWAPOPT_ACTIVATION_RUNTIME": "loopback"})
    assert settings.enabled and settings.requested and settings.device_budget
    assert settings.values["offload_optimizer_device"] == "cpu"
    assert settings.activations == OffloadConfig(device_budget_mb=96, runtime="loopback")
    assert settings.activations.max_resident_activation_mb is None
    # The same through the Accelerate plugin's dataclass, explicit and from the variable.
    plugin = SwapOptimizerPlugin(device_budget_mb="64")
    assert plugin.enabled and plugin.offload_config() == OffloadConfig(device_budget_mb=64)
    for off in ("", "none"):
        assert not _read({"SWAPOPT_DEVICE_BUDGET_MB": off}).device_budget


def test_device_budget_and_activation_budget_are_exclusive() -> None:
    both = {"SWAPOPT_DEVICE_BUDGET_MB": "96", "SWAPOPT_ACTIVATION_BUDGET_MB": "8"}
    with pytest.raises(ValueError) as info:
        _read(both)
    message = str(info.value)
    assert "environment variable SWAPOPT_ACTIVATION_BUDGET_MB=8" in message
    assert "environment variable SWAPOPT_DEVICE_BUDGET_MB=96" in message
    assert "Give one" in message
    with pytest.raises(ValueError, match=r"Owner.activation_budget_mb=2 and environment var"):
        _read({"SWAPOPT_DEVICE_BUDGET_MB": "96"}, activation_budget_mb=2)


def test_device_budget_refuses_an_offload_device_of_none() -> None:
    with pytest.raises(ValueError, match=r"^Owner.offload_optimizer_device='none' contradicts"):
        _read({"SWAPOPT_DEVICE_BUDGET_MB": "96"}, offload_optimizer_device="none")
    assert _read({"SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "SWAPOPT_DEVICE_BUDGET_MB": "1"})


def test_swap_fraction_and_prefetch_variables_reach_the_swap_config() -> None:
    environ = {"SWAPOPT_RESIDENT_STATE_FRACTION": "0.25", "SWAPOPT_PREFETCH_BATCHES": "1"}
    swap = _read(environ).swap
    assert (swap.resident_state_fraction, swap.prefetch_batches) == (0.25, 1)


def test_callback_core_takes_a_device_budget_beside_a_runtime_only() -> None:
    from swapopt_core.callbacks import SwapCallbackCore

    core = SwapCallbackCore(
        activation_offload=OffloadConfig(runtime="loopback"), device_budget_mb="48"
    )
    assert core.activation_offload == OffloadConfig(device_budget_mb=48, runtime="loopback")
    assert core.device_budget_mb == 48 and SwapCallbackCore().device_budget_mb is None
    with pytest.raises(ValueError, match=r"^Cb got device_budget_mb=48 and activation_offload"):
        SwapCallbackCore(
            activation_offload=OffloadConfig(max_resident_activation_mb=4),
            device_budget_mb=48,
            owner="Cb",
        )
    with pytest.raises(ValueError, match=r"^Cb.device_budget_mb='big' is invalid"):
        SwapCallbackCore(device_budget_mb="big", owner="Cb")


def test_callback_core_with_a_device_budget_needs_one_optimizer() -> None:
    import torch

    from swapopt_core.callbacks import SwapCallbackCore

    core = SwapCallbackCore(device_budget_mb=48, owner="Cb")
    core.swap_enabled = False  # the count is checked before anything is swapped
    params = [torch.nn.Parameter(torch.zeros(2))]
    two = [torch.optim.SGD(params, lr=0.1), torch.optim.SGD(params, lr=0.1)]
    for optimizers in ([], two):
        with pytest.raises(ValueError, match=rf"this fit has {len(optimizers)} optimizers"):
            core.install(optimizers)
