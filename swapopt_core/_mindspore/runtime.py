"""Transfer runtimes for MindSpore: the CPU loopback and a small Ascend runtime.

A runtime hands out buffers (host: between steps; device: while a batch is staged) and
carves ``mindspore.Tensor`` views out of them; the swapped state Parameters hold host views
between steps. On CPU a buffer is a numpy array, which every view keeps alive, so memory is
freed exactly when the last view of it is dropped.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from swapopt_core._device.interface import TransferRuntime
from swapopt_core._errors import SwapOptWarning

if TYPE_CHECKING:
    import mindspore  # noqa: F401 - the base class's tensor type argument names it
    import numpy as np

__all__ = [
    "MindSporeAscendRuntime",
    "MindSporeLoopbackRuntime",
    "MindSporeRuntime",
    "drain_compute",
    "numpy_dtype",
]

_warned_unverified = False


class MindSporeRuntime(TransferRuntime["mindspore.Tensor", Any, Any]):
    """A runtime whose tensors are ``mindspore.Tensor`` objects.

    Beyond ``TransferRuntime`` it knows how to carve a view out of a device buffer (packed
    staging) and whether it can (``views_at_offset``), and how to put host values on the
    device for good (``to_device``, used when the swap is removed).
    """

    framework = "mindspore"
    #: Whether ``view`` can start at a non-zero offset, which packed staging needs.
    views_at_offset: ClassVar[bool] = True

    def _count(self, host: np.ndarray) -> None:
        """Count ``host`` in ``pinned_bytes`` until it (and every view of it) is freed."""
        nbytes = int(host.nbytes)
        self.pinned_bytes += nbytes
        weakref.finalize(host, self._uncount_host, nbytes)

    def view(self, buffer: Any, offset: int, numel: int, shape: tuple[int, ...]) -> Any:
        """A tensor of ``shape`` over ``buffer[offset:offset + numel]`` sharing its memory."""
        from mindspore import Tensor

        return Tensor.from_numpy(buffer[offset : offset + numel].reshape(shape))

    def release_device(self, tensor: Any, after: Sequence[Any] = ()) -> None:
        """Nothing to do: device memory is returned when its last view is dropped."""

    def to_device(self, host: Any, device: str) -> Any:
        """A new device tensor holding ``host``'s values."""
        from mindspore import Tensor

        return Tensor.from_numpy(host.asnumpy().copy())


class MindSporeLoopbackRuntime(MindSporeRuntime):
    """CPU tensors play the device, separate CPU buffers the host.

    Every copy is a real memcpy and every staged buffer is handed out and given back, so
    the whole engine runs on CPU. Never picked by ``runtime="auto"``.

    Released "device" buffers go back to a pool that the next request of the same byte
    size takes, as a device's caching allocator keeps freed blocks: a fresh multi-megabyte
    buffer per batch and step may fault its pages in again on first touch, a cost no
    device has.
    """

    name = "loopback"
    device_types = ()

    def __init__(self) -> None:
        super().__init__()
        self._pool: dict[int, list[np.ndarray]] = {}  # free raw byte buffers by size
        self._pool_lock = threading.Lock()  # the asynchronous loopback recycles on its lanes

    def serves(self, device: Any) -> bool:
        return str(device).upper().startswith("CPU")

    # Copies are plain memcpy through numpy views of the same memory: MindSpore's CPU
    # ``Tensor.copy_`` runs elementwise and costs about 150x a memcpy (4 MB: 16 ms).

    def copy_in(self, pairs: Sequence[tuple[Any, Any]], after: Sequence[Any] = ()) -> Any:
        import numpy

        # The packed layout's queued copies may still be writing the host buffer.
        drain_compute()
        for device_tensor, host_tensor in pairs:
            numpy.copyto(device_tensor.asnumpy(), host_tensor.asnumpy())
        return None

    def copy_out(self, pairs: Sequence[tuple[Any, Any]]) -> Any:
        import numpy

        # The batch's queued update kernels must have written the device views.
        drain_compute()
        for device_tensor, host_tensor in pairs:
            numpy.copyto(host_tensor.asnumpy(), device_tensor.asnumpy())
        return None

    def alloc_host(self, numel: int, dtype: Any) -> Any:
        host = _empty(numel, dtype)
        self._count(host)
        return host

    def alloc_device(self, numel: int, dtype: Any, device: Any) -> Any:
        kind = numpy_dtype(dtype)
        with self._pool_lock:
            free = self._pool.get(numel * kind.itemsize)
            raw = free.pop() if free else None
        if raw is None:
            return _empty(numel, dtype)
        return raw.view(kind)

    def release_device(self, tensor: Any, after: Sequence[Any] = ()) -> None:
        """Keep ``tensor``'s memory for the next request of its size (the copies are done)."""
        self._recycle(tensor)

    def _recycle(self, buffer: np.ndarray) -> None:
        """Put ``buffer`` (a 1-D array from ``alloc_device``) back in the pool."""
        raw = buffer.view("uint8")
        if raw.nbytes:
            with self._pool_lock:
                self._pool.setdefault(raw.nbytes, []).append(raw)

    def wait(self, ticket: Any) -> None:
        return None  # the copies are done when copy_in returns

    def synchronize(self) -> None:
        # The host buffers are read through numpy (checkpoints, stats), outside the queue.
        drain_compute()


class MindSporeAscendRuntime(MindSporeRuntime):
    """Ascend NPUs: pinned host tensors, one copy stream, events as tickets.

    Written against MindSpore 2.9's ``mindspore.runtime`` stream and event API and pinned
    ``mint.empty``; no Ascend device was available where it was written, so it stays
    minimal (per-tensor staging only: device views at an offset are not relied on) and warns
    once when it is first used.
    """

    name = "ascend"
    device_types = ("Ascend",)
    packed_default = False
    views_at_offset = False

    def __init__(self) -> None:
        super().__init__()
        self._stream: Any = None
        self._last_out: Any = None  # the ticket of the newest copy out
        self._held: list[tuple[Any, Any]] = []  # (ticket, released buffer) until it completes
        global _warned_unverified
        if not _warned_unverified:
            _warned_unverified = True
            warnings.warn(
                "swapopt's 'ascend' runtime has not been run on an Ascend device yet. Compare a "
                "few steps against the unswapped optimizer (parameters should be bitwise equal) "
                "and watch swap_stats before relying on it.",
                SwapOptWarning,
                stacklevel=4,
            )

    @property
    def stream(self) -> Any:
        if self._stream is None:
            import mindspore as ms

            self._stream = ms.runtime.Stream()
        return self._stream

    def serves(self, device: Any) -> bool:
        return str(device).startswith("Ascend")

    def alloc_host(self, numel: int, dtype: Any) -> Any:
        from mindspore import mint

        host = mint.empty((numel,), dtype=dtype, device="CPU", pin_memory=True)
        self.pinned_bytes += int(host.nbytes)  # kept for the optimizer's lifetime
        return host

    def alloc_device(self, numel: int, dtype: Any, device: Any) -> Any:
        from mindspore import mint

        return mint.empty((numel,), dtype=dtype, device="Ascend")

    def view(self, buffer: Any, offset: int, numel: int, shape: tuple[int, ...]) -> Any:
        if offset:
            raise ValueError("the ascend runtime gives views of whole buffers only")
        return buffer.view(shape)

    def to_device(self, host: Any, device: str) -> Any:
        from mindspore import mint

        local = mint.empty(tuple(host.shape), dtype=host.dtype, device="Ascend")
        local.copy_(host)
        return local

    def _on_stream(self, pairs: Sequence[tuple[Any, Any]], inward: bool) -> Any:
        import mindspore as ms

        ready = ms.runtime.Event()
        # The copy must not start before the compute queued so far (for copies out: the update).
        ready.record(ms.runtime.current_stream())
        self.stream.wait_event(ready)
        with ms.runtime.StreamCtx(self.stream):
            for device_tensor, host_tensor in pairs:
                if inward:
                    device_tensor.copy_(host_tensor, non_blocking=True)
                else:
                    host_tensor.copy_(device_tensor, non_blocking=True)
        done = ms.runtime.Event()
        # The ticket: compute that reads the copied-in batch waits on it.
        done.record(self.stream)
        return done

    def copy_in(self, pairs: Sequence[tuple[Any, Any]], after: Sequence[Any] = ()) -> Any:
        return self._on_stream(pairs, inward=True)

    def copy_out(self, pairs: Sequence[tuple[Any, Any]]) -> Any:
        self._last_out = self._on_stream(pairs, inward=False)
        return self._last_out

    def release_device(self, tensor: Any, after: Sequence[Any] = ()) -> None:
        """Drop ``tensor`` once the copies out queued so far have finished reading it.

        MindSpore's pool may hand memory freed here to compute at once, without knowing
        that the copy stream still reads it, so the last reference is held until the
        ticket of the newest copy out completes.
        """
        self._held = [(t, b) for t, b in self._held if not t.query()]
        if self._last_out is not None and not self._last_out.query():
            self._held.append((self._last_out, tensor))

    @property
    def held_buffers(self) -> int:
        """Released buffers still waiting for their copy out to finish."""
        return len(self._held)

    def wait(self, ticket: Any) -> None:
        if ticket is not None:
            import mindspore as ms

            # The update reads the batch only once its copy in has landed.
            ms.runtime.current_stream().wait_event(ticket)

    def synchronize(self) -> None:
        # The host copies are the optimizer's public state: final when the step returns.
        self.stream.synchronize()
        self._held.clear()  # every copy has finished reading its buffer


def drain_compute() -> None:
    """Block until MindSpore's queue has run every op queued so far (PyNative runs them on a
    worker thread); nearly free when it is empty."""
    from mindspore.graph.api import _pynative_executor

    _pynative_executor.sync()


def _empty(numel: int, dtype: Any) -> np.ndarray:
    """An uninitialised 1-D host array of exactly ``numel`` items of MindSpore ``dtype``."""
    import numpy

    return numpy.empty(numel, dtype=numpy_dtype(dtype))


@functools.cache
def numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype MindSpore uses for ``dtype`` on the host (bfloat16 included)."""
    import numpy
    from mindspore import mint

    return numpy.dtype(mint.empty((0,), dtype=dtype).asnumpy().dtype)
