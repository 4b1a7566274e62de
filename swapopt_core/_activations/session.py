"""``OffloadSession``: keep activations under a device budget across forward and backward."""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import pluggy
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from swapopt_core import _launch
from swapopt_core._activations.config import OffloadConfig
from swapopt_core._activations.entry import Entry
from swapopt_core._activations.executor import Executor
from swapopt_core._activations.session_stats import OffloadStats, session_stats
from swapopt_core._device.registry import RuntimeChoice, resolve_runtime
from swapopt_core._planning.interface import ResidencyPlanner, resolve_planner
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule
from swapopt_core._step.budget import StepBudget

logger = logging.getLogger(__name__)

__all__ = ["OffloadSession", "skip_offload"]

_ACTIVE: contextvars.ContextVar[OffloadSession | None] = contextvars.ContextVar(
    "swapopt_offload_session", default=None
)
_F = TypeVar("_F", bound=Callable[..., Any])


class OffloadSession:
    """A reusable context manager around one training step's forward and backward.

    The first entry is the **warmup**: every op runs under a tracer that records the step
    and keeps activations under ``max_resident_activation_mb`` by evicting the oldest ones
    to host memory and paging them back when needed. On exit the planner turns the trace
    into a schedule. Later entries **replay** the schedule: copies out start right after
    each activation's last write and copies back start just early enough, on a stream per
    direction. The session keeps a plan per distinct op sequence (gradient accumulation
    alternates two), goes on with another kept plan when a step leaves the one it replays,
    and otherwise falls back to a warmup that records the rest of the step; a plan holds the
    largest size of each storage seen and is made again when a step's storages are larger
    (dynamic padding). The session's ``Executor`` decides (``_activations/executor.py``).
    ``trace`` and ``schedule`` are the plan, and ``load_plan`` replays one saved as JSON.
    Results are the same bits as without the session.

    With ``OffloadConfig(device_budget_mb=N)`` and ``optimizer=opt`` the session plans the
    whole step under ``N`` (``swapopt_core._step.budget``): it swaps ``opt``
    itself (or re-configures its swap), the ``opt.step()`` after the ``with`` block is part
    of the plan, and ``stats()`` reports the measured and planned peaks. Where the plan keeps
    every activation on the device, later entries run without the tracer (no cost per op; a
    step whose activations grow past the plan is then not watched).

    Args:
        config: Budget, host cap, planner and runtime. Default: ``OffloadConfig()``.
        optimizer: The torch optimizer stepped after each ``with`` block; required with
            ``device_budget_mb``, refused without it.
        plugin_manager: Where to look up planners and activation runtimes. Default:
            ``get_plugin_manager()``.

    Raises:
        TypeError: ``config`` is not an ``OffloadConfig``.
        ValueError: ``config.planner`` or ``config.runtime`` names nothing registered with
            the plugin manager (the message lists what is), ``runtime="auto"`` cannot
            choose (two runtimes declare one device type), ``device_budget_mb`` is given
            without ``optimizer`` (or the reverse), or the budget cannot hold the parameters,
            their gradients and the state of the largest parameter (``BudgetTooSmall``).

    Example:
        >>> session = OffloadSession(OffloadConfig(max_resident_activation_mb=512))
        >>> for batch in loader:
        ...     with session:
        ...         loss = model(batch).loss
        ...         loss.backward()
        ...     optimizer.step()
    """

    def __init__(
        self,
        config: OffloadConfig | None = None,
        *,
        optimizer: Any = None,
        plugin_manager: pluggy.PluginManager | None = None,
    ) -> None:
        self.config = OffloadConfig() if config is None else config
        if not isinstance(self.config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}.")
        _check_pairing(self.config, optimizer)
        manager = _manager(plugin_manager)
        self._executor = Executor(
            self.config,
            _planner(self.config, manager),
            runtimes=_runtimes(self.config, manager),
        )
        self._budget = (
            None if optimizer is None else StepBudget(self.config, optimizer, self._executor)
        )
        self._token: contextvars.Token | None = None
        self._lock = threading.Lock()
        self._owner: threading.Thread | None = None  # the thread inside the session
        # What `swapopt run` checks and sums up at exit; the figures come from the parts.
        snapshot = functools.partial(session_stats, self._executor, self._budget)
        _launch.note_offload_session(self, snapshot)

    @property
    def trace(self) -> ActivationTrace | None:
        """The step the most recently used plan was made for (a warmup's trace, or a
        loaded one); the session may keep plans for other op sequences too."""
        return self._executor.trace

    @property
    def schedule(self) -> ResidencySchedule | None:
        """The schedule of the most recently used plan; ``None`` until a warmup (or after
        the last kept plan was dropped)."""
        return self._executor.schedule

    def load_plan(self, trace: ActivationTrace, schedule: ResidencySchedule) -> None:
        """Replay ``schedule`` for ``trace`` from the next entry on, without a warmup.

        Use it to reuse a plan from an earlier run, or one ``swapopt plan`` made from a saved
        trace: ``ActivationTrace.from_json`` and ``ResidencySchedule.from_json`` read them
        back. The replay follows the schedule (not this session's activation budget) and
        falls back as any replay does when the step's ops differ from the trace. Under a
        device budget, a plan made for another activation budget than the one the budget
        leaves is planned again for it (with a warning). The loaded plan joins the
        plans the session keeps, and the next entry starts with it.

        Raises:
            TypeError: ``trace`` or ``schedule`` has the wrong type.
            ValueError: The trace was not recorded by an ``OffloadSession`` (it lacks the
                output positions replay needs), the schedule was not planned for it, or the
                trace marks recompute an op whose schema forbids it (random numbers, views,
                in-place writes; the message names the op).
        """
        budget = self._budget
        limit = self._executor.budget_bytes
        if (
            budget is not None
            and isinstance(trace, ActivationTrace)
            and trace.memory_limit_bytes != limit
            and not budget.keeps_activations
        ):
            # A plan made for another budget would replay at that budget, not this one's.
            logger.warning(
                "swapopt: the loaded plan was made for an activation budget of %s; this "
                "session's device budget leaves activations %s: it is planned again for that",
                trace.memory_limit_bytes,
                limit,
            )
            trace = trace.with_limit(limit)
            self._executor.load(trace, self._executor.planner.plan(trace))
            return
        self._executor.load(trace, schedule)

    # ---- the context manager -------------------------------------------------------------

    def __enter__(self) -> OffloadSession:
        if _ACTIVE.get() is not None:
            raise RuntimeError(
                "An OffloadSession is already active in this context; sessions do not nest. "
                "Wrap each step's forward and backward in one session."
            )
        with self._lock:
            owner = self._owner
            if owner is not None:
                raise RuntimeError(
                    f"This OffloadSession is already active in thread {owner.name!r}; a "
                    f"session serves one thread at a time (entered from "
                    f"{threading.current_thread().name!r}). Give each thread its own "
                    "OffloadSession."
                )
            self._owner = threading.current_thread()
        try:
            if self._budget is not None:
                self._budget.entered()  # the step's meter opens before its first op
            if not self._bypassed:
                self._executor.enter()
        except BaseException:
            self._owner = None
            if self._budget is not None:
                self._budget.exited(failed=True)
            raise
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if self._owner is not threading.current_thread():
            raise RuntimeError(
                "OffloadSession.__exit__ was called from another thread than its __enter__; "
                "enter and leave a session in the same thread."
            )
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
        budget = self._budget
        failed = exc_type is not None
        try:
            if self._executor.entry is not None:
                self._executor.exit(exc_type, exc, tb)
        except BaseException:
            failed = True
            raise
        finally:
            self._owner = None
            if budget is not None:
                # An abandoned step's meter window closes with it (a retry is metered from
                # its own start, and no meter stays pushed over later ops).
                budget.exited(failed=failed)
        return False

    def close(self) -> None:
        """End the session's whole-step budget: the hooks it put on the optimizer's ``step``
        are removed and an open meter window is closed. The optimizer's swap stays as the
        budget last configured it. A session that is collected does the same; without a
        device budget there is nothing to close. Idempotent.

        Raises:
            RuntimeError: The session is active (inside its ``with`` block).
        """
        if self._owner is not None:
            raise RuntimeError(
                "OffloadSession.close() was called inside the session's with block; close "
                "it after the block."
            )
        if self._budget is not None and self._budget.ended is None:
            self._budget.end("the session was closed", warn=False)

    @property
    def _bypassed(self) -> bool:
        """A whole-step plan keeps every activation on the device: entries run untraced."""
        return self._budget is not None and self._budget.keeps_activations

    # ---- results -------------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        return session_stats(self._executor, self._budget)

    # ---- opaque regions ------------------------------------------------------------------

    def _run_opaque(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        entry = self._executor.entry
        if entry is None or entry.opaque:
            return fn(*args, **kwargs)
        entry.begin_virtual(f"{name}.forward", (args, kwargs))
        outputs: Any = None
        try:
            dummy = torch.zeros((), requires_grad=True)
            flat, spec = tree_flatten((args, kwargs))
            slots = [i for i, v in enumerate(flat) if _differentiable(v)]
            through = _RegionStart.apply(entry, dummy, *(flat[i] for i in slots))
            for i, value in zip(slots, through[1:], strict=True):
                flat[i] = value
            args, kwargs = tree_unflatten(flat, spec)
            result = fn(*args, **kwargs)
            flat_out, spec_out = tree_flatten(result)
            out_slots = [i for i, v in enumerate(flat_out) if _differentiable(v)]
            if out_slots:
                ended = _RegionEnd.apply(entry, name, through[0], *(flat_out[i] for i in out_slots))
                for i, value in zip(out_slots, ended[1:], strict=True):
                    flat_out[i] = value
            outputs = tree_unflatten(flat_out, spec_out)
            return outputs
        finally:
            entry.end_virtual(outputs)


def _check_pairing(config: OffloadConfig, optimizer: object) -> None:
    """A device budget plans the optimizer's update: the two come together."""
    if config.device_budget_mb is not None and optimizer is None:
        raise ValueError(
            f"OffloadConfig.device_budget_mb={config.device_budget_mb} plans the whole step, "
            "the optimizer's update included: pass the optimizer, "
            "OffloadSession(config, optimizer=opt). To budget activations alone, use "
            "max_resident_activation_mb."
        )
    if config.device_budget_mb is None and optimizer is not None:
        raise ValueError(
            "OffloadSession(optimizer=...) is for a whole-step device budget; the config has "
            "no device_budget_mb. Set OffloadConfig(device_budget_mb=N), or drop optimizer=."
        )


def _manager(manager: pluggy.PluginManager | None) -> pluggy.PluginManager:
    from swapopt_core._plugins import get_plugin_manager

    return get_plugin_manager() if manager is None else manager


def _planner(config: OffloadConfig, manager: pluggy.PluginManager) -> ResidencyPlanner:
    from swapopt_core._plugins import residency_planners

    planners = residency_planners(manager)
    return resolve_planner(config.planner, planners, label="OffloadConfig.planner")


def _runtimes(config: OffloadConfig, manager: pluggy.PluginManager) -> RuntimeChoice:
    from swapopt_core._plugins import runtime_classes

    runtimes = runtime_classes(manager, "torch")
    return resolve_runtime(config.runtime, runtimes, label="OffloadConfig.runtime")


def _differentiable(value: object) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


class _RegionStart(torch.autograd.Function):
    """Identity at a region's entry; its backward closes the region's backward op."""

    @staticmethod
    def forward(ctx: Any, entry: Entry, dummy: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.entry = entry
        return (dummy.view_as(dummy), *(t.view_as(t) for t in tensors))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.entry.end_virtual(grads[1:])
        return (None, grads[0], *grads[1:])


class _RegionEnd(torch.autograd.Function):
    """Identity at a region's exit; its backward opens the region's backward op."""

    @staticmethod
    def forward(
        ctx: Any, entry: Entry, name: str, dummy: torch.Tensor, *tensors: torch.Tensor
    ) -> Any:
        ctx.entry, ctx.name = entry, name
        return (dummy.view_as(dummy), *(t.view_as(t) for t in tensors))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.entry.begin_virtual(f"{ctx.name}.backward", grads[1:])
        return (None, None, torch.zeros(()), *grads[1:])


def skip_offload(fn: _F) -> _F:
    """Run ``fn`` as one opaque op inside an ``OffloadSession`` (and its backward as one).

    Use it for custom kernels, collectives or code that touches tensor memory outside
    PyTorch's dispatcher (``.numpy()``, C extensions): nothing inside is traced or
    offloaded, and its inputs are on the device when it starts. Outside a session the
    function runs as is.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"skip_offload needs a callable, got {type(fn).__name__}.")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        session = _ACTIVE.get()
        if session is None:
            return fn(*args, **kwargs)
        return session._run_opaque(getattr(fn, "__name__", "region"), fn, args, kwargs)

    return wrapper  # type: ignore[return-value]
