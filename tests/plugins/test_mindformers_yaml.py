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
