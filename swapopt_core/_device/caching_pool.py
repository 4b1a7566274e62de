"""The emulated device's caching allocator: when freed memory may be handed out again.

On an accelerator, freed device memory goes back to the caching allocator, which hands it
out again by one of two rules, and the loopback runtimes follow both:

* **In stream order.** A block freed by the compute queue (after that queue was made to
  wait for the copies that used it) may be handed out at once: anything that later uses
  it is queued after the wait. ``give``.
* **After the copies, as the host sees them.** A block freed while copy queues still use
  it (``Tensor.record_stream``) returns to the pool only when the allocator, at a later
  allocation, finds those copies finished. A host that queued a whole step in a
  millisecond finds none finished, so every allocation of the step takes new memory.
  ``hold`` keeps such a block out of the pool until ``collect`` is told its copies are
  *seen* done; the loopback runtimes say a copy is seen only once the host waited for it,
  the worst a host running ahead of its device may meet.

A request takes a cached block of its size, else the smallest at most a quarter larger
(handed out whole, and counted whole), else new memory. CUDA would split a larger block
and reuse the rest; not splitting only ever reserves more, so the reserved figure here is
at least what CUDA's would be, and the storages stay exact for the step meter.
``allocated`` counts the blocks handed out, ``reserved`` those plus the cached and held
ones, as ``torch.cuda.memory_allocated`` and ``memory_reserved`` do.

This module moves no bytes; its callers (``loopback``, ``loopback_async``) do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["CachingPool"]


class CachingPool:
    """Device blocks of an emulated device: handed out, cached, or held for copies.

    Thread-safe: a copy lane's thread may give blocks back.

    Attributes:
        allocated: Bytes of the blocks handed out.
        reserved: Bytes of every block this pool has (handed out, cached, held).
        peak_reserved: The most ``reserved`` since ``reset_peak``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.UntypedStorage] = []
        # Freed in compute order while copies still used them (``give_fenced``): (those
        # copies, the tensor that held the block). Free for the next request, which waits.
        self._fenced: list[tuple[tuple[Any, ...], torch.Tensor]] = []
        # (tickets still using it, the tensor whose memory goes back once they are seen)
        self._held: list[tuple[tuple[Any, ...], torch.Tensor]] = []
        self.allocated = 0
        self.reserved = 0
        self.peak_reserved = 0

    @property
    def cached(self) -> int:
        """Bytes reserved but not handed out (cached or held for copies)."""
        return self.reserved - self.allocated

    @property
    def held_blocks(self) -> int:
        """Blocks freed while copies used them, not seen finished yet."""
        return len(self._held)

    def take(
        self,
        nbytes: int,
        settle: Callable[[Sequence[Any]], bool] | None = None,
        empty: Callable[[torch.Tensor], torch.UntypedStorage] | None = None,
    ) -> torch.UntypedStorage:
        """A block of at least ``nbytes``: the smallest cached one that fits, else the
        smallest fenced one (``settle`` waits for its copies, as compute would, and says
        whether they succeeded; ``empty`` takes the block from its tensor), else new.

        The callbacks run without the pool's lock: they run ops, which an open step meter
        (or another dispatch mode) sees, and which may call back into the runtime.
        """
        while True:
            with self._lock:
                fits = [s for s in self._free if _fits(s.nbytes(), nbytes)]
                if fits:
                    block = min(fits, key=lambda s: s.nbytes())
                    self._free.remove(block)
                    self.allocated += block.nbytes()
                    return block
                fenced = [e for e in self._fenced if _fits(e[1].untyped_storage().nbytes(), nbytes)]
                if not fenced:
                    block = torch.UntypedStorage(nbytes)
                    self.reserved += block.nbytes()
                    self.peak_reserved = max(self.peak_reserved, self.reserved)
                    self.allocated += block.nbytes()
                    return block
                entry = min(fenced, key=lambda e: e[1].untyped_storage().nbytes())
                self._fenced = [e for e in self._fenced if e is not entry]
            assert settle is not None and empty is not None
            tickets, tensor = entry
            if not settle(tickets):
                # A copy that used it failed: its tensor keeps the memory; look again.
                with self._lock:
                    self.allocated += tensor.untyped_storage().nbytes()
                continue
            block = empty(tensor)
            with self._lock:
                self.allocated += block.nbytes()
            return block

    def give_fenced(self, tensor: torch.Tensor, tickets: Sequence[Any]) -> None:
        """``tensor``'s block is free in compute order, after the copies of ``tickets``
        (which still use it): the next request may take it, waiting for them first."""
        with self._lock:
            self.allocated -= tensor.untyped_storage().nbytes()
            self._fenced.append((tuple(tickets), tensor))

    def give(self, block: torch.UntypedStorage) -> None:
        """``block`` is free from here on in compute order: the next request may take it."""
        with self._lock:
            self.allocated -= block.nbytes()
            if block.nbytes():
                self._free.append(block)

    def hold(self, tensor: torch.Tensor, tickets: Sequence[Any]) -> None:
        """``tensor``'s block goes back once the copies of ``tickets`` are seen finished."""
        with self._lock:
            self._held.append((tuple(tickets), tensor))

    def collect(
        self,
        seen: Callable[[Any], bool],
        failed: Callable[[Any], bool],
        recycle: Callable[[torch.Tensor], None],
    ) -> None:
        """Give back the held blocks whose copies are all ``seen``, as an allocation does.

        A block one of whose copies ``failed`` is not given back: its tensor keeps the
        memory (the only copy of an update whose copy out failed).
        """
        with self._lock:
            ready: list[tuple[tuple[Any, ...], torch.Tensor]] = []
            waiting: list[tuple[tuple[Any, ...], torch.Tensor]] = []
            for entry in self._held:
                (ready if all(seen(t) for t in entry[0]) else waiting).append(entry)
            self._held = waiting
        for tickets, tensor in ready:
            if not any(failed(t) for t in tickets):
                recycle(tensor)

    def empty_cache(self) -> None:
        """Give the cached blocks back to the system (``torch.cuda.empty_cache``)."""
        with self._lock:
            self.reserved -= sum(block.nbytes() for block in self._free)
            self._free = []

    def free_storages(self) -> list[torch.UntypedStorage]:
        """The cached blocks, those freed in compute order included (not the held ones,
        which still count as held by the step)."""
        with self._lock:
            return [*self._free, *(tensor.untyped_storage() for _, tensor in self._fenced)]

    def reset_peak(self) -> None:
        """Start ``peak_reserved`` again from what is reserved now."""
        with self._lock:
            self.peak_reserved = self.reserved


def _fits(block: int, nbytes: int) -> bool:
    """Whether a cached block of ``block`` bytes serves a request of ``nbytes`` whole."""
    return nbytes <= block <= nbytes + nbytes // 4
