"""The framework-free core of swapopt's training-loop callbacks.

``SwapCallbackCore`` holds a callback's state and decisions over the events every training
loop has: when the optimizer swap is installed, its restored state re-offloaded and the swap
removed, and when an activation-offload session opens and closes around the forward and
backward of one optimizer step. An integration derives its callback from this class and
its framework's callback class (``swapopt_plugins.lightning``, ``swapopt_plugins.
transformers``), or holds one for a loop of your own; it only translates its framework's
events into these calls and says where the config comes from (``from_environment`` reads
the ``SWAPOPT_*`` variables). With a device budget (``device_budget_mb``) the session is
``OffloadSession(config, optimizer=opt)``: it plans the whole step, the optimizer's update
after the window included; a fit with no optimizer keeps its activations under what the budget
leaves beside the parameters and their gradients (``_budget.activations_alone``). Nothing
here computes or imports a training framework.

Example:
    >>> core = SwapCallbackCore(SwapOptimizerConfig(swap_times=8))
    >>> core.install([optimizer])          # fit start
    >>> for batch in loader:
    ...     core.batch_start()             # opens the activation session, if configured
    ...     loss(model(batch)).backward()
    ...     core.before_optimizer_step()   # the step itself runs outside the session
    ...     optimizer.step()
    ...     core.batch_end(window_done=True)
    >>> core.remove()                      # fit end: unswap what install swapped
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from swapopt_core import (
    OffloadConfig,
    OffloadSession,
    OffloadStats,
    SwapOptimizerConfig,
    SwapStats,
    is_swap_optimizer,
    offload_optimizer_state,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._automatic import refused, swap_automatically
from swapopt_core._budget import (
    activations_alone,
    budget_not_applied,
    budget_session,
    check_one_optimizer,
    with_device_budget,
)
from swapopt_core._figures import offload_figures, summary_line, swap_figures
from swapopt_core._launch import note_nothing_to_swap, warn_without_run
from swapopt_core._refusals import deepspeed_offloads, engine_refusal
from swapopt_core._step.hooks import StepHooks
from swapopt_core.options import auto_enabled, read_settings

logger = logging.getLogger(__name__)

__all__ = ["SwapCallbackCore", "deepspeed_offloads", "engine_refusal"]

_STATE_VERSION = 1
_C = TypeVar("_C", bound="SwapCallbackCore")
_BATCH_START = -1  # session key of windows opened at a batch start (else: the index stepped)


def _check_type(owner: str, name: str, value: object, expected: type) -> None:
    if value is not None and not isinstance(value, expected):
        raise TypeError(
            f"{owner}({name}=...) must be a {expected.__name__} or None, got "
            f"{value!r}. Pass e.g. {name}={expected.__name__}(...), or None for the default."
        )


class SwapCallbackCore:
    """State and decisions of a swapopt training callback, with no framework in them.

    Args:
        config: How optimizer state is swapped. Default: ``SwapOptimizerConfig()``.
        activation_offload: When given, each optimizer step's forward and backward run
            inside one ``OffloadSession`` with this config. Default: None (no offload).
        device_budget_mb: The most device memory, in MiB, one training step may hold. Each
            step's forward and backward run inside ``OffloadSession(config,
            optimizer=opt)``, which plans the swap of ``opt`` (how much state stays
            resident, ``swap_times``, the prefetch) and the activations under it; the fit
            needs one optimizer (with none, and ``parameters`` given to ``install``, the
            budget minus them and their gradients is the activation budget). Exclusive
            with an activation budget in
            ``activation_offload`` (whose runtime and planner it keeps). Default: None.
        auto: Created from the environment rather than by the user (see ``stand_by``).
        owner: How messages name the callback, e.g. ``"SwapOptimizerCallback"``.

    Attributes:
        config: The optimizer-swap config.
        activation_offload: The activation-offload config, or None.
        swap_enabled: Whether ``install`` swaps (``from_environment`` sets it from
            ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE``); else only sessions are kept.
        offload_sessions: The sessions of the current fit, keyed by the kind of window.
        optimizer_steps: Optimizer steps seen (restored by ``load_state_dict``).
        reoffloaded_tensors: State tensors ``reoffload`` took back to host memory.
        swap_stats: ``SwapStats`` of each swapped optimizer of the current (or last) fit,
            taken by ``figures()`` and, at the end of the fit, before the swap is removed.
        offload_stats: ``OffloadStats`` of each of ``offload_sessions``.

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
        auto: bool = False,
        owner: str = "SwapOptimizerCallback",
    ) -> None:
        _check_type(owner, "config", config, SwapOptimizerConfig)
        _check_type(owner, "activation_offload", activation_offload, OffloadConfig)
        self.config = SwapOptimizerConfig() if config is None else config
        self.activation_offload = with_device_budget(owner, activation_offload, device_budget_mb)
        self.auto = auto
        self.owner = owner
        self.swap_enabled = True
        self.active = True
        self.rank_zero = True
        self.optimizer_steps = 0
        self.reoffloaded_tensors = 0
        self.offload_sessions: dict[int, OffloadSession] = {}
        self.swap_stats: list[SwapStats] = []
        self._reset_run()

    @classmethod
    def from_environment(cls: type[_C], owner: str, *, auto: bool = True) -> _C:
        """A core configured from the ``SWAPOPT_*`` variables (``options.read_settings``).

        ``swap_enabled`` says whether ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu`` (or a device
        budget is set); the activation config is set when ``SWAPOPT_ACTIVATION_BUDGET_MB`` or
        ``SWAPOPT_DEVICE_BUDGET_MB`` is.

        Raises:
            ValueError: A variable holds a value that is not accepted; the message names it.
        """
        settings = read_settings({}, owner=owner)
        core = cls(settings.swap, activation_offload=settings.activations, auto=auto, owner=owner)
        core.swap_enabled = settings.enabled
        return core

    @classmethod
    def auto_callbacks(cls: type[_C]) -> list[_C]:
        """What a framework's callbacks-factory entry point returns: ``[cls.from_environment()]``
        with the swap on when ``SWAPOPT_LIGHTNING_AUTO`` is a yes word, else ``[]`` (and,
        when ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu`` asks for a swap this framework will
        not make, the once-per-process warning to start the script through ``swapopt run``).

        Raises:
            ValueError: A ``SWAPOPT_*`` variable is invalid; the message names it.
        """
        if not auto_enabled(os.environ):
            warn_without_run()
            return []
        callback = cls.from_environment(cls.__name__)
        callback.swap_enabled = True  # SWAPOPT_LIGHTNING_AUTO asks for the swap itself
        return [callback]

    def _reset_run(self) -> None:
        self._optimizers: list[torch.optim.Optimizer] = []
        self._installed: list[torch.optim.Optimizer] = []
        self._handles: list[Any] = []
        self._open: OffloadSession | None = None
        self._window_key = _BATCH_START
        self._in_batch = False
        self._automatic = True
        self._unplanned = False  # a device budget whose optimizer swapopt cannot serve
        self._alone: OffloadConfig | None = None  # a device budget's, with no optimizer

    def __getstate__(self) -> dict[str, Any]:
        # NOTE: ddp_spawn pickles callbacks into the workers; hooks and sessions stay here.
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        state["offload_sessions"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_run()

    def identity(self) -> dict[str, Any]:
        """What tells this callback's saved state from another's (a framework's state key):
        the configs, and ``auto`` for one created from the environment."""
        extra = {"auto": True} if self.auto else {}
        return {"config": self.config, "activation_offload": self.activation_offload, **extra}

    def say(self, message: str, *args: object) -> None:
        """Log ``message`` at INFO, on rank zero only."""
        if self.rank_zero:
            logger.info(message, *args)

    # ---- fit start -------------------------------------------------------------------------

    def install(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        *,
        automatic: bool = True,
        rank_zero: bool = True,
        offload_kept: bool = False,
        parameters: Iterable[torch.Tensor] | None = None,
    ) -> None:
        """Swap every optimizer of this fit (those swapped by someone else already are kept).

        Args:
            optimizers: The loop's torch optimizers (unwrapped).
            automatic: Whether the loop steps the optimizers itself; in manual
                optimization each ``step()`` also opens the next activation window.
            rank_zero: Whether this process logs.
            offload_kept: Take the state of a kept optimizer back to host memory now (a
                checkpoint restore after its swap moved it to the device).
            parameters: The model's parameters. With a device budget and no optimizer, the
                budget minus them and their gradients becomes the activation budget of the
                fit's sessions (logged); without them such a fit is refused.

        Raises:
            ValueError: A device budget and not one optimizer (none, and no
                ``parameters``), or a budget that cannot hold the parameters and gradients.
        """
        self.remove()
        self._automatic, self.rank_zero = automatic, rank_zero
        self._optimizers = list(optimizers)
        self.offload_sessions, self.swap_stats = {}, []
        offload = self.activation_offload
        if self.active and offload is not None and offload.device_budget_mb is not None:
            if not self._optimizers and parameters is not None:
                self._alone, said = activations_alone(offload, parameters, self.owner)
                self.say("%s", said)
            else:
                check_one_optimizer(self.owner, self.device_budget_mb, len(self._optimizers))
        for opt in self._optimizers:
            if is_swap_optimizer(opt):
                self.say("swapopt: %s is already swapped; keeping it", type(opt).__name__)
                if offload_kept:
                    # NOTE: the first step would take it back anyway; this frees it now.
                    moved = offload_optimizer_state(opt)
                    self.say("swapopt: moved %d restored state tensors to host memory", moved)
            elif self.swap_enabled and swap_automatically(opt, self.config):
                self._installed.append(opt)
            if self.activation_offload is not None:
                self._handles.append(StepHooks.of(opt).join("window", post=self._after_step))
        # NOTE: the budget plans the step of a swapped optimizer: without one it runs as plain.
        self._unplanned = self.device_budget_mb is not None and any(map(refused, self._optimizers))
        if self._unplanned and self.active and self.rank_zero:
            assert self.device_budget_mb is not None
            names = ", ".join(type(opt).__name__ for opt in self._optimizers if refused(opt))
            why = f"{names} is an optimizer swapopt cannot serve (left unswapped)"
            budget_not_applied(self.device_budget_mb, why)
        swapped = len(self.swapped)
        self.say(
            "swapopt: optimizer swap on %d of %d optimizers (%d swapped here, %d swapped "
            "before and kept) (%s)%s",
            swapped,
            len(self._optimizers),
            len(self._installed),
            swapped - len(self._installed),
            self.config,
            f"; activation offload {self.activation_offload}" if self.activation_offload else "",
        )

    def nothing_to_swap(self, why: str) -> None:
        """Say (once per call, on rank zero) that this run has no optimizer to swap.

        Training goes on: activation offload, if configured, still runs. ``swapopt run``
        counts the message and does not repeat it at exit.
        """
        note_nothing_to_swap()
        if self.rank_zero:
            logger.warning("swapopt: %s, so there is nothing to swap; training goes on", why)

    def stand_by(self, explicit: Sequence[object]) -> bool:
        """Whether this callback stays idle for this fit: it was created from the environment
        (``auto``) and ``explicit`` holds callbacks the user set (one swap is enough)."""
        self.active = not (self.auto and explicit)
        if not self.active:
            name = type(explicit[0]).__name__
            self.say("swapopt: %s set explicitly; the auto-registered one stays idle", name)
        return not self.active

    @property
    def device_budget_mb(self) -> float | None:
        """The whole step's device budget in MiB, or None."""
        offload = self.activation_offload
        return None if offload is None else offload.device_budget_mb

    @property
    def swapped(self) -> list[torch.optim.Optimizer]:
        """The optimizers of this fit that are swapped now (installed here or kept)."""
        return [opt for opt in self._optimizers if is_swap_optimizer(opt)]

    def reoffload(self) -> int:
        """Take state a checkpoint restore moved to the device back into host memory."""
        moved = sum(offload_optimizer_state(opt) for opt in self._installed)
        self.reoffloaded_tensors += moved
        if moved:
            self.say("swapopt: moved %d restored state tensors to host memory", moved)
        return moved

    # ---- activation-offload windows --------------------------------------------------------

    def _enter(self) -> None:
        if self.activation_offload is None or self._open is not None or not self.active:
            return
        if self._unplanned:
            return
        # NOTE: one session per kind of window, so each replays the same ops: the window
        # opened at a batch start, and in manual optimization the one after each optimizer.
        session = self.offload_sessions.get(self._window_key)
        if session is None:
            config = self._alone or self.activation_offload
            session = budget_session(config, self._optimizers[:1], self._none)
            self.offload_sessions[self._window_key] = session
        session.__enter__()
        self._open = session

    def _none(self, budget: float, count: int) -> str:
        return (
            f"{self.owner}(device_budget_mb={budget:g}) found no "
            "optimizer to plan the step with (the swap is off, or none was passed)."
        )

    def close_window(self, exc: BaseException | None = None) -> None:
        """Leave the open session, if any (with ``exc`` it plans nothing)."""
        session, self._open = self._open, None
        if session is not None:
            if exc is None:
                session.__exit__(None, None, None)
            else:
                session.__exit__(type(exc), exc, exc.__traceback__)

    def batch_start(self) -> None:
        """A training batch begins: open a window unless one is open (accumulation)."""
        self._in_batch = True
        self._window_key = _BATCH_START
        self._enter()

    def before_optimizer_step(self) -> None:
        """Backward of the window is done: the step itself runs outside the session."""
        self.optimizer_steps += 1
        self.close_window()

    def _after_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Manual optimization steps inside training_step: the code after this step (the
        # next optimizer's forward and backward) is the next window.
        # With a device budget the one optimizer's step ends its window: none opens after it.
        if not self._automatic and self._in_batch and self.device_budget_mb is None:
            index = next((i for i, o in enumerate(self._optimizers) if o is opt), None)
            self._window_key = _BATCH_START if index is None else index
            self._enter()

    def batch_end(self, *, window_done: bool) -> None:
        """A training batch ended; an unfinished accumulation window stays open."""
        self._in_batch = False
        if not self._automatic or window_done:
            self.close_window()

    # ---- figures ---------------------------------------------------------------------------

    @property
    def offload_stats(self) -> list[OffloadStats]:
        """``OffloadStats`` of each activation session of the current (or last) fit."""
        return [session.stats() for session in self.offload_sessions.values()]

    def figures(self) -> dict[str, float]:
        """Take ``swap_stats`` now and return the ``swapopt/...`` figures a logger gets
        (``swap_figures`` and ``offload_figures``; ``docs/figures.md``)."""
        if swapped := self.swapped:
            self.swap_stats = [swap_stats(opt) for opt in swapped]
        return {**swap_figures(self.swap_stats), **offload_figures(self.offload_stats)}

    def summary(self) -> str | None:
        """The one line for the end of a fit (``swap_stats`` and ``offload_stats``), or None
        when this fit swapped nothing and opened no session."""
        return summary_line(self.swap_stats, self.offload_stats)

    # ---- removal and state -----------------------------------------------------------------

    def remove(self, exc: BaseException | None = None) -> None:
        """Close any session, take ``swap_stats``, remove the hooks and unswap what this
        callback installed."""
        try:
            self.close_window(exc)
        finally:
            if self.swapped:
                self.figures()  # the last stats stay readable after the swap is gone
            errors: list[BaseException] = []
            for handle in self._handles:
                handle.remove()
            for opt in filter(is_swap_optimizer, self._installed):  # unless unswapped since
                try:
                    unswap_optimizer(opt)
                except Exception as error:  # one failure must not leave the others swapped
                    errors.append(error)
            self._reset_run()
            if errors and exc is None:
                raise errors[0]
            for failed in errors:
                logger.warning("swapopt: unswap failed while handling an error: %r", failed)

    def state_dict(self) -> dict[str, Any]:
        """Plain data only (checkpoints load with ``weights_only=True``)."""
        offload = self.activation_offload
        return {
            "version": _STATE_VERSION,
            "config": dataclasses.asdict(self.config),
            "activation_offload": None if offload is None else dataclasses.asdict(offload),
            "optimizer_steps": self.optimizer_steps,
            "reoffloaded_tensors": self.reoffloaded_tensors,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the counters; the configuration given at construction stays in force."""
        self.optimizer_steps = int(state_dict.get("optimizer_steps", 0))
        self.reoffloaded_tensors = int(state_dict.get("reoffloaded_tensors", 0))
        saved = state_dict.get("config")
        if saved is not None and saved != dataclasses.asdict(self.config):
            self.say("swapopt: checkpoint was written with %s; now using %s", saved, self.config)
