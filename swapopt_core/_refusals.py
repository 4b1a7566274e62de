"""Why an integration refuses a framework setting whose engine manages optimizer state itself.

DeepSpeed, Megatron-LM and FSDP with CPU offload keep the optimizer state in their own
optimizer (or in host memory already), so swapopt has nothing to swap there. Every
integration refuses them with the message ``engine_refusal`` builds (public as
``swapopt_core.callbacks.engine_refusal``), in its framework's own exception type. Nothing
here imports a training framework.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["deepspeed_offloads", "engine_refusal"]

#: What each engine that manages the optimizer state itself does with it.
_ENGINES = {
    "deepspeed": "DeepSpeed keeps the optimizer state inside its own ZeRO optimizer",
    "megatron": "Megatron-LM keeps the optimizer state inside its own optimizer",
    "fsdp-offload": "FSDP's CPU offload already keeps parameters, gradients and optimizer "
    "state in host memory and steps there, so nothing is left on the device to swap",
}


def engine_refusal(
    setting: str,
    engine: str,
    *,
    own_offload: str,
    instead: str,
    offloads: Sequence[str] = (),
    who: str = "SwapOptimizerCallback",
) -> str:
    """Why ``who`` refuses a framework setting whose engine manages optimizer state itself.

    Args:
        setting: The framework's setting as the user wrote it, e.g. ``"DeepSpeedStrategy"``.
        engine: ``"deepspeed"``, ``"megatron"`` or ``"fsdp-offload"``.
        own_offload: How to get the engine's own offload instead of swapopt's.
        instead: What to change to keep swapopt, e.g. ``"train with strategy='ddp'"``.
        offloads: What the engine offloads already (``deepspeed_offloads``), named in the
            message.
        who: What refuses, default ``"SwapOptimizerCallback"``.

    Returns:
        The message, for the framework's own exception type.
    """
    detail = f" and already offloads it ({', '.join(offloads)})" if offloads else ""
    return (
        f"{who} cannot run with {setting}: {_ENGINES[engine]}{detail}. Use {own_offload} "
        f"without swapopt, or keep swapopt and {instead}."
    )


def deepspeed_offloads(config: Mapping[str, Any] | None) -> list[str]:
    """The parts a DeepSpeed config offloads already: ``offload_optimizer`` and/or
    ``offload_param`` of ``zero_optimization``, where their ``device`` is not ``"none"``."""
    zero = (config or {}).get("zero_optimization", {})
    return [
        key
        for key in ("offload_optimizer", "offload_param")
        if isinstance(zero.get(key), dict) and zero[key].get("device", "none") != "none"
    ]
