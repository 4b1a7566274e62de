"""The interface every transfer runtime implements: host buffers, device storage, copies."""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

__all__ = ["CopyPair", "TransferRuntime"]

#: A device tensor and its host counterpart of identical shape and dtype.
CopyPair = tuple[torch.Tensor, torch.Tensor]


class TransferRuntime(ABC):
    """Moves optimizer state between host memory and one kind of device.

    The model is a device with a compute queue and one copy queue per direction (see
    ``swapopt_core._swap.pipeline`` for the order the engine uses). Copies return tickets (a
    recorded event): the compute queue waits on a ticket before it touches what the copy
    wrote (``wait``), the host before it reads or rewrites host memory (``host_wait``), a
    copy queue before it writes memory another copy still uses (``copy_in(after=...)``),
    and the allocator before it hands out memory a copy still uses
    (``release_device(after=...)``). A synchronous runtime returns ``None`` tickets.

    A copy that fails where it runs, after its call returned, is reported by ``failure``
    once it ran; memory released after it is then not reused, because the device copy of a
    batch whose copy out failed is the only copy of its update. A runtime whose copies
    cannot fail one by one (on CUDA an asynchronous error poisons the whole context) keeps
    the default, which reports nothing.

    Attributes:
        pinned_bytes: Host bytes this runtime holds page-locked (or, for runtimes without
            page locking, the bytes it set aside as the host tier).
    """

    #: Name selected by ``SwapOptimizerConfig.runtime``; unique within ``framework``.
    name: ClassVar[str]
    #: The tensor library this runtime moves (``"torch"`` or ``"mindspore"``). Tensors,
    #: dtypes and devices in the methods below are that library's.
    framework: ClassVar[str] = "torch"
    #: Device types that ``runtime="auto"`` picks this runtime for.
    device_types: ClassVar[tuple[str, ...]] = ()
    #: Whether ``packed_swap=None`` means packed for this runtime.
    packed_default: ClassVar[bool] = True

    def __init__(self) -> None:
        self.pinned_bytes = 0

    def _count_host(self, host: torch.Tensor) -> None:
        """Count ``host`` in ``pinned_bytes`` until its storage (and every view) is freed."""
        storage = host.untyped_storage()
        self.pinned_bytes += storage.nbytes()
        weakref.finalize(storage, self._uncount_host, storage.nbytes())

    def _uncount_host(self, nbytes: int) -> None:
        self.pinned_bytes -= nbytes

    @abstractmethod
    def accepts(self, device: torch.device) -> bool:
        """Whether state living on ``device`` can be swapped by this runtime."""

    @abstractmethod
    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host tensor of exactly ``numel`` elements, page-locked where possible."""

    @abstractmethod
    def alloc_device(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D uninitialised device tensor, allocated in copy-queue order."""

    @abstractmethod
    def release_device(self, tensor: torch.Tensor, after: Sequence[Any] = ()) -> None:
        """Give ``tensor``'s device storage back; views of it become empty.

        Args:
            tensor: A tensor from ``alloc_device``.
            after: Tickets of copies still using the storage: the memory is reused only
                once they finished (stream-ordered), without blocking the host. If one of
                them failed (``failure``), the memory is not reused: ``tensor`` keeps it.
        """

    @abstractmethod
    def copy_in(self, pairs: Sequence[CopyPair], after: Sequence[Any] = ()) -> Any:
        """Queue host-to-device copies; return a ticket for ``wait``.

        The copies start after the compute work queued so far (the device memory may have
        just been given back by it) and after the copies of the ``after`` tickets (which
        still use the memory, or write the host memory read here).
        """

    @abstractmethod
    def copy_out(self, pairs: Sequence[CopyPair]) -> Any:
        """Queue device-to-host copies after all compute queued so far; return a ticket."""

    @abstractmethod
    def wait(self, ticket: Any) -> None:
        """Make the compute queue wait for ``ticket`` (without blocking the host if possible)."""

    def failure(self, ticket: Any) -> BaseException | None:
        """What the copies of ``ticket`` raised, if they ran and failed; without blocking.

        ``None`` while they run, once they succeeded, and always on runtimes that raise
        copy errors where the copy is queued or waited for instead.
        """
        return None

    def host_wait(self, ticket: Any) -> None:
        """Block the host until the copies of ``ticket`` finished (all copies if unsure)."""
        if ticket is not None:
            self.synchronize()

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until every copy queued so far has finished."""
