"""The ``swap_optimizer:`` section of a MindFormers training YAML, checked without MindFormers.

``swapopt_plugins.mindformers`` re-exports what users need. This module holds the parsing:
one checker serves the YAML section and the callback's keyword arguments, so both reject
the same values with the same kind of message (the key, the value, what is accepted).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swapopt_core import SwapOptimizerConfig, get_plugin_manager
from swapopt_core._plugins import runtime_classes

__all__ = [
    "CALLBACK_NAME",
    "SECTION",
    "STATE_KEYS",
    "SwapOptimizerSection",
    "build_trainer_config",
    "check_options",
]

SECTION = "swap_optimizer"
CALLBACK_NAME = "SwapOptimizerCallback"
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SwapOptimizerConfig)}


class _Invalid(Exception):
    """Raised by a checker; turned into a ValueError naming the key."""


def _int(minimum: int) -> Callable[[object], int]:
    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _Invalid
        return value

    return check


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Invalid
    return value


def _packed(value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    raise _Invalid


def _state_keys(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    keys = (value,) if isinstance(value, str) else value
    if not isinstance(keys, Sequence) or not keys:
        raise _Invalid
    keys = tuple(keys)
    if len(set(keys)) != len(keys) or any(k not in STATE_KEYS for k in keys):
        raise _Invalid
    return keys


def _runtime_names() -> list[str]:
    """``auto`` and the names of the registered MindSpore runtimes."""
    return sorted({"auto", *runtime_classes(get_plugin_manager(), "mindspore")})


def _runtime(value: object) -> str:
    if not isinstance(value, str) or value.strip() not in _runtime_names():
        raise _Invalid
    return value.strip()


#: option -> (checker, accepted values in words); the fields of SwapOptimizerConfig.
_OPTIONS: dict[str, tuple[Callable[[object], Any], str]] = {
    "swap_times": (_int(1), "an integer >= 1"),
    "state_keys": (_state_keys, f"null, or a list of distinct names from {list(STATE_KEYS)}"),
    "min_numel": (_int(0), "an integer >= 0"),
    "include_master_params": (_bool, "true or false"),
    "packed_swap": (_packed, "true, false, or null/'auto' for the runtime's default"),
    "runtime": (_runtime, "one of the MindSpore runtimes {runtimes}"),
}


def check_options(options: Mapping[str, object], *, owner: str) -> dict[str, Any]:
    """Check swap options given as ``SwapOptimizerConfig`` field names.

    Args:
        options: Field name to value; names not given keep their defaults.
        owner: How errors name the options, e.g. ``"swap_optimizer"``.

    Returns:
        Every option, normalised (``state_keys`` as a tuple, ``'auto'`` packing as None).

    Raises:
        ValueError: An unknown name (the message lists the accepted ones) or a bad value
            (the message shows ``owner.name``, the value and what is accepted).
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(
            f"{owner} has no key {', '.join(map(repr, unknown))}; accepted keys: "
            f"{sorted(_OPTIONS)}."
        )
    checked = {}
    for name, (check, accepted) in _OPTIONS.items():
        value = options.get(name, _DEFAULTS[name])
        try:
            checked[name] = check(value)
        except _Invalid:
            raise ValueError(
                f"{owner}.{name}={value!r} is invalid; accepted: "
                f"{accepted.format(runtimes=_runtime_names())}."
            ) from None
    return checked


@dataclass(frozen=True)
class SwapOptimizerSection:
    """The ``swap_optimizer:`` section of a training YAML.

    Writing the section turns the swap on unless it says ``enable: false``; every other
    key is a ``SwapOptimizerConfig`` field with the same default.

    Raises:
        ValueError: A value is out of range or of the wrong type; the message names
            ``swap_optimizer.<key>``, shows the value and lists what is accepted.
    """

    enable: bool = True
    swap_times: int = _DEFAULTS["swap_times"]
    state_keys: tuple[str, ...] | None = _DEFAULTS["state_keys"]
    min_numel: int = _DEFAULTS["min_numel"]
    include_master_params: bool = _DEFAULTS["include_master_params"]
    packed_swap: bool | None = _DEFAULTS["packed_swap"]
    runtime: str = _DEFAULTS["runtime"]

    def __post_init__(self) -> None:
        if not isinstance(self.enable, bool):
            raise ValueError(
                f"{SECTION}.enable={self.enable!r} is invalid; accepted: true or false."
            )
        for name, value in check_options(self._options(), owner=SECTION).items():
            object.__setattr__(self, name, value)

    def _options(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _OPTIONS}

    @classmethod
    def from_yaml(cls, mapping: Mapping[str, Any]) -> SwapOptimizerSection:
        """Read the section as ``yaml.safe_load`` returns it.

        Raises:
            ValueError: ``mapping`` is not a mapping, has an unknown key (the message
                lists the accepted keys) or a bad value.
        """
        if not isinstance(mapping, Mapping):
            raise ValueError(
                f"{SECTION} must be a mapping of settings, got {mapping!r}. Write e.g. "
                f"'{SECTION}: {{enable: true, swap_times: 8}}', or leave the section out."
            )
        unknown = sorted(set(mapping) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"{SECTION} has no key {', '.join(map(repr, unknown))}; accepted keys: "
                f"{[f.name for f in dataclasses.fields(cls)]}."
            )
        return cls(**mapping)

    def to_yaml(self) -> dict[str, Any]:
        """The section as plain YAML values; ``from_yaml`` reads it back equal."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.state_keys is not None:
            data["state_keys"] = list(self.state_keys)
        return data

    def to_config(self) -> SwapOptimizerConfig:
        """The ``SwapOptimizerConfig`` the section describes (``enable`` aside)."""
        return SwapOptimizerConfig(**self._options())

    def callback_entry(self) -> dict[str, Any]:
        """The ``callbacks:`` entry that builds the callback with these settings."""
        options = self.to_yaml()
        del options["enable"]
        return {"type": CALLBACK_NAME, **options}


def build_trainer_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config dict the launcher hands to MindFormers' pynative ``Trainer``.

    Without a ``swap_optimizer:`` section the result equals ``config``. With one, the
    section is checked and removed, and when enabled a ``SwapOptimizerCallback`` entry with
    its settings is appended to ``callbacks``. ``config`` itself is not modified.

    Raises:
        ValueError: The section is invalid, or it is enabled while ``callbacks`` already
            lists a ``SwapOptimizerCallback`` (configure the swap in one place).
    """
    result = copy.deepcopy(dict(config))
    if SECTION not in result:
        return result
    section = SwapOptimizerSection.from_yaml(result.pop(SECTION))
    if not section.enable:
        return result
    callbacks = result.get("callbacks") or []
    if not isinstance(callbacks, list):
        raise ValueError(f"callbacks must be a list of {{type: ...}} entries, got {callbacks!r}.")
    if any(isinstance(c, Mapping) and c.get("type") == CALLBACK_NAME for c in callbacks):
        raise ValueError(
            f"The YAML enables the '{SECTION}:' section and also lists a {CALLBACK_NAME} under "
            f"'callbacks:'. Configure the swap in one place: remove that callbacks entry, or "
            f"set '{SECTION}: {{enable: false}}' (or drop the section)."
        )
    result["callbacks"] = [*callbacks, section.callback_entry()]
    return result
