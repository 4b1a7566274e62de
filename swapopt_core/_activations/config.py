"""Frozen, validated configuration of the activation offload."""

from __future__ import annotations

import math
from dataclasses import dataclass

from swapopt_core._config import OptionsConfig
from swapopt_core._options import (
    MAX_BYTES,
    Option,
    parse_bool,
    parse_choice,
    parse_mib,
    parse_name,
)
from swapopt_core._planning.interface import AUTO, DEFAULT_MIN_OFFLOAD_BYTES

__all__ = ["OffloadConfig"]


#: The activation budget, in MiB, of a session given neither budget.
DEFAULT_ACTIVATION_BUDGET_MB = 1024

_UNITS = {"MiB": 2**20, "KiB": 2**10}


def _size(name: str, value: object, unit: str) -> None:
    """Refuse a size that is not a number, negative, NaN, infinite, or too big in bytes."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"OffloadConfig.{name} must be a number of {unit}, got {value!r}.")
    if not value >= 0:
        raise ValueError(f"OffloadConfig.{name} must be >= 0 {unit}, got {value!r}.")
    # Byte counts are int64 downstream; an infinite or absurd size would overflow there.
    # The same rule as the options parser's (``parse_mib``), so both accept the same values.
    if not math.isfinite(value) or value * _UNITS[unit] > MAX_BYTES:
        raise ValueError(
            f"OffloadConfig.{name} must be a finite number of {unit} below "
            f"{(MAX_BYTES + 1) // _UNITS[unit]}, got "
            f"{value!r}. Give the real size; a budget larger than the device is never binding."
        )


@dataclass(frozen=True)
class OffloadConfig(OptionsConfig):
    """How an ``OffloadSession`` keeps activations under a device budget.

    Args:
        device_budget_mb: The most device memory, in MiB, one training step may hold:
            parameters, gradients, optimizer state with its staging, activations and
            temporaries. With ``OffloadSession(config, optimizer=opt)`` the session plans the
            whole step under it (how much optimizer state stays resident, ``swap_times``, the
            prefetch during backward and the activation plan). Exclusive with
            ``max_resident_activation_mb``. ``None``: no whole-step target. Default: None.
        max_resident_activation_mb: Device budget, in MiB, for activation storages created
            inside the session (saved activations, temporaries, gradients). The warmup step
            evicts to stay under it; the planner schedules copies so replays stay under it.
            Exclusive with ``device_budget_mb``. ``None``: 1024 without a device budget.
            Default: None.
        max_offload_activation_mb: Cap, in MiB, on the host memory holding offloaded
            activations. When it is reached, a storage that would be offloaded stays on the
            device instead (counted in ``OffloadStats.host_cap_refusals``): no data is ever
            dropped. Default: 65536.
        planner: Name of a registered residency planner. ``"auto"`` is
            ``swapopt_core._planning.interface.DEFAULT_PLANNER``, the built-in time-aware
            planner ``"timed"``. Default: "auto".
        runtime: Name of a registered activation runtime (plugins add them through
            ``swapopt_register_runtimes``; the session checks the name when it is
            created). ``"auto"`` follows the activations: at an entry's first op, the runtime
            declaring the type of the device that op's tensors (or its ``device`` argument,
            as in ``x.to("cuda")``) are on, so the CUDA runtime for CUDA tensors, and
            loopback otherwise. The built-ins: ``"cuda"`` (the current CUDA device),
            ``"loopback"`` (CPU tensors play the device) and ``"loopback-async"``, loopback
            with the copies on worker threads, as on CUDA streams (paced by
            ``SWAPOPT_LOOPBACK_GBPS`` and ``SWAPOPT_LOOPBACK_JITTER_US``). Default: "auto".
        min_offload_kib: Storages smaller than this are left on the device unless the
            budget cannot be met otherwise (a copy's fixed cost outweighs what they free);
            the warmup never evicts them, and the trace carries it to the planner
            (``ActivationTrace.min_offload_bytes``). Default: 1024 (1 MiB).
        meter_every_step: With ``device_budget_mb``: meter every whole step on the
            loopback runtimes too (their meter counts storages, which costs about half a CPU
            step; by default they meter the first step and the two after each plan). An
            accelerator's meter reads the allocator and watches every step anyway. Default:
            False.

    Raises:
        TypeError: A field has the wrong type.
        ValueError: A field is out of range.
    """

    device_budget_mb: float | None = None
    max_resident_activation_mb: float | None = None
    max_offload_activation_mb: float = 65536
    planner: str = AUTO
    runtime: str = "auto"
    min_offload_kib: float = DEFAULT_MIN_OFFLOAD_BYTES // 2**10
    meter_every_step: bool = False

    def __post_init__(self) -> None:
        if self.device_budget_mb is not None and self.max_resident_activation_mb is not None:
            raise ValueError(
                f"OffloadConfig got both device_budget_mb={self.device_budget_mb!r} and "
                f"max_resident_activation_mb={self.max_resident_activation_mb!r}. Give one: "
                "device_budget_mb is the whole step's target and plans the activation budget "
                "itself; max_resident_activation_mb budgets activations alone."
            )
        if self.device_budget_mb is not None:
            _size("device_budget_mb", self.device_budget_mb, "MiB")
        if self.max_resident_activation_mb is not None:
            _size("max_resident_activation_mb", self.max_resident_activation_mb, "MiB")
        _size("max_offload_activation_mb", self.max_offload_activation_mb, "MiB")
        _size("min_offload_kib", self.min_offload_kib, "KiB")
        if not isinstance(self.meter_every_step, bool):
            raise TypeError(
                f"OffloadConfig.meter_every_step must be True or False, got "
                f"{self.meter_every_step!r}."
            )
        if not isinstance(self.planner, str) or not self.planner:
            raise ValueError(
                f"OffloadConfig.planner must be a planner name, got {self.planner!r}. "
                "Use 'auto' for the built-in time-aware planner."
            )
        if not isinstance(self.runtime, str) or not self.runtime.strip():
            raise ValueError(
                f"OffloadConfig.runtime must be an activation runtime name, got "
                f"{self.runtime!r}. Use 'auto' to follow the device the activations are on."
            )

    @property
    def budget_bytes(self) -> int:
        """The activation budget the warmup starts with, in bytes (with a device budget,
        the session lowers it to what the rest of the step leaves)."""
        if self.max_resident_activation_mb is not None:
            return int(self.max_resident_activation_mb * 2**20)
        if self.device_budget_mb is not None:
            return int(self.device_budget_mb * 2**20)
        return DEFAULT_ACTIVATION_BUDGET_MB * 2**20

    @property
    def device_budget_bytes(self) -> int | None:
        """The whole step's device budget in bytes, or ``None``."""
        return None if self.device_budget_mb is None else int(self.device_budget_mb * 2**20)

    @property
    def host_cap_bytes(self) -> int:
        return int(self.max_offload_activation_mb * 2**20)

    @property
    def min_offload_bytes(self) -> int:
        return int(self.min_offload_kib * 2**10)

    @classmethod
    def option_readers(cls, framework: str | None) -> dict[str, Option]:
        """How ``from_options`` reads each field: sizes as numbers or their text. The
        runtime name is checked against the activation runtimes registered with
        ``get_plugin_manager()`` (whatever ``framework``: activation offload is torch's);
        the planner name when the session is created (plugins may add planners)."""
        return _OPTIONS


def _runtime_names() -> list[str]:
    # Imported here: the plugin manager imports the activation runtimes, which import torch.
    from swapopt_core._plugins import runtime_names

    return runtime_names("torch")


_MIB = Option(parse_mib(allow_none=False), f"a number of MiB >= 0 and below {2**43}")
_MIB_OR_NONE = Option(
    parse_mib(allow_none=True), f"null, or a number of MiB >= 0 and below {2**43}"
)
_OPTIONS = {
    "device_budget_mb": _MIB_OR_NONE,
    "max_resident_activation_mb": _MIB_OR_NONE,
    "max_offload_activation_mb": _MIB,
    "planner": Option(parse_name, "a registered planner name, or 'auto'"),
    "runtime": Option(
        parse_choice(_runtime_names),
        "one of {choices} (the registered activation runtimes; a plugin adds one through "
        "swapopt_register_runtimes)",
        _runtime_names,
    ),
    "meter_every_step": Option(parse_bool, "true or false"),
    "min_offload_kib": Option(
        parse_mib(allow_none=False, unit=2**10), f"a number of KiB >= 0 and below {2**53}"
    ),
}
