"""The settings file named by ``SWAPOPT_CONFIG`` and the warning for unknown variables.

The file (YAML, JSON or TOML by suffix; flat or under a ``swapopt`` section) is read by
``read_settings``, below explicit values and variables and above the defaults; every problem
names the file, the key, the value and what to do. ``SWAPOPT_*`` names swapopt does not read
warn once per process with the closest known name.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swapopt_core import SwapOptWarning, _variables
from swapopt_core._config_file import SUFFIXES, VARIABLE_ONLY
from swapopt_core._variables import CONFIG_ENV, VARIABLES, warn_unknown_variables
from swapopt_core.options import (
    AUTO_ENV,
    ENV_VARS,
    SwapSettings,
    enable_lightning_auto,
    read_settings,
)

REPO = Path(__file__).resolve().parents[2]
FLAT = {"offload_optimizer_device": "cpu", "swap_times": 4, "runtime": "loopback"}


def _write(path: Path, settings: dict[str, object], *, section: bool) -> Path:
    """``settings`` in the format ``path``'s suffix names (TOML written by hand)."""
    data: dict[str, object] = {"swapopt": settings} if section else settings
    if path.suffix == ".json":
        path.write_text(json.dumps(data))
    elif path.suffix == ".toml":
        lines = ["[swapopt]"] if section else []
        for key, value in settings.items():
            text = str(value).lower() if isinstance(value, bool) else json.dumps(value)
            lines.append(f"{key} = {text}")
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text(yaml.safe_dump(data))
    return path


def _read(path: Path | str, **environ: str):
    return read_settings({}, owner="Owner", environ={CONFIG_ENV: str(path), **environ})


def _error(path: Path | str, **environ: str) -> str:
    with pytest.raises(ValueError) as info:
        _read(path, **environ)
    return str(info.value)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no unknown variable warned about yet."""
    monkeypatch.setattr(_variables, "_warned", set())


# ---- formats and shape -----------------------------------------------------------------------


@pytest.mark.parametrize("section", [False, True], ids=["flat", "section"])
@pytest.mark.parametrize("suffix", sorted(SUFFIXES))
def test_every_format_flat_or_in_a_section(tmp_path: Path, suffix: str, section: bool) -> None:
    path = _write(tmp_path / f"cfg{suffix}", FLAT, section=section)
    settings = _read(path)
    assert settings.enabled and settings.swap.swap_times == 4
    assert settings.swap.runtime == "loopback"
    key = "swapopt.swap_times" if section else "swap_times"
    assert settings.sources["swap_times"] == f"{path}: {key}"
    assert "min_numel" not in settings.sources  # the default, from nowhere


def test_suffix_is_case_insensitive_and_a_shared_file_keeps_other_sections(tmp_path: Path) -> None:
    path = tmp_path / "train.YML"
    path.write_text("trainer: {epochs: 3}\nswapopt:\n  swap_times: 6\n")
    assert _read(path).swap.swap_times == 6


def test_null_leaves_the_default_and_an_empty_file_holds_nothing(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("swap_times: null\nactivation_budget_mb: ~\n")
    settings = _read(path)
    assert settings.swap.swap_times == 16 and settings.activations is None
    path.write_text("")
    assert _read(path).values == read_settings({}, owner="Owner", environ={}).values
    path.write_text("swapopt:\n")
    assert _read(path).sources == {}


def test_an_unquoted_yaml_no_means_none(tmp_path: Path) -> None:
    """YAML reads ``offload_optimizer_device: no`` as False: it means ``none``, not an error."""
    path = tmp_path / "swapopt.yaml"
    path.write_text("offload_optimizer_device: no\nswap_times: 4\n")
    settings = _read(path)
    assert settings.values["offload_optimizer_device"] == "none" and not settings.enabled
    path.write_text("offload_optimizer_device: yes\n")
    assert "offload_optimizer_device=True is invalid" in _error(path)


def test_every_field_is_read_from_the_file(tmp_path: Path) -> None:
    values = {
        "offload_optimizer_device": "cpu",
        "swap_times": 3,
        "min_numel": 0,
        "packed_swap": True,
        "runtime": "loopback",
        "activation_budget_mb": 5,
        "activation_runtime": "loopback",
        "resident_state_fraction": 0.5,
        "prefetch_batches": 1,
    }
    settings = _read(_write(tmp_path / "cfg.toml", values, section=True))
    assert set(settings.sources) == set(values)
    assert settings.values == {**values, "activation_budget_mb": 5.0, "device_budget_mb": None}
    budget = _read(_write(tmp_path / "b.json", {"device_budget_mb": 96}, section=False))
    assert budget.enabled and budget.activations is not None
    assert budget.activations.device_budget_mb == 96


# ---- precedence ------------------------------------------------------------------------------


def test_explicit_over_variables_over_the_file_over_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path / "cfg.yaml", {"swap_times": 4, "min_numel": 7}, section=False)
    environ = {CONFIG_ENV: str(path), "SWAPOPT_SWAP_TIMES": "5"}
    settings = read_settings({}, owner="O", environ=environ)
    assert (settings.swap.swap_times, settings.swap.min_numel) == (5, 7)
    assert settings.sources["swap_times"] == "environment variable SWAPOPT_SWAP_TIMES"
    assert settings.sources["min_numel"] == f"{path}: min_numel"
    settings = read_settings({"swap_times": 6, "min_numel": None}, owner="O", environ=environ)
    assert (settings.swap.swap_times, settings.swap.min_numel) == (6, 7)
    assert settings.swap.prefetch_batches == 2  # the default


def test_a_variable_hides_a_bad_value_in_the_file_and_an_empty_one_does_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("swap_times: lots\nactivation_budget_mb: 8\n")
    assert _read(path, SWAPOPT_SWAP_TIMES="2").swap.swap_times == 2
    assert "swap_times='lots'" in _error(path, SWAPOPT_SWAP_TIMES=" ")
    # An empty budget variable switches the file's budget off, as it does a default.
    settings = _read(path, SWAPOPT_SWAP_TIMES="2", SWAPOPT_ACTIVATION_BUDGET_MB="")
    assert settings.activations is None


def test_budgets_from_the_file_and_a_variable_are_still_exclusive(tmp_path: Path) -> None:
    path = _write(tmp_path / "cfg.json", {"device_budget_mb": 96}, section=False)
    message = _error(path, SWAPOPT_ACTIVATION_BUDGET_MB="8")
    assert "environment variable SWAPOPT_ACTIVATION_BUDGET_MB=8" in message
    assert f"{path}: device_budget_mb=96" in message


def test_accelerate_plugin_dataclass_reads_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "cfg.toml", FLAT, section=False)
    monkeypatch.setenv(CONFIG_ENV, str(path))
    plugin = SwapSettings(swap_times=2)
    assert plugin.enabled and plugin.swap_times == 2 and plugin.runtime == "loopback"
    monkeypatch.delenv(CONFIG_ENV)  # resolved once, at creation
    assert plugin.swap_config().runtime == "loopback"


def test_lightning_auto_follows_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "cfg.yaml", FLAT, section=True)
    environ = {CONFIG_ENV: str(path)}
    assert enable_lightning_auto(environ) and environ[AUTO_ENV] == "1"
    activations_only = {"offload_optimizer_device": "none", "activation_budget_mb": 4}
    path = _write(tmp_path / "act.yaml", activations_only, section=True)
    environ = {CONFIG_ENV: str(path)}
    assert not enable_lightning_auto(environ) and AUTO_ENV not in environ
    environ = {
        CONFIG_ENV: str(_write(tmp_path / "b.yaml", {"activation_budget_mb": 4}, section=True))
    }
    assert enable_lightning_auto(environ)  # no "none" said: the callback swaps too


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".json", ".toml"])
def test_bad_value_names_the_file_the_key_and_what_is_accepted(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path / f"cfg{suffix}", {"swap_times": "x"}, section=False)
    assert _error(path) == f"{path}: swap_times='x' is invalid; accepted: an integer >= 1."
    path = _write(tmp_path / f"s{suffix}", {"runtime": "tpu"}, section=True)
    assert _error(path).startswith(f"{path}: swapopt.runtime='tpu' is invalid; accepted: one of")


def test_unknown_keys_are_listed_with_the_closest_name(tmp_path: Path) -> None:
    path = _write(tmp_path / "cfg.yaml", {"swaptimes": 8, "SWAPOPT_MIN_NUMEL": 0}, section=True)
    message = _error(path)
    assert message.startswith(f"{path}: 'swapopt.")
    assert "'swapopt.swaptimes' is unknown (did you mean 'swap_times'?)" in message
    assert "'swapopt.SWAPOPT_MIN_NUMEL' is unknown (did you mean 'min_numel'?)" in message
    assert f"Known settings: {sorted(ENV_VARS)}." in message
    path = _write(tmp_path / "far.json", {"qqq": 1}, section=False)
    assert _error(path).startswith(f"{path}: 'qqq' is unknown. Known settings:")


@pytest.mark.parametrize("key", sorted(VARIABLE_ONLY))
def test_variable_only_keys_name_their_variable(tmp_path: Path, key: str) -> None:
    path = _write(tmp_path / "cfg.json", {key: True}, section=False)
    assert f"{key!r} is not read from the file: set the environment variable " in _error(path)
    assert VARIABLE_ONLY[key] in _error(path)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.yaml", "swap_times: [1\n", r"not valid YAML: .*line 2"),
        ("bad.json", '{"swap_times": 4,}', r"not valid JSON: .*line 1 column"),
        ("bad.toml", "swap_times = \n", r"not valid TOML: .*line 1"),
        ("list.yaml", "- swap_times\n", r"must hold a mapping of settings .*got list"),
        ("scalar.json", "4", r"must hold a mapping of settings .*got int 4"),
        ("section.yaml", "swapopt: 4\n", r"the 'swapopt' section must be a mapping"),
        ("stray.yaml", "swap_times: 4\nswapopt: {min_numel: 0}\n", r"'swap_times' beside the"),
        ("keys.yaml", "1: 2\n", r"1 is not a setting name"),
        ("deep.json", "[" * 100_000 + "]" * 100_000, r"nests lists or mappings too deeply"),
    ],
)
def test_file_problems_name_the_file(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    message = _error(path)
    assert message.startswith(f"{path}: ")
    assert re.search(expected, message), message


def test_missing_or_unreadable_file_and_unknown_suffix(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    assert _error(missing) == (
        f"{missing}: cannot read the settings file named by SWAPOPT_CONFIG: No such file or "
        "directory. Fix the path, or unset SWAPOPT_CONFIG."
    )
    folder = tmp_path / "folder.json"
    folder.mkdir()
    assert _error(folder).startswith(f"{folder}: cannot read the settings file")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    assert _error(binary).startswith(f"{binary}: cannot read the settings file")
    ini = tmp_path / "cfg.ini"
    ini.write_text("[swapopt]\n")
    assert _error(ini) == (
        f"SWAPOPT_CONFIG={str(ini)!r}: the file's suffix '.ini' says no format; accepted: "
        ".yaml, .yml, .json, .toml (YAML, JSON or TOML)."
    )


def test_an_empty_config_variable_reads_no_file() -> None:
    assert _read(" ").sources == {}


# ---- property: the file gives what the same values given explicitly give -------------------

_VALUES = st.fixed_dictionaries(
    {},
    optional={
        "offload_optimizer_device": st.sampled_from(["none", "cpu"]),
        "swap_times": st.integers(1, 64),
        "min_numel": st.integers(0, 10**6),
        "packed_swap": st.booleans() | st.just("auto"),
        "runtime": st.sampled_from(["auto", "loopback", "loopback-async"]),
        "activation_budget_mb": st.integers(0, 4096) | st.floats(0, 1e6),
        "resident_state_fraction": st.floats(0, 1),
        "prefetch_batches": st.integers(0, 8),
    },
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(values=_VALUES, suffix=st.sampled_from(sorted(SUFFIXES)), section=st.booleans())
def test_file_reads_as_explicit_values(
    tmp_path: Path, values: dict[str, object], suffix: str, section: bool
) -> None:
    path = _write(tmp_path / f"p{suffix}", values, section=section)
    assert _read(path).values == read_settings(values, owner="O", environ={}).values


# ---- unknown variables -----------------------------------------------------------------------


def test_a_misspelt_variable_warns_once_with_the_closest_name() -> None:
    environ = {"SWAPOPT_SWAPTIMES": "8", "SWAPOPT_SWAP_TIMES": "2"}
    with pytest.warns(SwapOptWarning) as caught:
        settings = read_settings({}, owner="O", environ=environ)
    assert settings.swap.swap_times == 2
    assert [str(w.message) for w in caught] == [
        "swapopt does not read the environment variable SWAPOPT_SWAPTIMES (it is ignored); "
        "did you mean SWAPOPT_SWAP_TIMES?"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_settings({}, owner="O", environ=environ)  # once per process
        read_settings({}, owner="O", environ={"SWAPOPT_RUN": "1", "SWAPOPT_STRICT": "1"})
    with pytest.warns(SwapOptWarning, match=r"SWAPOPT_STICT .*did you mean SWAPOPT_STRICT\?"):
        read_settings({}, owner="O", environ={"SWAPOPT_STICT": "1"})
    with pytest.warns(SwapOptWarning, match=r"SWAPOPT_ZZZ \(it is ignored\); known: SWAPOPT_"):
        assert warn_unknown_variables({"SWAPOPT_ZZZ": ""}) == ["SWAPOPT_ZZZ"]


def test_importing_swapopt_reads_no_environment() -> None:
    code = "import swapopt_core, swapopt_core.options, swapopt_plugins, swapopt_core.callbacks"
    result = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code],
        env={**_clean_env(), "SWAPOPT_SWAPTIMES": "8", CONFIG_ENV: "/nonexistent.yaml"},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "SWAPOPT_SWAPTIMES" not in result.stderr


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("SWAPOPT_")}


def test_every_variable_in_the_sources_is_known() -> None:
    """The list in ``_variables`` is complete: every name the package, its plugins, the
    benchmarks and the integration tests read is on it."""
    found: set[str] = set()
    for folder in ("swapopt_core", "swapopt_plugins", "benchmarks", "integration_tests"):
        for path in (REPO / folder).rglob("*.py"):
            found |= set(re.findall(r"\bSWAPOPT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert found - {"SWAPOPT_SWAPTIMES"} <= set(VARIABLES)
    from swapopt_core._automatic import STRICT_ENV
    from swapopt_core._device.lanes import ENV_GBPS, ENV_JITTER_US
    from swapopt_core._launch import RUN_ENV
    from swapopt_core._plugins import DISABLE_AUTOLOAD_ENV
    from swapopt_core.options import AUTO_ENV as LIGHTNING_AUTO

    named = {STRICT_ENV, ENV_GBPS, ENV_JITTER_US, RUN_ENV, DISABLE_AUTOLOAD_ENV, LIGHTNING_AUTO}
    assert named | set(ENV_VARS.values()) | {CONFIG_ENV} == set(VARIABLES)
