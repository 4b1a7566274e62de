"""The one interface every transfer runtime implements, for both halves of swapopt.

A runtime stands for one device and the link to its host memory: host buffers, device
storage handed out and given back in stream order, one copy queue per direction, waits,
clocks and a bandwidth measurement. The optimizer swap (``swapopt_core._swap``) and the
activation offload (``swapopt_core._activations``) drive the same instance per device
(``swapopt_core._device.registry``), so their copies share one queue per direction.

The interface is generic in the tensor library: torch code uses ``TorchRuntime``; MindSpore's
runtimes subclass ``TransferRuntime[mindspore.Tensor, str, ...]``.
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeAlias, TypeVar

import torch

from swapopt_core._device.meter import AllocatorMeter, StepMeter, StorageMeter

__all__ = [
    "ACTIVATIONS",
    "OPTIMIZER",
    "on_queue",
    "AnyRuntime",
    "CopyPair",
    "HostKeeper",
    "Ticket",
    "TorchRuntime",
    "TransferRuntime",
    "byte_view",
]

#: The copy queues of a device, one pair (in, out) each: the activation offload's, and the
#: optimizer swap's. Copy queues are FIFO: with one pair for both halves, a prefetch of the
#: optimizer's state queued at the first gradient would hold back every activation page-in
#: backward queues after it.
ACTIVATIONS = "activations"
OPTIMIZER = "optimizer"


def on_queue(runtime: TransferRuntime[Any, Any, Any], queue: str) -> dict[str, str]:
    """The keyword arguments that put a copy on ``queue`` where ``runtime`` has it.

    A runtime that declares only one pair of copy queues (``copy_queues``, as runtimes
    written before there were two) is called without the keyword: both halves share it.
    """
    return {"queue": queue} if queue in runtime.copy_queues and queue != ACTIVATIONS else {}


#: The two directions of ``measure_duplex_bandwidth``, as its results are keyed.
_DIRECTIONS = ("d2h", "h2d")
_NO_SIZE = 1 << 62  # sorts after every real size: bisects to the last buffer at an address

TensorT = TypeVar("TensorT")
DeviceT = TypeVar("DeviceT")
TicketT = TypeVar("TicketT")

#: A device tensor and its host counterpart of identical shape and dtype.
CopyPair = tuple[torch.Tensor, torch.Tensor]


class Ticket(Protocol):
    """What a copy returns: a point in a copy queue (a recorded event).

    Each runtime has its own ticket type (a lane's ``lanes.Ticket``, the accelerator's
    ``accelerator.StreamTicket``; ``None`` for copies that are done when they return). A
    ticket is only ever handed back to the runtime that issued it.
    """

    def done(self) -> bool:
        """Whether the copies it stands for finished, without blocking."""
        ...


class HostKeeper:
    """Keeps the host memory of queued copies alive until the copies finished.

    A device copies from and into host memory by DMA after the call that queued the copy
    returned; nothing in the tensor library ties the host buffer to that copy. An owner
    dropped right after queuing (an optimizer deleted after ``step()``) would free, and
    unregister, memory a copy is still writing. A runtime ``keep``s each copy's host
    tensors with its ticket and lets go of them once ``finished`` says so (``prune``,
    called on every later copy and wait), on the calling thread.

    Args:
        finished: Whether a ticket's copies finished (without blocking).
    """

    def __init__(self, finished: Callable[[Any], bool]) -> None:
        self._finished = finished
        self._lock = threading.Lock()  # copies are queued from the autograd thread too
        self._kept: list[tuple[Any, list[Any]]] = []  # oldest first

    def keep(self, ticket: Any, hosts: Sequence[Any]) -> None:
        """Hold ``hosts`` until the copies of ``ticket`` finished."""
        if ticket is not None and hosts:
            with self._lock:
                self._kept.append((ticket, list(hosts)))

    def prune(self) -> None:
        """Let go of the host memory of copies that finished."""
        done: list[tuple[Any, list[Any]]] = []
        with self._lock:
            # Oldest first, up to the first that runs: cheap on every call, and a copy
            # queued behind a slow one on another queue is let go a little later only.
            while self._kept and self._finished(self._kept[0][0]):
                done.append(self._kept.pop(0))
        # The references drop here, outside the lock: a buffer's finalizer may run now.
        del done

    def clear(self) -> None:
        """Let go of everything (every copy is known to have finished)."""
        with self._lock:
            kept, self._kept = self._kept, []
        del kept

    def __len__(self) -> int:
        return len(self._kept)


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage`` (how activations hand a storage to
    ``copy_in``/``copy_out``)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class TransferRuntime(ABC, Generic[TensorT, DeviceT, TicketT]):
    """Moves bytes between host memory and one kind of device, for both halves of swapopt.

    The model is a device with a compute queue and one copy queue per direction. Copies
    return tickets (``TicketT``; ``None`` when the copy is done already): the compute queue
    waits on a ticket before it touches what the copy wrote (``wait``), the host before it
    reads or rewrites the host memory (``host_wait``), a copy queue before it writes memory
    another copy still uses (``copy_in(after=...)``), and the allocator before it hands out
    memory a copy still uses (``release_device(after=...)``).

    A copy that fails where it runs, after its call returned, is reported by ``failure``
    once it ran; memory released after it is then not reused, because the device copy of a
    batch whose copy out failed is the only copy of its update. A runtime whose copies
    cannot fail one by one (on CUDA an asynchronous error poisons the whole context) keeps
    the default, which reports nothing.

    One instance serves the optimizer swap and the activation offload of its device at the
    same time (``registry.shared_runtime``), so it must not keep per-caller state beyond
    what one entry of an ``OffloadSession`` sets (``begin_entry``).

    Attributes:
        device: The device this instance was made for (``None``: not tied to one).
        pinned_bytes: Host bytes this instance holds page-locked, all callers together (for
            runtimes without page locking: the bytes set aside as the host tier). A caller
            asks ``pinned_nbytes`` for its own buffers.
    """

    #: Name selected by ``SwapOptimizerConfig.runtime`` and ``OffloadConfig.runtime``;
    #: unique within ``framework``; never ``"auto"``.
    name: ClassVar[str]
    #: The tensor library this runtime moves (``"torch"`` or ``"mindspore"``).
    framework: ClassVar[str] = "torch"
    #: Device types that ``runtime="auto"`` picks this runtime for.
    device_types: ClassVar[tuple[str, ...]] = ()
    #: The copy queues this runtime keeps apart (``copy_in``/``copy_out`` take ``queue=``
    #: only when it names more than ``ACTIVATIONS``; see ``on_queue``).
    copy_queues: ClassVar[tuple[str, ...]] = (ACTIVATIONS,)
    #: Whether ``packed_swap=None`` means packed for this runtime.
    packed_default: ClassVar[bool] = True
    #: Whether ``stamp`` results are read only after ``wait_stamps`` (device events).
    stamps_need_sync: ClassVar[bool] = False
    #: This instance's whole-step meter, made at the first ``step_meter`` call.
    _step_meter: StepMeter | None = None
    #: Host buffers counted with a key, sorted by address, with the count of buffer
    #: changes the list reflects (``_is_host``).
    _host_version = 0
    _host_index: tuple[int, list[tuple[int, int]]] = (-1, [])

    def __init__(self) -> None:
        self.device: DeviceT | None = None
        self.pinned_bytes = 0
        self._pinned: dict[int, int] = {}  # key of a page-locked buffer -> its bytes

    # ---- making and choosing -------------------------------------------------------------

    @classmethod
    def create(cls, device: DeviceT | None) -> TransferRuntime[TensorT, DeviceT, TicketT]:
        """Make the runtime for ``device`` (``None``: the one a named runtime picks itself).

        Called by the registry only when no live instance of this class serves ``device``
        yet (``shared_key``). Override it when the constructor needs the device.

        Raises:
            RuntimeError: The runtime cannot run here (its device is not available).
        """
        return cls()

    @classmethod
    def shared_key(cls, device: DeviceT | None) -> object:
        """What makes two requests share one instance: by default the device asked for."""
        return device

    @abstractmethod
    def serves(self, device: DeviceT) -> bool:
        """Whether tensors on ``device`` are the ones this runtime moves."""

    # ---- memory ------------------------------------------------------------------------

    @abstractmethod
    def alloc_host(self, numel: int, dtype: Any) -> TensorT:
        """A 1-D host tensor of exactly ``numel`` elements, page-locked where possible.

        What it page-locked is counted in ``pinned_bytes`` (``_count_pinned``) until the
        buffer is freed.
        """

    def pinned_nbytes(self, hosts: Iterable[TensorT]) -> int:
        """Page-locked bytes under ``hosts`` (each buffer once, views included).

        How an owner (an engine, a session) reports its own pinned bytes on an instance it
        shares. This default reports every byte the instance holds (exact while a single
        owner uses it); runtimes that count buffers with ``_count_pinned(..., key=...)``
        report only those under ``hosts``.
        """
        if not self._pinned:
            return self.pinned_bytes
        keys = {self._buffer_key(host) for host in hosts}
        return sum(self._pinned.get(key, 0) for key in keys)

    def pageable_buffers(self, hosts: Iterable[TensorT]) -> int:
        """How many buffers under ``hosts`` were meant to be page-locked but are pageable
        (page-locking failed for them); 0 on runtimes that never page-lock."""
        return 0

    def _buffer_key(self, host: TensorT) -> int:
        """Identity of the buffer under ``host`` (views of one buffer share it)."""
        return int(host.untyped_storage().data_ptr())  # type: ignore[attr-defined]

    def _count_pinned(self, owner: object, nbytes: int, key: int | None = None) -> None:
        """Count ``nbytes`` in ``pinned_bytes`` until ``owner`` (the buffer) is freed."""
        self.pinned_bytes += nbytes
        if key is not None:
            self._pinned[key] = nbytes
            self._host_version += 1
        # A weak reference: a buffer (which a queued copy may still hold) must not keep the
        # runtime, its lanes and every buffer they hold alive.
        weakref.finalize(owner, _uncount, weakref.ref(self), nbytes, key)

    def _uncount_pinned(self, nbytes: int, key: int | None = None) -> None:
        self.pinned_bytes -= nbytes
        if key is not None:
            self._pinned.pop(key, None)
            self._host_version += 1

    def _uncount_host(self, nbytes: int) -> None:
        """``_uncount_pinned`` for a buffer counted without a key."""
        self._uncount_pinned(nbytes)

    @abstractmethod
    def alloc_device(self, numel: int, dtype: Any, device: DeviceT) -> TensorT:
        """A 1-D uninitialised device tensor, allocated in copy-queue order."""

    @abstractmethod
    def release_device(self, tensor: TensorT, after: Sequence[TicketT | None] = ()) -> None:
        """Give ``tensor``'s device storage back; views of it become empty.

        Args:
            tensor: A tensor from ``alloc_device``.
            after: Tickets of copies still using the storage: the memory is reused only
                once they finished (stream-ordered), without blocking the host. If one of
                them failed (``failure``), the memory is not reused: ``tensor`` keeps it.
        """

    def release_ordered(self, tensor: TensorT, after: Sequence[TicketT | None] = ()) -> None:
        """Give ``tensor``'s device storage back in compute-queue order.

        The compute queue first waits for the ``after`` copies (which still use the
        memory); the memory is then free at once for work queued later, whose copies wait
        for that compute first. Unlike ``release_device`` (the allocator holding a block
        until it sees the copies done), the block is reused without the host ever seeing
        a copy finish: a step queued in one go keeps reusing the same few blocks. If one of
        the copies failed, ``tensor`` keeps the memory (as for ``release_device``).

        The default is ``release_device``, for runtimes whose release already waits.
        """
        self.release_device(tensor, after)

    def reserved_bytes(self) -> int | None:
        """Device memory reserved now: on an accelerator everything its allocator holds, on
        an emulated device the blocks of this runtime's allocator; ``None`` if unknown."""
        return None

    # ---- the whole-step meter ------------------------------------------------------------

    def step_meter(self) -> StepMeter:
        """This instance's whole-step meter (one per instance: both halves share it)."""
        if self._step_meter is None:
            self._step_meter = self._make_step_meter()
        return self._step_meter

    def _make_step_meter(self) -> StepMeter:
        """Make the meter ``step_meter`` returns.

        By default the allocator's counters (``AllocatorMeter``) for a runtime made for an
        accelerator device, and a storage count (``StorageMeter``) where CPU memory plays
        the device (``device`` is ``None`` or the CPU). The storage count is exact when
        ``alloc_host`` counts its buffers with ``_count_pinned(..., key=...)`` (they never
        count as device memory) and ``alloc_device``/``release_device`` report to it
        (``_note_alloc``/``_note_release``, as the loopback runtimes do). Override it for
        other devices.
        """
        device = self.device
        if isinstance(device, torch.device) and device.type not in ("cpu", "meta"):
            return AllocatorMeter(device)
        return StorageMeter("cpu", self._is_host, self._cached_device_bytes)

    def _cached_device_bytes(self) -> int:
        """Device bytes an emulated allocator caches or holds for copies (reserved, not
        handed out); 0 where the runtime has none."""
        return 0

    def _is_host(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` lies in a host buffer counted with a key (a buffer, or a
        piece of one with a storage of its own, as a swapped state tensor)."""
        address = storage.data_ptr()
        if address in self._pinned:
            return True
        version, index = self._host_index
        if version != self._host_version:
            # Buffers came or went. The index keeps the count it was built from: a buffer
            # freed meanwhile on a lane's thread makes the next call rebuild it again.
            version = self._host_version
            index = sorted(list(self._pinned.items()))  # ``list``: one step under the GIL
            self._host_index = (version, index)
        at = bisect.bisect_right(index, (address, _NO_SIZE)) - 1
        return at >= 0 and address < index[at][0] + index[at][1]

    def _note_alloc(self, tensor: Any) -> None:
        """``alloc_device`` handed out ``tensor``: an open storage count counts it (a
        prefetch during backward allocates outside every dispatch mode)."""
        meter = self._step_meter
        if isinstance(meter, StorageMeter):
            # A cached block handed out whole may be larger than asked for; CUDA would have
            # split it: the request is what the step holds.
            meter.requested(tensor.untyped_storage(), tensor.numel() * tensor.element_size())
        if meter is not None and meter.is_open:
            meter.resized(tensor.untyped_storage())

    def _note_release(self, storage: Any) -> None:
        """``release_device`` took ``storage`` back for reuse: it is no longer held."""
        meter = self._step_meter
        if isinstance(meter, StorageMeter):
            meter.forget(storage)

    def note_resized(self, storage: Any) -> None:
        """swapopt resized a device ``storage`` in place (an activation released to zero
        bytes, or restored): an open step meter that counts storages follows it."""
        meter = self._step_meter
        if meter is not None and meter.is_open:
            meter.resized(storage)

    # ---- copies and waits ----------------------------------------------------------------

    @abstractmethod
    def copy_in(
        self, pairs: Sequence[tuple[TensorT, TensorT]], after: Sequence[TicketT | None] = ()
    ) -> TicketT | None:
        """Queue host-to-device copies of ``(device, host)`` pairs; return a ticket.

        The copies start after the compute work queued so far (the device memory may have
        just been given back by it) and after the copies of the ``after`` tickets (which
        still use the memory, or write the host memory read here). A runtime whose
        ``copy_queues`` has more than ``ACTIVATIONS`` also takes ``queue=`` (the half
        that copies): each half then has its own copy queue per direction, so neither
        waits behind the other's copies.
        """

    @abstractmethod
    def copy_out(self, pairs: Sequence[tuple[TensorT, TensorT]]) -> TicketT | None:
        """Queue device-to-host copies of ``(device, host)`` pairs after all compute queued
        so far; return a ticket. Takes ``queue=`` as ``copy_in`` does."""

    @abstractmethod
    def wait(self, ticket: TicketT | None) -> None:
        """Order the compute queue that issued the copy after it (without blocking the host
        where the device can): before compute reads, rewrites or frees what it touches."""

    def host_wait(self, ticket: TicketT | None) -> None:
        """Block the host until the copies of ``ticket`` finished (all copies if unsure)."""
        if ticket is not None:
            # The host reads or rewrites memory the copy touches; without a finer wait,
            # every copy must be done.
            self.synchronize()

    def done(self, ticket: TicketT | None) -> bool:
        """Whether the copies of ``ticket`` finished, without blocking."""
        return ticket is None or bool(ticket.done())  # type: ignore[attr-defined]

    def failure(self, ticket: TicketT | None) -> BaseException | None:
        """What the copies of ``ticket`` raised, if they ran and failed; without blocking.

        ``None`` while they run, once they succeeded, and always on runtimes that raise
        copy errors where the copy is queued or waited for instead.
        """
        return None

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until every copy queued so far (by any caller) has finished."""

    def begin_entry(self, device: DeviceT) -> Callable[[], None] | None:
        """Called at an ``OffloadSession`` entry's first op on ``device``; returns a check
        to run before each of its ops (refusing what the copies cannot be ordered with)."""
        return None

    # ---- clocks ------------------------------------------------------------------------

    def stamp(self) -> Any:
        """A point on the compute queue whose time ``elapsed_ms`` reads later."""
        return time.perf_counter()

    def wait_stamps(self) -> None:
        """Make every stamp taken so far readable (called when ``stamps_need_sync``)."""
        return

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two ``stamp`` results."""
        return float((end - start) * 1e3)

    def measure_bandwidth(self, nbytes: int = 32 * 2**20, repeats: int = 5) -> tuple[float, float]:
        """Median D2H and H2D bandwidth in GB/s of ``repeats`` warm copies of ``nbytes``.

        Measured through this runtime's own ``copy_out``/``copy_in`` and ``host_wait`` on
        buffers from ``alloc_host``/``alloc_device`` (uint8 torch tensors on ``device``, or
        the CPU), so the planner prices copies at what this runtime delivers.
        """
        device = self.device if self.device is not None else torch.device("cpu")
        host: Any = self.alloc_host(nbytes, torch.uint8)
        on_device: Any = self.alloc_device(nbytes, torch.uint8, device)  # type: ignore[arg-type]
        host.fill_(2)
        on_device.fill_(1)
        pairs = [(on_device, host)]
        d2h: list[float] = []
        h2d: list[float] = []
        try:
            for _ in range(repeats + 1):
                for results, issue in ((d2h, self.copy_out), (h2d, self.copy_in)):
                    start = time.perf_counter()
                    # Calibration runs once per warmup and needs the finished copy's time.
                    self.host_wait(issue(pairs))
                    results.append(nbytes / max(time.perf_counter() - start, 1e-9) / 1e9)
        finally:
            # The device buffer goes back once the last copy is done (waited above).
            self.release_device(on_device)
        return statistics.median(d2h[1:]), statistics.median(h2d[1:])

    def measure_duplex_bandwidth(
        self, nbytes: int = 32 * 2**20, repeats: int = 5
    ) -> tuple[float, float]:
        """Median D2H and H2D bandwidth in GB/s with both directions queued together.

        ``measure_bandwidth`` times each direction alone; backward copies both ways at once
        (it pages out the activations it makes and pages in those it reads next), and a
        link may not carry both at full speed. Each measurement queues a ``copy_out`` and a
        ``copy_in`` of ``nbytes`` (buffers of their own, so neither waits for the other)
        before waiting for either, then waits for one direction: its figure is ``nbytes``
        over the time from queuing the pair until its copy is done, while the other
        direction shared the link. Each direction is measured ``repeats`` times (after one
        warm round), waited for first in turn. Through this runtime's own
        ``copy_out``/``copy_in``/``host_wait`` on buffers from ``alloc_host``/``alloc_device``,
        like ``measure_bandwidth``; on a synchronous runtime the copies run one after the
        other as they are queued.

        Returns:
            ``(d2h, h2d)`` in GB/s, each measured while the other direction ran.
        """
        device = self.device if self.device is not None else torch.device("cpu")
        hosts: dict[str, Any] = {d: self.alloc_host(nbytes, torch.uint8) for d in _DIRECTIONS}
        on_device: dict[str, Any] = {
            d: self.alloc_device(nbytes, torch.uint8, device)  # type: ignore[arg-type]
            for d in _DIRECTIONS
        }
        hosts["h2d"].fill_(2)
        on_device["d2h"].fill_(1)
        results: dict[str, list[float]] = {d: [] for d in _DIRECTIONS}
        tickets: dict[str, Any] = {}
        try:
            for _ in range(repeats + 1):
                for first, second in (_DIRECTIONS, _DIRECTIONS[::-1]):
                    start = time.perf_counter()
                    tickets["d2h"] = self.copy_out([(on_device["d2h"], hosts["d2h"])])
                    tickets["h2d"] = self.copy_in([(on_device["h2d"], hosts["h2d"])])
                    # Calibration needs the finished copy's time; the other one is still
                    # running (or queued), sharing the link.
                    self.host_wait(tickets.pop(first))
                    elapsed = time.perf_counter() - start
                    # Both buffers are written again next round: that copy must be done.
                    self.host_wait(tickets.pop(second))
                    results[first].append(nbytes / max(elapsed, 1e-9) / 1e9)
        finally:
            for ticket in tickets.values():
                # The buffers go back below: a copy left queued by a failure must be done.
                self.host_wait(ticket)
            for tensor in on_device.values():
                self.release_device(tensor)
        # The first (warm) round of each direction is left out.
        d2h, h2d = (statistics.median(results[d][1:]) for d in _DIRECTIONS)
        return d2h, h2d


def _uncount(
    runtime: weakref.ref[TransferRuntime[Any, Any, Any]], nbytes: int, key: int | None
) -> None:
    """A counted buffer was freed: take it off its runtime's count, if the runtime lives."""
    alive = runtime()
    if alive is not None:
        alive._uncount_pinned(nbytes, key)


#: The interface as torch code uses it.
TorchRuntime: TypeAlias = TransferRuntime[torch.Tensor, torch.device, Any]
#: A runtime of any tensor library, as the framework-neutral optimizer swap drives it.
AnyRuntime: TypeAlias = TransferRuntime[Any, Any, Any]
