"""``OffloadSession``: keep activations under a device budget across forward and backward."""

from __future__ import annotations

import contextvars
import copy
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pluggy
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from swapopt_core._activations.config import OffloadConfig
from swapopt_core._activations.executor import Executor, OpGuide
from swapopt_core._activations.residency import HostPool
from swapopt_core._activations.runtime import ActivationRuntime, CudaActivationRuntime
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


class OffloadSession:
    """A reusable context manager around one training step's forward and backward.

    The first entry is the **warmup**: every op runs under a tracer that records the step
    and keeps activations under ``max_resident_activation_mb`` by evicting the oldest ones
    to host memory and paging them back when needed. On exit the planner turns the trace
    into a schedule. Later entries **replay** the schedule: copies out start right after
    each activation's last write and copies back start just early enough, on a stream per
    direction. A step whose ops differ from the trace falls back to warmup and the next
    entry traces again. Results are the same bits as without the session.

    Args:
        config: Budget, host cap, planner and runtime. Default: ``OffloadConfig()``.
        plugin_manager: Where to look up planners. Default: ``get_plugin_manager()``.

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
        self._manager = plugin_manager
        self._planner = self._resolve_planner()
        self.trace: ActivationTrace | None = None
        self.schedule: ResidencySchedule | None = None
        self._guide: list[OpGuide] | None = None
        self._runtime: ActivationRuntime | None = None
        self._pool: HostPool | None = None
        self._bandwidth: tuple[float, float] | None = None
        self._executor: Executor | None = None
        self._strikes = 0  # replays in a row that diverged from the current plan
        self._token: contextvars.Token | None = None
        self._counts = {
            "warmups": 0,
            "replays": 0,
            "retraces": 0,
            "d2h": 0,
            "h2d": 0,
            "peak": 0,
            "last_peak": 0,
            "refusals": 0,
        }

    def _resolve_planner(self) -> Any:
        from swapopt_core._plugins import get_plugin_manager, residency_planners

        manager = get_plugin_manager() if self._manager is None else self._manager
        planners = residency_planners(manager)
        name = "timed" if self.config.planner == "auto" else self.config.planner
        if name not in planners:
            raise ValueError(
                f"OffloadConfig.planner={self.config.planner!r} is not a registered planner. "
                f"Choose one of {sorted(['auto', *planners])}, or register a plugin that "
                "provides it (swapopt_register_planners)."
            )
        planner = planners[name]
        if hasattr(planner, "min_bytes"):
            # Planners with a size threshold take the session's (a copy: others may share it).
            planner = copy.copy(planner)
            planner.min_bytes = self.config.min_offload_bytes
        return planner

    def _make_runtime(self) -> ActivationRuntime:
        wanted = self.config.runtime
        if wanted == "auto":
            wanted = "cuda" if torch.cuda.is_available() else "loopback"
        if wanted == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "OffloadConfig.runtime='cuda' but CUDA is not available. Use "
                    "runtime='loopback' to run the offload on CPU, or 'auto'."
                )
            return CudaActivationRuntime(torch.device("cuda", torch.cuda.current_device()))
        return ActivationRuntime()

    # ---- the context manager -------------------------------------------------------------

    def __enter__(self) -> OffloadSession:
        if _ACTIVE.get() is not None:
            raise RuntimeError(
                "An OffloadSession is already active in this context; sessions do not nest. "
                "Wrap each step's forward and backward in one session."
            )
        if self._runtime is None:
            self._runtime = self._make_runtime()
            self._pool = HostPool(self._runtime, self.config.host_cap_bytes)
        assert self._pool is not None
        replay = self.schedule is not None and self._guide is not None
        self._executor = Executor(
            self._runtime,
            self._pool,
            self.config.budget_bytes,
            self.config.min_offload_bytes,
            schedule=self.schedule if replay else None,
            guide=list(self._guide) if replay and self._guide is not None else None,
        )
        self._token = _ACTIVE.set(self)
        self._executor.mode.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        executor, runtime = self._executor, self._runtime
        assert executor is not None and runtime is not None
        executor.mode.__exit__(exc_type, exc, tb)
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
        try:
            if exc_type is None:
                self._finish(executor, runtime)
        finally:
            executor.closed = True
            residency = executor.residency
            residency.close()
            self._executor = None
            counts = self._counts
            counts["d2h"] += residency.d2h_bytes
            counts["h2d"] += residency.h2d_bytes
            counts["refusals"] += residency.host_cap_refusals
            counts["last_peak"] = residency.peak_bytes
            counts["peak"] = max(counts["peak"], residency.peak_bytes)
        return False

    def _finish(self, executor: Executor, runtime: ActivationRuntime) -> None:
        if executor.replaying and executor.op + 1 == len(executor.guide):
            self._counts["replays"] += 1
            self._strikes = 0
            return
        if executor.replaying:  # the step ended early: its ops differ from the trace
            logger.info(
                "activation replay ran %d of %d traced ops", executor.op + 1, len(executor.guide)
            )
            executor.diverged, executor.recording = True, False
        if executor.diverged:
            self._counts["retraces"] += 1
        if not executor.recording:
            # NOTE: a one-off step (Lightning logs differently on an epoch's first batch)
            # keeps the plan; the same plan failing twice in a row is traced again.
            self._strikes += 1
            if self._strikes >= 2:
                self.schedule = self._guide = None
                self._strikes = 0
            return
        self._strikes = 0
        self._counts["warmups"] += 1
        if isinstance(runtime, CudaActivationRuntime):
            # Op durations are read from events: they must all have completed.
            torch.cuda.synchronize(runtime.device)
        if self._bandwidth is None:
            self._bandwidth = runtime.measure_bandwidth()
        d2h, h2d = self._bandwidth
        self.trace = ActivationTrace(
            tuple(executor.trace_ops()),
            {sid: e.nbytes for sid, e in executor.residency.by_sid.items()},
            executor.retained(),
            self.config.budget_bytes,
            d2h,
            h2d,
        )
        self.schedule = self._planner.plan(self.trace)
        self._guide = executor.guide
        logger.info(
            "activation warmup traced %d ops, %d storages; planned %d actions",
            len(self.trace.ops),
            len(self.trace.storage_sizes),
            len(self.schedule),
        )

    # ---- results -------------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        counts = self._counts
        return OffloadStats(
            peak_resident_activation_bytes=counts["peak"],
            last_peak_resident_activation_bytes=counts["last_peak"],
            d2h_bytes=counts["d2h"],
            h2d_bytes=counts["h2d"],
            warmups=counts["warmups"],
            replays=counts["replays"],
            retraces=counts["retraces"],
            host_peak_bytes=self._pool.peak if self._pool is not None else 0,
            host_cap_refusals=counts["refusals"],
            planned_actions=len(self.schedule) if self.schedule is not None else 0,
            budget_bytes=self.config.budget_bytes,
        )

    # ---- opaque regions ------------------------------------------------------------------

    def _run_opaque(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        executor = self._executor
        if executor is None or executor.opaque:
            return fn(*args, **kwargs)
        executor.begin_virtual(f"{name}.forward", (args, kwargs))
        outputs: Any = None
        try:
            dummy = torch.zeros((), requires_grad=True)
            flat, spec = tree_flatten((args, kwargs))
            slots = [i for i, v in enumerate(flat) if _differentiable(v)]
            through = _RegionStart.apply(executor, dummy, *(flat[i] for i in slots))
            for i, value in zip(slots, through[1:], strict=True):
                flat[i] = value
            args, kwargs = tree_unflatten(flat, spec)
            result = fn(*args, **kwargs)
            flat_out, spec_out = tree_flatten(result)
            out_slots = [i for i, v in enumerate(flat_out) if _differentiable(v)]
            if out_slots:
                ended = _RegionEnd.apply(
                    executor, name, through[0], *(flat_out[i] for i in out_slots)
                )
                for i, value in zip(out_slots, ended[1:], strict=True):
                    flat_out[i] = value
            outputs = tree_unflatten(flat_out, spec_out)
            return outputs
        finally:
            executor.end_virtual(outputs)


def _differentiable(value: object) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


class _RegionStart(torch.autograd.Function):
    """Identity at a region's entry; its backward closes the region's backward op."""

    @staticmethod
    def forward(ctx: Any, executor: Executor, dummy: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.executor = executor
        return (dummy.view_as(dummy), *(t.view_as(t) for t in tensors))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.executor.end_virtual(grads[1:])
        return (None, grads[0], *grads[1:])


class _RegionEnd(torch.autograd.Function):
    """Identity at a region's exit; its backward opens the region's backward op."""

    @staticmethod
    def forward(
        ctx: Any, executor: Executor, name: str, dummy: torch.Tensor, *tensors: torch.Tensor
    ) -> Any:
        ctx.executor, ctx.name = executor, name
        return (dummy.view_as(dummy), *(t.view_as(t) for t in tensors))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.executor.begin_virtual(f"{ctx.name}.backward", grads[1:])
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
