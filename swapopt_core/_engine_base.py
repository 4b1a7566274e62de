"""What every swap engine is and keeps, whatever its framework.

``swapopt_core._api`` talks to the engines only through ``EngineBase``: it asks each
backend's engine class whether it ``serves`` an optimizer, builds that engine, and then
calls ``install``, ``offload``, ``uninstall`` and ``stats`` on it. Everything a framework
does differently (hooks or a replaced ``construct``, how state is found and moved) lives
in the backend's subclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import pluggy

from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._device.interface import TransferRuntime
from swapopt_core._layout import DeviceLedger
from swapopt_core._pipeline import write_back
from swapopt_core._stats import SwapStats

__all__ = ["ENGINE_ATTR", "EngineBase", "engine_of"]

#: The attribute under which an engine is installed on its optimizer.
ENGINE_ATTR = "_swapopt_engine"


class EngineBase(ABC):
    """The interface of a swap engine, with the staging choice, traffic counters and
    ``SwapStats`` that the torch and MindSpore engines share.

    Subclasses set ``framework``, ``packed_staging`` and ``per_tensor_staging`` (classes
    taking ``(runtime, ledger)``), fill ``slots`` with objects that have ``nbytes``, and
    implement the abstract methods.
    """

    #: The tensor library served (``"torch"``, ``"mindspore"``): only runtimes and adapters
    #: of the same ``framework`` are offered to this engine.
    framework: ClassVar[str]
    #: Appended to the log line of a successful install.
    install_note: ClassVar[str] = ""
    packed_staging: type
    per_tensor_staging: type

    def __init__(
        self,
        optimizer: Any,
        config: SwapOptimizerConfig,
        adapter: Any,
        runtime: TransferRuntime,
        plugin_manager: pluggy.PluginManager,
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.adapter = adapter
        self.runtime = runtime
        self.plugin_manager = plugin_manager
        self.ledger = DeviceLedger()
        packed = runtime.packed_default if config.packed_swap is None else config.packed_swap
        staging = self.packed_staging if packed else self.per_tensor_staging
        self.staging = staging(runtime, self.ledger)
        self.slots: dict[Any, Any] = {}
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.steps = 0
        self.last_batches = 0
        #: Batches an interrupted step updated but could not copy back: kept on the device
        #: until ``settle`` writes them back.
        self.kept: list[Any] = []
        #: The last step was updated and counted, but an observer raised before all saw it.
        self.observers_owed = False
        #: The last step's pipeline while its copies may still run (``Pipeline`` has their
        #: tickets); ``None`` once they are known to be done.
        self.previous: Any = None

    # ---- what each backend implements --------------------------------------------------

    @classmethod
    @abstractmethod
    def serves(cls, optimizer: object) -> bool:
        """Whether ``optimizer`` is of this engine's framework (without importing it)."""

    @classmethod
    @abstractmethod
    def param_devices(cls, optimizer: Any) -> set[str]:
        """Device types of ``optimizer``'s parameters, as runtimes list them in
        ``device_types`` (torch ``"cuda"``, ``"cpu"``; MindSpore ``"Ascend"``, ``"CPU"``)."""

    @classmethod
    def runtime_serves(cls, runtime: TransferRuntime, optimizer: Any) -> bool:
        """Whether ``runtime`` serves the device of at least one of the parameters."""
        return any(runtime.serves(device) for device in cls.param_devices(optimizer))

    @abstractmethod
    def install(self) -> None:
        """Offload the state that exists, hook the step in and mark the optimizer."""

    @abstractmethod
    def uninstall(self) -> None:
        """Move every swapped state back to its device and leave a plain optimizer."""

    @abstractmethod
    def offload(self) -> int:
        """Take swappable state that is not in host memory there now.

        Returns:
            How many state tensors were moved.
        """

    # ---- shared bookkeeping ----------------------------------------------------------------

    def host_state_bytes(self) -> int:
        """Host bytes holding swapped state (packed buffers may hold more than the slots)."""
        return sum(slot.nbytes for slot in self.slots.values())

    def settle(self) -> None:
        """Write back what is kept on the device; first thing on every entry.

        Kept are the batches an interrupted step updated but could not copy back, and those
        of the last step whose copy out is known by now (without waiting) to have failed
        where it ran.

        Raises:
            BaseException: The copy failed again; the batches stay kept.
        """
        if self.previous is not None:
            self.previous.reclaim(self.kept)
        if self.kept:
            self.host_changing()
            write_back(self.kept, self.staging, self.runtime)

    def quiesce(self) -> None:
        """Make host state final for a reader: wait for the copies, write back kept batches.

        Raises:
            BaseException: A kept batch could not be written back, or a copy failed.
        """
        self.wait_copies()
        self.settle()

    def wait_copies(self) -> None:
        """Block until every queued copy finished.

        A batch whose copy out failed where it ran is kept on the device from now on (and
        counted as resident) until ``settle`` writes it back.
        """
        # The host copies are read (or rewritten) next: every copy into them must be done.
        self.runtime.synchronize()
        if self.previous is not None:
            self.previous.reclaim(self.kept)
        self.previous = None

    def host_changing(self) -> None:  # noqa: B027
        """Host state is about to be rewritten under the engine (a write back): a backend
        drops what it read from it ahead of time."""

    @property
    def last_out(self) -> Any:
        """Ticket of the last step's last copy out (``None``: nothing in flight)."""
        return None if self.previous is None else self.previous.last_out

    def finish_step(self, h2d: int, d2h: int, batches: int, *, resumed: bool = False) -> None:
        """Count a completed step and tell the observers.

        Args:
            resumed: The call only finished a step an earlier call had updated completely
                but whose observers raised: it is not counted again.
        """
        if not (resumed and self.observers_owed):
            self.h2d_bytes += h2d
            self.d2h_bytes += d2h
            self.steps += 1
            self.last_batches = batches
        self.observers_owed = True
        self.plugin_manager.hook.swapopt_after_step(optimizer=self.optimizer, stats=self.stats())
        self.observers_owed = False

    def stats(self) -> SwapStats:
        """A snapshot of the memory and traffic of this engine."""
        return SwapStats(
            total_state_bytes=sum(slot.nbytes for slot in self.slots.values()),
            resident_state_bytes=self.ledger.current,
            peak_resident_state_bytes=self.ledger.peak,
            host_state_bytes=self.host_state_bytes(),
            pinned_host_bytes=self.runtime.pinned_nbytes(s.host for s in self.slots.values()),
            h2d_bytes=self.h2d_bytes,
            d2h_bytes=self.d2h_bytes,
            steps=self.steps,
            swapped_tensors=len(self.slots),
            batches=self.last_batches,
            packed=self.staging.packed,
            runtime=self.runtime.name,
        )


def engine_of(optimizer: object) -> EngineBase | None:
    """The engine installed on ``optimizer`` (torch or MindSpore), if any."""
    return getattr(optimizer, ENGINE_ATTR, None)
