"""One entry of an ``OffloadSession``: every aten op inside it passes through ``dispatch``.

``Entry`` is what the session's dispatch mode, its opaque regions and the executor talk to.
It takes the runtime at the entry's first op, runs the session's checks on every op, lets
swapopt's own ops through (``Quiet``), keeps the stack of opaque regions, and hands each op to
the phase that serves the entry now: a ``ReplayEntry`` (``replay_entry.py``) that follows a
kept plan, or a ``WarmupEntry`` (``warmup.py``) that records and keeps the budget. A replay
that leaves its plan hands the rest of the entry over to a warmup; both work on one ``Scope``
(``scope.py``): the runtime, the residency of the storages and the gradient watch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from swapopt_core._activations.calls import device_of, storage_of
from swapopt_core._activations.guards import CompileWatch, compiled_refusal
from swapopt_core._activations.replay_entry import ReplayEntry
from swapopt_core._activations.scope import Open, Scope
from swapopt_core._activations.warmup import WarmupEntry

if TYPE_CHECKING:
    from swapopt_core._activations.executor import Executor
    from swapopt_core._activations.plans import Plan

logger = logging.getLogger(__name__)

__all__ = ["Entry"]


class _Mode(TorchDispatchMode):
    def __init__(self, entry: Entry) -> None:
        super().__init__()
        self.entry = entry
        self.armed = False  # set once entered: Dynamo asks before running compiled code

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]
        if self.armed:
            raise compiled_refusal()  # before Dynamo marks the function to run eagerly
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return self.entry.dispatch(func, args, kwargs or {})


class Entry:
    """One entry of a session: a replay of a kept ``Plan``, or a warmup that records.

    Args:
        executor: The session's executor: it chooses the runtime and keeps the plans.
        plan: The plan to replay; ``None`` for a warmup.
    """

    def __init__(self, executor: Executor, plan: Plan | None = None) -> None:
        self.executor = executor
        self.scope = Scope(executor.budget_bytes, executor.min_offload_bytes, executor.leaves)
        self.scope.outside_counts = executor.outside_counts
        self.quiet = self.scope.quiet  # > 0 while the entry's own bookkeeping runs ops
        self.replay: ReplayEntry | None = None  # the replay the entry started as
        self.warmup: WarmupEntry | None = None  # the warmup it is, or was handed over to
        self.phase: ReplayEntry | WarmupEntry  # which of them serves the ops now
        if plan is None:
            self.warmup = self.phase = WarmupEntry(self.scope)
        else:
            self.replay = self.phase = ReplayEntry(self.scope, executor.book, plan, self._hand_over)
        self.opaque = 0
        self._virtual: list[Open] = []
        self.mode = _Mode(self)
        self.closed = False  # set when the entry ends; a late backward region is ignored
        self._check: Any = None  # the runtime's per-op ordering check, if it has one
        self.compiled = CompileWatch()

    def _start(self, inputs: object) -> None:
        """The first op: take the runtime that serves the device its tensors are on."""
        device = device_of(inputs)
        runtime, pool = self.executor.runtime_for(device)
        self.scope.start(runtime, pool)
        self._check = runtime.begin_entry(device)
        if self.replay is not None:
            self.replay.start()

    def _hand_over(self, warmup: WarmupEntry) -> None:
        """The replay left its plan: ``warmup`` serves the rest of the entry."""
        self.warmup = self.phase = warmup

    # ---- the op path ---------------------------------------------------------------------

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.quiet.depth:
            return func(*args, **kwargs)
        if self.opaque:
            self._ready_inputs((args, kwargs))
            return func(*args, **kwargs)
        if not self.scope.started:
            self._start((args, kwargs))
        self.compiled.check()
        if self._check is not None:
            self._check()
        return self.phase.dispatch(func, args, kwargs)

    def _ready_inputs(self, inputs: object) -> None:
        residency = self.scope.residency if self.scope.started else None
        if residency is None or (not residency.released and not residency.pending_in):
            return  # nothing is away or in flight: the common, cheap case
        leaves = tree_leaves(inputs)
        residency.ready_any({id(s) for value in leaves if (s := storage_of(value)) is not None})

    # ---- opaque regions ------------------------------------------------------------------

    def begin_virtual(self, name: str, inputs: object) -> None:
        """Start a region that counts as one op ``name`` (``skip_offload``)."""
        if self.closed:
            return
        with self.quiet:  # the copies and waits below are ours, not the step's ops
            if not self.scope.started:
                self._start(inputs)
            self._virtual.append(self.phase.begin_region(name, inputs))
            self.opaque += 1

    def end_virtual(self, outputs: object) -> None:
        if self.closed or not self._virtual:
            return
        with self.quiet:
            self.opaque = max(0, self.opaque - 1)
            self.phase.end(self._virtual.pop(), outputs)

    # ---- end of the entry ----------------------------------------------------------------

    def close(self) -> None:
        """The entry ended: restore what is still alive; late region calls are ignored."""
        self.closed = True
        self.compiled.stop()
        if self.warmup is not None:
            self.warmup.close()
        scope = self.scope
        if scope.started:
            scope.gradients.close()
            scope.residency.close()
            scope.gradients.sample(scope.residency.resident_bytes)  # all back on the device
