"""Which optimizers were swapped by whom, so that the swap can be taken back.

An integration that swaps optimizers on a framework object it does not own (an
``Accelerator``'s ``prepare``) keeps a ``SwapState`` on that object: the settings it read
once, the prepared optimizers and the activation session. ``release`` takes back one swap
such a state made (``note_swapped_by``), wherever the optimizer is used next, e.g. when a
``transformers.Trainer`` callback takes over an optimizer an accelerator swapped. The state
also counts the optimizer steps and hands the ``swapopt/...`` figures to the framework's
logger every ``REPORT_EVERY_N_STEPS`` of them (``SwapState.report``). With a device budget,
``follow_steps`` applies it to a loop that never asks for the session (a plain script under
``swapopt run``): the session opens at the model's training forward and closes right before
the optimizer's ``step()``. Nothing here imports a training framework.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from swapopt_core import (
    OffloadSession,
    SwapStats,
    is_swap_optimizer,
    offload_optimizer_state,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._activations.session import _ACTIVE
from swapopt_core._automatic import refused, swap_automatically
from swapopt_core._budget import budget_not_applied, budget_session, budget_setting
from swapopt_core._figures import offload_figures, swap_figures
from swapopt_core._step.hooks import StepHooks
from swapopt_core.options import SwapSettings

logger = logging.getLogger(__name__)

__all__ = ["REPORT_EVERY_N_STEPS", "SwapState", "note_swapped_by", "release"]

#: Optimizer steps between two reports of the figures (Lightning's ``log_every_n_steps``
#: default): often enough for a curve, rare enough to cost nothing.
REPORT_EVERY_N_STEPS = 50


class _Owner(Protocol):
    def forget(self, optimizer: object) -> None: ...


# Optimizer -> what swapped it through ``note_swapped_by`` (e.g. an accelerator's prepare).
# NOTE: weak both ways, so this registry never keeps an optimizer or its owner alive.
_swapped_by: weakref.WeakKeyDictionary[Any, weakref.ref[_Owner]] = weakref.WeakKeyDictionary()


def note_swapped_by(optimizer: object, owner: _Owner) -> None:
    """Record that ``owner`` swapped ``optimizer``, so that ``release`` can take it back."""
    _swapped_by[optimizer] = weakref.ref(owner)


def release(optimizer: object) -> bool:
    """Take back a swap recorded by ``note_swapped_by``: unswap ``optimizer`` (state back on
    the device, a plain optimizer again) and tell its owner to ``forget`` it. A swap made
    some other way (``swap_optimizer``, a callback) is left alone.

    Returns:
        Whether a recorded swap was removed.
    """
    ref = _swapped_by.pop(optimizer, None)
    owner = None if ref is None else ref()
    if owner is None or not is_swap_optimizer(optimizer):
        return False
    owner.forget(optimizer)
    unswap_optimizer(optimizer)
    return True


def _not_one_prepared(budget: float, count: int) -> str:
    return (
        f"A device budget (device_budget_mb={budget:g}) plans one "
        f"optimizer's step, but {count} optimizers were prepared. "
        "prepare() exactly one optimizer before asking for the session."
    )


class SwapState:
    """What swapopt keeps on one framework object: settings, swapped optimizers, session.

    Kept as the object's one attribute ``_swapopt`` (``of``); the first settings stay.

    Args:
        plugin: The settings, read once (``SwapSettings`` or a framework's subclass).
        unwrap: The torch optimizer inside one of the framework's prepared optimizers.

    Attributes:
        plugin: The settings.
        optimizers: The framework's prepared optimizers this state swapped or kept.
        session: The activation ``OffloadSession``, once ``offload_session`` made it.
        steps: Steps of the first prepared optimizer since it was prepared.
        report: Called with this state every ``report_every`` steps (the framework's
            logger); None: no reports.
        report_every: Steps between two reports. Default: ``REPORT_EVERY_N_STEPS``.
    """

    ATTR = "_swapopt"

    def __init__(
        self, plugin: SwapSettings, unwrap: Callable[[Any], torch.optim.Optimizer]
    ) -> None:
        self.plugin = plugin
        self.unwrap = unwrap
        self.optimizers: list[Any] = []
        self.session: OffloadSession | None = None
        self.steps = 0
        self.report: Callable[[SwapState], object] | None = None
        self.report_every = REPORT_EVERY_N_STEPS
        self._counted: tuple[object, Any] | None = None  # (optimizer, its step post-hook)
        self._window: OffloadSession | None = None  # the session follow_steps entered
        self._followed: list[tuple[object, Any]] = []  # (module or optimizer, its hook)
        self._not_applied = False  # follow_steps found the budget cannot apply

    @classmethod
    def of(
        cls,
        holder: object,
        plugin: SwapSettings | None,
        default: Callable[[], SwapSettings],
        unwrap: Callable[[Any], torch.optim.Optimizer],
    ) -> SwapState:
        """``holder``'s state, created on first use with ``plugin``, else ``default()``."""
        state = cls.find(holder)
        if state is None:
            state = cls(default() if plugin is None else plugin, unwrap)
            setattr(holder, cls.ATTR, state)
        elif plugin is not None and plugin != state.plugin:
            name = type(holder).__name__
            logger.warning("swapopt: the %s keeps its first settings %s", name, state.plugin)
        return state

    @classmethod
    def find(cls, holder: object) -> SwapState | None:
        """``holder``'s state, or None when swapopt never used it."""
        state: SwapState | None = vars(holder).get(cls.ATTR)
        return state

    def install(self, prepared: Iterable[Any]) -> None:
        """Swap the torch optimizer inside each of ``prepared`` (once each), when enabled;
        count the steps of the first one (for ``report``), enabled or not."""
        prepared = list(prepared)
        if self._counted is None and prepared:
            inner = self.unwrap(prepared[0])
            self._counted = (inner, StepHooks.of(inner).join("counter", post=self._stepped))
        if not self.plugin.enabled:
            return
        config = self.plugin.swap_config()
        for obj in prepared:
            if any(obj is o for o in self.optimizers):
                continue
            inner = self.unwrap(obj)
            if is_swap_optimizer(inner):
                logger.info("swapopt: %s was swapped already; kept", type(inner).__name__)
            elif swap_automatically(inner, config):  # one swapopt cannot serve stays as it is
                note_swapped_by(inner, self)  # so that release() can take it back
            self.optimizers.append(obj)

    def forget(self, optimizer: object) -> None:
        """Drop ``optimizer`` (unswapped by ``release``): the next ``install`` swaps it again."""
        self.optimizers = [opt for opt in self.optimizers if self.unwrap(opt) is not optimizer]
        if self._counted is not None and self._counted[0] is optimizer:
            self._uncount()
        self._unfollow(optimizer)

    # ---- the device budget of a loop that never asks for the session ---------------------

    def follow_steps(self, prepared: Iterable[Any]) -> None:
        """Apply the device budget to an unmodified loop over ``prepared`` objects.

        The session of the one optimizer kept here (``offload_session``) is entered at each
        training forward of a prepared module (training mode, gradients on) unless a
        session is active already (the script's own, a callback's) or one is open, and left
        right before the optimizer's ``step()`` runs: the step's forward and backward (a whole
        accumulation window's) run inside it and the update after it is planned with them.
        Where the budget cannot apply (no optimizer prepared before the first training
        forward, or one swapopt cannot serve) it says so once (``budget_not_applied``) and
        the loop trains without it. Does nothing without a device budget.
        """
        config = self.plugin.offload_config()
        if config is None or config.device_budget_mb is None:
            return
        hooked = [target for target, _ in self._followed]
        for obj in prepared:
            if any(obj is target for target in hooked):
                continue
            if isinstance(obj, torch.nn.Module):
                handle = obj.register_forward_pre_hook(self._training_forward)
                self._followed.append((obj, handle))
        for obj in self.optimizers:
            inner = self.unwrap(obj)
            if not any(inner is target for target in hooked):
                # The window closes before the budget's part of the step runs (StepHooks).
                joined = StepHooks.of(inner).join("window", pre=self._before_update)
                self._followed.append((inner, joined))

    def _training_forward(self, module: torch.nn.Module, args: object) -> None:
        if self._window is not None or self._not_applied:
            return
        if not (module.training and torch.is_grad_enabled()) or _ACTIVE.get() is not None:
            return
        session = self._followed_session()
        if session is not None:
            session.__enter__()
            self._window = session

    def _followed_session(self) -> OffloadSession | None:
        """The session ``follow_steps`` enters; None (said once) where the budget cannot apply.

        Raises:
            ValueError: Several optimizers were prepared (a device budget plans one), or the
                budget cannot hold the step (the message names its setting).
        """
        if self.session is not None:
            return self.session
        config = self.plugin.offload_config()
        assert config is not None and config.device_budget_mb is not None
        budget = config.device_budget_mb
        inner = [self.unwrap(opt) for opt in self.optimizers]
        why = None
        if not inner:
            why = (
                "no optimizer was prepared before the model's first training forward, and the "
                "budget plans the step of the one optimizer accelerator.prepare() returns; "
                "prepare the optimizer the script steps"
            )
        elif len(inner) > 1:
            raise ValueError(
                f"{budget_setting(budget)} plans one optimizer's step, but {len(inner)} "
                "optimizers were prepared. Train with one optimizer, or budget activations "
                "alone (SWAPOPT_ACTIVATION_BUDGET_MB with SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu) "
                "instead of the device budget."
            )
        elif refused(inner[0]):
            why = f"{type(inner[0]).__name__} is an optimizer swapopt cannot serve (left unswapped)"
        if why is not None:
            self._not_applied = True
            budget_not_applied(budget, why)
            return None
        return self.offload_session("a device budget")

    def _before_update(self, optimizer: object, args: object, kwargs: object) -> None:
        self.close_window()

    def close_window(self) -> None:
        """Leave the session ``follow_steps`` entered, if it is open."""
        window, self._window = self._window, None
        if window is not None:
            window.__exit__(None, None, None)

    def _unfollow(self, target: object | None = None) -> None:
        """Remove ``follow_steps``' hooks (on ``target`` only, when given)."""
        kept = []
        for obj, handle in self._followed:
            if target is None or obj is target:
                handle.remove()
            else:
                kept.append((obj, handle))
        self._followed = kept

    def _uncount(self) -> None:
        if self._counted is not None:
            self._counted[1].remove()
            self._counted = None

    def _stepped(self, optimizer: object, args: object, kwargs: object) -> None:
        self.steps += 1
        if self.report is not None and self.steps % self.report_every == 0:
            self.report(self)

    def stats(self) -> list[SwapStats]:
        """``swap_stats`` of each optimizer kept here that is swapped now."""
        inner = [self.unwrap(opt) for opt in self.optimizers]
        return [swap_stats(opt) for opt in inner if is_swap_optimizer(opt)]

    def figures(self) -> dict[str, float]:
        """The ``swapopt/...`` figures of the swapped optimizers and the session, now."""
        offload = [] if self.session is None else [self.session.stats()]
        return {**swap_figures(self.stats()), **offload_figures(offload)}

    def unswap(self) -> None:
        """Unswap every optimizer kept here (also those swapped before) and drop the session."""
        self.close_window()
        self._unfollow()
        self._not_applied = False
        optimizers, self.optimizers, self.session = self.optimizers, [], None
        self._uncount()
        for opt in optimizers:
            inner = self.unwrap(opt)
            if not release(inner) and is_swap_optimizer(inner):  # kept ones, swapped before
                unswap_optimizer(inner)

    def offload(self) -> int:
        """Take the state of every optimizer kept here to host memory (e.g. after a checkpoint
        load put it on the device); returns the number of state tensors moved."""
        moved = sum(offload_optimizer_state(self.unwrap(opt)) for opt in self.optimizers)
        logger.debug("swapopt: %d optimizer state tensors offloaded to host memory", moved)
        return moved

    def offload_session(self, how_to_set: str) -> OffloadSession:
        """The activation session (created once). With a device budget it is
        ``OffloadSession(config, optimizer=opt)`` for the one optimizer kept here, and plans
        the whole step: forward and backward inside it, ``opt.step()`` after it.

        Raises:
            ValueError: No activation or device budget is set (``how_to_set`` says how to
                set one), or a device budget is set and not exactly one optimizer was
                prepared.
        """
        if self.session is None:
            config = self.plugin.offload_config()
            if config is None:
                message = "No activation or device budget is set, so there is no offload session."
                raise ValueError(f"{message} Set {how_to_set}.")
            inner = [self.unwrap(opt) for opt in self.optimizers]
            self.session = budget_session(config, inner, _not_one_prepared)
        return self.session
