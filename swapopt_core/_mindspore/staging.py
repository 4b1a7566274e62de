"""Swap slots of MindSpore optimizers and where a batch of them lives during a step.

A slot is one optimizer-owned state Parameter (``moment1[i]``, ``exp_avg[i]``, ...). Between
steps its data is ``host``, a CPU tensor; during its batch the update works on a device
view that ``MsPerTensorStaging`` or ``MsPackedStaging`` provides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from swapopt_core._errors import SwapOptError
from swapopt_core._mindspore.runtime import MindSporeRuntime
from swapopt_core._staging import Residency

__all__ = ["MsPackedStaging", "MsPerTensorStaging", "MsSlot", "MsStaged"]


@dataclass(eq=False)
class MsSlot:
    """One swapped state Parameter of the optimizer.

    Attributes:
        key: State name (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``master_param``).
        index: Position of the parameter it belongs to in ``optimizer._parameters``.
        state: The optimizer-owned Parameter; its data is ``host`` between steps.
        host: CPU tensor with the values (shape of the state).
        device: Where the parameter lives (``"CPU"``, ``"Ascend:0"``).
        offset: Element offset in the packed host buffer of its dtype, ``-1`` if unpacked.
    """

    key: str
    index: int
    state: Any
    host: Any
    device: str
    offset: int = -1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.state.shape)

    @property
    def dtype(self) -> Any:
        return self.state.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.state.itemsize


@dataclass
class MsStaged:
    """One batch on the device: a device view per slot and the copies that move it."""

    views: dict[MsSlot, Any] = field(default_factory=dict)
    pairs: list[tuple[Any, Any]] = field(default_factory=list)
    owned: list[tuple[Any, int]] = field(default_factory=list)
    copy_bytes: int = 0


class MsPerTensorStaging:
    """Each slot gets its own device buffer for the time its batch is on the device."""

    packed = False

    def __init__(self, runtime: MindSporeRuntime, residency: Residency) -> None:
        self.runtime = runtime
        self.residency = residency

    def begin(self, batches: Sequence[Sequence[MsSlot]]) -> None:
        return None

    def stage(self, index: int, slots: Sequence[MsSlot]) -> MsStaged:
        staged = MsStaged()
        try:
            for slot in slots:
                flat = self.runtime.alloc_device(slot.numel, slot.dtype, slot.device)
                self.residency.add(slot.nbytes)
                staged.owned.append((flat, slot.nbytes))
                view = self.runtime.view(flat, 0, slot.numel, slot.shape)
                staged.views[slot] = view
                staged.pairs.append((view, slot.host))
                staged.copy_bytes += slot.nbytes
        except BaseException:
            self.unstage(staged)
            raise
        return staged

    def unstage(self, staged: MsStaged) -> None:
        for flat, nbytes in staged.owned:
            self.residency.sub(nbytes)
            self.runtime.release_device(flat)
        staged.owned.clear()
        staged.views.clear()
        staged.pairs.clear()

    def end(self) -> None:
        return None


class MsPackedStaging:
    """All slots of a dtype share one host buffer; batches alternate between two arenas."""

    packed = True

    def __init__(self, runtime: MindSporeRuntime, residency: Residency) -> None:
        if not runtime.views_at_offset:
            raise SwapOptError(
                f"packed_swap=True needs device views at an offset, which the {runtime.name!r} "
                "runtime does not provide. Set SwapOptimizerConfig(packed_swap=False)."
            )
        self.runtime = runtime
        self.residency = residency
        self.buffers: dict[Any, Any] = {}
        self._signature: tuple[int, ...] = ()
        self._regions: list[dict[Any, tuple[int, int]]] = []  # per batch: dtype -> lo, hi
        self._arenas: list[dict[Any, Any]] = []
        self._arena_bytes = 0

    def layout(self, slots: Sequence[MsSlot], publish: Callable[[MsSlot], None]) -> bool:
        """Pack ``slots`` (in layout order) into one host buffer per dtype if they changed.

        Every slot's current values (``slot.host``) are copied into its place, then
        ``publish`` makes the place the state Parameter's data.

        Returns:
            Whether the layout was rebuilt.
        """
        signature = tuple(id(slot) for slot in slots)
        if signature == self._signature and all(s.offset >= 0 for s in slots):
            return False
        devices = {slot.device for slot in slots}
        if len(devices) > 1:
            raise SwapOptError(
                "packed_swap=True needs every swapped state on one device, but they live on "
                f"{sorted(devices)}. Set SwapOptimizerConfig(packed_swap=False)."
            )
        totals: dict[Any, int] = {}
        for slot in slots:
            totals[slot.dtype] = totals.get(slot.dtype, 0) + slot.numel
        buffers = {dtype: self.runtime.alloc_host(n, dtype) for dtype, n in totals.items()}
        cursor = dict.fromkeys(totals, 0)
        for slot in slots:
            start = cursor[slot.dtype]
            view = self.runtime.view(buffers[slot.dtype], start, slot.numel, slot.shape)
            view.copy_(slot.host)
            slot.offset = cursor[slot.dtype]
            cursor[slot.dtype] += slot.numel
            slot.host = view
            publish(slot)
        self.buffers = buffers
        self._signature = signature
        return True

    def begin(self, batches: Sequence[Sequence[MsSlot]]) -> None:
        self._regions = []
        widest: dict[Any, int] = {}
        device = None
        for slots in batches:
            regions: dict[Any, tuple[int, int]] = {}
            for slot in slots:
                end = slot.offset + slot.numel
                lo, hi = regions.get(slot.dtype, (slot.offset, end))
                regions[slot.dtype] = (min(lo, slot.offset), max(hi, end))
                device = slot.device
            for dtype, (lo, hi) in regions.items():
                widest[dtype] = max(widest.get(dtype, 0), hi - lo)
            self._regions.append(regions)
        if not widest:
            return
        itemsizes = {s.dtype: s.state.itemsize for b in batches for s in b}
        self._arena_bytes = sum(n * itemsizes[d] for d, n in widest.items())
        for _ in range(min(2, len(batches))):
            arena = {d: self.runtime.alloc_device(n, d, device) for d, n in widest.items()}
            self._arenas.append(arena)
            self.residency.add(self._arena_bytes)

    def stage(self, index: int, slots: Sequence[MsSlot]) -> MsStaged:
        staged = MsStaged()
        arena = self._arenas[index % 2]
        for dtype, (lo, hi) in self._regions[index].items():
            region = self.runtime.view(arena[dtype], 0, hi - lo, (hi - lo,))
            host = self.runtime.view(self.buffers[dtype], lo, hi - lo, (hi - lo,))
            staged.pairs.append((region, host))
            staged.copy_bytes += int(region.nbytes)
            for slot in slots:
                if slot.dtype == dtype:
                    staged.views[slot] = self.runtime.view(
                        arena[dtype], slot.offset - lo, slot.numel, slot.shape
                    )
        return staged

    def unstage(self, staged: MsStaged) -> None:
        staged.views.clear()
        staged.pairs.clear()

    def end(self) -> None:
        for arena in self._arenas:
            self.residency.sub(self._arena_bytes)
            for buffer in arena.values():
                self.runtime.release_device(buffer)
        self._arenas = []
        self._regions = []
