"""Hugging Face Transformers: ``Trainer(..., callbacks=[SwapOptimizerCallback()])``.

The callback swaps the Trainer's optimizer in place when training begins. The Trainer
restores a checkpoint's optimizer state (``train(resume_from_checkpoint=...)``) before it
calls ``on_train_begin``, so the swap installed there takes the restored state straight to
host memory; an optimizer someone else swapped already (``swapopt run``'s Accelerate patch,
or the user) is kept and its restored state re-offloaded. ``on_train_end`` records
``swap_stats`` and removes the swap made for this ``train()``: its own, or the one the
Accelerate patch made at ``prepare()`` (a swap the user installed stays). The Trainer has no
hook for an exception in ``train``: there the optimizer stays swapped (it keeps working; the
next ``train`` re-installs it, or call ``unswap_optimizer(trainer.optimizer.optimizer)``).
See ``docs/transformers.md``.

The decisions (what to swap and unswap, when a session opens and closes) are those of the
Lightning callback, ``swapopt_plugins._lightning_core.SwapCallbackCore``; this module maps
the Trainer's events onto them.
"""

from __future__ import annotations

import os
from typing import Any

import transformers.trainer as _hf_trainer
from accelerate.optimizer import AcceleratedOptimizer
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from swapopt_core import (
    OffloadConfig,
    OffloadSession,
    SwapOptimizerConfig,
    SwapStats,
    is_swap_optimizer,
    offload_optimizer_state,
    swap_stats,
)
from swapopt_plugins._lightning_core import SwapCallbackCore
from swapopt_plugins._options import read_settings
from swapopt_plugins.accelerate import release

__all__ = ["SwapOptimizerCallback", "install_globally"]


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside the Trainer's ``AcceleratedOptimizer`` wrapper(s)."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class SwapOptimizerCallback(TrainerCallback):
    """Keep the Trainer's optimizer state in host memory; optionally offload activations.

    Args:
        config: How optimizer state is swapped. Default: ``SwapOptimizerConfig()`` (on a
            machine without an accelerator, ``runtime="auto"`` swaps nothing; use
            ``runtime="loopback"`` to exercise the swap on CPU).
        activation_offload: When given, the forward and backward of every micro-batch of one
            optimizer step (all gradient-accumulation substeps) run inside one entry of an
            ``OffloadSession`` with this config. Default: None (no offload).

    Attributes:
        stats: ``swap_stats`` of each swapped optimizer, taken at the last log or at the end
            of training (before the swap is removed).

    Raises:
        TypeError: ``config`` or ``activation_offload`` has the wrong type.
    """

    def __init__(
        self,
        config: SwapOptimizerConfig | None = None,
        *,
        activation_offload: OffloadConfig | None = None,
    ) -> None:
        self._core = SwapCallbackCore(config, activation_offload)
        self._swapped: list[Any] = []
        self.stats: list[SwapStats] = []

    @property
    def config(self) -> SwapOptimizerConfig:
        """The optimizer-swap config."""
        return self._core.config

    @property
    def activation_offload(self) -> OffloadConfig | None:
        """The activation-offload config, or None."""
        return self._core.activation_offload

    @property
    def offload_session(self) -> OffloadSession | None:
        """The activation session (created at the first step), or None."""
        return next(iter(self._core.offload_sessions.values()), None)

    def _refuse(self, args: TrainingArguments) -> None:
        if args.deepspeed:
            raise ValueError(
                f"SwapOptimizerCallback cannot run with TrainingArguments(deepspeed="
                f"{args.deepspeed!r}): DeepSpeed keeps the optimizer state inside its own ZeRO "
                "optimizer. Use DeepSpeed's offload_optimizer without this callback, or keep "
                "the callback and drop deepspeed."
            )
        if any("offload" in str(option) for option in args.fsdp or ()):
            raise ValueError(
                f"SwapOptimizerCallback cannot run with TrainingArguments(fsdp={args.fsdp!r}): "
                "FSDP's offload already keeps optimizer state in host memory. Remove the "
                "callback or the 'offload' option."
            )

    def _collect(self) -> list[SwapStats]:
        self.stats = [swap_stats(opt) for opt in self._swapped if is_swap_optimizer(opt)]
        return self.stats

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Swap the optimizer (its checkpoint state, if any, is loaded by now)."""
        self._refuse(args)
        optimizer = kwargs.get("optimizer")
        if optimizer is None:
            self._core.rank_zero = state.is_world_process_zero
            self._core.nothing_to_swap("the Trainer passed no optimizer")
            return
        inner = _inner(optimizer)
        swapped_before = is_swap_optimizer(inner) and not any(
            inner is opt for opt in self._core._installed
        )
        self._core.install([inner], automatic=True, rank_zero=state.is_world_process_zero)
        if swapped_before:
            # NOTE: a swap installed at prepare() saw the checkpoint load put state back on
            # the device; the first step would take it back anyway, this frees it now.
            moved = offload_optimizer_state(inner)
            self._core._say("swapopt: moved %d restored state tensors to host memory", moved)
        self._swapped = [inner] if is_swap_optimizer(inner) else []

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The first substep of an optimizer step begins: open the session."""
        self._core.batch_start()

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A substep ended without a step: the session stays open (opened if a resume
        started mid-window), so the next substep runs inside the same entry."""
        self._core.batch_start()

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Backward (and clipping) done: the optimizer step runs outside the session."""
        self._core.before_optimizer_step()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Close a session a stop request left open."""
        self._core.close_window()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add the swap's host and peak device bytes to the Trainer's logs."""
        if logs is None or not self._swapped:
            return
        stats = self._collect()
        logs["swapopt_host_state_bytes"] = sum(s.host_state_bytes for s in stats)
        logs["swapopt_peak_resident_state_bytes"] = sum(s.peak_resident_state_bytes for s in stats)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Record ``swap_stats``, then remove the swap made for this ``train()``: the one this
        callback installed, or the one ``swapopt run``'s Accelerate patch made at
        ``prepare()`` (the next ``train()`` prepares, and so swaps, again)."""
        if self._swapped:
            for stats in self._collect():
                self._core._say("swapopt: %s", stats)
        swapped, self._swapped = self._swapped, []
        self._core.remove()
        for opt in swapped:
            release(opt)


class _EnvSwapOptimizerCallback(SwapOptimizerCallback):
    """The callback ``install_globally`` adds to every Trainer, set from ``SWAPOPT_*``."""

    def __init__(self) -> None:
        settings = read_settings({}, owner="SwapOptimizerCallback")
        super().__init__(settings.swap, activation_offload=settings.activations)
        self._enabled = settings.enabled

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """As ``SwapOptimizerCallback``, but with the swap off only sessions are kept."""
        if self._enabled:
            super().on_train_begin(args, state, control, **kwargs)


def install_globally() -> bool:
    """Add the callback to every ``transformers.Trainer`` created from now on, from the
    ``SWAPOPT_*`` variables (called by ``swapopt run``; idempotent).

    It swaps what the Accelerate patch did not swap, re-offloads state a resume restored,
    and opens an activation session per optimizer step when
    ``SWAPOPT_ACTIVATION_BUDGET_MB`` is set.

    Returns:
        Whether the callback is now added (False when the variables ask for nothing).
    """
    settings = read_settings({}, owner="swapopt run", environ=os.environ)
    if not settings.enabled and settings.activations is None:
        return False
    if _EnvSwapOptimizerCallback not in _hf_trainer.DEFAULT_CALLBACKS:
        _hf_trainer.DEFAULT_CALLBACKS.append(_EnvSwapOptimizerCallback)
    return True
