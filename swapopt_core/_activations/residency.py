"""Where each activation storage is right now: on the device, in host memory, or both.

Storages are the ``UntypedStorage`` objects PyTorch keeps for their whole life (views share
one). Releasing resizes one to zero bytes in place, restoring resizes it back and copies its
bytes in, so every tensor and autograd node that refers to it sees the data again. One that
cannot be resized (shared with NumPy, ``from_blob`` memory) stays on the device.

The flags of a storage change before its bytes do, so an exception (a ``KeyboardInterrupt``
too) anywhere in a move leaves a state ``restore_all`` can finish from.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from swapopt_core._activations.quiet import Quiet
from swapopt_core._device.interface import TorchRuntime, byte_view

if TYPE_CHECKING:
    from swapopt_core._activations.recipe import Recipe

logger = logging.getLogger(__name__)

__all__ = ["HostPool", "Residency", "Tracked"]


class HostPool:
    """Host buffers for offloaded activations: exact sizes, reused by size, capped.

    Replays offload the same sizes every step, so a free list per exact size serves them
    without new allocations (and, on CUDA, without registering new pages). A storage
    smaller than its plan's size (a shorter sequence) fills the front of a plan-size buffer.
    A buffer comes back with the tickets of the copies that last used it and is handed out
    again only once they are done: a finished one is preferred, the host waits if none is.
    """

    def __init__(self, runtime: TorchRuntime, cap_bytes: int) -> None:
        self.runtime = runtime
        self.cap_bytes = cap_bytes
        self.allocated = 0
        self.peak = 0
        self.exhausted = False  # a host allocation failed (MemoryError) at least once
        self._free: dict[int, list[tuple[torch.Tensor, tuple[Any, ...]]]] = {}
        # Every buffer allocated and not yet freed (handed out or idle), held weakly.
        self._made: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._serial = 0

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A host buffer of ``nbytes``, or ``None`` when the cap leaves no room."""
        free = self._free.get(nbytes)
        if free:
            done = self.runtime.done
            for index, (host, tickets) in enumerate(free):
                if all(done(t) for t in tickets):
                    del free[index]
                    return host
            host, tickets = free.pop(0)  # the oldest: its copies were queued first
            for ticket in tickets:
                # The buffer is about to be written again: its last copies must be done.
                self.runtime.host_wait(ticket)
            return host
        if self.allocated + nbytes > self.cap_bytes:
            self._trim(self.allocated + nbytes - self.cap_bytes)
            if self.allocated + nbytes > self.cap_bytes:
                return None
        host = self.runtime.alloc_host(nbytes, torch.uint8)
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        self._serial += 1
        self._made[self._serial] = host
        return host

    def buffers(self) -> list[torch.Tensor]:
        """The host buffers the pool allocated that are still alive (idle or handed out):
        what the runtime's ``pinned_nbytes``/``pageable_buffers`` are asked about."""
        return list(self._made.values())

    def release(self, host: torch.Tensor, tickets: tuple[Any, ...] = ()) -> None:
        """Take ``host`` back; ``tickets`` are the copies that may still be using it."""
        pending = tuple(t for t in tickets if t is not None)
        self._free.setdefault(host.numel(), []).append((host, pending))

    def _trim(self, needed: int) -> None:
        for size in sorted(self._free, reverse=True):
            while self._free[size] and needed > 0:
                _, tickets = self._free[size].pop()
                for ticket in tickets:
                    # The buffer is freed now: no copy may still be using it.
                    self.runtime.host_wait(ticket)
                self.allocated -= size
                needed -= size

    def clear(self) -> None:
        self._free.clear()

    def keep_only(self, sizes: Container[int]) -> None:
        """Free the idle buffers of every size not in ``sizes``: no plan takes them again
        (a plan made again for larger storages takes buffers of the larger sizes)."""
        for size in [s for s in self._free if s not in sizes]:
            for _, tickets in self._free.pop(size):
                for ticket in tickets:
                    # The buffer is freed now: no copy may still be using it.
                    self.runtime.host_wait(ticket)
                self.allocated -= size


@dataclass(eq=False, slots=True)
class Tracked:
    """One activation storage the session created."""

    sid: int
    nbytes: int
    produced_at: int
    ref: weakref.ref
    resident: bool = True
    alive: bool = True
    host: torch.Tensor | None = None
    host_valid: bool = False  # the host copy equals the device bytes
    capacity: int = 0  # bytes of the host buffer to take: the plan's size when larger
    d2h: Any = None  # ticket of a copy out still reading the storage
    h2d: Any = None  # ticket of a copy in still writing it
    recipe: Recipe | None = None  # how to regenerate it without a host copy

    def storage(self) -> torch.UntypedStorage | None:
        return self.ref()


class Residency:
    """Bookkeeping and moves for the activation storages of one session entry.

    Args:
        runtime: What copies, waits and allocates host memory.
        pool: The host buffers of the session.
        quiet: The entry's guard, held while a move runs ops of its own (a recompute, a
            page-in when a storage is untracked). Default: one of its own.
    """

    def __init__(self, runtime: TorchRuntime, pool: HostPool, quiet: Quiet | None = None) -> None:
        self.runtime = runtime
        self.pool = pool
        self.quiet = quiet if quiet is not None else Quiet()
        self.by_storage: weakref.WeakKeyDictionary[torch.UntypedStorage, Tracked] = (
            weakref.WeakKeyDictionary()
        )
        self.by_sid: dict[int, Tracked] = {}
        self.resident_bytes = 0
        self.peak_bytes = 0
        self.released: set[int] = set()
        self.pending_in: set[int] = set()
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.host_cap_refusals = 0
        self.recomputes = 0  # storages made again from their recipes
        self.eviction_stalls = 0  # evictions whose release waited on their own copy out

    # ---- registration --------------------------------------------------------------------

    def track(self, storage: torch.UntypedStorage, sid: int, op: int) -> Tracked:
        entry = Tracked(sid, storage.nbytes(), op, weakref.ref(storage))
        self.by_storage[storage] = entry
        self.by_sid[sid] = entry
        weakref.finalize(storage, self._died, entry)
        self._add(entry.nbytes)
        return entry

    def track_sid(
        self, storage: torch.UntypedStorage, sid: int, op: int, capacity: int = 0
    ) -> Tracked:
        """``track`` for a replay, which knows its storages by id only: no lookup by storage,
        and a plain weak reference reports the death (cheaper than ``weakref.finalize``).

        ``capacity``: the storage's size in the plan. A storage smaller than planned (a
        shorter sequence) takes host buffers of the planned size, so the pool hands out
        the same buffers whatever the step's sizes.
        """
        entry = Tracked(sid, storage.nbytes(), op, None, capacity=capacity)  # type: ignore[arg-type]
        died = self._died
        entry.ref = weakref.ref(storage, lambda _ref: died(entry))
        self.by_sid[sid] = entry
        self.resident_bytes += entry.nbytes
        if self.resident_bytes > self.peak_bytes:
            self.peak_bytes = self.resident_bytes
        return entry

    def _add(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes)

    def _died(self, entry: Tracked) -> None:
        entry.alive = False
        entry.recipe = None  # its inputs may go now
        if entry.resident:
            self.resident_bytes -= entry.nbytes
            entry.resident = False
        self.released.discard(entry.sid)
        self.pending_in.discard(entry.sid)
        runtime = self.runtime
        for ticket in (entry.d2h, entry.h2d):
            if ticket is not None and not runtime.done(ticket):
                # The freed block may be reused by the next op: that op must come after the
                # copy still using it (stream-ordered on CUDA, no host block).
                runtime.wait(ticket)
        self._drop_host(entry)

    def _drop_host(self, entry: Tracked) -> None:
        if entry.host is not None:
            # No host wait: the pool hands the buffer out again once these copies are done.
            self.pool.release(entry.host, (entry.d2h, entry.h2d))
            entry.host, entry.host_valid = None, False
        entry.d2h = entry.h2d = None

    # ---- moves ---------------------------------------------------------------------------

    def copy_out(self, entry: Tracked) -> bool:
        """Start copying ``entry`` to host memory; False if it stays on the device.

        It stays when the host cap (or the host's memory) refuses a buffer, and when the
        storage cannot be resized, so could never be released.
        """
        storage = entry.storage()
        if storage is None or not entry.resident or not storage.resizable():
            return False
        if entry.host_valid:
            return True
        if entry.host is None:
            try:
                size = entry.nbytes if entry.nbytes >= entry.capacity else entry.capacity
                entry.host = self.pool.acquire(size)
            except MemoryError:
                if not self.pool.exhausted:  # once per session: it repeats every step
                    logger.warning(
                        "no host memory for a %d-byte activation: it stays on the device, "
                        "as at the host cap (counted in host_cap_refusals)",
                        entry.nbytes,
                    )
                self.pool.exhausted = True
            if entry.host is None:
                self.host_cap_refusals += 1
                return False
        host = entry.host
        if host.numel() != entry.nbytes:  # a buffer of the plan's larger size
            host = host[: entry.nbytes]
        entry.d2h = self.runtime.copy_out([(byte_view(storage), host)])
        entry.host_valid = True
        self.d2h_bytes += entry.nbytes
        return True

    def release(self, entry: Tracked) -> None:
        """Free ``entry``'s device bytes; its host copy must exist (or be on its way), or
        it must have a recipe whose inputs are unchanged (``replay.Recipe``)."""
        storage = entry.storage()
        if storage is None or not entry.resident:
            return
        if not entry.host_valid and (entry.recipe is None or not entry.recipe.intact()):
            return
        if not storage.resizable():  # shared with NumPy since it was copied: it stays
            return
        # Stream-ordered: compute waits for the copy still reading this storage.
        self.runtime.wait(entry.d2h)
        self.runtime.wait(entry.h2d)
        entry.h2d = None
        entry.resident = False
        self.resident_bytes -= entry.nbytes
        self.released.add(entry.sid)
        storage.resize_(0)
        self.runtime.note_resized(storage)  # a step meter follows the release

    def evict(self, entry: Tracked) -> bool:
        """Copy ``entry`` out and release it at once (to make room now); False if
        ``copy_out`` refused it (it stays on the device).

        When the copy out is issued here, the release makes compute wait for that very
        copy: the whole D2H runs between two ops on the compute stream, with nothing to
        overlap it. Such evictions are counted in ``eviction_stalls`` (a plan's own
        ``COPY_D2H`` ahead of its ``RELEASE_DEVICE`` is how a replay avoids them). Releasing
        later instead would break the budget the eviction holds.
        """
        issued = not entry.host_valid  # the copy out is issued now, not by an earlier action
        if not self.copy_out(entry):
            return False
        was_resident = entry.resident
        self.release(entry)
        if issued and was_resident and not entry.resident:
            self.eviction_stalls += 1
        return True

    def copy_in(self, entry: Tracked) -> None:
        """Re-allocate ``entry`` and start copying its bytes back (a prefetch); one without a
        host copy is regenerated from its recipe instead."""
        storage = entry.storage()
        if storage is None or entry.resident:
            return
        if not entry.host_valid:
            self.recompute(entry)
            return
        host = entry.host
        assert host is not None  # a valid host copy lives in a host buffer
        storage.resize_(entry.nbytes)
        self.runtime.note_resized(storage)  # a step meter counts it again
        if host.numel() != entry.nbytes:  # a buffer of the plan's larger size
            host = host[: entry.nbytes]
        ticket = self.runtime.copy_in([(byte_view(storage), host)])
        # Marked resident only once the copy is issued: a failure before leaves it released.
        entry.h2d, entry.resident = ticket, True
        self.pending_in.add(entry.sid)
        self.released.discard(entry.sid)
        self._add(entry.nbytes)
        self.h2d_bytes += entry.nbytes

    def ready(self, entry: Tracked) -> None:
        """Make ``entry`` usable by the next compute op: page it in if needed, then wait."""
        if not entry.resident:
            self.copy_in(entry)
        if entry.h2d is not None:
            self.runtime.wait(entry.h2d)
            entry.h2d = None
        self.pending_in.discard(entry.sid)

    def untrack(self, entry: Tracked) -> None:
        """Stop tracking ``entry`` (a parameter gradient): back on the device, its host copy
        dropped, out of the resident bytes; nothing moves it again."""
        with self.quiet:  # a page-in here runs ops of ours, not the step's
            self.ready(entry)
        self._drop_host(entry)
        if entry.resident:
            self.resident_bytes -= entry.nbytes
            entry.resident = False  # so its death later subtracts nothing
        self.by_sid.pop(entry.sid, None)
        storage = entry.storage()
        if storage is not None:
            self.by_storage.pop(storage, None)

    def written(self, entry: Tracked) -> None:
        """``entry`` is about to be modified on the device: its host copy is stale, and its
        recipe no longer makes these bytes."""
        if entry.d2h is not None:
            # The write must not overtake a copy out still reading the old bytes.
            self.runtime.wait(entry.d2h)
        entry.host_valid = False
        entry.recipe = None

    def recompute(self, entry: Tracked) -> None:
        """Bring a released ``entry`` back by re-running the op that made it (its recipe)."""
        if entry.resident or not entry.alive:
            return
        recipe = entry.recipe
        if recipe is None:
            raise RuntimeError(
                f"Activation storage {entry.sid} is off the device with neither a host copy "
                "nor a recipe to recompute it; this is a bug in the replay, please report it."
            )
        storage = entry.storage()
        if storage is not None:
            with self.quiet:  # the op re-run and the page-ins below are ours, not the step's
                for source in recipe.inputs:
                    if source.alive:
                        self.ready(source)  # pages in, or recomputes, what is away
                recipe.run_into(storage, entry.nbytes)
            self.runtime.note_resized(storage)  # a step meter counts it again
            self.recomputes += 1
        # Marked resident once its bytes are back: a failure before leaves it released.
        entry.resident = True
        self.released.discard(entry.sid)
        self._add(entry.nbytes)

    def index_storages(self) -> None:
        """Make every live storage findable by object (``by_storage``), as ``track`` does:
        a warmup that follows a replay looks them up that way."""
        for entry in self.by_sid.values():
            storage = entry.storage() if entry.alive else None
            if storage is not None:
                self.by_storage[storage] = entry

    def ready_any(self, storages: Container[int]) -> None:
        """Ready the storages away or in flight whose objects' ids are in ``storages`` (a
        replay registers its storages by id only, so they are matched by object)."""
        by_sid = self.by_sid
        for sid in [*self.released, *self.pending_in]:
            entry = by_sid.get(sid)
            if entry is not None and id(entry.storage()) in storages:
                self.ready(entry)

    def unresizable(self) -> set[int]:
        """Live storages that cannot be released: shared with NumPy or foreign memory."""
        return {
            e.sid
            for e in self.by_sid.values()
            if e.alive and (s := e.storage()) is not None and not s.resizable()
        }

    def release_host(self, entry: Tracked) -> None:
        if entry.resident:
            self._drop_host(entry)

    def restore_all(self) -> None:
        """Bring every live released storage back (end of the session, or a fallback).

        A storage whose copy in fails is tried once more after the others, so one transient
        fault loses nothing; a second failure is raised, with the storage still released. A
        ``KeyboardInterrupt`` waits until every storage is back, then is raised again.
        """
        failed, interrupt = [], None
        for sid in [*self.released, *self.pending_in]:
            try:
                self.ready(self.by_sid[sid])
            except BaseException as error:  # noqa: BLE001 - an interrupt is re-raised below
                if not isinstance(error, Exception):
                    interrupt = interrupt or error
                logger.warning("restoring activation %d failed; retrying", sid, exc_info=True)
                failed.append(sid)
        for sid in failed:
            self.ready(self.by_sid[sid])
        if interrupt is not None:
            raise interrupt

    def close(self) -> None:
        """End of the session entry: restore what is still alive and drop host copies."""
        self.restore_all()
        # Every copy must be done before the host buffers go back to the pool.
        self.runtime.synchronize()
        for entry in list(self.by_sid.values()):
            self._drop_host(entry)
        self.by_sid.clear()
        self.by_storage = weakref.WeakKeyDictionary()
