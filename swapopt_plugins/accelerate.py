"""HF Accelerate integration: swap prepared optimizers' state to host memory.

Switch it on at launch, the way DeepSpeed's ``offload_optimizer_device`` is read::

    SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu accelerate launch train.py

with ``SwapAccelerator`` in ``train.py``, or call :func:`prepare` on a plain ``Accelerator``.
The swap is installed in place on the inner optimizer of each ``AcceleratedOptimizer`` after
Accelerate's own ``prepare``, so schedulers, the gradient scaler and accumulation keep working.
See ``docs/accelerate.md``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from swapopt_core import (
    OffloadConfig,
    OffloadSession,
    SwapOptimizerConfig,
    is_swap_optimizer,
    offload_optimizer_state,
    swap_optimizer,
    unswap_optimizer,
)
from swapopt_plugins._env import offload_config_kwargs, resolve_settings, swap_config_kwargs

logger = logging.getLogger(__name__)

__all__ = ["SwapAccelerator", "SwapOptimizerPlugin", "free_memory", "offload_session", "prepare"]

_MARK = "_swapopt_prepared"  # set on an AcceleratedOptimizer once its inner optimizer is swapped


@dataclass
class SwapOptimizerPlugin:
    """Settings of the optimizer swap; each ``None`` field defaults from its env variable.

    Args:
        offload_optimizer_device: ``"cpu"`` keeps optimizer state in host memory, ``"none"``
            leaves the optimizer alone. Env ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE``; default
            ``"none"``.
        swap_times: Pipeline batches per step. Env ``SWAPOPT_SWAP_TIMES``; default 16.
        min_numel: Smaller state tensors stay on the device. Env ``SWAPOPT_MIN_NUMEL``;
            default 1024.
        packed_swap: ``True``/``False``, or ``"auto"`` for the runtime default. Env
            ``SWAPOPT_PACKED_SWAP``; default ``"auto"``.
        runtime: ``"auto"``, ``"cuda"``, ``"loopback"`` or a plugin's runtime. Env
            ``SWAPOPT_RUNTIME``; default ``"auto"``.
        activation_budget_mb: Device budget in MiB for activations; when set,
            ``offload_session()`` offers an ``OffloadSession``. ``"none"`` switches it off.
            Env ``SWAPOPT_ACTIVATION_BUDGET_MB``; default off.

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

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in resolve_settings(values, owner=type(self).__name__).items():
            setattr(self, name, value)

    @property
    def enabled(self) -> bool:
        """Whether prepared optimizers get swapped (``offload_optimizer_device == "cpu"``)."""
        return self.offload_optimizer_device == "cpu"

    def swap_config(self) -> SwapOptimizerConfig:
        """The ``SwapOptimizerConfig`` these settings describe."""
        return SwapOptimizerConfig(**swap_config_kwargs(vars(self)))

    def offload_config(self) -> OffloadConfig | None:
        """The ``OffloadConfig`` for the activation budget, or ``None`` when it is unset."""
        kwargs = offload_config_kwargs(vars(self))
        return None if kwargs is None else OffloadConfig(**kwargs)


def _check_supported(accelerator: Accelerator, plugin: SwapOptimizerPlugin) -> None:
    if not plugin.enabled:
        return
    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"swapopt cannot swap optimizer state under distributed type {kind.value}: that "
            "engine owns its optimizer. With DeepSpeed use its own offload "
            "(deepspeed_config: offload_optimizer_device: cpu) and leave "
            "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=none; or train with DDP or FSDP2 "
            "(fsdp_version: 2) to use swapopt."
        )
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    if kind == DistributedType.FSDP and getattr(
        getattr(fsdp, "cpu_offload", None), "offload_params", False
    ):
        raise ValueError(
            "swapopt cannot swap optimizer state with FSDP cpu_offload=True: parameters and "
            "state already live on the CPU. Turn one of the two off."
        )


def _install(accelerator: Accelerator, prepared: Any, plugin: SwapOptimizerPlugin) -> None:
    objects = prepared if isinstance(prepared, tuple) else (prepared,)
    config = plugin.swap_config()
    swapped = accelerator.__dict__.setdefault("_swapopt_optimizers", [])
    for obj in objects:
        if not isinstance(obj, AcceleratedOptimizer) or getattr(obj, _MARK, False):
            continue
        if is_swap_optimizer(obj.optimizer):
            logger.info("%s is already swapped; keeping its config", type(obj.optimizer).__name__)
        else:
            swap_optimizer(obj.optimizer, config)
        setattr(obj, _MARK, True)
        swapped.append(obj)


def prepare(
    accelerator: Accelerator,
    *objects: Any,
    plugin: SwapOptimizerPlugin | None = None,
    **kwargs: Any,
) -> Any:
    """``accelerator.prepare(*objects)``, then swap every optimizer it prepared.

    For code that keeps a plain ``Accelerator``. After ``accelerator.load_state(...)`` call
    ``offload_optimizer_state(opt.optimizer)`` for each prepared ``opt``; instead of
    ``accelerator.free_memory()`` call :func:`free_memory`.

    Args:
        accelerator: The ``Accelerator`` to prepare with.
        *objects: Models, optimizers, data loaders and schedulers, as for ``prepare``.
        plugin: The settings. Default: ``SwapOptimizerPlugin()`` (from the environment).
        **kwargs: Passed on to ``accelerator.prepare`` (e.g. ``device_placement``).

    Returns:
        What ``accelerator.prepare`` returns.

    Raises:
        ValueError: The swap is on and the distributed type manages optimizer state itself
            (DeepSpeed, Megatron-LM, FSDP with CPU offload).
    """
    plugin = SwapOptimizerPlugin() if plugin is None else plugin
    accelerator.__dict__.setdefault("_swapopt_plugin", plugin)
    _check_supported(accelerator, plugin)
    prepared = accelerator.prepare(*objects, **kwargs)
    if plugin.enabled:
        _install(accelerator, prepared, plugin)
    return prepared


def offload_session(accelerator: Accelerator) -> OffloadSession:
    """The accelerator's ``OffloadSession`` (created once), to wrap forward and backward.

    Raises:
        ValueError: No activation budget is set (``activation_budget_mb`` /
            ``SWAPOPT_ACTIVATION_BUDGET_MB``).
    """
    session = accelerator.__dict__.get("_swapopt_session")
    if session is None:
        plugin = accelerator.__dict__.get("_swapopt_plugin") or SwapOptimizerPlugin()
        config = plugin.offload_config()
        if config is None:
            raise ValueError(
                "No activation budget is set, so there is no offload session. Set "
                "SwapOptimizerPlugin(activation_budget_mb=...) or SWAPOPT_ACTIVATION_BUDGET_MB."
            )
        session = accelerator.__dict__["_swapopt_session"] = OffloadSession(config)
    return session


def _unswap_all(accelerator: Accelerator) -> None:
    for obj in accelerator.__dict__.pop("_swapopt_optimizers", []):
        unswap_optimizer(obj.optimizer)
        setattr(obj, _MARK, False)
    accelerator.__dict__.pop("_swapopt_session", None)


def free_memory(accelerator: Accelerator, *objects: Any) -> Any:
    """Remove the swap from the optimizers swapped through ``accelerator``, then free it.

    The optimizers become plain again (state back on the device), so a reference still
    held keeps working; then Accelerate drops its references.

    Returns:
        What ``accelerator.free_memory(*objects)`` returns.
    """
    _unswap_all(accelerator)
    return accelerator.free_memory(*objects)


class SwapAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare`` swaps the optimizers' state to host memory.

    Args:
        *args: As for ``Accelerator``.
        swap_plugin: The settings. Default: ``SwapOptimizerPlugin()``, read from the
            ``SWAPOPT_*`` environment variables (off unless
            ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu``).
        **kwargs: As for ``Accelerator``.

    Raises:
        ValueError: The swap is on and the distributed type manages optimizer state itself.
    """

    def __init__(
        self, *args: Any, swap_plugin: SwapOptimizerPlugin | None = None, **kwargs: Any
    ) -> None:
        plugin = SwapOptimizerPlugin() if swap_plugin is None else swap_plugin
        if not isinstance(plugin, SwapOptimizerPlugin):
            raise TypeError(f"swap_plugin must be a SwapOptimizerPlugin, got {plugin!r}.")
        super().__init__(*args, **kwargs)
        self.swap_plugin = self._swapopt_plugin = plugin
        _check_supported(self, plugin)

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """``Accelerator.prepare``, then swap each prepared optimizer (once)."""
        _check_supported(self, self.swap_plugin)
        prepared = super().prepare(*args, device_placement=device_placement)
        if self.swap_plugin.enabled:
            _install(self, prepared, self.swap_plugin)
        return prepared

    def offload_session(self) -> OffloadSession:
        """The ``OffloadSession`` for the activation budget; see :func:`offload_session`."""
        return offload_session(self)

    def load_state(
        self,
        input_dir: str | None = None,
        load_kwargs: dict | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """``Accelerator.load_state``, then the loaded optimizer state back to host memory."""
        super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        moved = sum(
            offload_optimizer_state(opt.optimizer)
            for opt in self.__dict__.get("_swapopt_optimizers", [])
        )
        logger.debug("swapopt: %d optimizer state tensors offloaded after load_state", moved)

    def free_memory(self, *objects: Any) -> Any:
        """Unswap the optimizers swapped by this accelerator, then ``Accelerator.free_memory``."""
        _unswap_all(self)
        return super().free_memory(*objects)
