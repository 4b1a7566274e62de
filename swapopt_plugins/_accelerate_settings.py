"""``SwapOptimizerPlugin``: the settings of the Accelerate integration, without Accelerate.

``swapopt_plugins.accelerate`` re-exports it. Each field left at ``None`` is read from its
``SWAPOPT_*`` variable when the plugin is created, through ``swapopt_plugins._options`` and
the core's one parser, the way Accelerate's own plugin dataclasses read ``ACCELERATE_*``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from swapopt_core import OffloadConfig, SwapOptimizerConfig
from swapopt_plugins._options import Settings, read_settings

__all__ = ["SwapOptimizerPlugin"]


@dataclass
class SwapOptimizerPlugin:
    """Settings of the swap; each ``None`` field defaults from its ``SWAPOPT_*`` variable.

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
        activation_budget_mb: Device budget in MiB for activations; when set,
            ``offload_session()`` offers an ``OffloadSession``. ``"none"`` switches it off.
            Env ``SWAPOPT_ACTIVATION_BUDGET_MB``; default off.
        activation_runtime: Runtime of the activation offload: ``"auto"`` (where the
            activations live), ``"cuda"``, ``"loopback"`` or ``"loopback-async"``. Env
            ``SWAPOPT_ACTIVATION_RUNTIME``; default ``"auto"``.

    Raises:
        ValueError: A field or environment variable has an invalid value; the message
            names it, shows the value and lists the accepted ones.
    """

    offload_optimizer_device: str | None = None
    swap_times: int | None = None
    min_numel: int | None = None
    packed_swap: bool | str | None = None
    runtime: str | None = None
    activation_budget_mb: float | str | None = None
    activation_runtime: str | None = None

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
        """Whether prepared optimizers get swapped (``offload_optimizer_device == "cpu"``)."""
        return self.offload_optimizer_device == "cpu"

    def swap_config(self) -> SwapOptimizerConfig:
        """The ``SwapOptimizerConfig`` these settings describe."""
        return self._settings().swap

    def offload_config(self) -> OffloadConfig | None:
        """The ``OffloadConfig`` for the activation budget, or ``None`` when it is unset."""
        return self._settings().activations

    def refusal(self, distributed_type: str, *, fsdp_offloads_params: bool) -> str | None:
        """Why the swap cannot run under ``distributed_type`` (Accelerate's
        ``DistributedType`` value), or ``None`` when it can (or is off)."""
        if not self.enabled:
            return None
        if distributed_type in ("DEEPSPEED", "MEGATRON_LM"):
            return (
                f"swapopt cannot swap optimizer state under distributed type {distributed_type}: "
                "that engine owns its optimizer. With DeepSpeed use its own offload "
                "(deepspeed_config: offload_optimizer_device: cpu) and leave "
                "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=none; or train with DDP or FSDP2 "
                "(fsdp_version: 2) to use swapopt."
            )
        if distributed_type == "FSDP" and fsdp_offloads_params:
            return (
                "swapopt cannot swap optimizer state with FSDP cpu_offload=True: parameters and "
                "state already live on the CPU. Turn one of the two off."
            )
        return None
