"""What every swap engine keeps, whatever its framework: staging, counters and stats."""

from __future__ import annotations

from typing import Any

import pluggy

from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._layout import DeviceLedger
from swapopt_core._runtime import TransferRuntime
from swapopt_core._stats import SwapStats

__all__ = ["ENGINE_ATTR", "EngineBase", "engine_of"]

#: The attribute under which an engine is installed on its optimizer.
ENGINE_ATTR = "_swapopt_engine"


class EngineBase:
    """Staging choice, traffic counters and ``SwapStats`` shared by the torch and MindSpore
    engines.

    Subclasses set ``packed_staging`` and ``per_tensor_staging`` (classes taking
    ``(runtime, ledger)``) and fill ``slots`` with objects that have ``nbytes``.
    """

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

    def host_state_bytes(self) -> int:
        """Host bytes holding swapped state (packed buffers may hold more than the slots)."""
        return sum(slot.nbytes for slot in self.slots.values())

    def finish_step(self, h2d: int, d2h: int, batches: int) -> None:
        """Count a completed step and tell the observers."""
        self.h2d_bytes += h2d
        self.d2h_bytes += d2h
        self.steps += 1
        self.last_batches = batches
        self.plugin_manager.hook.swapopt_after_step(optimizer=self.optimizer, stats=self.stats())

    def stats(self) -> SwapStats:
        return SwapStats(
            total_state_bytes=sum(slot.nbytes for slot in self.slots.values()),
            resident_state_bytes=self.ledger.current,
            peak_resident_state_bytes=self.ledger.peak,
            host_state_bytes=self.host_state_bytes(),
            pinned_host_bytes=self.runtime.pinned_bytes,
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
