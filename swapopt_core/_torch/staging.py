"""Where a batch of swapped state lives on the device during a step.

``PerTensorStaging`` gives every state tensor its own device storage, allocated before its
copy in and released (ordered after its copy out) once the batch leaves. ``PackedStaging``
keeps all swapped state of one dtype in one exact-size host buffer and moves a batch with
one copy per dtype into one of three device arenas that take turns: one batch comes in,
one updates and one goes out at the same time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swapopt_core._device.interface import CopyPair, TransferRuntime
from swapopt_core._layout import DeviceLedger, plan_layout
from swapopt_core._torch.state import Slot, wrap_like

__all__ = ["PackedStaging", "PerTensorStaging", "Staged", "release_all"]

_ALIGN = 512  # bytes; every dtype section of an arena starts on this boundary
ARENAS = 3  # one batch coming in, one updating, one going out


def _carve(buffer: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """A 1-D tensor over ``buffer[offset:offset + numel]`` with a storage of its own.

    The piece aliases the buffer's memory and keeps it alive, but starts at storage offset
    0: it pickles on its own, and a DTensor wrapping it saves and deep-copies normally
    (a DTensor over a view with an offset cannot be saved in torch 2.13).
    """
    size = buffer.element_size()
    piece = buffer.untyped_storage()[offset * size : (offset + numel) * size]
    return torch.empty(0, dtype=buffer.dtype).set_(piece)


@dataclass
class Staged:
    """One batch on the device: a device view per slot and the copies that move it."""

    views: dict[Slot, torch.Tensor] = field(default_factory=dict)
    pairs: list[CopyPair] = field(default_factory=list)
    owned: list[torch.Tensor] = field(default_factory=list)  #: to release when it leaves
    memory: list[torch.Tensor] = field(default_factory=list)  #: what the views live in
    arena: int | None = None  #: packed: which of the arenas holds the batch
    reuse_after: Any = None  #: ticket of the last copy that used the arena before

    @property
    def copy_bytes(self) -> int:
        return sum(d.numel() * d.element_size() for d, _ in self.pairs)


def release_all(
    owned: list[torch.Tensor],
    runtime: TransferRuntime,
    ledger: DeviceLedger,
    after: Any = None,
) -> None:
    """Give back every tensor in ``owned`` (emptying it), even when a release raises.

    The memory is reused only after the copies of ticket ``after`` (stream-ordered).

    Each tensor leaves ``owned`` and the ledger before the runtime is asked to free it; if
    the runtime fails, dropping the last reference frees it anyway. The first error is
    raised once all were tried.
    """
    error: BaseException | None = None
    while owned:
        flat = owned.pop(0)
        ledger.sub(flat.numel() * flat.element_size())
        try:
            runtime.release_device(flat, (after,))
        except BaseException as exc:  # keep releasing; report the first failure
            error = error or exc
    if error is not None:
        raise error


class PerTensorStaging:
    """Each slot gets its own device storage for the time its batch is on the device."""

    packed = False

    def __init__(self, runtime: TransferRuntime, ledger: DeviceLedger) -> None:
        self.runtime = runtime
        self.ledger = ledger

    def begin(self, batches: Sequence[Sequence[Slot]]) -> None:
        return None

    def stage(self, index: int, slots: Sequence[Slot]) -> Staged:
        staged = Staged()
        try:
            for slot in slots:
                flat = self.runtime.alloc_device(slot.host.numel(), slot.host.dtype, slot.device)
                self.ledger.add(slot.nbytes)
                staged.owned.append(flat)
                staged.memory.append(flat)
                view = flat.view(slot.host.shape)
                staged.views[slot] = view
                staged.pairs.append((view, slot.host))
        except BaseException:
            self.unstage(staged)
            raise
        return staged

    def keep(self, staged: Staged) -> None:
        return None  # each batch owns its storage already

    def reclaim(self, staged: Staged) -> None:
        """``staged`` left, but its copy out failed, so the runtime kept its memory: the
        batch owns it again (and it counts as resident) until it is written back."""
        staged.owned = list(staged.memory)
        self.ledger.add(sum(flat.numel() * flat.element_size() for flat in staged.memory))

    def unstage(self, staged: Staged, after: Any = None) -> None:
        release_all(staged.owned, self.runtime, self.ledger, after)

    def end(self) -> None:
        return None


class PackedStaging:
    """All slots of a dtype share one host buffer; batches alternate between two arenas."""

    packed = True

    def __init__(self, runtime: TransferRuntime, ledger: DeviceLedger) -> None:
        self.runtime = runtime
        self.ledger = ledger
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self._signature: tuple[int, ...] = ()
        # per arena: dtype -> (byte offset, bytes)
        self._sections: list[dict[torch.dtype, tuple[int, int]]] = []
        self._regions: list[dict[torch.dtype, tuple[int, int]]] = []  # per batch: lo, hi
        self._arenas: list[torch.Tensor | None] = []
        self._arena_bytes: list[int] = []
        self._last: list[Any] = []  # per arena: ticket of the last copy that used it
        self._device: torch.device | None = None
        self._kept: set[int] = set()  # arenas handed over to batches kept by a failure

    # ---- host layout ---------------------------------------------------------------------

    def layout(
        self,
        slots: Sequence[Slot],
        publish: Callable[[Slot], None],
        drain: Callable[[], None] | None = None,
    ) -> bool:
        """Pack ``slots`` (in layout order) into one host buffer per dtype if they changed.

        Args:
            drain: Makes the old buffers final before they are copied (default: the
                runtime's ``synchronize``); the engine also writes back into them a batch
                whose copy out failed.

        Returns:
            Whether the layout was rebuilt.
        """
        plan = plan_layout(slots, self._signature, lambda s: (s.host.dtype, s.host.numel()))
        if plan is None:
            return False
        # The old buffers are read below: the last step's copies out may still be writing
        # them, and a prefetch reading them.
        (drain or self.runtime.synchronize)()
        signature, totals = plan
        buffers = {dtype: self.runtime.alloc_host(n, dtype) for dtype, n in totals.items()}
        cursor = dict.fromkeys(totals, 0)
        for slot in slots:
            dtype, numel = slot.host.dtype, slot.host.numel()
            view = _carve(buffers[dtype], cursor[dtype], numel).view(slot.host.shape)
            view.copy_(slot.host)  # broadcasts the expanded zeros of fresh state
            slot.offset = cursor[dtype]
            cursor[dtype] += numel
            slot.host = view
            slot.value = wrap_like(slot.host, slot.value)
            publish(slot)
        self.buffers = buffers
        self._signature = signature
        return True

    # ---- device arenas -------------------------------------------------------------------

    def begin(self, batches: Sequence[Sequence[Slot]]) -> None:
        """Plan the arenas: arena ``k`` holds batches ``k``, ``k + 3``, ... and is as large as
        the widest of those (not of all batches), so uneven batches waste less memory."""
        self._regions = []
        count = min(ARENAS, len(batches))
        widest: list[dict[torch.dtype, int]] = [{} for _ in range(count)]
        for index, slots in enumerate(batches):
            regions: dict[torch.dtype, tuple[int, int]] = {}
            for slot in slots:
                end = slot.offset + slot.host.numel()
                lo, hi = regions.get(slot.host.dtype, (slot.offset, end))
                regions[slot.host.dtype] = (min(lo, slot.offset), max(hi, end))
                self._device = slot.device
            sizes = widest[index % ARENAS]
            for dtype, (lo, hi) in regions.items():
                sizes[dtype] = max(sizes.get(dtype, 0), (hi - lo) * dtype.itemsize)
            self._regions.append(regions)
        self._sections, self._arena_bytes = [], []
        for sizes in widest:
            offset, sections = 0, {}
            for dtype in sorted(sizes, key=str):
                sections[dtype] = (offset, sizes[dtype])
                offset += -(-sizes[dtype] // _ALIGN) * _ALIGN
            self._sections.append(sections)
            self._arena_bytes.append(offset)
        self._arenas = [None] * count  # each allocated when its first batch is staged
        self._last = [None] * count

    def _arena(self, k: int) -> torch.Tensor:
        arena = self._arenas[k]
        if arena is None:
            assert self._device is not None
            arena = self._arenas[k] = self.runtime.alloc_device(
                self._arena_bytes[k], torch.uint8, self._device
            )
            self.ledger.add(self._arena_bytes[k])
        return arena

    def stage(self, index: int, slots: Sequence[Slot]) -> Staged:
        staged = Staged()
        for dtype, (lo, hi) in self._regions[index].items():
            if hi == lo:  # only zero-size state of this dtype: nothing to move
                for slot in slots:
                    if slot.host.dtype == dtype:
                        staged.views[slot] = torch.empty_like(slot.host, device=self._device)
                continue
            start, nbytes = self._sections[index % ARENAS][dtype]
            section = self._arena(index % ARENAS).narrow(0, start, nbytes).view(dtype)
            region = self.buffers[dtype].narrow(0, lo, hi - lo)
            staged.pairs.append((section.narrow(0, 0, hi - lo), region))
            for slot in slots:
                if slot.host.dtype == dtype:
                    view = section.narrow(0, slot.offset - lo, slot.host.numel())
                    staged.views[slot] = view.view(slot.host.shape)
        if staged.pairs:
            staged.arena = index % ARENAS
            staged.reuse_after = self._last[staged.arena]
            staged.memory = [self._arena(staged.arena)]
        return staged

    def keep(self, staged: Staged) -> None:
        """Hand ``staged``'s arena over to it, so ``end`` leaves it for ``unstage``."""
        if staged.arena is not None and staged.arena < len(self._arenas):
            arena = self._arenas[staged.arena]
            if arena is not None:
                self._kept.add(staged.arena)
                staged.owned.append(arena)
        staged.arena = None  # no longer one of the ring's: it leaves with the batch

    def reclaim(self, staged: Staged) -> None:
        """``staged`` left, but its copy out failed: the runtime kept its arena (the only copy
        of the update). The batch owns the arena again until it is written back."""
        k = staged.arena
        ring = self._arenas[k] if k is not None and k < len(self._arenas) else None
        if ring is not None and staged.memory and ring is staged.memory[0]:
            self.keep(staged)  # still one of this step's ring: ``end`` must leave it
            return
        # ``end`` released it, after the failed copy: kept by the runtime, no longer counted.
        staged.arena = None
        staged.owned.extend(staged.memory)
        self.ledger.add(sum(arena.numel() for arena in staged.memory))

    def unstage(self, staged: Staged, after: Any = None) -> None:
        """The batch left its arena; the next batch there writes it only after ``after``."""
        if staged.arena is not None and staged.arena not in self._kept:
            self._last[staged.arena] = after
        release_all(staged.owned, self.runtime, self.ledger, after)  # a kept arena, if any

    def end(self) -> None:
        arenas = [
            (a, self._last[k])
            for k, a in enumerate(self._arenas)
            if k not in self._kept and a is not None
        ]
        self._arenas, self._regions, self._kept, self._last = [], [], set(), []
        error: BaseException | None = None
        for arena, last in arenas:
            try:
                release_all([arena], self.runtime, self.ledger, last)
            except BaseException as exc:  # keep releasing; report the first failure
                error = error or exc
        if error is not None:
            raise error
