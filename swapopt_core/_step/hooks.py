"""The one owner of the hooks swapopt puts on an optimizer's ``step``.

swapopt takes part in ``opt.step()`` in several places: the per-parameter path hides the
groups from the family's own update, the swap engine runs the update after it, and a
whole-step budget meters the update and plans the next step. Each used to register its own
torch hooks and re-order torch's hook dictionaries to land in the right place. Now one
``StepHooks`` per optimizer holds one pre-hook and one post-hook, and runs the parts that
joined it in a fixed order (``PRE_ORDER``, ``POST_ORDER``), whatever order they joined in.

A part joins with ``StepHooks.of(opt).join(name, pre=..., post=...)`` and leaves with the
handle it got back. A part may be held weakly (``weak=True``): a session's budget must not be
kept alive by the optimizer it plans. When the last part leaves, the torch hooks go too.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["POST_ORDER", "PRE_ORDER", "StepHookHandle", "StepHooks"]

_ATTR = "_swapopt_step_hooks"

#: Pre-hook parts, first to last: an integration that runs the step's forward and backward
#: in a session closes its window (``window``); the budget wraps the closure (its update
#: phase, and the first update's plan, start once the closure returned); the per-parameter
#: path around it (it hides the groups after that, so the budget still sees them).
PRE_ORDER = ("window", "budget", "hiding")
#: Post-hook parts, first to last: the groups shown again, the swapped update, the budget's
#: meter closed over the whole update, then the integrations: the next window of a manual
#: loop (``window``) and the count of steps (``counter``).
POST_ORDER = ("hiding", "engine", "budget", "window", "counter")
_PARTS = frozenset(PRE_ORDER) | frozenset(POST_ORDER)
#: Parts an optimizer has at most one of; the integrations' may be several (in join order).
_SINGLE = frozenset({"hiding", "engine", "budget"})

PreHook = Callable[
    [torch.optim.Optimizer, tuple[Any, ...], dict[str, Any]],
    "tuple[tuple[Any, ...], dict[str, Any]] | None",
]
PostHook = Callable[[torch.optim.Optimizer, tuple[Any, ...], dict[str, Any]], None]


class _Part:
    """One part's hooks, held strongly or through weak method references."""

    def __init__(
        self,
        pre: PreHook | None,
        post: PostHook | None,
        abort: Callable[[], None] | None,
        weak: bool,
    ) -> None:
        self._pre = _hold(pre, weak)
        self._post = _hold(post, weak)
        self._abort = _hold(abort, weak)

    def pre(self) -> PreHook | None:
        hook: PreHook | None = self._pre()
        return hook

    def post(self) -> PostHook | None:
        hook: PostHook | None = self._post()
        return hook

    def holder(self) -> object | None:
        """The object whose bound methods these hooks are (None once it died)."""
        for hook in (self._pre(), self._post()):
            if hook is not None:
                return getattr(hook, "__self__", None)
        return None

    @property
    def dead(self) -> bool:
        """A weakly held part whose object was collected."""
        return self._pre() is None and self._post() is None and self._abort() is None

    def abort(self) -> Callable[[], None] | None:
        hook: Callable[[], None] | None = self._abort()
        return hook


def _hold(fn: Callable[..., Any] | None, weak: bool) -> Callable[[], Any]:
    if fn is None:
        return lambda: None
    if weak:
        if not hasattr(fn, "__self__"):
            raise TypeError("a weakly held step hook must be a bound method")
        return weakref.WeakMethod(fn)
    return lambda: fn


class StepHookHandle:
    """A part's membership of an optimizer's ``StepHooks``; ``remove()`` (or a call) ends it.
    Holds the owner, not the part's object (which may be held weakly)."""

    def __init__(self, owner: StepHooks, name: str, part: _Part) -> None:
        self._owner, self._name, self._part = owner, name, part

    def remove(self) -> None:
        self._owner._leave(self._name, self._part)

    __call__ = remove


class StepHooks:
    """swapopt's hooks on one optimizer's ``step``; get it with ``StepHooks.of(opt)``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._parts: dict[str, list[_Part]] = {}
        self._pre_handle = optimizer.register_step_pre_hook(self._before)
        self._post_handle = optimizer.register_step_post_hook(self._after)
        # The swapped update runs in our post-hook: post-hooks the user registered earlier
        # expect an updated model, so ours goes first. torch has no public way to put a hook
        # ahead of earlier ones; this is the one place swapopt re-orders torch's hooks.
        optimizer._optimizer_step_post_hooks.move_to_end(  # type: ignore[attr-defined]
            self._post_handle.id, last=False
        )

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> StepHooks:
        """``optimizer``'s owner of swapopt's step hooks (made on first use)."""
        owner: StepHooks | None = vars(optimizer).get(_ATTR)
        if owner is None:
            owner = cls(optimizer)
            setattr(optimizer, _ATTR, owner)
        return owner

    @staticmethod
    def find(optimizer: object) -> StepHooks | None:
        """The owner on ``optimizer``, or None when no swapopt part has joined it."""
        owner: StepHooks | None = vars(optimizer).get(_ATTR)
        return owner

    @property
    def parts(self) -> tuple[str, ...]:
        """The names of the parts now joined, in post-hook order."""
        return tuple(name for name in POST_ORDER if self._parts.get(name))

    def join(
        self,
        name: str,
        *,
        pre: PreHook | None = None,
        post: PostHook | None = None,
        abort: Callable[[], None] | None = None,
        weak: bool = False,
    ) -> StepHookHandle:
        """Add the part ``name``; returns the handle that removes it (``remove()``, or a
        call).

        Args:
            name: One of ``PRE_ORDER`` / ``POST_ORDER``.
            pre: Run as a step pre-hook, in ``PRE_ORDER``.
            post: Run as a step post-hook, in ``POST_ORDER``.
            abort: Run instead of ``post`` when a part before it raised in the post-hooks:
                the step ends with that exception.
            weak: Hold the hooks through weak references to their bound methods; a part
                whose object died is skipped.

        Raises:
            ValueError: ``name`` is not a known part, or the part has joined already.
        """
        if name not in _PARTS:
            raise ValueError(f"unknown step-hook part {name!r}; known: {sorted(_PARTS)}")
        members = [p for p in self._parts.get(name, []) if not p.dead]
        if members and name in _SINGLE:
            raise ValueError(f"the step-hook part {name!r} has joined this optimizer already")
        part = _Part(pre, post, abort, weak)
        self._parts[name] = [*members, part]

        return StepHookHandle(self, name, part)

    def _leave(self, name: str, part: _Part) -> None:
        members = self._parts.get(name, [])
        if any(p is part for p in members):
            kept = [p for p in members if p is not part]
            if kept:
                self._parts[name] = kept
            else:
                del self._parts[name]
            if not self._parts:
                self._close()

    def holder(self, name: str) -> object | None:
        """The live object behind the part ``name`` (a budget that still plans the step)."""
        for part in self._parts.get(name, []):
            holder = part.holder()
            if holder is not None:
                return holder
        return None

    def _close(self) -> None:
        self._pre_handle.remove()
        self._post_handle.remove()
        optimizer = self._optimizer()
        if optimizer is not None and vars(optimizer).get(_ATTR) is self:
            delattr(optimizer, _ATTR)

    def _before(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        changed = False
        for part in self._in_order(PRE_ORDER):
            hook = part.pre()
            if hook is None:
                continue
            result = hook(optimizer, args, kwargs)
            if result is not None:
                args, kwargs = result
                changed = True
        return (args, kwargs) if changed else None

    def _in_order(self, order: tuple[str, ...]) -> list[_Part]:
        return [part for name in order for part in list(self._parts.get(name, []))]

    def _after(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        failed: BaseException | None = None
        for part in self._in_order(POST_ORDER):
            if failed is not None:
                abort = part.abort()
                if abort is not None:
                    abort()
                continue
            hook = part.post()
            if hook is None:
                continue
            try:
                hook(optimizer, args, kwargs)
            except BaseException as error:  # the later parts learn the step ended
                failed = error
        if failed is not None:
            raise failed
