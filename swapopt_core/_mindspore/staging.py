"""Swap slots of MindSpore optimizers and where a batch of them lives during a step.

A slot is one optimizer-owned state Parameter (``moment1[i]``, ``exp_avg[i]``, ...). Between
steps its data is ``host``, a CPU tensor; during its batch the update works on a device
view that ``PerTensorStaging`` (a buffer per slot) or ``PackedStaging`` (one host buffer
per dtype for all slots, one device buffer per dtype per batch, one copy each) provides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from swapopt_core._errors import SwapOptError
from swapopt_core._layout import DeviceLedger, plan_layout
from swapopt_core._mindspore.runtime import MindSporeRuntime

__all__ = ["PackedStaging", "PerTensorStaging", "Slot", "Staged", "StagingBase"]


@dataclass(eq=False)
class Slot:
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
class Staged:
    """One batch on the device: a device view per slot and the copies that move it."""

    views: dict[Slot, Any] = field(default_factory=dict)
    pairs: list[tuple[Any, Any]] = field(default_factory=list)
    owned: list[tuple[Any, int]] = field(default_factory=list)
    copy_bytes: int = 0
    reuse_after: Any = None  #: every batch has buffers of its own: nothing to wait for


class StagingBase:
    """Device buffers owned by a staged batch, freed when it is unstaged."""

    def __init__(self, runtime: MindSporeRuntime, ledger: DeviceLedger) -> None:
        self.runtime = runtime
        self.ledger = ledger

    def keep(self, staged: Staged) -> None:
        """Nothing to hand over: each batch owns its device buffers until ``unstage``."""

    def unstage(self, staged: Staged, after: Any = None) -> None:
        """Release ``staged``'s buffers, ordered after the copies of ticket ``after``.

        Each leaves the books before the runtime frees it, so a failing release is reported
        once (the first error, after trying them all)."""
        error: BaseException | None = None
        staged.views.clear()
        staged.pairs.clear()
        while staged.owned:
            flat, nbytes = staged.owned.pop(0)
            self.ledger.sub(nbytes)
            try:
                self.runtime.release_device(flat, (after,))
            except BaseException as exc:  # keep releasing; report the first failure
                error = error or exc
        if error is not None:
            raise error


class PerTensorStaging(StagingBase):
    """Each slot gets its own device buffer for the time its batch is on the device."""

    packed = False

    def begin(self, batches: Sequence[Sequence[Slot]]) -> None:
        return None

    def stage(self, index: int, slots: Sequence[Slot]) -> Staged:
        staged = Staged()
        try:
            for slot in slots:
                flat = self.runtime.alloc_device(slot.numel, slot.dtype, slot.device)
                self.ledger.add(slot.nbytes)
                staged.owned.append((flat, slot.nbytes))
                view = self.runtime.view(flat, 0, slot.numel, slot.shape)
                staged.views[slot] = view
                staged.pairs.append((view, slot.host))
                staged.copy_bytes += slot.nbytes
        except BaseException:
            self.unstage(staged)
            raise
        return staged

    def end(self) -> None:
        return None


class PackedStaging(StagingBase):
    """All slots of a dtype share one host buffer; a batch moves with one copy per dtype."""

    packed = True

    def __init__(self, runtime: MindSporeRuntime, ledger: DeviceLedger) -> None:
        if not runtime.views_at_offset:
            raise SwapOptError(
                f"packed_swap=True needs device views at an offset, which the {runtime.name!r} "
                "runtime does not provide. Set SwapOptimizerConfig(packed_swap=False)."
            )
        super().__init__(runtime, ledger)
        self.buffers: dict[Any, Any] = {}
        self._signature: tuple[int, ...] = ()
        self._regions: list[dict[Any, tuple[int, int]]] = []  # per batch: dtype -> lo, hi

    def layout(self, slots: Sequence[Slot], publish: Callable[[Slot], None]) -> bool:
        """Pack ``slots`` (in layout order) into one host buffer per dtype if they changed.

        Every slot's current values (``slot.host``) are copied into its place, then
        ``publish`` makes the place the state Parameter's data.

        Returns:
            Whether the layout was rebuilt.
        """
        plan = plan_layout(slots, self._signature, lambda s: (s.dtype, s.numel))
        if plan is None:
            return False
        signature, totals = plan
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

    def begin(self, batches: Sequence[Sequence[Slot]]) -> None:
        self._regions = []
        for slots in batches:
            regions: dict[Any, tuple[int, int]] = {}
            for slot in slots:
                end = slot.offset + slot.numel
                lo, hi = regions.get(slot.dtype, (slot.offset, end))
                regions[slot.dtype] = (min(lo, slot.offset), max(hi, end))
            self._regions.append(regions)

    def stage(self, index: int, slots: Sequence[Slot]) -> Staged:
        """Give batch ``index`` one exact-size device buffer per dtype, its views and copies.

        A buffer per batch (instead of two arenas sized for the widest batch) keeps the
        device peak at the two largest neighbouring batches, even when one tensor dominates.
        """
        staged = Staged()
        device = slots[0].device if slots else None
        try:
            for dtype, (lo, hi) in self._regions[index].items():
                flat = self.runtime.alloc_device(hi - lo, dtype, device)
                nbytes = (hi - lo) * next(s.state.itemsize for s in slots if s.dtype == dtype)
                self.ledger.add(nbytes)
                staged.owned.append((flat, nbytes))
                region = self.runtime.view(flat, 0, hi - lo, (hi - lo,))
                host = self.runtime.view(self.buffers[dtype], lo, hi - lo, (hi - lo,))
                staged.pairs.append((region, host))
                staged.copy_bytes += nbytes
                for slot in slots:
                    if slot.dtype == dtype:
                        staged.views[slot] = self.runtime.view(
                            flat, slot.offset - lo, slot.numel, slot.shape
                        )
        except BaseException:
            self.unstage(staged)
            raise
        return staged

    def end(self) -> None:
        self._regions = []
