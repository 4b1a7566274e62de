"""Whole-step device meters: how much device memory one training step held at its peak.

Every runtime instance gives one meter (``TransferRuntime.step_meter``); the optimizer swap
and the activation offload share the instance of their device, so one window covers
forward, backward and the optimizer's update together. A window opens with ``begin(held)``
(the tensors the step holds on the device when it starts: parameters, gradients, optimizer
state) and closes with ``end()``, which returns the window's peak in bytes.

* ``AllocatorMeter`` (accelerators): the device allocator's own counters, through torch's
  device-generic ``torch.accelerator`` memory statistics, allocated and reserved. The peak
  counts every byte the allocator handed out (the whole process on that device), kernel
  scratch included. It never resets the allocator's peak statistics: they are the user's
  (``torch.cuda.max_memory_allocated``).
* ``StorageMeter`` (the loopback runtimes, where CPU memory plays the device): every storage
  the step holds, counted exactly. Each storage an op reads or writes during the window (a
  ``TorchDispatchMode`` pushed for the window), each storage ``held`` names and each buffer
  the runtime hands out (``alloc_device``) is counted once at its current size, until it
  dies, the runtime takes it back (``release_device``) or swapopt resizes it in place
  (``note_resized``: activations released to zero bytes and restored). The runtime's host
  buffers never count. Scratch memory a kernel allocates and frees inside one op is not
  seen, as it never becomes a storage the step holds. Reserved is that count plus what the
  runtime's emulated allocator caches or holds back for copies (``caching_pool``).

Windows do not nest: ``begin`` while a window is open starts a new one (the old one's peak
is dropped). ``end`` on a closed meter returns the last window's peak again.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

__all__ = ["AllocatorMeter", "StepMeter", "StorageMeter"]


class StepMeter(ABC):
    """The device memory one step holds, from ``begin`` to ``end``.

    Attributes:
        is_open: Whether a window is open.
    """

    def __init__(self) -> None:
        self.is_open = False
        self._last_peak = 0

    @abstractmethod
    def begin(self, held: Iterable[torch.Tensor] = ()) -> None:
        """Open a window (restart it if one is open).

        Args:
            held: The tensors the step holds on the device as it starts (parameters,
                gradients, optimizer state); each storage counts once, whatever views of
                it are given. Meters that read an allocator count them anyway.
        """

    @property
    @abstractmethod
    def current_bytes(self) -> int:
        """Device bytes held now (0 when no window is open, for ``StorageMeter``)."""

    @property
    @abstractmethod
    def peak_bytes(self) -> int:
        """The most device bytes held at once since ``begin`` (the last window's peak when
        none is open)."""

    @abstractmethod
    def end(self) -> int:
        """Close the window and return its peak in bytes (on a closed meter: the last
        window's peak again, 0 before the first)."""

    @property
    def peak_reserved_bytes(self) -> int:
        """The most device memory reserved at once since ``begin`` (held plus what the
        allocator keeps cached or holds back for copies); the last window's when closed."""
        return self.peak_bytes

    @abstractmethod
    def restart_peak(self) -> int:
        """Return the peak so far and start the peak again from what is held now (a
        window's phases: forward and backward, then the update)."""

    def resized(self, storage: Any) -> None:
        """swapopt resized ``storage`` in place; meters that count storages follow it."""
        return


class AllocatorMeter(StepMeter):
    """The accelerator allocator's counters for one device, read without resetting them.

    The allocator keeps one peak per process, which the user reads too
    (``max_memory_allocated``); resetting it would take that figure from them. So a
    window's peak is the larger of the readings taken at its points (``begin``, each phase
    change, ``end``, and each device allocation or resize swapopt makes: ``resized``) and
    the allocator's own peak when that rose during the window (a new high was reached
    inside it). A peak inside the window that stayed below an earlier high is seen only at
    those points: then the figure is a lower bound.

    Args:
        device: The accelerator device measured.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._base = (0, 0)  # the allocator's (allocated, reserved) peaks at the window start
        self._seen = [0, 0]  # the highest (allocated, reserved) read during the window
        self._last_reserved = 0

    def _read(self) -> tuple[int, int]:
        return (
            int(torch.accelerator.memory_allocated(self.device)),
            int(torch.accelerator.memory_reserved(self.device)),
        )

    def _peaks(self) -> tuple[int, int]:
        return (
            int(torch.accelerator.max_memory_allocated(self.device)),
            int(torch.accelerator.max_memory_reserved(self.device)),
        )

    def _start(self) -> None:
        self._base = self._peaks()
        self._seen = list(self._read())

    def begin(self, held: Iterable[torch.Tensor] = ()) -> None:
        # The allocator already counts everything held: ``held`` adds nothing here.
        self._start()
        self.is_open = True

    def resized(self, storage: Any) -> None:
        if self.is_open:
            allocated, reserved = self._read()
            self._seen = [max(self._seen[0], allocated), max(self._seen[1], reserved)]

    @property
    def current_bytes(self) -> int:
        return int(torch.accelerator.memory_allocated(self.device))

    def _window(self, index: int) -> int:
        now = self._read()[index]
        high = self._peaks()[index]
        seen = max(self._seen[index], now)
        return max(seen, high) if high > self._base[index] else seen

    @property
    def peak_bytes(self) -> int:
        if not self.is_open:
            return self._last_peak
        return self._window(0)

    @property
    def peak_reserved_bytes(self) -> int:
        if not self.is_open:
            return self._last_reserved
        return self._window(1)

    def end(self) -> int:
        if self.is_open:
            self._last_peak = self.peak_bytes
            self._last_reserved = self.peak_reserved_bytes
            self.is_open = False
        return self._last_peak

    def restart_peak(self) -> int:
        peak = self.peak_bytes
        if self.is_open:
            self._start()
        return peak


class StorageMeter(StepMeter):
    """Counts every storage of ``device_type`` the step holds (the loopback runtimes).

    Args:
        device_type: The device type whose storages count (``"cpu"`` for loopback).
        is_host: Whether a storage is one of the runtime's host buffers (never counted).
    """

    def __init__(
        self,
        device_type: str,
        is_host: Callable[[torch.UntypedStorage], bool],
        cached: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        self.device_type = device_type
        self._is_host = is_host
        self._cached = cached or (lambda: 0)
        self._peak_reserved = 0
        self._last_reserved = 0
        # Blocks the runtime handed out for fewer bytes than they have: counted at that.
        self._requested: weakref.WeakKeyDictionary[torch.UntypedStorage, int] = (
            weakref.WeakKeyDictionary()
        )
        # Storages counted: identity -> [weak reference, bytes counted]. Deaths and
        # releases may come from a copy lane's thread, hence the (reentrant) lock.
        self._live: dict[int, list[Any]] = {}
        self._lock = threading.RLock()
        self._current = 0
        self._peak = 0
        self._mode: _MeterMode | None = None

    # ---- the window ----------------------------------------------------------------------

    def begin(self, held: Iterable[torch.Tensor] = ()) -> None:
        if self.is_open:
            logger.debug("step meter restarted while its window was open")
            self._close()
        with self._lock:
            self._live.clear()
            self._current = self._peak = 0
            self.is_open = True
            for tensor in held:
                if isinstance(tensor, torch.Tensor):
                    self._see_tensor(tensor)
            self._peak = self._current
            self._peak_reserved = 0
            self._bump()
        self._mode = _MeterMode(self)
        self._mode.__enter__()

    @property
    def current_bytes(self) -> int:
        return self._current if self.is_open else 0

    @property
    def peak_bytes(self) -> int:
        return self._peak if self.is_open else self._last_peak

    @property
    def peak_reserved_bytes(self) -> int:
        return self._peak_reserved if self.is_open else self._last_reserved

    def end(self) -> int:
        if self.is_open:
            self._last_peak = self._peak
            self._last_reserved = self._peak_reserved
            self._close()
        return self._last_peak

    def restart_peak(self) -> int:
        with self._lock:
            peak = self.peak_bytes
            if self.is_open:
                self._peak = self._current
            return peak

    def _bump(self) -> None:
        """Take the peaks (called with ``_lock`` held, after ``_current`` changed)."""
        if self._current > self._peak:
            self._peak = self._current
        reserved = self._current + self._cached()
        if reserved > self._peak_reserved:
            self._peak_reserved = reserved

    def _close(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            _leave(mode)
        with self._lock:
            self.is_open = False
            self._live.clear()  # the weak references go with it: no callback fires later
            self._current = 0

    # ---- what the runtime and the mode report ------------------------------------------

    def resized(self, storage: Any) -> None:
        if self.is_open:
            self.see(storage)

    def see(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` at its current size (again, if it was resized)."""
        if not self.is_open:
            return
        with self._lock:
            self._see(storage)
            self._bump()

    def requested(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """The runtime handed out ``storage`` for ``nbytes`` (its block may be larger, as an
        allocator's cached block is before it is split): count it at ``nbytes``."""
        with self._lock:
            if nbytes < storage.nbytes():
                self._requested[storage] = nbytes
            else:
                self._requested.pop(storage, None)

    def forget(self, storage: torch.UntypedStorage) -> None:
        """The runtime took ``storage`` back (a pool keeps it): it no longer counts."""
        with self._lock:
            self._requested.pop(storage, None)
        if not self.is_open:
            return
        with self._lock:
            entry = self._live.pop(storage._cdata, None)
            if entry is not None:
                self._current -= entry[1]
            self._bump()  # a block given back to the pool is still reserved

    def after_op(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Count what an op read and wrote (its outputs may be new, its inputs resized)."""
        with self._lock:
            if not self.is_open:
                return
            for tensor in _tensors(args, kwargs, out):
                self._see_tensor(tensor)
            self._bump()

    def _see_tensor(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage
            return
        self._see(storage)

    def _see(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        entry = self._live.get(key)
        nbytes = storage.nbytes()
        if nbytes:
            nbytes = self._requested.get(storage, nbytes)
        if entry is not None:
            self._current += nbytes - entry[1]
            entry[1] = nbytes
            return
        if not nbytes or storage.device.type != self.device_type or self._is_host(storage):
            return  # an empty one is counted when it first shows bytes
        ref = weakref.ref(storage, functools.partial(self._died, key))
        self._live[key] = [ref, nbytes]
        self._current += nbytes

    def _died(self, key: int, ref: weakref.ref[Any]) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry[0] is ref:
                del self._live[key]
                self._current -= entry[1]


class _MeterMode(TorchDispatchMode):
    """Shows a ``StorageMeter`` every op that runs during its window."""

    def __init__(self, meter: StorageMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if any(kind is not torch.Tensor for kind in types):
            return NotImplemented  # a tensor subclass runs first; its inner ops come back
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.meter.after_op(args, kwargs, out)
        return out


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments and results (one list level deep, as aten's)."""
    for group in (args, kwargs.values(), (out,)):
        for value in group:
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor):
                        yield item


def _leave(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off the dispatch mode stack, wherever it is.

    A window opened at an ``OffloadSession`` entry's first op (inside the entry's own mode)
    sits below that mode; when it ends first, the modes above it are put back in order.
    """
    above: list[Any] = []
    try:
        while torch._C._len_torch_dispatch_stack() > 0:
            top = torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1)
            if top is mode:
                mode.__exit__(None, None, None)
                return
            above.append(torch._C._pop_torch_dispatch_stack(None))
        logger.debug("the step meter's dispatch mode was not on the stack any more")
    finally:
        for other in reversed(above):
            torch._C._push_on_torch_dispatch_stack(other)
