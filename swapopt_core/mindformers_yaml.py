"""Where the MindFormers integration's config comes from, read without MindFormers.

Framework-free like ``swapopt_core.options`` (whose parser it uses), so it is tested, and
a training YAML checked, on machines without MindSpore.

The ``swap_optimizer:`` section of a training YAML is ``enable`` plus the fields of
``SwapOptimizerConfig``. Those fields are read by the core's one parser
(``SwapOptimizerConfig.from_options`` with ``framework="mindspore"``, which checks ``runtime``
and ``state_keys`` against the registered MindSpore runtimes and optimizer families), so the
section and the callback's keyword arguments reject the same values with the same kind of
message. ``device_budget_mb`` is the one key beside them: the device bytes the optimizer
state may hold (resident part plus staging), which ``fit_device_budget`` turns into the
largest ``resident_state_fraction`` that fits once the optimizer exists (the rule is
``swapopt_core._mindspore.budget.resident_fraction``). ``read_command_line`` is the
framework-free half of the launcher
``python -m swapopt_plugins.mindformers``: its options, the YAML file, the section turned
into a callback entry. ``swapopt_plugins.mindformers`` re-exports what users need.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swapopt_core import SwapOptimizerConfig
from swapopt_core._mindspore.budget import BUDGET_KEY, fit_device_budget
from swapopt_core._options import NO, YES, Option, parse_bool, parse_mib, read_options

logger = logging.getLogger(__name__)

__all__ = [
    "CALLBACK_NAME",
    "GRAPH_HINT",
    "SECTION",
    "SwapOptimizerSection",
    "build_trainer_config",
    "fit_device_budget",
    "read_callback_options",
    "read_command_line",
    "read_context",
]

SECTION = "swap_optimizer"
CALLBACK_NAME = "SwapOptimizerCallback"
GRAPH_HINT = (
    "In graph mode use MindFormers' own host-side optimizer state instead: "
    "'optimizer: {type: AdamW, swap: True}'."
)

_FIELDS = tuple(f.name for f in dataclasses.fields(SwapOptimizerConfig))
_BUDGET = Option(
    parse_mib(allow_none=True),
    f"null, or a number of MiB >= 0 (below {2**43}) the optimizer state may hold on the device",
)
# The section's keys: ``enable`` and the budget are read here; the config's fields pass
# through as given, to be read by SwapOptimizerConfig.from_options.
_KEYS = {
    "enable": Option(parse_bool, f"a boolean ({'/'.join(YES + NO)})"),
    BUDGET_KEY: _BUDGET,
    **{name: Option(lambda value: value, "") for name in _FIELDS},
}


def read_callback_options(
    options: Mapping[str, object], *, source: str
) -> tuple[SwapOptimizerConfig, float | None]:
    """The config and ``device_budget_mb`` of a callback's keys (a ``callbacks:`` entry).

    Raises:
        ValueError: An unknown key or a bad value (named as ``source.key``), or both
            ``device_budget_mb`` and ``resident_state_fraction`` (the budget sets it).
    """
    rest = {key: value for key, value in options.items() if key != BUDGET_KEY}
    budget = read_options(
        {BUDGET_KEY: _BUDGET}, {BUDGET_KEY: options.get(BUDGET_KEY)}, source=source
    )
    mib = budget.get(BUDGET_KEY)
    if mib is not None and "resident_state_fraction" in rest:
        raise ValueError(
            f"{source}.{BUDGET_KEY}={mib:g} and {source}.resident_state_fraction="
            f"{rest['resident_state_fraction']!r} are both set. Give one: the budget chooses "
            "the resident share itself."
        )
    config = SwapOptimizerConfig.from_options(rest, source=source, framework="mindspore")
    return config, mib


def _read(values: Mapping[Any, object]) -> tuple[bool, SwapOptimizerConfig, float | None]:
    """``enable``, the config and the device budget of a section, each key read once."""
    if not isinstance(values, Mapping):
        raise ValueError(
            f"{SECTION} must be a mapping of settings, got {values!r}. Write e.g. "
            f"'{SECTION}: {{enable: true, swap_times: 8}}', or leave the section out."
        )
    options = read_options(_KEYS, values, source=SECTION)
    enable = options.pop("enable", True)
    config, budget = read_callback_options(options, source=SECTION)
    return enable, config, budget


def _plain(config: SwapOptimizerConfig) -> dict[str, Any]:
    """The config's fields as plain YAML values."""
    data = dataclasses.asdict(config)
    if config.state_keys is not None:
        data["state_keys"] = list(config.state_keys)
    return data


@dataclass(frozen=True, init=False)
class SwapOptimizerSection:
    """The ``swap_optimizer:`` section of a training YAML: ``enable`` and a config.

    ``SwapOptimizerSection(**keys)`` takes the keys a YAML section has and reads them as
    ``from_yaml`` does. Writing the section turns the swap on unless it says
    ``enable: false``; every other key is a ``SwapOptimizerConfig`` field with the same
    default, also readable as an attribute (``section.swap_times``).

    Attributes:
        enable: Whether the launcher adds the callback.
        config: The swap configuration the section describes.
        device_budget_mb: Device MiB the optimizer state may hold (resident share plus
            staging), or None: the callback then keeps resident as much as fits.

    Raises:
        ValueError: An unknown key (the message lists the accepted ones) or a value that is
            not accepted (the message names ``swap_optimizer.<key>``, shows the value and
            says what is accepted).
    """

    enable: bool
    config: SwapOptimizerConfig
    device_budget_mb: float | None

    def __init__(self, enable: object = True, **options: object) -> None:
        self._set(_read({"enable": enable, **options}))

    def _set(self, read: tuple[bool, SwapOptimizerConfig, float | None]) -> None:
        for name, value in zip(("enable", "config", BUDGET_KEY), read, strict=True):
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name in _FIELDS:  # the config's fields, as keys of the section
            return getattr(self.config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_yaml(cls, mapping: Mapping[str, Any]) -> SwapOptimizerSection:
        """Read the section as ``yaml.safe_load`` returns it.

        Raises:
            ValueError: ``mapping`` is not a mapping, has an unknown key (the message
                lists the accepted keys) or a value that is not accepted.
        """
        section = object.__new__(cls)
        section._set(_read(mapping))
        return section

    def _budget(self) -> dict[str, Any]:
        return {} if self.device_budget_mb is None else {BUDGET_KEY: self.device_budget_mb}

    def to_yaml(self) -> dict[str, Any]:
        """The section as plain YAML values; ``from_yaml`` reads it back equal."""
        config = _plain(self.config)
        if self.device_budget_mb is not None:
            del config["resident_state_fraction"]  # the budget chooses it
        return {"enable": self.enable, **config, **self._budget()}

    def to_config(self) -> SwapOptimizerConfig:
        """The ``SwapOptimizerConfig`` the section describes (``enable`` aside)."""
        return self.config

    def callback_entry(self) -> dict[str, Any]:
        """The ``callbacks:`` entry that builds the callback with these settings."""
        entry = {"type": CALLBACK_NAME, **self.to_yaml()}
        del entry["enable"]
        return entry


def _where(path: tuple[object, ...]) -> str:
    """A YAML path as a user would write it: ``trainer.callbacks[0]``, or ``the top level``."""
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path)
    return text.lstrip(".") or "the top level"


def _check_keys(config: Mapping[Any, Any]) -> None:
    """Refuse non-string keys anywhere, and a ``swap_optimizer:`` section below the top."""
    pending: list[tuple[tuple[object, ...], object]] = [((), config)]
    while pending:  # a loop, not recursion: a deeply nested YAML must not overflow the stack
        path, node = pending.pop()
        if isinstance(node, list):
            pending.extend(((*path, index), item) for index, item in enumerate(node))
            continue
        if not isinstance(node, Mapping):
            continue
        for key, value in node.items():
            if not isinstance(key, str):
                raise ValueError(
                    f"The YAML key {key!r} at {_where(path)} is not a string; MindFormers "
                    f"reads keys as setting names. Quote it ('{key}': ...) or remove it."
                )
            if key == SECTION and path:
                raise ValueError(
                    f"'{SECTION}:' is misplaced at {_where((*path, key))}: the launcher reads "
                    f"it only at the top level of the YAML. Move the section there (unindented, "
                    f"beside 'trainer:'), or remove it."
                )
            pending.append(((*path, key), value))


def read_context(config: Mapping[str, Any]) -> dict[str, Any]:
    """The YAML's ``context:`` section, checked for the launcher (``{}`` without one).

    Raises:
        ValueError: ``context`` is not a mapping, or its ``device_target`` is not a
            non-empty name; the message shows the value and how to write it.
    """
    context = config.get("context")
    if context is None:
        return {}
    if not isinstance(context, Mapping):
        raise ValueError(
            f"context={context!r} must be a mapping of MindSpore context settings. Write e.g. "
            "'context: {device_target: CPU, mode: 1}', or leave the section out."
        )
    target = context.get("device_target")
    if target is not None and (not isinstance(target, str) or not target.strip()):
        raise ValueError(
            f"context.device_target={target!r} must be a device name such as 'CPU' or "
            "'Ascend'; leave it out to keep MindSpore's default device."
        )
    return dict(context)


def _check_listed_callbacks(callbacks: object) -> None:
    """Read each ``SwapOptimizerCallback`` entry of ``callbacks:`` now, as the callback will.

    MindFormers builds callbacks inside the Trainer, where a bad value is a traceback; read
    here, it is one line before anything is built.
    """
    if not isinstance(callbacks, list):
        return
    for index, entry in enumerate(callbacks):
        if isinstance(entry, Mapping) and entry.get("type") == CALLBACK_NAME:
            options = {key: value for key, value in entry.items() if key != "type"}
            read_callback_options(options, source=f"callbacks[{index}]")


def build_trainer_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config dict the launcher hands to MindFormers' pynative ``Trainer``.

    Without a ``swap_optimizer:`` section the result equals ``config``. With one, the
    section is read and removed, and when enabled a ``SwapOptimizerCallback`` entry with
    its settings is appended to ``callbacks``. ``config`` itself is not modified.

    Raises:
        ValueError: A key anywhere in ``config`` is not a string; a ``swap_optimizer:``
            section is nested below the top level; the section, or a ``SwapOptimizerCallback``
            entry of ``callbacks``, is invalid; ``callbacks``
            is not a list of ``{type: ...}`` entries while the section is enabled; or the
            section is enabled while ``callbacks`` already lists a ``SwapOptimizerCallback``
            (configure the swap in one place).
    """
    _check_keys(config)
    result = copy.deepcopy(dict(config))
    _check_listed_callbacks(result.get("callbacks"))
    if SECTION not in result:
        return result
    section = SwapOptimizerSection.from_yaml(result.pop(SECTION))
    if not section.enable:
        return result
    callbacks = result.get("callbacks")
    callbacks = [] if callbacks is None else callbacks
    bad = not isinstance(callbacks, list) or not all(
        isinstance(c, Mapping) and isinstance(c.get("type"), str) for c in callbacks
    )
    if bad:
        raise ValueError(
            f"callbacks={callbacks!r} must be a list of {{type: ...}} entries for the "
            f"'{SECTION}:' section to add its {CALLBACK_NAME} to; write e.g. "
            "'callbacks: [{type: MFLossMonitor}]', or leave 'callbacks:' out."
        )
    if any(c.get("type") == CALLBACK_NAME for c in callbacks):
        raise ValueError(
            f"The YAML enables the '{SECTION}:' section and also lists a {CALLBACK_NAME} under "
            f"'callbacks:'. Configure the swap in one place: remove that callbacks entry, or "
            f"set '{SECTION}: {{enable: false}}' (or drop the section)."
        )
    result["callbacks"] = [*callbacks, section.callback_entry()]
    return result


def _log_to_stderr() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
    for name in ("swapopt_core", "swapopt_plugins"):
        named = logging.getLogger(name)
        if not named.handlers:
            named.addHandler(handler)
            named.setLevel(logging.INFO)


def read_command_line(
    argv: Sequence[str] | None, apply_context: Callable[[Mapping[str, Any]], None]
) -> tuple[argparse.Namespace, dict[str, Any]] | int:
    """The launcher's options and the config for MindFormers' pynative ``Trainer``.

    Imports the modules named by ``--register`` (first: they may register models, configs or
    runtimes), reads the YAML, turns its ``swap_optimizer:`` section into a callback entry
    (``build_trainer_config``) and hands the result to ``apply_context`` (mode and device).

    Returns:
        The parsed options and the config; or 2 when the YAML or an option is invalid (the
        reason, one line, went to stderr).
    """
    parser = argparse.ArgumentParser(
        prog="python -m swapopt_plugins.mindformers",
        description="Train with MindFormers' pynative Trainer; a 'swap_optimizer:' section of "
        "the YAML keeps the optimizer state in host memory.",
    )
    parser.add_argument("--config", required=True, help="training YAML")
    parser.add_argument(
        "--register",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, so it registers models or configs (repeatable)",
    )
    parser.add_argument("--checkpoint", default=None, help="resume from this checkpoint folder")
    parser.add_argument(
        "--mode",
        default="pretrain",
        choices=["pretrain", "finetune"],
        help="passed to Trainer.train(mode=...)",
    )
    args = parser.parse_args(argv)

    import yaml  # type: ignore[import-untyped]  # PyYAML ships no type information

    for module in args.register:
        importlib.import_module(module)
    try:
        with open(args.config, encoding="utf-8") as file:
            loaded = yaml.safe_load(file)
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config} must hold a mapping of sections, got {loaded!r}.")
        config = build_trainer_config(loaded)
        apply_context(config)
    except (OSError, ValueError, yaml.YAMLError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except RecursionError:
        print(
            f"{parser.prog}: error: {args.config} nests lists or mappings too deeply to be a "
            "training YAML.",
            file=sys.stderr,
        )
        return 2
    _log_to_stderr()
    if SECTION in loaded:
        logger.info("swapopt: %s section read; callbacks: %s", SECTION, config.get("callbacks"))
    return args, config
