"""Where a batch of swapped state lives on the device during a step, for every backend.

``PerTensorStaging`` gives every state tensor its own device buffer, allocated before its
copy in and released (ordered after its copy out) once the batch leaves. ``PackedStaging``
keeps all swapped state of one dtype in one exact-size host buffer (``plan`` / ``apply``),
and gives each batch one exact-size device buffer per dtype, moved with one copy each.
A buffer per batch (rather than a ring of arenas sized for the widest batch) keeps the
device peak at the three largest neighbouring batches, even when one tensor dominates.

Buffers come from the transfer runtime; views and sizes from the backend's ``TensorOps``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from swapopt_core._device.interface import AnyRuntime
from swapopt_core._errors import SwapOptError
from swapopt_core._swap.layout import LayoutPlan, plan_layout
from swapopt_core._swap.ledger import DeviceLedger
from swapopt_core._swap.ops import SwapSlot, TensorOps

__all__ = ["PackedStaging", "PerTensorStaging", "Staged", "Staging", "make_staging"]


@dataclass
class Staged:
    """One batch on the device: a device view per slot and the copies that move it."""

    views: dict[Any, Any] = field(default_factory=dict)
    pairs: list[tuple[Any, Any]] = field(default_factory=list)  #: (device, host) copies
    owned: list[tuple[Any, int]] = field(default_factory=list)  #: to release, with bytes
    memory: list[tuple[Any, int]] = field(default_factory=list)  #: what the views live in
    copy_bytes: int = 0


class Staging:
    """Device buffers owned by a staged batch, freed when it leaves.

    Args:
        runtime: Allocates and releases the buffers.
        ops: The backend's views and sizes.
        ledger: Counts the device bytes held.
    """

    packed = False

    def __init__(self, runtime: AnyRuntime, ops: TensorOps, ledger: DeviceLedger) -> None:
        self.runtime = runtime
        self.ops = ops
        self.ledger = ledger

    def begin(self, batches: Sequence[Sequence[SwapSlot]]) -> None:
        """A step's batches are about to be staged, in order."""

    def stage(self, index: int, slots: Sequence[SwapSlot]) -> Staged:
        """Give batch ``index`` device memory, a view per slot and its copy pairs."""
        raise NotImplementedError

    def end(self) -> None:
        """The step's batches have all left."""

    def _own(self, staged: Staged, numel: int, dtype: Any, device: Any, nbytes: int) -> Any:
        flat = self.runtime.alloc_device(numel, dtype, device)
        self.ledger.add(nbytes)
        # Where reserved memory can grow: the allocator may not have reused a block.
        self.ledger.note_reserved(self.runtime.reserved_bytes())
        staged.owned.append((flat, nbytes))
        staged.memory.append((flat, nbytes))
        staged.copy_bytes += nbytes
        return flat

    def keep(self, staged: Staged) -> None:
        """``staged`` stays on the device after the step (kept): it owns its buffers already."""

    def reclaim(self, staged: Staged) -> None:
        """``staged`` left, but its copy out failed where it ran, so the runtime kept its
        memory: the batch owns it again (and it counts as resident) until written back."""
        staged.owned = list(staged.memory)
        self.ledger.add(sum(nbytes for _, nbytes in staged.memory))

    def unstage(self, staged: Staged, after: Any = None) -> None:
        """Release ``staged``'s buffers, reused only after the copies of ticket ``after``.

        Each leaves the books before the runtime frees it; if the runtime fails, dropping
        the last reference frees it anyway. The first error is raised once all were tried.
        """
        staged.views.clear()  # the update is over: nothing reads them again
        if not self.ops.failures_reported:
            # No late failure can make the batch written back: drop every view of the memory.
            staged.pairs.clear()
            staged.memory.clear()
        error: BaseException | None = None
        while staged.owned:
            flat, nbytes = staged.owned.pop(0)
            self.ledger.sub(nbytes)
            try:
                # In compute-queue order: reused at once by work queued after this point.
                self.runtime.release_ordered(flat, (after,))
            except BaseException as exc:  # keep releasing; report the first failure
                error = error or exc
        if error is not None:
            raise error


class PerTensorStaging(Staging):
    """Each slot gets its own device buffer for the time its batch is on the device."""

    def stage(self, index: int, slots: Sequence[SwapSlot]) -> Staged:
        staged = Staged()
        try:
            for slot in slots:
                flat = self._own(staged, slot.numel, slot.dtype, slot.device, slot.nbytes)
                view = self.ops.view(flat, 0, slot.numel, slot.shape)
                staged.views[slot] = view
                staged.pairs.append((view, slot.host))
        except BaseException:
            self.unstage(staged)
            raise
        return staged


class PackedStaging(Staging):
    """All slots of a dtype share one host buffer; a batch moves with one copy per dtype."""

    packed = True

    def __init__(self, runtime: AnyRuntime, ops: TensorOps, ledger: DeviceLedger) -> None:
        if not ops.views_at_offset:
            raise SwapOptError(
                f"packed_swap=True needs device views at an offset, which the {runtime.name!r} "
                "runtime does not provide. Set SwapOptimizerConfig(packed_swap=False)."
            )
        super().__init__(runtime, ops, ledger)
        self.buffers: dict[Any, Any] = {}
        self._signature: tuple[int, ...] = ()
        self._regions: list[dict[Any, tuple[int, int]]] = []  # per batch: dtype -> lo, hi

    # ---- host layout ---------------------------------------------------------------------

    def plan(self, slots: Sequence[SwapSlot]) -> LayoutPlan | None:
        """The new host layout ``slots`` (in layout order) need; ``None``: they have it."""
        return plan_layout(slots, self._signature, lambda s: (s.dtype, s.numel))

    def apply(self, slots: Sequence[SwapSlot], plan: LayoutPlan) -> list[SwapSlot]:
        """Pack ``slots`` into new host buffers as ``plan`` says.

        The caller makes the old host memory final first (no copy still writing it). Every
        slot's current values are copied into its place and ``slot.host`` becomes the place.

        Returns:
            The slots whose host memory moved (all of them): the caller makes each one's
            state entry hold its new ``host``.
        """
        signature, totals = plan
        buffers = {dtype: self.runtime.alloc_host(n, dtype) for dtype, n in totals.items()}
        cursor = dict.fromkeys(totals, 0)
        for slot in slots:
            start = cursor[slot.dtype]
            place = self.ops.host_piece(buffers[slot.dtype], start, slot.numel, slot.shape)
            place.copy_(slot.host)  # broadcasts the expanded zeros of fresh state
            slot.offset = start
            cursor[slot.dtype] = start + slot.numel
            slot.host = place
        self.buffers = buffers
        self._signature = signature
        return list(slots)

    def layout(self, slots: Sequence[SwapSlot]) -> list[SwapSlot]:
        """``plan`` and ``apply`` in one, for host memory no copy is writing.

        Returns:
            The slots whose host memory moved (none if the layout was current).
        """
        plan = self.plan(slots)
        return [] if plan is None else self.apply(slots, plan)

    @property
    def host_bytes(self) -> int:
        """Bytes of the packed host buffers."""
        return sum(int(b.nbytes) for b in self.buffers.values())

    # ---- device buffers ------------------------------------------------------------------

    def begin(self, batches: Sequence[Sequence[SwapSlot]]) -> None:
        self._regions = []
        for slots in batches:
            regions: dict[Any, tuple[int, int]] = {}
            for slot in slots:
                end = slot.offset + slot.numel
                lo, hi = regions.get(slot.dtype, (slot.offset, end))
                regions[slot.dtype] = (min(lo, slot.offset), max(hi, end))
            self._regions.append(regions)

    def stage(self, index: int, slots: Sequence[SwapSlot]) -> Staged:
        """Give batch ``index`` one exact-size device buffer per dtype, its views and copies."""
        staged = Staged()
        device = slots[0].device if slots else None
        try:
            for dtype, (lo, hi) in self._regions[index].items():
                itemsize = next(s.itemsize for s in slots if s.dtype == dtype)
                flat = self._own(staged, hi - lo, dtype, device, (hi - lo) * itemsize)
                if hi > lo:  # only zero-size state of this dtype: nothing to move
                    region = self.ops.view(flat, 0, hi - lo, (hi - lo,))
                    host = self.ops.view(self.buffers[dtype], lo, hi - lo, (hi - lo,))
                    staged.pairs.append((region, host))
                for slot in slots:
                    if slot.dtype == dtype:
                        staged.views[slot] = self.ops.view(
                            flat, slot.offset - lo, slot.numel, slot.shape
                        )
        except BaseException:
            self.unstage(staged)
            raise
        return staged

    def end(self) -> None:
        self._regions = []


def make_staging(
    runtime: AnyRuntime, ops: TensorOps, ledger: DeviceLedger, packed: bool | None
) -> Staging:
    """The staging ``packed`` asks for (``None``: the runtime's default)."""
    if packed is None:
        packed = runtime.packed_default
    return (PackedStaging if packed else PerTensorStaging)(runtime, ops, ledger)
