"""Property tests (hypothesis) of the configs' one parser (issue 10).

Any valid ``SwapOptimizerConfig`` or ``OffloadConfig`` is rebuilt equal by ``from_options``
from its own field values and from their text (as a YAML file, flags or ``SWAPOPT_*``
variables give them), and every valid size converts to bytes without overflow.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from swapopt_core import OffloadConfig, SwapOptimizerConfig
from swapopt_core._plugins import state_key_names

PROPERTY = settings(max_examples=50, deadline=None)
TORCH_KEYS = tuple(state_key_names("torch"))

swap_configs = st.builds(
    SwapOptimizerConfig,
    swap_times=st.integers(1, 10**6),
    state_keys=st.one_of(
        st.none(),
        st.lists(st.sampled_from(TORCH_KEYS), min_size=1, unique=True).map(tuple),
    ),
    min_numel=st.integers(0, 2**40),
    include_master_params=st.booleans(),
    packed_swap=st.sampled_from([None, True, False]),
    runtime=st.sampled_from(["auto", "cuda", "loopback"]),
    resident_state_fraction=st.floats(0.0, 1.0, allow_nan=False),
    prefetch_batches=st.integers(0, 64),
)


def _sizes(limit: float) -> st.SearchStrategy[float]:
    """Sizes a config accepts: finite, >= 0, below ``limit``; whole and fractional."""
    return st.one_of(
        st.integers(0, int(limit) - 1),
        st.floats(0.0, limit, exclude_max=True, allow_nan=False, allow_infinity=False),
    )


offload_configs = st.builds(
    OffloadConfig,
    max_resident_activation_mb=_sizes(2.0**43),
    max_offload_activation_mb=_sizes(2.0**43),
    planner=st.sampled_from(["auto", "timed", "every-gap"]),
    runtime=st.sampled_from(["auto", "cuda", "loopback"]),
    min_offload_kib=_sizes(2.0**53),
)


def _fields(config: object) -> dict[str, object]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _swap_text(config: SwapOptimizerConfig) -> dict[str, str]:
    packed = {None: "auto", True: "yes", False: "off"}[config.packed_swap]
    return {
        "swap_times": f" {config.swap_times} ",
        "state_keys": "none" if config.state_keys is None else ",".join(config.state_keys),
        "min_numel": str(config.min_numel),
        "include_master_params": "TRUE" if config.include_master_params else "n",
        "packed_swap": packed,
        "runtime": config.runtime,
        "resident_state_fraction": repr(config.resident_state_fraction),
        "prefetch_batches": str(config.prefetch_batches),
    }


@PROPERTY
@given(swap_configs)
def test_swap_config_round_trips_through_from_options(config: SwapOptimizerConfig) -> None:
    assert SwapOptimizerConfig.from_options(_fields(config)) == config
    assert SwapOptimizerConfig.from_options(_fields(config), framework="torch") == config
    assert SwapOptimizerConfig.from_options(_swap_text(config), framework="torch") == config
    assert SwapOptimizerConfig.from_options({}, base=config) == config


@PROPERTY
@given(offload_configs)
def test_offload_config_round_trips_through_from_options(config: OffloadConfig) -> None:
    assert OffloadConfig.from_options(_fields(config)) == config
    text = {name: str(value) for name, value in _fields(config).items()}
    assert OffloadConfig.from_options(text) == config
    for nbytes in (config.budget_bytes, config.host_cap_bytes, config.min_offload_bytes):
        assert 0 <= nbytes <= 2**63 - 1
