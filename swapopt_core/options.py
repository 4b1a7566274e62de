"""Where swapopt's options come from, parsed one way: the public entry point.

Keyword arguments, YAML sections, ``SWAPOPT_*`` environment variables and command-line
flags are all read by one parser (``read_options`` with ``Option`` fields, and the configs'
``SwapOptimizerConfig.from_options`` / ``OffloadConfig.from_options``), so a bad value gets
the same kind of error wherever it is written. This module gives the integrations what they
read: the parser's vocabulary, the ``SWAPOPT_*`` variables and the settings file named by
``SWAPOPT_CONFIG`` (``read_settings``, ``SwapSettings``; explicit values win over variables,
variables over the file, the file over the defaults; see ``docs/configuration.md``); the
``swap_optimizer:`` section of a MindFormers training YAML is read by
``swapopt_core.mindformers_yaml`` (``SwapOptimizerSection``) over the same parser. It imports
no training framework.

Settings (field name: environment variable):

- ``offload_optimizer_device``: ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE``, ``none`` or ``cpu``.
- ``swap_times``: ``SWAPOPT_SWAP_TIMES``, an integer >= 1.
- ``min_numel``: ``SWAPOPT_MIN_NUMEL``, an integer >= 0.
- ``packed_swap``: ``SWAPOPT_PACKED_SWAP``, a yes/no word, or ``auto`` for the runtime default.
- ``runtime``: ``SWAPOPT_RUNTIME``, ``auto`` or a registered torch runtime (optimizer swap).
- ``activation_budget_mb``: ``SWAPOPT_ACTIVATION_BUDGET_MB``, MiB >= 0, or ``none``.
- ``activation_runtime``: ``SWAPOPT_ACTIVATION_RUNTIME``, ``auto`` (where the activations
  live), ``cuda``, ``loopback`` or ``loopback-async``.
- ``device_budget_mb``: ``SWAPOPT_DEVICE_BUDGET_MB``, MiB >= 0, or ``none``: the most device
  memory one training step may hold; swapopt plans the optimizer swap and the activation
  offload under it (``OffloadSession(config, optimizer=opt)``). Exclusive with
  ``activation_budget_mb``; it turns the optimizer swap on (``offload_optimizer_device``
  ``none`` beside it is refused).
- ``resident_state_fraction``: ``SWAPOPT_RESIDENT_STATE_FRACTION``, a number in [0, 1], and
  ``prefetch_batches``: ``SWAPOPT_PREFETCH_BATCHES``, an integer >= 0 (optimizer swap).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any

from swapopt_core import OffloadConfig, SwapOptimizerConfig
from swapopt_core._budget import check_device_budget, with_device_budget
from swapopt_core._config_file import read_config_file
from swapopt_core._options import (
    NO,
    YES,
    Invalid,
    Option,
    env_flag,
    parse_bool,
    parse_int,
    parse_mib,
    parse_name_list,
    read_options,
)
from swapopt_core._variables import CONFIG_ENV, SETTING_VARIABLES, warn_unknown_variables

logger = logging.getLogger(__name__)

__all__ = [
    "AUTO_ENV",
    "CONFIG_ENV",
    "ENV_VARS",
    "NO",
    "YES",
    "Invalid",
    "Option",
    "Settings",
    "SwapSettings",
    "auto_enabled",
    "enable_lightning_auto",
    "parse_bool",
    "parse_int",
    "parse_mib",
    "parse_name_list",
    "read_options",
    "read_settings",
    "with_device_budget",
]

#: Field name -> the environment variable it defaults from.
ENV_VARS: dict[str, str] = SETTING_VARIABLES
#: Set to a yes word to add the Lightning callback to every Trainer through entry points.
AUTO_ENV = "SWAPOPT_LIGHTNING_AUTO"

_SWAP_FIELDS = (
    "swap_times",
    "min_numel",
    "packed_swap",
    "runtime",
    "resident_state_fraction",
    "prefetch_batches",
)


def _device(value: object) -> str:
    if value is False:  # YAML reads an unquoted `no` / `off` as False: it means "none"
        return "none"
    word = value.strip().lower() if isinstance(value, str) else None
    if word not in ("none", "cpu"):
        raise Invalid
    return word


_OWN = {
    "offload_optimizer_device": Option(_device, "'none' or 'cpu' (false means 'none')"),
    "activation_budget_mb": Option(
        parse_mib(allow_none=True),
        f"a number of MiB >= 0, or 'none' to switch activation offload off (below {2**43})",
    ),
    "device_budget_mb": Option(
        parse_mib(allow_none=True),
        f"a number of MiB >= 0, or 'none' for no whole-step budget (below {2**43})",
    ),
}


@dataclass(frozen=True)
class Settings:
    """Resolved settings of an integration.

    Attributes:
        values: Every field of ``ENV_VARS`` by name, checked and converted (fields neither
            given nor set in the environment hold their defaults).
        swap: The optimizer-swap config.
        activations: The activation-offload config, or ``None`` when no budget is set; with
            a device budget it holds ``device_budget_mb`` (the session then plans the whole
            step with the optimizer, ``OffloadSession(config, optimizer=opt)``).
        sources: Where each field given somewhere came from, by name, as errors name it
            (``"Owner.swap_times"``, ``"environment variable SWAPOPT_SWAP_TIMES"``,
            ``"/path/cfg.yaml: swap_times"``); fields left to their defaults are absent.
    """

    values: dict[str, Any]
    swap: SwapOptimizerConfig
    activations: OffloadConfig | None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """Whether optimizer state goes to host memory (``offload_optimizer_device=cpu``;
        a device budget sets it)."""
        return bool(self.values["offload_optimizer_device"] == "cpu")

    @property
    def device_budget(self) -> bool:
        """Whether a whole-step device budget is set (``device_budget_mb``)."""
        return self.values["device_budget_mb"] is not None

    @property
    def requested(self) -> bool:
        """Whether the settings ask for anything: the optimizer swap or an activation budget."""
        return self.enabled or self.activations is not None


def read_settings(
    explicit: Mapping[str, object], *, owner: str, environ: Mapping[str, str] | None = None
) -> Settings:
    """Resolve every setting: an explicit value, else its environment variable, else the
    settings file named by ``SWAPOPT_CONFIG``, else the default.

    The first call that reads an environment warns once per process about each
    ``SWAPOPT_*`` variable swapopt does not read (``SwapOptWarning``, with the closest name).

    Args:
        explicit: Field name to value; ``None`` (or a missing name) reads the environment
            variable, else the file, else the default. Unknown names are rejected.
        owner: How errors name an explicit value, e.g. ``"SwapOptimizerPlugin"``.
        environ: Where variables (``SWAPOPT_CONFIG`` included) are read. Default:
            ``os.environ``.

    Raises:
        ValueError: A value, variable or file key is invalid; the message names it
            (``owner.field``, ``environment variable NAME`` or ``/path/file: key``), shows
            the value and says what is accepted. The settings file cannot be read, is not
            YAML/JSON/TOML by its suffix, or holds an unknown key (named with the closest).
    """
    environ = os.environ if environ is None else environ
    warn_unknown_variables(environ)
    given: dict[str, object] = {}
    labels: dict[str, str] = {}
    for name, value in explicit.items():
        if value is not None:
            given[name] = value
            labels[name] = f"{owner}.{name}"
    for name, variable in ENV_VARS.items():
        raw = environ.get(variable)
        if name in given or raw is None:
            continue
        if raw.strip() == "" and name != "activation_budget_mb":
            continue  # an empty variable means "unset", except that it switches a budget off
        given[name] = raw
        labels[name] = f"environment variable {variable}"
    path = environ.get(CONFIG_ENV, "").strip()
    if path:
        in_file, file_labels = read_config_file(path, ENV_VARS)
        for name, value in in_file.items():
            if name not in given:
                given[name] = value
                labels[name] = file_labels[name]
    unknown = sorted(set(given) - set(ENV_VARS))
    if unknown:
        raise ValueError(f"{owner} has no setting {unknown}; known: {sorted(ENV_VARS)}.")
    own = read_options(
        _OWN, {k: v for k, v in given.items() if k in _OWN}, source=owner, labels=labels
    )
    swap = SwapOptimizerConfig.from_options(
        {k: given[k] for k in _SWAP_FIELDS if k in given},
        source=owner,
        labels=labels,
        framework="torch",
    )
    budget = own.get("activation_budget_mb")
    device_budget = own.get("device_budget_mb")
    device = own.get("offload_optimizer_device")
    if device_budget is not None:
        check_device_budget(budget, device, device_budget, labels)
        device = "cpu"  # the whole-step plan decides how much state moves, maybe none
    wanted: dict[str, object] = {}
    if budget is not None:
        wanted["max_resident_activation_mb"] = budget
    if device_budget is not None:
        wanted["device_budget_mb"] = device_budget
    if "activation_runtime" in given:
        wanted["runtime"] = given["activation_runtime"]
    # Checked even without a budget, so a misspelt runtime is reported at once.
    checked = OffloadConfig.from_options(
        wanted,
        source=owner,
        labels={"runtime": labels.get("activation_runtime", f"{owner}.activation_runtime")},
    )
    activations = checked if budget is not None or device_budget is not None else None
    values: dict[str, Any] = {
        "offload_optimizer_device": device or "none",
        **{name: getattr(swap, name) for name in _SWAP_FIELDS},
        "activation_budget_mb": budget,
        "activation_runtime": checked.runtime,
        "device_budget_mb": device_budget,
    }
    logger.debug("swapopt settings for %s: %s", owner, values)
    return Settings(values, swap, activations, {name: labels[name] for name in given})


def auto_enabled(environ: Mapping[str, str]) -> bool:
    """Whether ``SWAPOPT_LIGHTNING_AUTO`` asks for the callback on every Trainer.

    Raises:
        ValueError: The variable holds something other than a yes/no word.
    """
    return env_flag(environ, AUTO_ENV, "to add the callback to every Trainer")


def enable_lightning_auto(environ: MutableMapping[str, str] | None = None) -> bool:
    """Add the callback to every Lightning ``Trainer``: set ``SWAPOPT_LIGHTNING_AUTO=1``.

    Done when ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu`` or ``SWAPOPT_DEVICE_BUDGET_MB`` is set
    (the callback then plans each step under it), or when an activation budget is set
    and the device setting does not say ``none`` (the callback then swaps the optimizer
    state too); each setting is read from its variable or the ``SWAPOPT_CONFIG`` file. A
    ``SWAPOPT_LIGHTNING_AUTO`` the user set is left as it is and decides. The variable is
    inherited by the processes the script starts (DDP workers).

    Args:
        environ: Where the variables are read and set. Default: ``os.environ``.

    Returns:
        Whether every Trainer now gets the callback.

    Raises:
        ValueError: A ``SWAPOPT_*`` variable is invalid; the message names it.
    """
    environ = os.environ if environ is None else environ
    settings = read_settings({}, owner="swapopt run", environ=environ)
    if environ.get(AUTO_ENV, "").strip():
        return auto_enabled(environ)
    # "none" said in a variable or the settings file (not the default) keeps the callback off.
    said_none = "offload_optimizer_device" in settings.sources and not settings.enabled
    if not (settings.enabled or (settings.activations is not None and not said_none)):
        return False
    environ[AUTO_ENV] = "1"
    return True


@dataclass
class SwapSettings:
    """The ``SWAPOPT_*`` settings as a dataclass; each ``None`` field defaults from its variable.

    The fields are resolved when the object is created (explicit value, else the variable,
    else the ``SWAPOPT_CONFIG`` file, else the default), the way Accelerate's plugin
    dataclasses read ``ACCELERATE_*``; a field set afterwards counts, a variable set
    afterwards does not.

    Args:
        offload_optimizer_device: ``"cpu"`` keeps optimizer state in host memory, ``"none"``
            leaves the optimizer alone. Env ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE``; default
            ``"none"``.
        swap_times: Pipeline batches per step. Env ``SWAPOPT_SWAP_TIMES``; default 16.
        min_numel: Smaller state tensors stay on the device. Env ``SWAPOPT_MIN_NUMEL``;
            default 1024.
        packed_swap: ``True``/``False``, or ``"auto"`` for the runtime default. Env
            ``SWAPOPT_PACKED_SWAP``; default ``"auto"``.
        runtime: Runtime of the optimizer swap: ``"auto"``, ``"cuda"``, ``"loopback"`` or a
            plugin's. Env ``SWAPOPT_RUNTIME``; default ``"auto"``.
        activation_budget_mb: Device budget in MiB for activations; ``"none"`` switches
            activation offload off. Env ``SWAPOPT_ACTIVATION_BUDGET_MB``; default off.
        activation_runtime: Runtime of the activation offload: ``"auto"`` (where the
            activations live), ``"cuda"``, ``"loopback"`` or ``"loopback-async"``. Env
            ``SWAPOPT_ACTIVATION_RUNTIME``; default ``"auto"``.
        device_budget_mb: The most device memory, in MiB, one training step may hold; the
            session plans the swap and the activation offload under it (it turns the swap
            on). Exclusive with ``activation_budget_mb``. Env ``SWAPOPT_DEVICE_BUDGET_MB``;
            default off.
        resident_state_fraction: Share of the swappable state kept on the device for good.
            Env ``SWAPOPT_RESIDENT_STATE_FRACTION``; default 0.0.
        prefetch_batches: Batches of state copied in during backward. Env
            ``SWAPOPT_PREFETCH_BATCHES``; default 2.

    Raises:
        ValueError: A field or environment variable has an invalid value; the message
            names it (``ClassName.field`` or the variable), shows the value and lists the
            accepted ones.
    """

    offload_optimizer_device: str | None = None
    swap_times: int | None = None
    min_numel: int | None = None
    packed_swap: bool | str | None = None
    runtime: str | None = None
    activation_budget_mb: float | str | None = None
    activation_runtime: str | None = None
    device_budget_mb: float | str | None = None
    resident_state_fraction: float | str | None = None
    prefetch_batches: int | str | None = None

    def __post_init__(self) -> None:
        for name, value in read_settings(self._fields(), owner=type(self).__name__).values.items():
            setattr(self, name, value)

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _settings(self) -> Settings:
        # The fields hold resolved values (or were set since): read them, not the environment.
        return read_settings(self._fields(), owner=type(self).__name__, environ={})

    @property
    def enabled(self) -> bool:
        """Whether optimizer state goes to host memory (``offload_optimizer_device == "cpu"``)."""
        return self.offload_optimizer_device == "cpu"

    def swap_config(self) -> SwapOptimizerConfig:
        """The ``SwapOptimizerConfig`` these settings describe."""
        return self._settings().swap

    def offload_config(self) -> OffloadConfig | None:
        """The ``OffloadConfig`` for the activation or device budget, or ``None`` when
        neither is set."""
        return self._settings().activations
