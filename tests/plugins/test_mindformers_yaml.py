"""Hostile MindFormers YAML, read without MindFormers (issue 10).

Each case was a ``TypeError`` / ``AttributeError`` traceback inside MindFormers or the
launcher, or was silently ignored. Every one must now be a ``ValueError`` naming the key,
showing the value and saying how to write it.
"""

from __future__ import annotations

import pytest
import yaml

from swapopt_core.mindformers_yaml import build_trainer_config, read_context


def _build(text: str) -> dict:
    return build_trainer_config(yaml.safe_load(text))


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("swap_optimizer: {state_keys: [[exp_avg]]}", ["swap_optimizer.state_keys=[['exp_avg']]"]),
        ("swap_optimizer: {state_keys: [exp_avg, 3]}", ["swap_optimizer.state_keys="]),
        ("1: 2\nswap_optimizer: {swap_times: 2}", ["YAML key 1 at the top level", "Quote it"]),
        ("trainer: {2: x}", ["YAML key 2 at trainer is not a string"]),
        ("model: {layers: [{true: 1}]}", ["YAML key True at model.layers[0]"]),
        ("swap_optimizer: {1: 2}", ["YAML key 1 at swap_optimizer is not a string"]),
        (
            "trainer: {swap_optimizer: {swap_times: 8}}",
            ["'swap_optimizer:' is misplaced at trainer.swap_optimizer", "top level"],
        ),
        (
            "runner: [{swap_optimizer: {swap_times: 8}}]",
            ["misplaced at runner[0].swap_optimizer"],
        ),
        ("swap_optimizer: {swap_times: 8}\ncallbacks: 0", ["callbacks=0 must be a list"]),
        ("swap_optimizer: {swap_times: 8}\ncallbacks: ''", ["callbacks='' must be a list"]),
        ("swap_optimizer: {swap_times: 8}\ncallbacks: [3]", ["callbacks=[3] must be a list"]),
        (
            "swap_optimizer: {swap_times: 8}\ncallbacks: [{name: x}]",
            ["callbacks=[{'name': 'x'}] must be a list of {type: ...} entries"],
        ),
    ],
)
def test_hostile_yaml_gets_a_named_error(text: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        _build(text)
    for word in words:
        assert word in str(info.value)


def test_misplaced_section_is_reported_even_beside_a_top_level_one() -> None:
    with pytest.raises(ValueError, match="misplaced at trainer.swap_optimizer"):
        _build("swap_optimizer: {swap_times: 2}\ntrainer: {swap_optimizer: {swap_times: 8}}")


def test_deeply_nested_yaml_is_walked_without_recursion() -> None:
    config: dict = {"leaf": {3: 1}}
    for _ in range(5000):
        config = {"a": [config]}
    with pytest.raises(ValueError, match="YAML key 3 at a\\[0\\]"):
        build_trainer_config(config)


def test_empty_callbacks_still_take_the_entry() -> None:
    for text in ("callbacks:", "callbacks: []"):
        built = _build(f"swap_optimizer: {{swap_times: 2}}\n{text}")
        assert [c["type"] for c in built["callbacks"]] == ["SwapOptimizerCallback"]


def test_disabled_section_leaves_callbacks_alone() -> None:
    assert _build("swap_optimizer: {enable: false}\ncallbacks: 0") == {"callbacks": 0}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("context: CPU", ["context='CPU' must be a mapping", "device_target: CPU"]),
        ("context: [1]", ["context=[1] must be a mapping"]),
        ("context: {device_target: 3}", ["context.device_target=3 must be a device name"]),
        ("context: {device_target: ''}", ["context.device_target='' must be a device name"]),
    ],
)
def test_bad_context_is_named(text: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        read_context(yaml.safe_load(text))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("text", ["{}", "context:", "context: {device_target: CPU, mode: 1}"])
def test_good_context_is_read(text: str) -> None:
    assert read_context(yaml.safe_load(text)) == (yaml.safe_load(text).get("context") or {})


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("{type: SwapOptimizerCallback, state_keys: [[exp_avg]]}", "callbacks[1].state_keys="),
        ("{type: SwapOptimizerCallback, swap_times: 0}", "callbacks[1].swap_times=0 is invalid"),
        ("{type: SwapOptimizerCallback, swap_time: 8}", "callbacks[1] has no option 'swap_time'"),
    ],
)
def test_a_listed_callback_entry_is_read_before_the_trainer_builds_it(
    entry: str, words: str
) -> None:
    # MindFormers builds callbacks inside the Trainer, where these were tracebacks.
    with pytest.raises(ValueError) as info:
        _build(f"callbacks: [{{type: MFLossMonitor}}, {entry}]")
    assert words in str(info.value)


def test_a_good_listed_callback_entry_passes_unchanged() -> None:
    text = "callbacks: [{type: SwapOptimizerCallback, swap_times: '8', runtime: loopback}]"
    assert _build(text) == yaml.safe_load(text)


# ---- device_budget_mb (optimizer state only) --------------------------------------------------


def test_the_section_reads_a_device_budget_and_carries_it_to_the_callback() -> None:
    from swapopt_core.mindformers_yaml import SwapOptimizerSection

    section = SwapOptimizerSection.from_yaml({"device_budget_mb": "12.5", "swap_times": 8})
    assert section.device_budget_mb == 12.5 and SwapOptimizerSection().device_budget_mb is None
    assert SwapOptimizerSection.from_yaml(section.to_yaml()) == section
    (entry,) = _build("swap_optimizer: {device_budget_mb: 12.5, swap_times: 8}")["callbacks"]
    assert entry["device_budget_mb"] == 12.5 and "resident_state_fraction" not in entry
    # A listed entry with a budget is read the same way (and passes unchanged).
    text = "callbacks: [{type: SwapOptimizerCallback, device_budget_mb: 4}]"
    assert _build(text) == yaml.safe_load(text)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("swap_optimizer: {device_budget_mb: lots}", "swap_optimizer.device_budget_mb='lots'"),
        ("swap_optimizer: {device_budget_mb: -1}", "swap_optimizer.device_budget_mb=-1 is inv"),
        (
            "swap_optimizer: {device_budget_mb: 8, resident_state_fraction: 0.5}",
            "swap_optimizer.device_budget_mb=8 and swap_optimizer.resident_state_fraction=0.5",
        ),
        (
            "callbacks: [{type: SwapOptimizerCallback, device_budget_mb: x}]",
            "callbacks[0].device_budget_mb='x' is invalid",
        ),
    ],
)
def test_a_bad_device_budget_is_named(text: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        _build(text)
    assert words in str(info.value)


MIB = 2**20


@pytest.mark.parametrize(
    ("budget_mib", "swap_times", "want"),
    [(100, 8, 1.0), (400, 8, 1.0), (50, 8, 0.2), (37.5, 8, 0.0), (70, 16, 51.25 / 81.25)],
)
def test_resident_fraction_fills_the_budget_with_resident_state_and_staging(
    budget_mib: float, swap_times: int, want: float
) -> None:
    from swapopt_core._mindspore.budget import resident_fraction

    state = 100 * MIB
    r = resident_fraction(budget_mib, state, swap_times)
    assert r == pytest.approx(want)
    # The rule of the docs: resident share plus the staging of the rest fits the budget.
    if r < 1.0:
        assert r * state + 3 * (1 - r) * state / swap_times == pytest.approx(budget_mib * MIB)


@pytest.mark.parametrize(("budget_mib", "swap_times", "floor"), [(30, 8, "37.500"), (99, 2, "100")])
def test_a_budget_below_the_floor_names_key_value_and_floor(budget_mib, swap_times, floor) -> None:
    from swapopt_core._mindspore.budget import resident_fraction

    with pytest.raises(ValueError) as info:
        resident_fraction(budget_mib, 100 * MIB, swap_times)
    message = str(info.value)
    assert message.startswith(f"swap_optimizer.device_budget_mb={budget_mib} is below the floor")
    assert f"floor of {floor}" in message and f"swap_times={swap_times}" in message
