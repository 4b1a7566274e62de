"""Hugging Face Transformers: ``Trainer(..., callbacks=[SwapOptimizerCallback()])``.

The callback swaps the Trainer's optimizer in place when training begins. The Trainer
restores a checkpoint's optimizer state (``train(resume_from_checkpoint=...)``) before it
calls ``on_train_begin``, so the swap installed there takes the restored state straight to
host memory; an optimizer someone else swapped already (``swapopt run``'s Accelerate patch,
or the user) is kept and its restored state re-offloaded. ``on_log`` adds the ``swapopt/...``
figures (``docs/figures.md``) to the Trainer's logs. ``on_train_end`` records ``swap_stats``,
logs the summary line and removes the swap made for this ``train()``: its own, or the one the
Accelerate patch made at ``prepare()`` (a swap the user installed stays). The Trainer has no
hook for an exception in ``train``: there the optimizer stays swapped (it keeps working; the
next ``train`` re-installs it, or call ``unswap_optimizer(trainer.optimizer.optimizer)``).
The callback is a ``swapopt_core.callbacks.SwapCallbackCore``, which makes every decision;
this module maps the Trainer's events onto it. See ``docs/transformers.md``.
"""

from __future__ import annotations

from typing import Any

import transformers.trainer as _hf_trainer
from accelerate.optimizer import AcceleratedOptimizer
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from swapopt_core import OffloadConfig, OffloadSession, SwapOptimizerConfig, SwapStats
from swapopt_core.callbacks import SwapCallbackCore, engine_refusal
from swapopt_core.options import read_settings
from swapopt_core.swaps import release

__all__ = ["SwapOptimizerCallback", "install_globally"]


def _refuse(args: TrainingArguments) -> None:
    """Raise for the Trainer settings whose engine manages the optimizer state itself."""
    if args.deepspeed:
        raise ValueError(
            engine_refusal(
                f"TrainingArguments(deepspeed={args.deepspeed!r})",
                "deepspeed",
                own_offload="DeepSpeed's offload_optimizer",
                instead="drop deepspeed",
            )
        )
    if any("offload" in str(option) for option in args.fsdp or ()):
        raise ValueError(
            engine_refusal(
                f"TrainingArguments(fsdp={args.fsdp!r})",
                "fsdp-offload",
                own_offload="FSDP's 'offload' option",
                instead="remove the 'offload' option",
            )
        )


class SwapOptimizerCallback(SwapCallbackCore, TrainerCallback):
    """Keep the Trainer's optimizer state in host memory; optionally offload activations.

    Args:
        config: How optimizer state is swapped. Default: ``SwapOptimizerConfig()`` (on a
            machine without an accelerator, ``runtime="auto"`` swaps nothing; use
            ``runtime="loopback"`` to exercise the swap on CPU).
        activation_offload: When given, the forward and backward of every micro-batch of one
            optimizer step (all gradient-accumulation substeps) run inside one entry of an
            ``OffloadSession`` with this config. Default: None (no offload).
        device_budget_mb: The most device memory, in MiB, one optimizer step may hold: the
            session is then ``OffloadSession(config, optimizer=the Trainer's optimizer)`` and
            plans the swap and the activations under it. Exclusive with an activation budget
            in ``activation_offload``, whose runtime it keeps. Default: None.

    Attributes:
        stats: ``swap_stats`` of each swapped optimizer, taken at the last log or at the end
            of training (before the swap is removed); the same list as ``swap_stats``.
        offload_stats: ``OffloadStats`` of the activation session, if any.
        training: Whether ``train()`` is running (``on_log`` adds figures only then).

    Raises:
        TypeError: ``config`` or ``activation_offload`` has the wrong type.
        ValueError: ``device_budget_mb`` is not a size, or comes with an activation budget.
    """

    def __init__(
        self,
        config: SwapOptimizerConfig | None = None,
        *,
        activation_offload: OffloadConfig | None = None,
        device_budget_mb: float | None = None,
    ) -> None:
        super().__init__(
            config, activation_offload=activation_offload, device_budget_mb=device_budget_mb
        )
        self.training = False

    @property
    def stats(self) -> list[SwapStats]:
        """``swap_stats`` (the name this callback has had since its first release)."""
        return self.swap_stats

    @property
    def offload_session(self) -> OffloadSession | None:
        """The activation session (created at the first step), or None."""
        return next(iter(self.offload_sessions.values()), None)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Swap the optimizer (its checkpoint state is loaded by now); one swapped already
        is kept, its restored state taken back to host memory."""
        self.training = True
        self.swap_stats = []
        if not self.swap_enabled:  # set from the environment with the swap off: sessions only
            return
        _refuse(args)
        self.rank_zero = state.is_world_process_zero
        optimizer = kwargs.get("optimizer")
        if optimizer is None:
            self.nothing_to_swap("the Trainer passed no optimizer")
            return
        while isinstance(optimizer, AcceleratedOptimizer):  # the torch optimizer inside
            optimizer = optimizer.optimizer
        self.install([optimizer], rank_zero=self.rank_zero, offload_kept=True)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The first substep of an optimizer step begins: open the session."""
        self.batch_start()

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A substep ended without a step: the session stays open (opened if a resume
        started mid-window), so the next substep runs inside the same entry."""
        self.batch_start()

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Backward (and clipping) done: the optimizer step runs outside the session."""
        self.before_optimizer_step()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Close a session a stop request left open."""
        self.close_window()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add the ``swapopt/...`` figures of the swap and the activation session to the
        Trainer's logs (during ``train()``)."""
        if logs is not None and self.training:
            logs.update(self.figures())

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Record ``swap_stats``, then remove the swap made for this ``train()``: this
        callback's, or the Accelerate patch's (the next ``train()`` prepares, and swaps, again)."""
        swapped, self.training = self.swapped, False
        self.remove()  # takes swap_stats first
        for opt in swapped:
            release(opt)
        if line := self.summary():
            self.say("%s", line)


class _EnvSwapOptimizerCallback(SwapOptimizerCallback):
    """The callback ``install_globally`` adds to every Trainer, set from ``SWAPOPT_*``; with
    the swap off (``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE`` not ``cpu``) only sessions are kept."""

    def __init__(self) -> None:
        settings = read_settings({}, owner="SwapOptimizerCallback")
        super().__init__(settings.swap, activation_offload=settings.activations)
        self.swap_enabled = settings.enabled


def install_globally() -> bool:
    """Add the callback to every ``transformers.Trainer`` created from now on, from the
    ``SWAPOPT_*`` variables (called by ``swapopt run``; idempotent).

    It swaps what the Accelerate patch did not swap, re-offloads state a resume restored,
    and opens an activation session per optimizer step when
    ``SWAPOPT_ACTIVATION_BUDGET_MB`` or ``SWAPOPT_DEVICE_BUDGET_MB`` is set.

    Returns:
        Whether the callback is now added (False when the variables ask for nothing).
    """
    if not read_settings({}, owner="swapopt run").requested:
        return False
    if _EnvSwapOptimizerCallback not in _hf_trainer.DEFAULT_CALLBACKS:
        _hf_trainer.DEFAULT_CALLBACKS.append(_EnvSwapOptimizerCallback)
    return True
