"""One entry of an ``OffloadSession``: every aten op inside it passes through ``dispatch``.

A **warmup** entry records each op (name, duration, the storages it reads and writes, and
where among its outputs each storage it creates is), registers the storages it creates, and
keeps the budget: before an op runs it makes room for the storages the op will page in and
for those it will create (predicted on meta tensors, ``prediction.py``) by evicting the
oldest (then largest) idle activations, and evicts again after the op for what was not
predicted; an evicted storage is paged back in the moment an op touches it. A **replay**
entry follows a plan and nothing else: the ``ActivationTrace`` says which op comes next,
which storages it writes and where its new storages are; the ``ResidencySchedule`` says
what to do before and after it. When an op does not match the trace, the replay goes on
with another plan the session keeps or falls back to a warmup (``handover.py``).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from swapopt_core._activations.calls import device_of, storage_of, written_tensors
from swapopt_core._activations.gradients import GradientWatch
from swapopt_core._activations.guards import CompileWatch, compiled_refusal
from swapopt_core._activations.handover import Handover
from swapopt_core._activations.prediction import fresh_bytes
from swapopt_core._activations.recording import InferenceWatch, call_devices, fresh_outputs
from swapopt_core._activations.replay_path import ReplayPath
from swapopt_core._activations.residency import Residency
from swapopt_core._device.interface import TorchRuntime
from swapopt_core._planning.ir import Access, AccessKind, TraceOp

if TYPE_CHECKING:
    from swapopt_core._activations.executor import Executor
    from swapopt_core._activations.plans import Plan

logger = logging.getLogger(__name__)

__all__ = ["Entry"]

_WRITE = AccessKind.WRITE


@dataclass
class _Open:
    """An op between its begin and its end."""

    index: int
    name: str
    start: Any
    inputs: set[torch.UntypedStorage] = field(default_factory=set)
    accesses: dict[int, AccessKind] = field(default_factory=dict)
    outputs: dict[int, int] = field(default_factory=dict)  # sid -> output position
    devices: frozenset[str] | None = None  # recording: set when it may be recomputed


class _Deaths:
    """The op during (or after) which each recorded storage was freed; it holds its entry
    weakly, so a storage that outlives the step keeps nothing of the entry alive."""

    def __init__(self, entry: Entry) -> None:
        self.entry = weakref.ref(entry)
        self.at: dict[int, int] = {}

    def note(self, sid: int) -> None:
        entry = self.entry()
        if entry is not None and not entry.closed:
            self.at[sid] = entry.op


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


class Entry(Handover, ReplayPath):
    """One entry of a session: a warmup that records, or a replay of a kept ``Plan``.

    Args:
        executor: The session's executor: it chooses the runtime, keeps the plans and
            says whether a replay registers every storage.
        plan: The plan to replay; ``None`` for a warmup.
    """

    def __init__(self, executor: Executor, plan: Plan | None = None) -> None:
        self.executor = executor
        self.runtime: TorchRuntime | None = None  # chosen at the first op
        self.residency: Residency | None = None
        self.budget = executor.budget_bytes
        self.min_offload = executor.min_offload_bytes
        self.replaying = plan is not None
        self.recording = not self.replaying
        self.diverged = False
        self.op = -1
        self.opaque = 0
        self.next_sid = 1  # the id of the next storage a recording tracks
        self._init_replay()
        self._init_handover(plan)
        self.ops: list[tuple[str, Any, Any, tuple[Access, ...], bool]] = []
        self._virtual: list[_Open] = []
        self.mode = _Mode(self)
        self.closed = False  # set when the entry ends; a late backward region is ignored
        self.quiet = 0  # > 0 while the entry's own bookkeeping runs ops (regions)
        self._check: Any = None  # the runtime's per-op ordering check, if it has one
        self.compiled = CompileWatch()
        self.pinned: set[int] = set()  # storages the warmup saw shared outside torch
        self.gradients = GradientWatch(self)  # parameter gradients: not activations
        self.inference = InferenceWatch()  # marked ops whose inference-mode input changes
        self.deaths = _Deaths(self)  # when each recorded storage was freed

    def _start(self, inputs: object) -> None:
        """The first op: take the runtime that serves the device its tensors are on."""
        device = device_of(inputs)
        self.runtime, pool = self.executor.runtime_for(device)
        self.residency = Residency(self.runtime, pool)
        self._check = self.runtime.begin_entry(device)
        self.residency.regenerate = self._regenerate
        if self.replaying and not self.tables.track_all:
            # Nothing is registered (the plan has no action): the plan's peak stands for it.
            self.residency.peak_bytes = self.tables.planned_peak

    # ---- the op path ---------------------------------------------------------------------

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.quiet:
            return func(*args, **kwargs)
        if self.opaque:
            self._ready_inputs((args, kwargs))
            return func(*args, **kwargs)
        if self.residency is None:
            self._start((args, kwargs))
        self.compiled.check()
        if self._check is not None:
            self._check()
        name = func.__name__
        if self.replaying:
            index = self.op + 1
            if index < self.ops_planned and name == self.tables.names[index]:
                return self._replay(index, func, args, kwargs)
            if self._leave(name):  # another kept plan goes on from here
                return self._replay(index, func, args, kwargs)
        written = written_tensors(func, args, kwargs)
        room = fresh_bytes(func, args, kwargs) if self._served(args, kwargs) else 0
        opened = self._begin(name, (args, kwargs), written, room)
        if self.recording:
            opened.devices = call_devices(func, args, kwargs)
            self.inference.note(opened.index, (args, kwargs), written, opened.devices is not None)
        return self._end(opened, func(*args, **kwargs))

    def _matches(self, name: str) -> bool:
        index = self.op + 1
        return index < self.ops_planned and self.tables.names[index] == name

    def _served(self, args: tuple, kwargs: dict) -> bool:
        """Whether an op's new storages would land on the device this entry serves."""
        return self.runtime.serves(device_of((args, kwargs)))

    def _begin(
        self, name: str, inputs: object, written: list[torch.Tensor], room: int = 0
    ) -> _Open:
        """Open op ``name``: on a replay, its ``pre`` actions; otherwise find the tracked
        storages it touches, make room for those away and for the ``room`` bytes it will
        create, then page them in."""
        residency = self.residency
        self.op += 1
        opened = _Open(self.op, name, None)
        if self.replaying:
            self._replay_pre(self.op)
        else:
            writes = {id(t) for t in written}
            touched = []
            for value in tree_leaves(inputs):
                storage = storage_of(value)
                if storage is None:
                    continue
                opened.inputs.add(storage)
                if value.requires_grad and value.is_leaf:
                    self.gradients.watch(value)
                entry = residency.by_storage.get(storage)
                if entry is None:
                    continue
                touched.append((entry, storage, id(value) in writes))
                if id(value) in writes:
                    opened.accesses[entry.sid] = AccessKind.WRITE
                else:
                    opened.accesses.setdefault(entry.sid, AccessKind.READ)
            away = {e.sid: e.nbytes for e, _, _ in touched if not e.resident}
            # Room before anything allocates: what it pages in, then what it creates.
            self._evict(protected=set(opened.accesses), room=sum(away.values()) + room)
            for entry, storage, write in touched:
                if not entry.resident:
                    self.gradients.paged_in(entry)
                residency.ready(entry)
                if not storage.resizable():  # .numpy() shares it: the plan must keep it
                    self.pinned.add(entry.sid)
                if write:
                    residency.written(entry)
            self.gradients.sample(residency.resident_bytes)
        opened.start = self.runtime.stamp() if self.recording else None
        return opened

    def _end(self, opened: _Open, out: Any) -> Any:
        residency = self.residency
        end = self.runtime.stamp() if self.recording else None
        if self.replaying:
            self._replay_post(opened.index, out)
            return out
        for position, value in enumerate(tree_leaves(out)):
            storage = storage_of(value)
            if storage is None or storage in opened.inputs or not self._ours(storage):
                continue
            known = residency.by_storage.get(storage)
            if known is not None:
                opened.accesses[known.sid] = AccessKind.WRITE
                continue
            entry = residency.track(storage, self.next_sid, opened.index)
            if self.recording:
                weakref.finalize(storage, self.deaths.note, entry.sid)
            self.next_sid += 1
            opened.accesses[entry.sid] = AccessKind.WRITE
            opened.outputs[entry.sid] = position
        if self.recording and opened.start is None:
            # A region the replay opened, closed after a fall-back: its inputs went unseen.
            logger.info(
                "activation fall-back: %s began in the replay; nothing is recorded", opened.name
            )
            self.recording = False
        if self.recording:
            accesses = tuple(
                Access(sid, kind, opened.outputs.get(sid)) for sid, kind in opened.accesses.items()
            )
            recompute = opened.devices is not None and fresh_outputs(
                out, opened.devices, opened.inputs, residency.by_storage, opened.outputs
            )
            self.ops.append((opened.name, opened.start, end, accesses, recompute))
        self.gradients.sample(residency.resident_bytes, opened.index)
        self._evict(protected=set(opened.accesses))
        return out

    def _ours(self, storage: torch.UntypedStorage) -> bool:
        return storage.nbytes() != 0 and self.runtime.serves(storage.device)

    def _ready_inputs(self, inputs: object) -> None:
        residency = self.residency
        if residency is None or (not residency.released and not residency.pending_in):
            return  # nothing is away or in flight: the common, cheap case
        # Matched by object among the storages away or in flight (a replay registers its
        # storages by id only).
        storages = {id(s) for value in tree_leaves(inputs) if (s := storage_of(value)) is not None}
        by_sid = residency.by_sid
        for sid in [*residency.released, *residency.pending_in]:
            entry = by_sid.get(sid)
            if entry is not None and id(entry.storage()) in storages:
                residency.ready(entry)

    # ---- warmup: online eviction ---------------------------------------------------------

    def _evict(self, protected: set[int], room: int = 0) -> None:
        """Bring the resident bytes under the budget less ``room``: storages of at least
        ``min_offload_bytes`` first (oldest, then largest), then, when that is not enough,
        the smaller ones too (oldest first)."""
        residency = self.residency
        limit = self.budget - self.unseen - room
        if residency.resident_bytes <= limit:
            return
        movable = [
            e
            for e in residency.by_sid.values()
            if e.alive and e.resident and e.sid not in protected
        ]
        large = sorted(
            (e for e in movable if e.nbytes >= self.min_offload),
            key=lambda e: (e.produced_at, -e.nbytes),
        )
        small = sorted(
            (e for e in movable if e.nbytes < self.min_offload), key=lambda e: e.produced_at
        )
        for entry in (*large, *small):
            if residency.resident_bytes <= limit:
                break
            if residency.copy_out(entry):
                residency.release(entry)
                if not entry.resident:
                    self.gradients.released(entry)

    # ---- opaque regions ------------------------------------------------------------------

    def begin_virtual(self, name: str, inputs: object) -> None:
        """Start a region that counts as one op ``name`` (``skip_offload``)."""
        if self.closed:
            return
        self.quiet += 1  # the copies and waits below are ours, not the step's ops
        try:
            if self.residency is None:
                self._start(inputs)
            if self.replaying and not self._matches(name):
                self._leave(name)  # another kept plan, or a fall-back to a warmup
            self._virtual.append(self._begin(name, inputs, []))
            self.opaque += 1
        finally:
            self.quiet -= 1

    def end_virtual(self, outputs: object) -> None:
        if self.closed or not self._virtual:
            return
        self.quiet += 1
        try:
            self.opaque = max(0, self.opaque - 1)
            self._end(self._virtual.pop(), outputs)
        finally:
            self.quiet -= 1

    # ---- end of the entry ----------------------------------------------------------------

    @property
    def replayed_to_end(self) -> bool:
        """The entry replayed every op of its trace, and nothing else."""
        return self.replaying and self.op + 1 == self.ops_planned

    def trace_ops(self) -> list[TraceOp]:
        """The recorded ops with their durations (needs every stamp to be complete), after
        the ops of the plan the entry replayed before it fell back (``seed``)."""
        runtime, spoiled, first = self.runtime, self.inference.spoiled, len(self.seed)
        return [*self.seed] + [
            TraceOp(
                name,
                runtime.elapsed_ms(start, end),
                accesses,
                recompute and first + i not in spoiled,
            )
            for i, (name, start, end, accesses, recompute) in enumerate(self.ops)
        ]

    def freed_after(self) -> dict[int, int]:
        """The op after which each recorded storage that outlived its last access was freed
        (the caller held it: ``ActivationTrace.freed_after``)."""
        last: dict[int, int] = {}
        for index, (_, _, _, accesses, _) in enumerate(self.ops, start=len(self.seed)):
            for access in accesses:
                last[access.storage_id] = index
        sizes = self.storage_sizes()
        return {
            sid: op for sid, op in self.deaths.at.items() if sid in sizes and op > last.get(sid, op)
        }

    def storage_sizes(self) -> dict[int, int]:
        """The size of every storage the entry tracked (the planned one where it was
        larger: a plan serves the largest sizes seen)."""
        by_sid = self.residency.by_sid if self.residency is not None else {}
        seeded = self.seed_sizes
        return {sid: max(e.nbytes, seeded.get(sid, 0)) for sid, e in by_sid.items()}

    def unmovable(self) -> set[int]:
        """Storages that cannot be released: shared with NumPy or other foreign memory."""
        by_sid = self.residency.by_sid if self.residency is not None else {}
        alive = {
            e.sid
            for e in by_sid.values()
            if e.alive and (s := e.storage()) is not None and not s.resizable()
        }
        return self.pinned | alive | self.seed_pinned

    def retained(self) -> frozenset[int]:
        by_sid = self.residency.by_sid if self.residency is not None else {}
        return frozenset(e.sid for e in by_sid.values() if e.alive)

    def close(self) -> None:
        """The entry ended: restore what is still alive; late region calls are ignored."""
        self.closed = True
        self.compiled.stop()
        self.gradients.close()
        if self.residency is not None:
            self.residency.close()
            self.gradients.sample(self.residency.resident_bytes)  # all back on the device
