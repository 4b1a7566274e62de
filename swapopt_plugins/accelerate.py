"""HF Accelerate integration: swap prepared optimizers' state to host memory.

``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu accelerate launch --no_python swapopt run train.py``
makes every ``Accelerator`` swap, with no change to ``train.py`` (``install_globally`` puts
this module's ``prepare`` and ``free_memory`` on the class); with ``SWAPOPT_DEVICE_BUDGET_MB``
that ``prepare`` also runs each step of the script's loop in the whole-step session
(``SwapState.follow_steps``). ``SwapAccelerator`` has them as methods (its session is
``offload_session()``, which the script enters); the module functions take any
``Accelerator``. All keep one ``swapopt_core.swaps.SwapState`` as ``accelerator._swapopt``
(settings, swapped optimizers, session). The swap is installed in place on each
``AcceleratedOptimizer``'s inner optimizer, so schedulers, the gradient scaler and
accumulation keep working; loading needs no patch
(``load_state_dict`` hooks put loaded state in host memory). With trackers configured
(``Accelerator(log_with=...)``) the ``swapopt/...`` figures go to ``accelerator.log`` every
``REPORT_EVERY_N_STEPS`` (50) optimizer steps on the main process; ``log_figures`` logs them
now. See ``docs/accelerate.md`` and ``docs/figures.md``."""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from swapopt_core import OffloadSession, SwapStats
from swapopt_core.callbacks import engine_refusal
from swapopt_core.options import SwapSettings
from swapopt_core.swaps import REPORT_EVERY_N_STEPS, SwapState, release
from swapopt_plugins._integrations import ClassPatch

__all__ = [
    "REPORT_EVERY_N_STEPS",
    "SwapAccelerator",
    "SwapOptimizerPlugin",
    "figures",
    "free_memory",
    "install_globally",
    "installed_plugin",
    "load_state",
    "log_figures",
    "offload_session",
    "prepare",
    "release",
    "stats",
    "uninstall_globally",
]


class SwapOptimizerPlugin(SwapSettings):
    """Settings of the swap; each ``None`` field defaults from its ``SWAPOPT_*`` variable.

    The fields, variables and defaults are ``swapopt_core.options.SwapSettings``'. With
    ``activation_budget_mb`` or ``device_budget_mb`` set, ``offload_session()`` offers an
    ``OffloadSession``; the device budget turns the swap on and plans the whole step.

    Raises:
        ValueError: A field or environment variable is invalid (the message names it).
    """


#: Keeps Accelerate's own methods, which the swapping ones call, and patches the class.
_patch = ClassPatch(Accelerator, ("prepare", "free_memory", "load_state"), SwapOptimizerPlugin)
_INNER = operator.attrgetter("optimizer")  # the torch optimizer of an AcceleratedOptimizer


def _check_supported(accelerator: Accelerator, plugin: SwapSettings) -> None:
    """Refuse a distributed type that manages optimizer state itself (when the swap is on)."""
    kind = accelerator.distributed_type.value
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    engine = {"DEEPSPEED": "deepspeed", "MEGATRON_LM": "megatron"}.get(kind)
    if kind == "FSDP" and getattr(getattr(fsdp, "cpu_offload", None), "offload_params", False):
        engine, kind = "fsdp-offload", "FSDP cpu_offload=True"
    if plugin.enabled and engine is not None:
        raise ValueError(
            engine_refusal(
                f"distributed type {kind}",
                engine,
                who="swapopt",
                own_offload="the engine's own offload (deepspeed_config: "
                "offload_optimizer_device: cpu) with SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=none",
                instead="train with DDP or FSDP2 (fsdp_version: 2) without cpu_offload",
            )
        )


def _state(accelerator: Accelerator, plugin: SwapOptimizerPlugin | None = None) -> SwapState:
    """The accelerator's swap state, created on first use with ``plugin``, else the settings
    ``install_globally`` read (a copy), else the environment's; the first settings stay."""
    state = SwapState.of(accelerator, plugin, _patch.copy_settings, _INNER)
    if state.report is None:
        # NOTE: weak, so that the optimizer's step hook does not keep the accelerator alive.
        ref = weakref.ref(accelerator)
        state.report = lambda _: (acc := ref()) is not None and log_figures(acc)
    return state


def stats(accelerator: Accelerator) -> list[SwapStats]:
    """``swap_stats`` of each optimizer swapped through ``accelerator`` (the activation
    session's are ``offload_session(accelerator).stats()``)."""
    state = SwapState.find(accelerator)
    return [] if state is None else state.stats()


def figures(accelerator: Accelerator) -> dict[str, float]:
    """The ``swapopt/...`` figures of ``accelerator``'s swap and session now (``{}`` when
    swapopt never used it); ``docs/figures.md`` says what each means."""
    state = SwapState.find(accelerator)
    return {} if state is None else state.figures()


def log_figures(accelerator: Accelerator, step: int | None = None) -> dict[str, float]:
    """Log ``figures(accelerator)`` through ``accelerator.log`` now, on the main process when
    trackers are configured (what runs every ``REPORT_EVERY_N_STEPS`` optimizer steps).

    Args:
        step: The tracker's step. Default: the optimizer steps counted since ``prepare``.

    Returns:
        What was logged (``{}`` without trackers, off the main process, or with nothing
        swapped and no session).
    """
    state = SwapState.find(accelerator)
    if state is None or not accelerator.trackers or not accelerator.is_main_process:
        return {}
    logged = state.figures()
    if logged:
        accelerator.log(logged, step=state.steps if step is None else step)
    return logged


def prepare(
    accelerator: Accelerator,
    *objects: Any,
    plugin: SwapOptimizerPlugin | None = None,
    device_placement: list[bool] | None = None,
) -> Any:
    """``accelerator.prepare(*objects, ...)``, then swap every optimizer it prepared (once).

    ``plugin`` gives the accelerator its settings on first use (default: the environment's);
    later calls keep them. ``SwapAccelerator.prepare`` and ``install_globally``'s patch are it.

    Raises:
        ValueError: The swap is on, an optimizer is prepared and the distributed type
            manages optimizer state itself (DeepSpeed, Megatron-LM, FSDP with CPU offload).
    """
    state = _state(accelerator, plugin)
    if any(isinstance(obj, torch.optim.Optimizer) for obj in objects):
        _check_supported(accelerator, state.plugin)
    prepared = _patch.own["prepare"](accelerator, *objects, device_placement=device_placement)
    objs = prepared if isinstance(prepared, tuple) else (prepared,)
    state.install(obj for obj in objs if isinstance(obj, AcceleratedOptimizer))
    return prepared


def _prepare_and_follow(
    accelerator: Accelerator, *objects: Any, device_placement: list[bool] | None = None
) -> Any:
    """``prepare``, and with a device budget the whole-step session around each step of the
    loop over what it prepared (``install_globally``'s ``prepare``, for a script that never
    asks for the session)."""
    prepared = prepare(accelerator, *objects, device_placement=device_placement)
    objs = prepared if isinstance(prepared, tuple) else (prepared,)
    _state(accelerator).follow_steps(objs)
    return prepared


def free_memory(accelerator: Accelerator, *objects: Any) -> Any:
    """Unswap the optimizers swapped through ``accelerator`` (a reference still held keeps
    working, state back on the device), then Accelerate's ``free_memory(*objects)``."""
    if (state := SwapState.find(accelerator)) is not None:
        state.unswap()
    return _patch.own["free_memory"](accelerator, *objects)


def load_state(accelerator: Accelerator, *args: Any, **kwargs: Any) -> None:
    """Accelerate's ``load_state(input_dir, load_kwargs, **kwargs)``, then the loaded
    optimizer state back to host memory."""
    _patch.own["load_state"](accelerator, *args, **kwargs)
    if (state := SwapState.find(accelerator)) is not None:
        state.offload()


def offload_session(accelerator: Accelerator) -> OffloadSession:
    """The accelerator's ``OffloadSession`` (created once), to wrap forward and backward.

    With a device budget (``device_budget_mb`` / ``SWAPOPT_DEVICE_BUDGET_MB``) it plans the
    whole step of the one prepared optimizer, whose ``step()`` follows the ``with`` block.

    Raises:
        ValueError: No budget is set, or a device budget with not one prepared optimizer.
    """
    how = (
        "SwapOptimizerPlugin(device_budget_mb=...) or SWAPOPT_DEVICE_BUDGET_MB (whole step), "
        "or activation_budget_mb / SWAPOPT_ACTIVATION_BUDGET_MB (activations alone)"
    )
    return _state(accelerator).offload_session(how)


class SwapAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare`` swaps the optimizers' state to host memory.

    ``free_memory`` unswaps first, ``load_state`` takes the loaded state back to host memory,
    ``offload_session()`` gives the session: each is the module function of the same name.

    Args:
        *args: As for ``Accelerator``.
        swap_plugin: The settings. Default: ``SwapOptimizerPlugin()``, read from ``SWAPOPT_*``
            (off unless ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu`` or a device budget is set).
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
        _check_supported(self, _state(self, plugin).plugin)

    @property
    def swap_plugin(self) -> SwapOptimizerPlugin:
        """The swap settings of this accelerator."""
        return _state(self).plugin  # type: ignore[return-value]

    prepare = prepare  # type: ignore[assignment]
    free_memory = free_memory
    load_state = load_state
    offload_session = offload_session
    log_figures = log_figures


def install_globally() -> bool:
    """Make every ``Accelerator`` swap the optimizers it prepares, when the environment asks.

    With ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu`` or ``SWAPOPT_DEVICE_BUDGET_MB`` (read as
    ``SwapAccelerator()`` reads them) it puts ``prepare`` and ``free_memory`` on
    ``Accelerator`` itself, so existing and future instances swap alike (``swapopt run`` calls
    it); with the device budget each step of the loop over what ``prepare`` returned runs in
    the whole-step session, opened at the model's training forward and closed before the
    optimizer's ``step()``. Else it changes nothing. Idempotent.

    Returns:
        Whether the patch is in place (``False`` when the variables ask for no swap).

    Raises:
        ValueError: A ``SWAPOPT_*`` variable has an invalid value (the message names it).
    """
    methods = {"prepare": _patch.guard("prepare", _prepare_and_follow), "free_memory": free_memory}
    return _patch.install(methods)


#: ``uninstall_globally()`` puts ``Accelerator``'s own methods back (optimizers swapped
#: meanwhile stay swapped: ``free_memory(accelerator)`` unswaps them); ``installed_plugin()``
#: is the settings ``install_globally`` put in place, or None when it is not installed.
uninstall_globally, installed_plugin = _patch.uninstall, _patch.installed
