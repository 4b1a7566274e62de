"""Read swapopt settings from ``SWAPOPT_*`` environment variables, with clear errors.

Shared by the framework integrations. Each setting can be given explicitly (a field of an
integration's config object) or left as ``None``, in which case its environment variable is
read, and failing that the swapopt default is used. Every value, from either source, is
checked, and a bad one raises a ``ValueError`` that names where it came from, what it was and
what is accepted.

Settings (field name: environment variable):

- ``offload_optimizer_device``: ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE``, ``none`` or ``cpu``.
- ``swap_times``: ``SWAPOPT_SWAP_TIMES``, an integer >= 1.
- ``min_numel``: ``SWAPOPT_MIN_NUMEL``, an integer >= 0.
- ``packed_swap``: ``SWAPOPT_PACKED_SWAP``, a boolean, or ``auto`` for the runtime default.
- ``runtime``: ``SWAPOPT_RUNTIME``, ``auto`` or a registered runtime name.
- ``activation_budget_mb``: ``SWAPOPT_ACTIVATION_BUDGET_MB``, MiB >= 0, or ``none``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from swapopt_core import OffloadConfig, SwapOptimizerConfig, get_plugin_manager
from swapopt_core._plugins import runtime_classes

logger = logging.getLogger(__name__)

__all__ = ["ENV_VARS", "offload_config_kwargs", "resolve_settings", "swap_config_kwargs"]

_TRUE = ("1", "true", "yes", "y", "on", "t")
_FALSE = ("0", "false", "no", "n", "off", "f")
_NONE = ("", "none", "off", "no")  # "switched off" spellings for the activation budget
_SWAP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SwapOptimizerConfig)}


class _Invalid(Exception):
    """Raised by a parser; turned into a ValueError that names the source."""


def _device(value: object) -> str:
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text not in ("none", "cpu"):
        raise _Invalid
    return text


def _int(minimum: int) -> Callable[[object], int]:
    def parse(value: object) -> int:
        if isinstance(value, bool):
            raise _Invalid
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise _Invalid from None
        if not isinstance(value, int) or value < minimum:
            raise _Invalid
        return value

    return parse


def _packed(value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return None
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise _Invalid


def _runtime_names() -> list[str]:
    """``auto`` and the torch runtimes (Lightning and Accelerate train torch models)."""
    return sorted({"auto", *runtime_classes(get_plugin_manager(), "torch")})


def _runtime(value: object) -> str:
    if not isinstance(value, str) or value.strip() not in _runtime_names():
        raise _Invalid
    return value.strip()


def _budget(value: object) -> float | None:
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _NONE:
            return None
        try:
            value = float(text)
        except ValueError:
            raise _Invalid from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise _Invalid
    return float(value)


#: field name -> (environment variable, parser, accepted values in words, default)
_OPTIONS: dict[str, tuple[str, Callable[[object], Any], str, Any]] = {
    "offload_optimizer_device": (
        "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE",
        _device,
        "'none' or 'cpu'",
        "none",
    ),
    "swap_times": ("SWAPOPT_SWAP_TIMES", _int(1), "an integer >= 1", _SWAP_DEFAULTS["swap_times"]),
    "min_numel": ("SWAPOPT_MIN_NUMEL", _int(0), "an integer >= 0", _SWAP_DEFAULTS["min_numel"]),
    "packed_swap": (
        "SWAPOPT_PACKED_SWAP",
        _packed,
        f"'auto' (runtime default) or a boolean ({'/'.join(_TRUE + _FALSE)})",
        None,
    ),
    "runtime": ("SWAPOPT_RUNTIME", _runtime, "one of {runtimes}", "auto"),
    "activation_budget_mb": (
        "SWAPOPT_ACTIVATION_BUDGET_MB",
        _budget,
        "a number of MiB >= 0, or 'none' to switch activation offload off",
        None,
    ),
}

#: field name -> environment variable it defaults from.
ENV_VARS: dict[str, str] = {name: option[0] for name, option in _OPTIONS.items()}


def resolve_settings(
    values: Mapping[str, object], *, owner: str, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Resolve every setting from an explicit value, else its environment variable.

    Args:
        values: Field name to explicit value; ``None`` (or a missing name) means "read the
            environment variable, else the default". Unknown names are rejected.
        owner: How to name an explicit value in errors, e.g. ``"SwapOptimizerPlugin"``.
        environ: Where to read variables from. Default: ``os.environ``.

    Returns:
        Every setting by field name, checked and normalised (lower-case strings, ints,
        ``True``/``False``/``None`` for ``packed_swap``, float or ``None`` for the budget).

    Raises:
        ValueError: A value or variable is invalid; the message names it, shows the value
            and lists what is accepted.
    """
    environ = os.environ if environ is None else environ
    unknown = sorted(set(values) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"{owner} has no setting {unknown}; known: {sorted(_OPTIONS)}.")
    resolved: dict[str, Any] = {}
    for name, (env, parse, accepted, default) in _OPTIONS.items():
        value, source = values.get(name), f"{owner}.{name}"
        if value is None:
            raw = environ.get(env)
            if raw is None or (raw.strip() == "" and name != "activation_budget_mb"):
                resolved[name] = default
                continue
            value, source = raw, f"environment variable {env}"
        try:
            resolved[name] = parse(value)
        except _Invalid:
            raise ValueError(
                f"{source}={value!r} is invalid; accepted: "
                f"{accepted.format(runtimes=_runtime_names())}."
            ) from None
    logger.debug("swapopt settings for %s: %s", owner, resolved)
    return resolved


def swap_config_kwargs(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``SwapOptimizerConfig`` keyword arguments from resolved settings."""
    return {key: settings[key] for key in ("swap_times", "min_numel", "packed_swap", "runtime")}


def offload_config_kwargs(settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """``OffloadConfig`` keyword arguments, or ``None`` when no activation budget is set.

    The activation offload follows ``runtime`` when ``OffloadConfig`` knows that name
    (``auto``, ``cuda``, ``loopback``), and picks automatically otherwise.
    """
    if settings["activation_budget_mb"] is None:
        return None
    runtime = settings["runtime"]
    try:
        OffloadConfig(runtime=runtime)
    except ValueError:
        runtime = "auto"
    return {"max_resident_activation_mb": settings["activation_budget_mb"], "runtime": runtime}
