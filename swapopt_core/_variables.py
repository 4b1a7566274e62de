"""Every ``SWAPOPT_*`` environment variable swapopt reads, and the warning for one it does not.

The list is the one place the names are collected (each module that reads a variable keeps
its own constant; a test checks that every ``SWAPOPT_`` name in the sources is listed here).
``warn_unknown_variables`` is called where the settings are first read
(``swapopt_core.options.read_settings``), never at import: a ``SWAPOPT_*`` name that is not
one of these gets one ``SwapOptWarning`` per process, naming the closest known name, so a
misspelt ``SWAPOPT_SWAPTIMES=8`` is not ignored silently.
"""

from __future__ import annotations

import difflib
import logging
import warnings
from collections.abc import Iterable, Mapping

from swapopt_core._errors import SwapOptWarning

logger = logging.getLogger(__name__)

__all__ = [
    "CONFIG_ENV",
    "PREFIX",
    "SETTING_VARIABLES",
    "VARIABLES",
    "closest",
    "warn_unknown_variables",
]

PREFIX = "SWAPOPT_"
#: Names the settings file read by ``read_settings`` (``swapopt_core._config_file``).
CONFIG_ENV = "SWAPOPT_CONFIG"

#: The settings' variables (``swapopt_core.options.ENV_VARS``): field name -> variable.
SETTING_VARIABLES: dict[str, str] = {
    "offload_optimizer_device": "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE",
    "swap_times": "SWAPOPT_SWAP_TIMES",
    "min_numel": "SWAPOPT_MIN_NUMEL",
    "packed_swap": "SWAPOPT_PACKED_SWAP",
    "runtime": "SWAPOPT_RUNTIME",
    "activation_budget_mb": "SWAPOPT_ACTIVATION_BUDGET_MB",
    "activation_runtime": "SWAPOPT_ACTIVATION_RUNTIME",
    "device_budget_mb": "SWAPOPT_DEVICE_BUDGET_MB",
    "resident_state_fraction": "SWAPOPT_RESIDENT_STATE_FRACTION",
    "prefetch_batches": "SWAPOPT_PREFETCH_BATCHES",
}

#: Every variable swapopt reads -> what it does, in a few words.
VARIABLES: dict[str, str] = {
    **{variable: f"the setting {field}" for field, variable in SETTING_VARIABLES.items()},
    CONFIG_ENV: "the settings file (YAML, JSON or TOML)",
    "SWAPOPT_STRICT": "raise for an optimizer the automatic ways in cannot serve",
    "SWAPOPT_LIGHTNING_AUTO": "add the callback to every Lightning Trainer",
    "SWAPOPT_RUN": "set by swapopt run for the script it starts",
    "SWAPOPT_DISABLE_PLUGIN_AUTOLOAD": "load no plugin through entry points",
    "SWAPOPT_LOOPBACK_GBPS": "the loopback-async runtime's copy rate",
    "SWAPOPT_LOOPBACK_JITTER_US": "the loopback-async runtime's random delay",
}

# The unknown names warned about in this process, so each is named once.
_warned: set[str] = set()


def closest(name: str, known: Iterable[str]) -> str | None:
    """The name in ``known`` most like ``name`` (``difflib``), or ``None`` if none is close."""
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def warn_unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """Warn once per process about each ``SWAPOPT_*`` variable in ``environ`` swapopt does
    not read (a ``SwapOptWarning`` naming it and the closest known name).

    Returns:
        The unknown names warned about by this call (those warned about before are left out).
    """
    fresh = sorted(
        name
        for name in environ
        if name.startswith(PREFIX) and name not in VARIABLES and name not in _warned
    )
    for name in fresh:
        _warned.add(name)
        # Compared without the prefix they all share, which would make any two names close.
        near = closest(name[len(PREFIX) :], [known[len(PREFIX) :] for known in VARIABLES])
        hint = (
            f"did you mean {PREFIX}{near}?" if near else f"known: {', '.join(sorted(VARIABLES))}."
        )
        warnings.warn(
            f"swapopt does not read the environment variable {name} (it is ignored); {hint}",
            SwapOptWarning,
            stacklevel=3,
        )
    return fresh
