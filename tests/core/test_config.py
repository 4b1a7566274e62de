"""SwapOptimizerConfig validates every field with a message naming it, the value and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from swapopt_core import OffloadConfig, SwapOptimizerConfig


def test_defaults_match_the_design() -> None:
    config = SwapOptimizerConfig()
    assert (config.swap_times, config.state_keys, config.min_numel) == (16, None, 1024)
    assert (config.include_master_params, config.packed_swap, config.runtime) == (
        False,
        None,
        "auto",
    )


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SwapOptimizerConfig().swap_times = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"swap_times": 0}, ValueError, r"swap_times must be at least 1, got 0"),
        ({"swap_times": -3}, ValueError, r"swap_times must be at least 1, got -3"),
        ({"swap_times": 2.5}, TypeError, r"swap_times must be an int, got 2\.5"),
        ({"swap_times": True}, TypeError, r"swap_times must be an int, got True"),
        ({"min_numel": -1}, ValueError, r"min_numel must be >= 0, got -1.*Use 0"),
        ({"min_numel": "8"}, TypeError, r"min_numel must be an int, got '8'"),
        ({"state_keys": ()}, ValueError, r"state_keys must name at least one"),
        ({"state_keys": ("exp_avg", "")}, ValueError, r"state_keys must name"),
        ({"state_keys": ("exp_avg", "exp_avg")}, ValueError, r"state_keys lists a key twice"),
        ({"state_keys": 3}, TypeError, r"state_keys must be None or a sequence"),
        ({"include_master_params": 1}, TypeError, r"include_master_params must be True or False"),
        ({"packed_swap": "yes"}, TypeError, r"packed_swap must be True, False or None, got 'yes'"),
        ({"runtime": ""}, ValueError, r"runtime must be a runtime name, got ''.*'loopback'"),
        ({"runtime": None}, ValueError, r"runtime must be a runtime name, got None"),
    ],
)
def test_bad_values_are_rejected(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=rf"SwapOptimizerConfig\.{pattern}"):
        SwapOptimizerConfig(**kwargs)


def test_state_keys_are_normalised_to_a_tuple() -> None:
    assert SwapOptimizerConfig(state_keys=["exp_avg"]).state_keys == ("exp_avg",)
    assert SwapOptimizerConfig(state_keys="exp_avg_sq").state_keys == ("exp_avg_sq",)


# ---- resident_state_fraction and prefetch_batches (issue 20) ---------------------------------


def test_resident_fraction_and_prefetch_defaults() -> None:
    config = SwapOptimizerConfig()
    assert config.resident_state_fraction == 0.0 and config.prefetch_batches == 2
    assert config.effective_prefetch_batches == 2
    assert SwapOptimizerConfig(resident_state_fraction=1).resident_state_fraction == 1.0
    off = SwapOptimizerConfig(prefetch_batches=5, prefetch_during_backward=False)
    assert off.effective_prefetch_batches == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"resident_state_fraction": -0.1}, ValueError, r"resident_state_fraction must be in"),
        ({"resident_state_fraction": 1.5}, ValueError, r"resident_state_fraction must be in"),
        ({"resident_state_fraction": float("nan")}, ValueError, r"resident_state_fraction"),
        ({"resident_state_fraction": "0.5"}, TypeError, r"resident_state_fraction must be a"),
        ({"resident_state_fraction": True}, TypeError, r"resident_state_fraction must be a"),
        ({"prefetch_batches": -1}, ValueError, r"prefetch_batches must be >= 0, got -1.*Use 0"),
        ({"prefetch_batches": 1.0}, TypeError, r"prefetch_batches must be an int, got 1\.0"),
    ],
)
def test_bad_fraction_and_prefetch_are_rejected(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=rf"SwapOptimizerConfig\.{pattern}"):
        SwapOptimizerConfig(**kwargs)


def test_fraction_and_prefetch_from_options() -> None:
    config = SwapOptimizerConfig.from_options(
        {"resident_state_fraction": " 0.25 ", "prefetch_batches": "3"}
    )
    assert (config.resident_state_fraction, config.prefetch_batches) == (0.25, 3)
    for bad in ("1.5", "half", -1):
        with pytest.raises(ValueError, match=r"env\.resident_state_fraction=.*\[0, 1\]"):
            SwapOptimizerConfig.from_options({"resident_state_fraction": bad}, source="env")
    with pytest.raises(ValueError, match=r"env\.prefetch_batches='-2'.*>= 0"):
        SwapOptimizerConfig.from_options({"prefetch_batches": "-2"}, source="env")


# ---- OffloadConfig: non-finite and absurd sizes (issue 10) ----------------------------------


@pytest.mark.parametrize(
    ("field", "unit"),
    [
        ("max_resident_activation_mb", "MiB"),
        ("max_offload_activation_mb", "MiB"),
        ("min_offload_kib", "KiB"),
    ],
)
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e308, 2**63])
def test_offload_config_refuses_sizes_not_held_in_int64_bytes(
    field: str, unit: str, value: float
) -> None:
    with pytest.raises(ValueError) as info:
        OffloadConfig(**{field: value})
    message = str(info.value)
    assert f"OffloadConfig.{field}" in message and repr(value) in message and unit in message


def test_offload_config_min_offload_kib_error_says_kib() -> None:
    with pytest.raises(ValueError, match=r"min_offload_kib must be .*KiB, got -1"):
        OffloadConfig(min_offload_kib=-1)


def test_offload_config_largest_sizes_still_give_bytes() -> None:
    config = OffloadConfig(max_resident_activation_mb=2**42, min_offload_kib=2**52)
    assert config.budget_bytes == 2**62 and config.min_offload_bytes == 2**62


@pytest.mark.parametrize(
    ("field", "unit"), [("max_offload_activation_mb", 2**20), ("min_offload_kib", 2**10)]
)
def test_offload_config_and_the_parser_share_one_limit(field: str, unit: int) -> None:
    # Found by hypothesis: 8796093022207.5 MiB fits in int64 bytes, and the parser took it
    # while the config refused it.
    from swapopt_core._options import parse_mib

    largest = (2**63 - 2**20) / unit + 0.5  # just under 2**63 bytes
    assert parse_mib(allow_none=False, unit=unit)(largest) == largest
    assert getattr(OffloadConfig(**{field: largest}), field) == largest
