"""The accelerator runtime: one copy stream per direction and device, events, pinned host.

Written against torch's device-generic ``torch.Stream``, ``torch.Event`` and
``torch.accelerator``, so the same lines serve CUDA, ROCm, Intel XPU, Ascend (``torch_npu``)
and Apple MPS. It is registered as ``"cuda"`` (the name configs have always used) and
``runtime="auto"`` picks it for every device type in ``device_types``. This is the only
module of swapopt that creates streams.

Device storage is allocated on the compute stream, so a batch's memory goes back to the
pool forward and backward draw from. Each copy stream first waits for the compute work
queued so far (that work wrote the data, or just gave the memory back), and a ticket
remembers that compute stream: ``wait`` makes it wait for the copy. Copies in and out run
on separate streams, so one direction overlaps the other (full duplex).

Two ways memory goes back, both without a host sync:

* ``release_ordered`` (the optimizer's staging buffers): the compute stream waits for the
  copies still using the block, then frees it; the allocator hands it out again at once in
  compute-stream order, and the next batch's copy in (which waits for compute) reuses it.
  ``release_device`` with ``record_stream`` would keep every block out of the pool until
  the host *saw* its copy finish, which a host queuing the whole step in a millisecond
  never does inside the step: reserved memory would grow to every batch of the step.
* An activation storage is released by the session (resized to 0) after compute waited on
  the copy's ticket, the same rule.

Each half (``ACTIVATIONS``, ``OPTIMIZER``) has its own pair of copy streams per device, so
the optimizer's prefetch, queued at the first gradient, never holds back an activation's
page-in on a FIFO stream; the copy engines interleave the two. Streams are switched with a
per-thread save and restore (``torch.accelerator.set_stream``), never through a shared
stream object's context manager. The host memory of every queued copy is kept alive until
its event completed (``HostKeeper``), so an owner dropped right after ``step()`` cannot
free, and unregister, memory a copy is still writing.

Host memory is page-locked at its exact size with ``cudaHostRegister`` where the backend is
CUDA (``pinned.py``); elsewhere it comes from the backend's own pinned allocator
(``torch.empty(..., pin_memory=True)``), whose caching allocator rounds every block up to a
power of two: ``pinned_bytes`` counts the rounded size, what is really page-locked.

At normal exit every live runtime waits for its copy streams, so the host state is final
once the process ends. A copy that fails on its stream is an asynchronous device error: it
is sticky (the context is unusable) and surfaces at the next synchronizing call, without
telling which copy failed, so ``failure`` reports nothing here.
"""

from __future__ import annotations

import atexit
import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from swapopt_core._device.interface import (
    ACTIVATIONS,
    OPTIMIZER,
    CopyPair,
    HostKeeper,
    TransferRuntime,
)
from swapopt_core._device.pinned import alloc_pinned

logger = logging.getLogger(__name__)

__all__ = ["AcceleratorRuntime", "StreamTicket"]


@dataclass
class StreamTicket:
    """Recorded events of one call's copies: one per device the copies touched.

    Attributes:
        marks: ``(copy stream, event recorded after the copies, compute stream they were
            issued from)`` per device.
    """

    marks: list[tuple[torch.Stream, torch.Event, torch.Stream]] = field(default_factory=list)

    def done(self) -> bool:
        return all(event.query() for _, event, _ in self.marks)


def _current_device(device_type: str, name: str) -> torch.device:
    """The current device of ``device_type``, with its index.

    Raises:
        RuntimeError: That accelerator is not available; the message names the fix.
    """
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != device_type or not _available(device_type):
        raise RuntimeError(
            f"runtime={name!r} but {device_type.upper()} is not available. Use "
            "runtime='loopback' to run on the CPU, or 'auto' to follow the tensors."
        )
    return torch.device(device_type, torch.accelerator.current_device_index())


def _available(device_type: str) -> bool:
    """Whether the backend says it can run now (``torch.cuda``, ``torch.xpu``, ``torch.mps``
    and ``torch_npu``'s ``torch.npu`` each answer ``is_available``)."""
    probe = getattr(getattr(torch, device_type, None), "is_available", None)
    return bool(probe()) if callable(probe) else bool(torch.accelerator.is_available())


@functools.cache
def accelerator_runtime() -> type[AcceleratorRuntime]:
    """The accelerator runtime class for this machine's torch accelerator.

    ``AcceleratorRuntime`` itself (named ``"cuda"``, declared for CUDA tensors) on CUDA, on
    ROCm (torch calls its devices ``cuda``) and where torch sees no accelerator; for any
    other accelerator (``xpu``, ``npu``, ``mps``, ...) the same class under that type's
    name, declared for that type. Asked when the plugin registers its runtimes, not at
    import.
    """
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type == AcceleratorRuntime.name:
        return AcceleratorRuntime
    kind = accelerator.type
    attributes = {"name": kind, "device_types": (kind,), "__module__": __name__}
    return type(f"{kind.capitalize()}Runtime", (AcceleratorRuntime,), attributes)


class AcceleratorRuntime(TransferRuntime[torch.Tensor, torch.device, StreamTicket]):
    """Asynchronous runtime for accelerator tensors (any torch accelerator).

    Args:
        device: The device it is made for (the current accelerator device if ``None``);
            tensors on other devices of its type are served too, each with its own streams.
    """

    name = "cuda"
    device_types = ("cuda",)
    copy_queues = (ACTIVATIONS, OPTIMIZER)
    stamps_need_sync = True

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        if device is None or device.index is None:
            device = _current_device(self.device_types[0], self.name)
        self.device: torch.device = device
        self._streams: dict[tuple[torch.device, str, str], torch.Stream] = {}
        # Host memory of queued copies, kept until their events completed (DMA reads and
        # writes it after the call returned; nothing else ties it to the copy).
        self.hosts = HostKeeper(lambda ticket: ticket.done())
        self._compute: dict[torch.device, torch.Stream] = {}  # of each device's entry
        self._entry_device = device  # where the last entry ran: what ``stamp`` times
        self._pageable: set[int] = set()  # keys of host buffers whose registration failed
        self._register_warned = False  # one warning per runtime; debug lines after
        _LIVE.add(self)

    @classmethod
    def create(cls, device: torch.device | None) -> AcceleratorRuntime:
        """The runtime for ``device``, or for the current accelerator device when ``None``.

        Raises:
            RuntimeError: No accelerator is available.
        """
        return cls(device)

    @classmethod
    def shared_key(cls, device: torch.device | None) -> object:
        if device is None or device.index is None:
            return _current_device(cls.device_types[0], cls.name)
        return device

    def serves(self, device: torch.device) -> bool:
        return device.type == self.device.type

    def _stream(self, device: torch.device, direction: str, queue: str) -> torch.Stream:
        """The copy stream of ``queue`` (each half has its own pair) in ``direction``."""
        key = (device, direction, queue)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.Stream(device=device)
        return stream

    # ---- memory ------------------------------------------------------------------------

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # Page locking acts on the current device (CUDA makes its context there first): this
        # runtime's device, not whichever the process last selected.
        with _on_device(self.device):
            if self.device.type == "cuda" and torch.version.hip is None:
                return self._alloc_registered(numel, dtype)
            host = torch.empty(numel, dtype=dtype, pin_memory=True)
        storage = host.untyped_storage()
        if storage.nbytes():
            # The caching host allocator hands out power-of-two blocks: that is what is
            # page-locked for this buffer.
            pinned = 1 << (storage.nbytes() - 1).bit_length()
            self._count_pinned(storage, pinned, key=storage.data_ptr())
        return host

    def _alloc_registered(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Exact-size host memory registered with CUDA.

        Each buffer is registered on its own: one that fails stays pageable (its copies
        block the host and do not overlap compute) and is counted (``pageable_buffers``),
        while the next buffer is tried again, so one transient failure (a page-lock limit
        reached for a moment) does not make every later buffer pageable. The first failure
        of a runtime is a warning, later ones debug lines.
        """
        host, error = alloc_pinned(numel, dtype)
        storage = host.untyped_storage()
        if not storage.nbytes():
            return host
        key = storage.data_ptr()
        if error == 0:
            self._count_pinned(storage, storage.nbytes(), key=key)
            return host
        self._pageable.add(key)
        weakref.finalize(storage, _forget_pageable, weakref.ref(self), key)
        if not self._register_warned:
            self._register_warned = True
            logger.warning(
                "cudaHostRegister failed (cudaError %d) for a %d-byte host buffer: it stays "
                "pageable, so its copies block the host and do not overlap compute. Later "
                "buffers are registered again; those that fail are counted "
                "(pinned_fallback_buffers) and logged at debug level.",
                error,
                storage.nbytes(),
            )
        else:
            logger.debug(
                "cudaHostRegister failed (cudaError %d) for a %d-byte host buffer: pageable",
                error,
                storage.nbytes(),
            )
        return host

    def pageable_buffers(self, hosts: Iterable[torch.Tensor]) -> int:
        """How many buffers under ``hosts`` (each once, views included) stayed pageable
        because their ``cudaHostRegister`` failed."""
        if not self._pageable:
            return 0
        return len({self._buffer_key(host) for host in hosts} & self._pageable)

    def alloc_device(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # On the compute stream: freed blocks return to the pool forward and backward use.
        return torch.empty(numel, dtype=dtype, device=device)

    def release_device(
        self, tensor: torch.Tensor, after: Sequence[StreamTicket | None] = ()
    ) -> None:
        for ticket in after:
            for stream, _event, _compute in ticket.marks if ticket is not None else ():
                if stream.device == tensor.device:
                    # The allocator reuses the block only once this stream's queued copies
                    # (which still read or write it) finished, as the host sees them: a
                    # host far ahead of the device keeps the block out of the pool.
                    tensor.record_stream(stream)
        tensor.untyped_storage().resize_(0)

    def release_ordered(
        self, tensor: torch.Tensor, after: Sequence[StreamTicket | None] = ()
    ) -> None:
        for ticket in after:
            # The compute stream the block was allocated on frees it only after the copies
            # still using it; later work there (and copies, which wait for it) reuses it.
            self.wait(ticket)
        tensor.untyped_storage().resize_(0)

    def reserved_bytes(self) -> int:
        return int(torch.accelerator.memory_reserved(self.device))

    # ---- copies and waits ----------------------------------------------------------------

    def _issue(
        self,
        direction: str,
        pairs: Sequence[CopyPair],
        after: Sequence[StreamTicket | None],
        queue: str,
    ) -> StreamTicket:
        self.hosts.prune()
        grouped: dict[torch.device, list[CopyPair]] = {}
        for pair in pairs:
            grouped.setdefault(pair[0].device, []).append(pair)
        ticket = StreamTicket()
        for device, group in grouped.items():
            stream = self._stream(device, direction, queue)
            compute = torch.accelerator.current_stream(device)
            # The copy starts after the compute work queued so far: it wrote the data
            # copied out, or just gave back the memory copied into.
            stream.wait_stream(compute)
            for other in after:
                for _stream, event, _compute in other.marks if other is not None else ():
                    # A copy still using this memory, or writing the host memory read here.
                    stream.wait_event(event)
            # Switched with a local save and restore, not ``with stream:``: the stream object
            # is shared by the main and the autograd thread, and its context manager keeps
            # the stream it replaced on the object (the current stream is per thread).
            previous = torch.accelerator.current_stream(device)
            torch.accelerator.set_stream(stream)
            try:
                for device_tensor, host_tensor in group:
                    if direction == "h2d":
                        # Async from pinned memory; compute waits on the ticket.
                        device_tensor.copy_(host_tensor, non_blocking=True)
                    else:
                        host_tensor.copy_(device_tensor, non_blocking=True)
            finally:
                torch.accelerator.set_stream(previous)
            # Marks the point compute (or the host) must reach before using the copied
            # memory; the compute stream is kept for ``wait``.
            ticket.marks.append((stream, stream.record_event(), compute))
        return ticket

    def copy_in(
        self,
        pairs: Sequence[CopyPair],
        after: Sequence[StreamTicket | None] = (),
        queue: str = ACTIVATIONS,
    ) -> StreamTicket:
        ticket = self._issue("h2d", pairs, after, queue)
        self.hosts.keep(ticket, [host for _, host in pairs])
        return ticket

    def copy_out(self, pairs: Sequence[CopyPair], queue: str = ACTIVATIONS) -> StreamTicket:
        ticket = self._issue("d2h", pairs, (), queue)
        self.hosts.keep(ticket, [host for _, host in pairs])
        return ticket

    def wait(self, ticket: StreamTicket | None) -> None:
        for _stream, event, compute in ticket.marks if ticket is not None else ():
            # The compute stream the copy was issued from touches the copied memory (or
            # frees its block) only after the copy landed; no host block. That stream even
            # if another is current: a storage may die while a side stream is current.
            compute.wait_event(event)
            current = torch.accelerator.current_stream(compute.device)
            if current != compute:
                # Work queued next on the current stream (an update run on another stream
                # than the one that issued its copy in) reads the copy too.
                current.wait_event(event)

    def host_wait(self, ticket: StreamTicket | None) -> None:
        for _stream, event, _compute in ticket.marks if ticket is not None else ():
            # The host reads or rewrites the host memory this copy writes or reads.
            event.synchronize()

    def done(self, ticket: StreamTicket | None) -> bool:
        return ticket is None or ticket.done()

    def synchronize(self) -> None:
        for stream in list(self._streams.values()):
            # The host reads or rewrites the host copies next: every copy must be done.
            stream.synchronize()
        self.hosts.prune()

    # ---- session entries ---------------------------------------------------------------

    def begin_entry(self, device: torch.device) -> Callable[[], None]:
        """Remember the compute stream of this entry (and its device, which ``stamp`` times)
        and refuse to start inside a capture.

        Raises:
            RuntimeError: A graph is being captured on the current stream.
        """
        self._compute[device] = torch.accelerator.current_stream(device)
        self._entry_device = device
        self.check_ordering(device)
        return self._cheap_check(device)

    def _cheap_check(self, device: torch.device) -> Callable[[], None]:
        """The per-op form of ``check_ordering``: it runs before every op of an entry.

        ``torch.accelerator.current_stream`` builds a new ``torch.Stream`` at every call (and
        ``torch.cuda.is_current_stream_capturing`` adds a Python frame): microseconds per op,
        tens of milliseconds a step at 10k ops. On CUDA the check compares the
        ``(id, device, type)`` tuple torch's ``_cuda_getCurrentStream`` returns (what
        ``torch.cuda.current_stream`` is built from) and asks the capture flag directly;
        only when one of them differs does ``check_ordering`` run and say what is wrong.
        Elsewhere (or a torch without those bindings) every op runs ``check_ordering``.
        """
        current = getattr(torch._C, "_cuda_getCurrentStream", None)
        capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
        index = device.index
        if device.type != "cuda" or current is None or capturing is None or index is None:

            def check() -> None:
                self.check_ordering(device)

            return check
        expected = current(index)
        check_ordering = self.check_ordering

        def fast_check() -> None:
            if current(index) != expected or capturing():
                check_ordering(device)  # raises, naming what is wrong

        return fast_check

    def check_ordering(self, device: torch.device) -> None:
        """Refuse an op the copies could not be ordered with.

        Raises:
            RuntimeError: The op runs while a graph is captured (a replayed graph would
                skip the copies and releases), or on another stream than the entry's first
                op (the copies wait for that stream only).
        """
        if _capturing(device):
            raise RuntimeError(
                "An OffloadSession op ran while a CUDA graph was being captured: the graph "
                "would replay without the session's copies. Capture CUDA graphs outside the "
                "session, or wrap the captured part in skip_offload."
            )
        current = torch.accelerator.current_stream(device)
        if current != self._compute.get(device):
            raise RuntimeError(
                f"An OffloadSession op ran on {device.type.upper()} stream {current}, but the "
                f"session's entry started on {self._compute.get(device)}: its copies are "
                "ordered with that stream only. Run the step on one stream, or wrap "
                "side-stream work in skip_offload."
            )

    # ---- clocks ------------------------------------------------------------------------

    def stamp(self) -> torch.Event:
        device = self._entry_device
        # The event is made and recorded on the entry's device, whichever device is current
        # (torch's CUDA event record switches to the stream's device itself; the guard keeps
        # it so for any backend).
        with _on_device(device):
            event = torch.Event(device=device, enable_timing=True)
            # Timing only: recorded on compute, read once the warmup ended (``wait_stamps``).
            event.record(self._compute.get(device) or torch.accelerator.current_stream(device))
        return event

    def wait_stamps(self) -> None:
        # Op durations are read from events on compute: they must all have completed.
        torch.accelerator.synchronize(self._entry_device)

    def elapsed_ms(self, start: torch.Event, end: torch.Event) -> float:
        return float(start.elapsed_time(end))


def _on_device(device: torch.device) -> AbstractContextManager[None]:
    """Make ``device`` the current accelerator device for the block (calls that act on the
    current device: page locking, events). A no-op for a device without an index."""
    if device.index is None:
        return nullcontext()
    return torch.accelerator.device_index(device.index)


def _forget_pageable(runtime: weakref.ref[AcceleratorRuntime], key: int) -> None:
    """A pageable host buffer was freed: take it off its runtime's set, if the runtime lives."""
    alive = runtime()
    if alive is not None:
        alive._pageable.discard(key)


def _capturing(device: torch.device) -> bool:
    """Whether a graph is being captured on ``device``'s current stream."""
    if device.type == "cuda":
        # Only CUDA (and ROCm through it) tells; torch.Stream has no generic query.
        return bool(torch.cuda.is_current_stream_capturing())
    return False


#: Runtimes that may have copies queued, held weakly: the exit hook keeps none alive.
_LIVE: weakref.WeakSet[AcceleratorRuntime] = weakref.WeakSet()


def _synchronize_all() -> None:
    """At exit: wait for the copies every live runtime still has queued."""
    for runtime in list(_LIVE):
        try:
            # The last step's copies out write the host state: it is final once they land.
            runtime.synchronize()
        except Exception:  # a sticky device error from earlier; nothing left to finish
            logger.warning("swapopt: waiting for the copy streams at exit failed", exc_info=True)


# An atexit hook runs before the interpreter and torch tear the device down, so the streams
# are still valid; a step's last copies out land before the process ends.
atexit.register(_synchronize_all)
