"""The warmup phase of a session entry: record every op and keep the budget.

A ``WarmupEntry`` records each op (name, duration, the storages it reads and writes, and
where among its outputs each storage it creates is), registers the storages it creates, and
keeps the budget: before an op runs it makes room for the storages the op will page in and
for those it will create (predicted on meta tensors, ``prediction.py``) by evicting the
oldest (then largest) idle activations, and evicts again after the op for what was not
predicted; an evicted storage is paged back in the moment an op touches it.

A warmup starts an entry that has no plan, or takes over from a replay that left its plan
(``ReplayEntry``, ``replay_entry.py``): then it works on the replay's residency (``take_over``)
and, when the replay saw every storage, records the rest of the step after the plan's first
ops (its ``Seed``); otherwise it keeps the budget without recording.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from swapopt_core._activations.calls import device_of, storage_of, written_tensors
from swapopt_core._activations.prediction import fresh_bytes
from swapopt_core._activations.recording import InferenceWatch, call_devices, fresh_outputs
from swapopt_core._activations.residency import Tracked
from swapopt_core._activations.scope import Open, Scope, away_bytes
from swapopt_core._planning.ir import Access, AccessKind, TraceOp

if TYPE_CHECKING:
    from swapopt_core._activations.plans import Plan

logger = logging.getLogger(__name__)

__all__ = ["OutsideReads", "Seed", "WarmupEntry"]


@dataclass(frozen=True)
class Seed:
    """The first ops of a recording that took over from a replay: the plan's, by
    construction the same ops on the same storages."""

    ops: tuple[TraceOp, ...] = ()
    sizes: dict[int, int] = field(default_factory=dict)
    pinned: frozenset[int] = frozenset()

    @classmethod
    def of(cls, plan: Plan, count: int) -> Seed:
        """The first ``count`` ops of ``plan``, with the sizes and pins of their storages."""
        ops = plan.trace.ops[:count]
        sizes = plan.trace.storage_sizes
        made = {a.storage_id for op in ops for a in op.accesses}
        return cls(ops, {sid: sizes[sid] for sid in made if sid in sizes}, plan.pinned & made)


class OutsideReads:
    """The storages made before an entry that its ops read, each noted once with its bytes.

    A storage is known by the object itself, held weakly: its record outlives it (the step
    read those bytes), and a new storage at a freed address is noted as the new one it is.
    """

    def __init__(self) -> None:
        self._seen: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
        self.records: list[tuple[weakref.ref[torch.UntypedStorage], int]] = []

    def note(self, storage: torch.UntypedStorage) -> bool:
        """Note ``storage`` (and its bytes now) unless it was noted already; whether it
        was new."""
        if storage in self._seen:
            return False
        self._seen.add(storage)
        self.records.append((weakref.ref(storage), storage.nbytes()))
        return True

    def bytes_besides(self, held: Collection[torch.UntypedStorage]) -> int:
        """Bytes of the noted storages that are not in ``held`` (dead ones count: the
        step read them)."""
        total = 0
        for ref, nbytes in self.records:
            storage = ref()
            if storage is None or storage not in held:
                total += nbytes
        return total


class _Deaths:
    """The op during (or after) which each recorded storage was freed; it holds its warmup
    weakly, so a storage that outlives the step keeps nothing of the entry alive."""

    def __init__(self, warmup: WarmupEntry) -> None:
        self.warmup = weakref.ref(warmup)
        self.at: dict[int, int] = {}

    def note(self, sid: int) -> None:
        warmup = self.warmup()
        if warmup is not None and not warmup.closed:
            self.at[sid] = warmup.op


class WarmupEntry:
    """Records the step's ops (unless told not to) and keeps the budget online.

    Args:
        scope: What the entry's phases share.
        op: The last op that ran before this warmup (a replay's, at a fall-back).
        next_sid: The id of the next storage it tracks.
        recording: Whether it records the step (a take-over from a replay that did not see
            every storage does not).
        seed: The plan's first ops, when it records after a replay.
        unseen: Planned bytes of live storages the replay never registered: they stay on the
            device, and the budget for the others is smaller by as much.
    """

    def __init__(
        self,
        scope: Scope,
        *,
        op: int = -1,
        next_sid: int = 1,
        recording: bool = True,
        seed: Seed | None = None,
        unseen: int = 0,
    ) -> None:
        self.scope = scope
        self.op = op
        self.next_sid = next_sid
        self.recording = recording
        self.seed = seed if seed is not None else Seed()
        self.unseen = unseen
        self.closed = False
        self.ops: list[tuple[str, Any, Any, tuple[Access, ...], bool]] = []
        self.pinned: set[int] = set()  # storages the warmup saw shared outside torch
        #: Device storages the ops read that were made before the entry (parameters, the
        #: batch, gradients), each once, with its bytes: held weakly, by the storage itself
        #: (the batch may die before the plan is made, and a storage made later at its
        #: address is another one).
        self.outside = OutsideReads()
        self.inference = InferenceWatch()  # marked ops whose inference-mode input changes
        self.deaths = _Deaths(self)  # when each recorded storage was freed

    # ---- the op path ---------------------------------------------------------------------

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        written = written_tensors(func, args, kwargs)
        served = self.scope.runtime.serves(device_of((args, kwargs)))
        room = fresh_bytes(func, args, kwargs) if served else 0
        opened = self.begin(func.__name__, (args, kwargs), written, room)
        if self.recording:
            opened.devices = call_devices(func, args, kwargs)
            self.inference.note(opened.index, (args, kwargs), written, opened.devices is not None)
        return self.end(opened, func(*args, **kwargs))

    def begin(self, name: str, inputs: object, written: list[torch.Tensor], room: int = 0) -> Open:
        """Open op ``name``: find the tracked storages it touches, make room for those away
        and for the ``room`` bytes it will create, then page them in."""
        scope = self.scope
        residency, gradients = scope.residency, scope.gradients
        self.op += 1
        opened = Open(self.op, name, None)
        writes = {id(t) for t in written}
        touched = []
        for value in tree_leaves(inputs):
            storage = storage_of(value)
            if storage is None:
                continue
            opened.inputs.add(storage)
            if value.requires_grad and value.is_leaf:
                gradients.watch(value)
            entry = residency.by_storage.get(storage)
            if entry is None:
                if (
                    self.recording
                    and scope.runtime.serves(storage.device)
                    and self.outside.note(storage)
                    and scope.outside_counts is not None
                    and scope.outside_counts(storage)
                ):
                    self.unseen += storage.nbytes()  # held through the step, by no tracker
                continue
            touched.append((entry, storage, id(value) in writes))
            if id(value) in writes:
                opened.accesses[entry.sid] = AccessKind.WRITE
            else:
                opened.accesses.setdefault(entry.sid, AccessKind.READ)
        away = {e.sid: e.nbytes for e, _, _ in touched if not e.resident}
        # Room before anything allocates: what it pages in, then what it creates.
        self.evict(protected=set(opened.accesses), room=sum(away.values()) + room)
        for entry, storage, write in touched:
            if not entry.resident:
                gradients.paged_in(entry)
            residency.ready(entry)
            if not storage.resizable():  # .numpy() shares it: the plan must keep it
                self.pinned.add(entry.sid)
            if write:
                residency.written(entry)
        gradients.sample(residency.resident_bytes)
        opened.start = scope.runtime.stamp() if self.recording else None
        return opened

    def end(self, opened: Open, out: Any) -> Any:
        scope = self.scope
        residency, runtime = scope.residency, scope.runtime
        end = runtime.stamp() if self.recording else None
        for position, value in enumerate(tree_leaves(out)):
            storage = storage_of(value)
            if storage is None or storage in opened.inputs:
                continue
            if storage.nbytes() == 0 or not runtime.serves(storage.device):
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
        scope.gradients.sample(residency.resident_bytes, opened.index)
        self.evict(protected=set(opened.accesses))
        return out

    def begin_region(self, name: str, inputs: object) -> Open:
        """Open a region that counts as one op ``name`` (``skip_offload``)."""
        return self.begin(name, inputs, [])

    # ---- online eviction -----------------------------------------------------------------

    def evict(self, protected: set[int], room: int = 0) -> None:
        """Bring the resident bytes under the budget less ``room``: storages of at least
        ``min_offload`` bytes first (oldest, then largest), then, when that is not enough,
        the smaller ones too (oldest first)."""
        scope = self.scope
        residency, least = scope.residency, scope.min_offload
        limit = scope.budget - self.unseen - room
        if residency.resident_bytes <= limit:
            return
        movable = [
            e
            for e in residency.by_sid.values()
            if e.alive and e.resident and e.sid not in protected
        ]
        large = sorted(
            (e for e in movable if e.nbytes >= least), key=lambda e: (e.produced_at, -e.nbytes)
        )
        small = sorted((e for e in movable if e.nbytes < least), key=lambda e: e.produced_at)
        for entry in (*large, *small):
            if residency.resident_bytes <= limit:
                break
            # Copied out and released at once, to stay under the budget now: compute waits
            # for the copy (counted in ``eviction_stalls``).
            if residency.evict(entry) and not entry.resident:
                scope.gradients.released(entry)

    def take_over(self) -> None:
        """Make the replay's residency a warmup's: storages findable by object, no recipes
        (storages away with only a recipe are recomputed first), and under the budget."""
        residency = self.scope.residency
        residency.index_storages()  # the warmup finds its storages by object
        for entry in list(residency.by_sid.values()):
            if entry.recipe is None:
                continue
            if entry.alive:
                self.regenerate_now(entry)
            entry.recipe = None  # no recompute after this: let their inputs go
        if self.unseen:
            logger.info(
                "activation fall-back: %d bytes the replay never registered stay on the device",
                self.unseen,
            )
        self.evict(protected=set())

    def regenerate_now(self, entry: Tracked) -> None:
        """Bring back ``entry`` if only its recipe holds its bytes, making room first for it
        and for the inputs its recompute pages in (or recomputes)."""
        if entry.resident or entry.host_valid:
            return
        needed = away_bytes(entry)
        self.evict(protected=set(needed), room=sum(needed.values()))
        self.scope.residency.ready(entry)  # recomputes it (the recipe's inputs paged in first)

    # ---- what it recorded ----------------------------------------------------------------

    def trace_ops(self) -> list[TraceOp]:
        """The recorded ops with their durations (needs every stamp to be complete), after
        the ops of the plan the replay followed before it fell back (``seed``)."""
        seed = self.seed.ops
        if not self.ops:
            return [*seed]
        runtime, spoiled, first = self.scope.runtime, self.inference.spoiled, len(seed)
        return [*seed] + [
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
        for index, (_, _, _, accesses, _) in enumerate(self.ops, start=len(self.seed.ops)):
            for access in accesses:
                last[access.storage_id] = index
        sizes = self.storage_sizes()
        return {
            sid: op for sid, op in self.deaths.at.items() if sid in sizes and op > last.get(sid, op)
        }

    def storage_sizes(self) -> dict[int, int]:
        """The size of every storage the entry tracked (the planned one where it was
        larger: a plan serves the largest sizes seen)."""
        return self.scope.sizes(self.seed.sizes)

    def unmovable(self) -> set[int]:
        """Storages that cannot be released: shared with NumPy or other foreign memory."""
        return self.pinned | self.scope.unresizable() | self.seed.pinned

    def close(self) -> None:
        self.closed = True
