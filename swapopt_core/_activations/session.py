"""``OffloadSession``: keep activations under a device budget across forward and backward."""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pluggy
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from swapopt_core._activations.config import OffloadConfig
from swapopt_core._activations.entry import Entry
from swapopt_core._activations.executor import Executor
from swapopt_core._activations.runtime import RuntimeChoice, resolve_runtime
from swapopt_core._planning.interface import ResidencyPlanner, resolve_planner
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule

logger = logging.getLogger(__name__)

__all__ = ["OffloadSession", "OffloadStats", "skip_offload"]

_ACTIVE: contextvars.ContextVar[OffloadSession | None] = contextvars.ContextVar(
    "swapopt_offload_session", default=None
)
_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class OffloadStats:
    """What an ``OffloadSession`` did since it was created.

    Attributes:
        peak_resident_activation_bytes: Highest device bytes of tracked activations in any
            entry.
        last_peak_resident_activation_bytes: The same, in the last entry only.
        d2h_bytes: Bytes copied device to host.
        h2d_bytes: Bytes copied host to device (prefetches and demand fetches).
        warmups: Entries that traced (the first, and each re-trace).
        replays: Entries that ran the plan to the end.
        retraces: Replays that diverged from the trace and fell back to warmup.
        host_peak_bytes: Highest host bytes held for offloaded activations.
        host_cap_refusals: Offloads refused because ``max_offload_activation_mb`` was reached
            (the storage stayed on the device).
        planned_actions: Actions in the current schedule.
        budget_bytes: The device budget.
        gradient_bytes: Bytes of the parameter gradients (``.grad`` of leaf tensors) that
            autograd created inside the last entry that traced the step; replays of its plan
            create the same. They are not activations: they do not count toward
            ``max_resident_activation_mb`` or the peaks above (a warmup counts one only from
            the op that computes it until autograd stores it in ``.grad``) and are never
            moved. 0 when the gradients existed before the entry (accumulated in place).
    """

    peak_resident_activation_bytes: int
    last_peak_resident_activation_bytes: int
    d2h_bytes: int
    h2d_bytes: int
    warmups: int
    replays: int
    retraces: int
    host_peak_bytes: int
    host_cap_refusals: int
    planned_actions: int
    budget_bytes: int
    gradient_bytes: int = 0


class OffloadSession:
    """A reusable context manager around one training step's forward and backward.

    The first entry is the **warmup**: every op runs under a tracer that records the step
    and keeps activations under ``max_resident_activation_mb`` by evicting the oldest ones
    to host memory and paging them back when needed. On exit the planner turns the trace
    into a schedule. Later entries **replay** the schedule: copies out start right after
    each activation's last write and copies back start just early enough, on a stream per
    direction. A step whose ops differ from the trace falls back without a plan; the
    session's ``Executor`` decides when to trace again (``_activations/executor.py``).
    ``trace`` and ``schedule`` are the plan, and ``load_plan`` replays one saved as JSON.
    Results are the same bits as without the session.

    Args:
        config: Budget, host cap, planner and runtime. Default: ``OffloadConfig()``.
        plugin_manager: Where to look up planners and activation runtimes. Default:
            ``get_plugin_manager()``.

    Raises:
        TypeError: ``config`` is not an ``OffloadConfig``.
        ValueError: ``config.planner`` or ``config.runtime`` names nothing registered with
            the plugin manager (the message lists what is), or ``runtime="auto"`` cannot
            choose (two runtimes declare one device type).

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
        plugin_manager: pluggy.PluginManager | None = None,
    ) -> None:
        self.config = OffloadConfig() if config is None else config
        if not isinstance(self.config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}.")
        manager = _manager(plugin_manager)
        self._executor = Executor(
            self.config,
            _planner(self.config, manager),
            runtimes=_runtimes(self.config, manager),
        )
        self._token: contextvars.Token | None = None
        self._lock = threading.Lock()
        self._owner: threading.Thread | None = None  # the thread inside the session

    @property
    def trace(self) -> ActivationTrace | None:
        """The step the plan was made for: the last warmup's trace, or a loaded one."""
        return self._executor.trace

    @property
    def schedule(self) -> ResidencySchedule | None:
        """The plan later entries replay; ``None`` until a warmup (or after a dropped plan)."""
        return self._executor.schedule

    def load_plan(self, trace: ActivationTrace, schedule: ResidencySchedule) -> None:
        """Replay ``schedule`` for ``trace`` from the next entry on, without a warmup.

        Use it to reuse a plan from an earlier run, or one ``swapopt plan`` made from a saved
        trace: ``ActivationTrace.from_json`` and ``ResidencySchedule.from_json`` read them
        back. The replay follows the schedule (not this session's budget) and falls back as
        any replay does when the step's ops differ from the trace.

        Raises:
            TypeError: ``trace`` or ``schedule`` has the wrong type.
            ValueError: The trace was not recorded by an ``OffloadSession`` (it lacks the
                output positions replay needs), or the schedule was not planned for it.
        """
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
            self._executor.enter()
        except BaseException:
            self._owner = None
            raise
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self._owner is not threading.current_thread():
            raise RuntimeError(
                "OffloadSession.__exit__ was called from another thread than its __enter__; "
                "enter and leave a session in the same thread."
            )
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
        try:
            self._executor.exit(exc_type, exc, tb)
        finally:
            self._owner = None
        return False

    # ---- results -------------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        executor = self._executor
        counts = executor.counts
        return OffloadStats(
            peak_resident_activation_bytes=counts["peak"],
            last_peak_resident_activation_bytes=counts["last_peak"],
            d2h_bytes=counts["d2h"],
            h2d_bytes=counts["h2d"],
            warmups=counts["warmups"],
            replays=counts["replays"],
            retraces=counts["retraces"],
            host_peak_bytes=executor.pool.peak if executor.pool is not None else 0,
            host_cap_refusals=counts["refusals"],
            planned_actions=len(executor.schedule) if executor.schedule is not None else 0,
            budget_bytes=self.config.budget_bytes,
            gradient_bytes=counts["gradients"],
        )

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


def _manager(manager: pluggy.PluginManager | None) -> pluggy.PluginManager:
    from swapopt_core._plugins import get_plugin_manager

    return get_plugin_manager() if manager is None else manager


def _planner(config: OffloadConfig, manager: pluggy.PluginManager) -> ResidencyPlanner:
    from swapopt_core._plugins import residency_planners

    planners = residency_planners(manager)
    return resolve_planner(config.planner, planners, label="OffloadConfig.planner")


def _runtimes(config: OffloadConfig, manager: pluggy.PluginManager) -> RuntimeChoice:
    from swapopt_core._plugins import activation_runtimes

    runtimes = activation_runtimes(manager)
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
