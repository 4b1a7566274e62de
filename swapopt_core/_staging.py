"""Where a batch of swapped state lives on the device during a step.

``PerTensorStaging`` gives every state tensor its own device storage, allocated before its
copy in and released right after its copy out. ``PackedStaging`` keeps all swapped state of
one dtype in one exact-size host buffer and moves a batch with one copy per dtype into one
of two device arenas that alternate between batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swapopt_core._errors import SwapOptError
from swapopt_core._runtime import CopyPair, TransferRuntime
from swapopt_core._state import Slot, wrap_like

__all__ = ["PackedStaging", "PerTensorStaging", "Residency", "Staged", "plan_layout"]

_ALIGN = 512  # bytes; every dtype section of an arena starts on this boundary


def _carve(buffer: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """A 1-D tensor over ``buffer[offset:offset + numel]`` with a storage of its own.

    The piece aliases the buffer's memory and keeps it alive, but starts at storage offset
    0: it pickles on its own, and a DTensor wrapping it saves and deep-copies normally
    (a DTensor over a view with an offset cannot be saved in torch 2.13).
    """
    size = buffer.element_size()
    piece = buffer.untyped_storage()[offset * size : (offset + numel) * size]
    return torch.empty(0, dtype=buffer.dtype).set_(piece)


def plan_layout(
    slots: Sequence[Any], previous: tuple[int, ...], size: Callable[[Any], tuple[Any, int]]
) -> tuple[tuple[int, ...], dict[Any, int]] | None:
    """Whether packed ``slots`` need a new host layout, and its elements per dtype.

    Args:
        slots: The slots in layout order (each with ``offset`` and ``device``).
        previous: The signature of the current layout.
        size: ``(dtype, numel)`` of a slot.

    Returns:
        ``None`` when ``slots`` are laid out already; else the new signature and the number
        of elements of each dtype.

    Raises:
        SwapOptError: The slots live on more than one device.
    """
    signature = tuple(id(slot) for slot in slots)
    if signature == previous and all(s.offset >= 0 for s in slots):
        return None
    devices = {str(slot.device) for slot in slots}
    if len(devices) > 1:
        raise SwapOptError(
            "packed_swap=True needs every swapped state on one device, but they live on "
            f"{sorted(devices)}. Set SwapOptimizerConfig(packed_swap=False) to give each state "
            "tensor its own storage."
        )
    totals: dict[Any, int] = {}
    for slot in slots:
        dtype, numel = size(slot)
        totals[dtype] = totals.get(dtype, 0) + numel
    return signature, totals


@dataclass
class Residency:
    """Device bytes of swapped state held right now, and the peak since install."""

    current: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        self.current -= nbytes


@dataclass
class Staged:
    """One batch on the device: a device view per slot and the copies that move it."""

    views: dict[Slot, torch.Tensor] = field(default_factory=dict)
    pairs: list[CopyPair] = field(default_factory=list)
    owned: list[torch.Tensor] = field(default_factory=list)

    @property
    def copy_bytes(self) -> int:
        return sum(d.numel() * d.element_size() for d, _ in self.pairs)


class PerTensorStaging:
    """Each slot gets its own device storage for the time its batch is on the device."""

    packed = False

    def __init__(self, runtime: TransferRuntime, residency: Residency) -> None:
        self.runtime = runtime
        self.residency = residency

    def begin(self, batches: Sequence[Sequence[Slot]]) -> None:
        return None

    def stage(self, index: int, slots: Sequence[Slot]) -> Staged:
        staged = Staged()
        try:
            for slot in slots:
                flat = self.runtime.alloc_device(slot.host.numel(), slot.host.dtype, slot.device)
                self.residency.add(slot.nbytes)
                staged.owned.append(flat)
                view = flat.view(slot.host.shape)
                staged.views[slot] = view
                staged.pairs.append((view, slot.host))
        except BaseException:
            self.unstage(staged)
            raise
        return staged

    def unstage(self, staged: Staged) -> None:
        for flat in staged.owned:
            self.residency.sub(flat.numel() * flat.element_size())
            self.runtime.release_device(flat)
        staged.owned.clear()

    def end(self) -> None:
        return None


class PackedStaging:
    """All slots of a dtype share one host buffer; batches alternate between two arenas."""

    packed = True

    def __init__(self, runtime: TransferRuntime, residency: Residency) -> None:
        self.runtime = runtime
        self.residency = residency
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self._signature: tuple[int, ...] = ()
        self._sections: dict[torch.dtype, tuple[int, int]] = {}  # dtype -> (byte offset, bytes)
        self._regions: list[dict[torch.dtype, tuple[int, int]]] = []  # per batch: lo, hi
        self._arenas: list[torch.Tensor] = []
        self._device: torch.device | None = None

    # ---- host layout ---------------------------------------------------------------------

    def layout(self, slots: Sequence[Slot], publish: Callable[[Slot], None]) -> bool:
        """Pack ``slots`` (in layout order) into one host buffer per dtype if they changed.

        Returns:
            Whether the layout was rebuilt.
        """
        plan = plan_layout(slots, self._signature, lambda s: (s.host.dtype, s.host.numel()))
        if plan is None:
            return False
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
        self._regions = []
        widest: dict[torch.dtype, int] = {}
        for slots in batches:
            regions: dict[torch.dtype, tuple[int, int]] = {}
            for slot in slots:
                end = slot.offset + slot.host.numel()
                lo, hi = regions.get(slot.host.dtype, (slot.offset, end))
                regions[slot.host.dtype] = (min(lo, slot.offset), max(hi, end))
                self._device = slot.device
            for dtype, (lo, hi) in regions.items():
                widest[dtype] = max(widest.get(dtype, 0), (hi - lo) * dtype.itemsize)
            self._regions.append(regions)
        offset = 0
        self._sections = {}
        for dtype in sorted(widest, key=str):
            self._sections[dtype] = (offset, widest[dtype])
            offset += -(-widest[dtype] // _ALIGN) * _ALIGN
        if offset and self._device is not None:
            for _ in range(min(2, len(batches))):
                self._arenas.append(self.runtime.alloc_device(offset, torch.uint8, self._device))
                self.residency.add(offset)

    def stage(self, index: int, slots: Sequence[Slot]) -> Staged:
        staged = Staged()
        for dtype, (lo, hi) in self._regions[index].items():
            start, nbytes = self._sections[dtype]
            section = self._arenas[index % 2].narrow(0, start, nbytes).view(dtype)
            region = self.buffers[dtype].narrow(0, lo, hi - lo)
            staged.pairs.append((section.narrow(0, 0, hi - lo), region))
            for slot in slots:
                if slot.host.dtype == dtype:
                    view = section.narrow(0, slot.offset - lo, slot.host.numel())
                    staged.views[slot] = view.view(slot.host.shape)
        return staged

    def unstage(self, staged: Staged) -> None:
        return None

    def end(self) -> None:
        for arena in self._arenas:
            self.residency.sub(arena.numel())
            self.runtime.release_device(arena)
        self._arenas = []
        self._regions = []
