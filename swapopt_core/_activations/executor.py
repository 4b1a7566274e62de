"""The dispatch-mode executor: warmup tracing with online eviction, and schedule replay.

Every aten op inside a session passes through ``dispatch``. In **warmup** the executor
records the op (name, duration, the storages it reads and writes), registers the storages
it creates, and evicts the oldest (then largest) activations whenever the budget is
exceeded; an evicted storage is paged back in the moment an op touches it. In **replay**
it applies a planned ``ResidencySchedule`` before and after each op. A replay whose ops
stop matching the trace restores everything and finishes the step as an untraced warmup,
and the next entry traces again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from swapopt_core._activations.residency import HostPool, Residency, Tracked
from swapopt_core._activations.runtime import ActivationRuntime
from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    Action,
    ActionKind,
    ResidencySchedule,
    TraceOp,
)

logger = logging.getLogger(__name__)

__all__ = ["Executor", "OpGuide"]


@dataclass(frozen=True)
class OpGuide:
    """What replay expects of op ``i``: its name, the storages its outputs create
    (``(leaf index, sid, bytes)``) and the tracked storages it writes in place."""

    name: str
    outputs: tuple[tuple[int, int, int], ...] = ()
    writes: tuple[int, ...] = ()


@dataclass
class _Open:
    """An op between its begin and its end."""

    index: int
    name: str
    start: Any
    inputs: set[torch.UntypedStorage] = field(default_factory=set)
    accesses: dict[int, AccessKind] = field(default_factory=dict)


def _storage(value: object) -> torch.UntypedStorage | None:
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    try:
        return value.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors ``func`` writes in place, matched by schema argument (position or name)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


class _Mode(TorchDispatchMode):
    def __init__(self, executor: Executor) -> None:
        super().__init__()
        self.executor = executor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return self.executor.dispatch(func, args, kwargs or {})


class Executor:
    """One entry of an ``OffloadSession``: a warmup or a replay of a schedule."""

    def __init__(
        self,
        runtime: ActivationRuntime,
        pool: HostPool,
        budget_bytes: int,
        min_offload_bytes: int,
        *,
        schedule: ResidencySchedule | None = None,
        guide: list[OpGuide] | None = None,
    ) -> None:
        self.runtime = runtime
        self.residency = Residency(runtime, pool)
        self.budget = budget_bytes
        self.min_offload = min_offload_bytes
        self.replaying = schedule is not None
        self.recording = not self.replaying
        self.diverged = False
        self.schedule = schedule or ResidencySchedule()
        self.guide: list[OpGuide] = guide if guide is not None else []
        self.op = -1
        self.opaque = 0
        self.next_sid = 1 + max((sid for g in self.guide for _, sid, _ in g.outputs), default=0)
        self.ops: list[tuple[str, Any, Any, tuple[Access, ...]]] = []
        self._virtual: list[_Open] = []
        self.mode = _Mode(self)
        self.closed = False  # set when the entry ends; a late backward region is ignored

    # ---- the op path ---------------------------------------------------------------------

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.opaque:
            self._ready_inputs((args, kwargs))
            return func(*args, **kwargs)
        name = func.__name__
        if self.replaying and not self._matches(name):
            self._diverge(f"op {self.op + 1} is {name}")
        opened = self._begin(name, (args, kwargs), _written(func, args, kwargs))
        return self._end(opened, func(*args, **kwargs))

    def _matches(self, name: str) -> bool:
        index = self.op + 1
        return index < len(self.guide) and self.guide[index].name == name

    def _begin(self, name: str, inputs: object, written: list[torch.Tensor]) -> _Open:
        self.op += 1
        opened = _Open(self.op, name, None)
        if self.replaying:
            for action in self.schedule.pre.get(self.op, ()):
                self._apply(action)
            for sid in self.guide[self.op].writes:
                entry = self.residency.by_sid.get(sid)
                if entry is not None:
                    self.residency.written(entry)
            self._ready_inputs(inputs)
        else:
            writes = {id(t) for t in written}
            for value in tree_leaves(inputs):
                storage = _storage(value)
                if storage is None:
                    continue
                opened.inputs.add(storage)
                entry = self.residency.by_storage.get(storage)
                if entry is None:
                    continue
                self.residency.ready(entry)
                if id(value) in writes:
                    opened.accesses[entry.sid] = AccessKind.WRITE
                    self.residency.written(entry)
                else:
                    opened.accesses.setdefault(entry.sid, AccessKind.READ)
        opened.start = self.runtime.stamp() if self.recording else None
        return opened

    def _end(self, opened: _Open, out: Any) -> Any:
        end = self.runtime.stamp() if self.recording else None
        if self.replaying:
            self._bind_replay(opened.index, out)
            for action in self.schedule.post.get(opened.index, ()):
                self._apply(action)
            return out
        bindings = []
        for position, value in enumerate(tree_leaves(out)):
            storage = _storage(value)
            if storage is None or storage in opened.inputs or not self._ours(storage):
                continue
            known = self.residency.by_storage.get(storage)
            if known is not None:
                opened.accesses[known.sid] = AccessKind.WRITE
                continue
            entry = self.residency.track(storage, self.next_sid, opened.index)
            self.next_sid += 1
            opened.accesses[entry.sid] = AccessKind.WRITE
            bindings.append((position, entry.sid, entry.nbytes))
        if self.recording:
            accesses = tuple(Access(sid, kind) for sid, kind in opened.accesses.items())
            self.ops.append((opened.name, opened.start, end, accesses))
            written = tuple(
                sid
                for sid, kind in opened.accesses.items()
                if kind is AccessKind.WRITE and sid not in {b[1] for b in bindings}
            )
            self.guide.append(OpGuide(opened.name, tuple(bindings), written))
        self._evict(protected=set(opened.accesses))
        return out

    def _ours(self, storage: torch.UntypedStorage) -> bool:
        if storage.nbytes() == 0:
            return False
        device = storage.device
        if self.runtime.name == "loopback":
            return device.type == "cpu"
        return device == self.runtime.device  # type: ignore[attr-defined]

    def _ready_inputs(self, inputs: object) -> None:
        residency = self.residency
        if not residency.released and not residency.pending_in:
            return  # nothing is away or in flight: the common, cheap case
        for value in tree_leaves(inputs):
            storage = _storage(value)
            entry = residency.by_storage.get(storage) if storage is not None else None
            if entry is not None:
                residency.ready(entry)

    # ---- warmup: online eviction ---------------------------------------------------------

    def _evict(self, protected: set[int]) -> None:
        residency = self.residency
        if residency.resident_bytes <= self.budget:
            return
        candidates = sorted(
            (
                e
                for e in residency.by_sid.values()
                if e.alive
                and e.resident
                and e.sid not in protected
                and e.nbytes >= self.min_offload
            ),
            key=lambda e: (e.produced_at, -e.nbytes),
        )
        for entry in candidates:
            if residency.resident_bytes <= self.budget:
                break
            if residency.copy_out(entry):
                residency.release(entry)

    # ---- replay --------------------------------------------------------------------------

    def _bind_replay(self, index: int, out: Any) -> None:
        outputs = self.guide[index].outputs
        if not outputs:
            return
        leaves = tree_leaves(out)
        for position, sid, nbytes in outputs:
            storage = _storage(leaves[position]) if position < len(leaves) else None
            if storage is None or storage.nbytes() != nbytes:
                # Its outputs stay untracked (never offloaded): safe, just not in budget.
                self._diverge(f"op {index} ({self.guide[index].name}) made other outputs")
                return
            if storage not in self.residency.by_storage:
                self.residency.track(storage, sid, index)

    def _apply(self, action: Action) -> None:
        entry: Tracked | None = self.residency.by_sid.get(action.storage_id)
        if entry is None or not entry.alive:
            return
        kind = action.kind
        if kind is ActionKind.COPY_D2H:
            self.residency.copy_out(entry)
        elif kind is ActionKind.RELEASE_DEVICE:
            self.residency.release(entry)
        elif kind is ActionKind.COPY_H2D:
            self.residency.copy_in(entry)
        elif kind is ActionKind.RELEASE_HOST:
            self.residency.release_host(entry)

    def _diverge(self, why: str) -> None:
        """Stop replaying: bring everything back and finish the step as a warmup."""
        logger.info("activation replay diverged from the trace (%s); tracing again", why)
        self.residency.restore_all()
        self.diverged = True
        self.replaying = False
        self.recording = self.op < 0  # a full trace only if nothing ran yet
        self.guide = [] if self.recording else self.guide

    # ---- opaque regions ------------------------------------------------------------------

    def begin_virtual(self, name: str, inputs: object) -> None:
        """Start a region that counts as one op ``name`` (``skip_offload``)."""
        if self.closed:
            return
        if self.replaying and not self._matches(name):
            self._diverge(f"op {self.op + 1} is the region {name}")
        self._virtual.append(self._begin(name, inputs, []))
        self.opaque += 1

    def end_virtual(self, outputs: object) -> None:
        if self.closed or not self._virtual:
            return
        self.opaque = max(0, self.opaque - 1)
        self._end(self._virtual.pop(), outputs)

    # ---- end of the entry ----------------------------------------------------------------

    def trace_ops(self) -> list[TraceOp]:
        """The recorded ops with their durations (needs every stamp to be complete)."""
        return [
            TraceOp(name, self.runtime.elapsed_ms(start, end), accesses)
            for name, start, end, accesses in self.ops
        ]

    def retained(self) -> frozenset[int]:
        return frozenset(e.sid for e in self.residency.by_sid.values() if e.alive)
