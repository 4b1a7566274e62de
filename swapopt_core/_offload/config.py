"""Frozen, validated configuration of the activation offload."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OffloadConfig"]

_RUNTIMES = ("auto", "cuda", "loopback")


def _number(name: str, value: object, *, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"OffloadConfig.{name} must be a number of MiB, got {value!r}.")
    if not value >= minimum:
        raise ValueError(f"OffloadConfig.{name} must be >= {minimum} MiB, got {value!r}.")


@dataclass(frozen=True)
class OffloadConfig:
    """How an ``OffloadSession`` keeps activations under a device budget.

    Args:
        max_resident_activation_mb: Device budget, in MiB, for activation storages created
            inside the session (saved activations, temporaries, gradients). The warmup step
            evicts to stay under it; the planner schedules copies so replays stay under it.
            Default: 1024.
        max_offload_activation_mb: Cap, in MiB, on the host memory holding offloaded
            activations. When it is reached, a storage that would be offloaded stays on the
            device instead (counted in ``OffloadStats.host_cap_refusals``): no data is ever
            dropped. Default: 65536.
        planner: Name of a registered residency planner. ``"auto"`` is the built-in
            time-aware planner (``"timed"``). Default: "auto".
        runtime: ``"auto"`` (CUDA when the activations are on CUDA, else loopback),
            ``"cuda"``, or ``"loopback"`` (CPU tensors play the device). Default: "auto".
        min_offload_kib: Storages smaller than this are left on the device unless the
            budget cannot be met otherwise (a copy's fixed cost outweighs what they free);
            the warmup never evicts them. Default: 1024 (1 MiB).

    Raises:
        TypeError: A field has the wrong type.
        ValueError: A field is out of range.
    """

    max_resident_activation_mb: float = 1024
    max_offload_activation_mb: float = 65536
    planner: str = "auto"
    runtime: str = "auto"
    min_offload_kib: float = 1024

    def __post_init__(self) -> None:
        _number("max_resident_activation_mb", self.max_resident_activation_mb, minimum=0)
        _number("max_offload_activation_mb", self.max_offload_activation_mb, minimum=0)
        _number("min_offload_kib", self.min_offload_kib, minimum=0)
        if not isinstance(self.planner, str) or not self.planner:
            raise ValueError(
                f"OffloadConfig.planner must be a planner name, got {self.planner!r}. "
                "Use 'auto' for the built-in time-aware planner."
            )
        if self.runtime not in _RUNTIMES:
            raise ValueError(
                f"OffloadConfig.runtime must be one of {list(_RUNTIMES)}, got {self.runtime!r}."
            )

    @property
    def budget_bytes(self) -> int:
        return int(self.max_resident_activation_mb * 2**20)

    @property
    def host_cap_bytes(self) -> int:
        return int(self.max_offload_activation_mb * 2**20)

    @property
    def min_offload_bytes(self) -> int:
        return int(self.min_offload_kib * 2**10)
