"""What every swap engine is and does, whatever its framework: the step transaction.

``swapopt_core._api`` talks to the engines only through ``EngineBase`` (``serves``, then
``install``, ``offload``, ``uninstall``, ``stats``, ``reconfigure``).

The step is written once, here (``run_step``): write back what an interrupted step kept,
let the backend list the parameters to update (``open_step``), skip those an interrupted
call with the same gradients finished, cut the rest into byte-balanced batches, and run them
through the pipeline with an undo copy around each batch's update. What a framework does
differently (how state is found, how a batch is updated) is the backend's ``StepWork``
(``_swap.step``, beside the memory of an interrupted call) and a few hooks; its tensor
operations are its ``TensorOps``.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import pluggy

from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._device.interface import AnyRuntime
from swapopt_core._planning.partition import partition
from swapopt_core._planning.whole_step import OptimizerCosts
from swapopt_core._record import record_step
from swapopt_core._stats import SwapStats, engine_stats
from swapopt_core._swap.costs import CostMeter, StepTiming
from swapopt_core._swap.ledger import DeviceLedger
from swapopt_core._swap.ops import SwapSlot, TensorOps
from swapopt_core._swap.pipeline import Pipeline, deferred_interrupt, write_back
from swapopt_core._swap.staging import PackedStaging, Staged, make_staging
from swapopt_core._swap.step import Interrupted, StepUnit, StepWork

logger = logging.getLogger(__name__)

__all__ = ["ENGINE_ATTR", "EngineBase", "engine_of"]

#: The attribute under which an engine is installed on its optimizer.
ENGINE_ATTR = "_swapopt_engine"


class EngineBase(ABC):
    """A swap engine: the step transaction, the staging choice, traffic and ``SwapStats``.

    Subclasses set ``framework``, implement ``tensor_ops`` and the abstract methods, and
    expose their slots (objects with ``nbytes``) as ``slots``.
    """

    #: The tensor library served (``"torch"``, ``"mindspore"``): only runtimes and adapters
    #: of the same ``framework`` are offered to this engine.
    framework: ClassVar[str]
    #: Appended to the log line of a successful install.
    install_note: ClassVar[str] = ""
    #: Whether every reader of host state asks the engine first (torch: ``state_dict``, the
    #: checkpoint hooks, ``swap_stats``, unswap), which then waits for what it reads: the
    #: step returns with its copies queued. ``False`` where host state is read with no hook
    #: to wait in (MindSpore's ``save_checkpoint`` reads the state Parameters): each step
    #: then makes it final (``quiesce``) before it returns.
    readers_hooked: ClassVar[bool] = True
    #: Whether the engine prefetches during backward (``SwapOptimizerConfig.prefetch_batches``).
    prefetches: ClassVar[bool] = False
    #: The config fields ``reconfigure`` changes in place; any other needs a new install.
    reconfigurable: ClassVar[frozenset[str]] = frozenset(
        {"swap_times", "prefetch_batches", "prefetch_during_backward"}
    )

    def __init__(
        self,
        optimizer: Any,
        config: SwapOptimizerConfig,
        adapter: Any,
        runtime: AnyRuntime,
        plugin_manager: pluggy.PluginManager,
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.adapter = adapter
        self.runtime = runtime
        self.plugin_manager = plugin_manager
        self.ledger = DeviceLedger()
        self.ops = self.tensor_ops(runtime)
        self.staging = make_staging(runtime, self.ops, self.ledger, config.packed_swap)
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.steps = 0
        self.last_batches = 0
        #: Batches an interrupted step updated but could not copy back: kept on the device
        #: until ``settle`` writes them back.
        self.kept: list[Staged] = []
        #: The last step was updated and counted, but an observer raised before all saw it.
        self.observers_owed = False
        #: The last step's pipeline while its copies may still run (``Pipeline`` has their
        #: tickets); ``None`` once they are known to be done.
        self.previous: Pipeline | None = None
        self._interrupted: Interrupted | None = None
        #: Measures the first full step and any after ``measure_next_step``.
        self.meter = CostMeter()

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
    def runtime_device(cls, optimizer: Any, device_types: tuple[str, ...]) -> Any:
        """The device to make the runtime for: that of the first parameter whose device
        type is in ``device_types`` (a runtime's ``device_types``), in parameter-group
        order. When the parameters span several devices of those types, the first one
        wins; the runtime serves the others too, but times, meters and page-locks on that
        one. ``None`` when no parameter is on such a device, or the backend does not tell
        (the runtime then picks, e.g. the current device): this default."""
        return None

    @classmethod
    def runtime_serves(cls, runtime: AnyRuntime, optimizer: Any) -> bool:
        """Whether ``runtime`` serves the device of at least one of the parameters."""
        return any(runtime.serves(device) for device in cls.param_devices(optimizer))

    @staticmethod
    @abstractmethod
    def tensor_ops(runtime: AnyRuntime) -> TensorOps:
        """The backend's tensor operations over ``runtime``."""

    @property
    @abstractmethod
    def slots(self) -> dict[Any, Any]:
        """The swapped slots by key."""

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

    @abstractmethod
    def open_step(self, call: Any) -> StepWork:
        """Check the call, bring the state in line and list the units to update."""

    @abstractmethod
    def publish(self, slot: Any) -> None:
        """Make ``slot``'s state entry hold its ``host`` (which the layout just moved)."""

    def computing(self) -> contextlib.AbstractContextManager[Any]:
        """The context the batches are updated in (torch: ``no_grad``)."""
        return contextlib.nullcontext()

    def start_pipeline(self, plan: list[list[Any]]) -> Pipeline:
        """The pipeline for this step's batches (the torch engine's may be prefetched)."""
        return Pipeline(plan, self.staging, self.runtime, self.previous)

    def step_queued(self, plan: list[list[Any]], resumed: bool) -> None:  # noqa: B027
        """Every batch was updated and its copy out queued (may raise: the step is kept)."""

    def split_resident(
        self, units: Sequence[StepUnit]
    ) -> tuple[list[list[StepUnit]], list[StepUnit]]:
        """Batches of the units whose state stays on the device, and the swapped rest.

        The resident batches are updated first, while the first swapped batches come in;
        nothing of them moves. Default: nothing is resident.
        """
        return [], list(units)

    def unit_bytes(self, units: Sequence[StepUnit]) -> list[int]:
        """Swappable state bytes per unit in step order, resident ones included (``costs``)."""
        return [u.nbytes for u in units]

    def fixed_state_bytes(self) -> int:
        """Device bytes of optimizer state that never moves (``costs``)."""
        return 0

    def host_changing(self) -> None:  # noqa: B027
        """Host state is about to be rewritten under the engine (a write back): a backend
        drops what it read from it ahead of time."""

    def reconfigure(self, config: SwapOptimizerConfig) -> None:
        """Take ``config`` (it differs only in ``reconfigurable`` fields) from the next step.

        The copies in flight are waited for and kept batches written back first, so state
        moves (``configured``) only from host memory that is final.
        """
        self.host_changing()
        self.quiesce()
        self.config = config
        self.configured()

    def configured(self) -> None:  # noqa: B027
        """``config`` changed: move the state the new one places elsewhere (torch)."""

    # ---- the step transaction ------------------------------------------------------------

    def run_step(self, call: Any) -> None:
        """Run one swapped update of every unit ``open_step`` lists for ``call``.

        If anything raises, each unit was updated completely or not at all, its state is
        in host memory (or kept on the device until the next call) and the updated ones
        are remembered: calling again with the same gradients finishes the step. A SIGINT
        during the step is delivered when it ends.
        """
        with deferred_interrupt():
            self.settle()
            work = self.open_step(call)
            memory = self._interrupted
            fresh = memory is None or memory.identity != work.identity
            if memory is None or fresh:
                memory = Interrupted(work.identity, work.prepare())
            # From here on a retry of the same call must not prepare the step again.
            self._interrupted = memory
            units = [u for u in work.units if not memory.finished(u)]
            resumed = not fresh and (len(units) < len(work.units) or not units)
            lead, units = self.split_resident(units)
            runs = partition([u.nbytes for u in units], self.config.swap_times)
            batches = [[units[k] for k in run] for run in runs]
            plan = [[s for u in batch for s in u.slots] for batch in batches]
            timing = self.meter.timing(self.runtime, resumed)
            self.ledger.open_window(self.runtime.reserved_bytes())
            with self.computing():
                pipeline = self._run_batches(work, memory, lead, batches, plan, resumed, timing)
            # Until the observers have seen the step, a retry of the call only tells them again.
            self.finish_step(pipeline.h2d, pipeline.d2h, len(batches), resumed=resumed)
            self._interrupted = None

    def _run_batches(
        self,
        work: StepWork,
        memory: Interrupted,
        lead: list[list[StepUnit]],
        batches: list[list[StepUnit]],
        plan: list[list[Any]],
        resumed: bool,
        timing: StepTiming | None = None,
    ) -> Pipeline:
        from swapopt_core._swap.undo import UndoArena

        arena = UndoArena(self.ops, [work.changed(batch) for batch in lead + batches])

        def update_batch(batch: list[StepUnit], views: dict[Any, Any]) -> None:
            start = None if timing is None else timing.start()
            saved = arena.save(work.changed(batch))
            try:
                work.update(batch, views, memory.prepared)
            except BaseException:
                arena.restore(saved)
                raise
            if timing is not None:
                timing.stop(start, sum(u.nbytes for u in batch))
            for unit in batch:
                memory.done[unit.key] = unit.token

        def update(i: int, views: dict[Any, Any]) -> None:
            update_batch(batches[i], views)

        def update_resident() -> None:
            for batch in lead:
                update_batch(batch, {})

        pipeline = self.start_pipeline(plan)
        try:
            try:
                pipeline.run(update, self.kept, update_resident if lead else None)
            finally:
                arena.release()
            # The step ends with its copies queued; the next one's copies in wait for these.
            # A step without batches queued none: the copies before it are still the ones.
            if pipeline.batches:
                self.previous = pipeline
            if not self.readers_hooked:
                # Host state is read next with no hook to wait in: it must be final, and a
                # batch whose copy out failed where it ran must be written back, by now.
                self.quiesce()
            self.step_queued(plan, resumed)
        except BaseException:
            self._collect_failures()
            raise
        if timing is not None:
            self.meter.record(
                timing,
                unit_bytes=self.unit_bytes(work.units),
                fixed_state_bytes=self.fixed_state_bytes(),
                extra_peak_bytes=self.ledger.window_peak - self.ledger.held + arena.peak_bytes,
                batches=[[u.nbytes for u in batch] for batch in lead + batches],
            )
        return pipeline

    def _collect_failures(self) -> None:
        """After a failed step: the last step's batches whose copy out failed join ``kept``."""
        try:
            # The recovery drained the queues: this only collects what they reported.
            self.wait_copies()
        except BaseException:  # the next entry tries again; the step's own error propagates
            logger.warning("swapopt: draining the copies after a failed step failed", exc_info=True)

    # ---- host state and the copies in flight ---------------------------------------------

    def lay_out(self, ordered: Sequence[SwapSlot]) -> None:
        """Pack ``ordered`` into the host buffers if they changed (packed staging only)."""
        if not isinstance(self.staging, PackedStaging):
            return
        plan = self.staging.plan(ordered)
        if plan is None:
            return
        # The old buffers are read below: the last step's copies out may still be writing
        # them, and a batch whose copy out failed is written back into them first.
        self.quiesce()
        for slot in self.staging.apply(ordered, plan):
            self.publish(slot)

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

    # ---- what the step costs ---------------------------------------------------------------

    def measure_next_step(self) -> None:
        """Measure the next full step for ``costs`` (it times each batch's update)."""
        self.meter.wanted = True

    def costs(self) -> OptimizerCosts | None:
        """What the update cost at the last measured step; ``None`` before one.

        The first full step after install is measured, and any after ``measure_next_step``;
        ``unit_bytes`` covers the resident units too, so a planner can choose the fraction.
        """
        return self.meter.last

    @property
    def last_out(self) -> Any:
        """Ticket of the last step's last copy out (``None``: nothing in flight)."""
        return None if self.previous is None else self.previous.last_out

    # ---- reporting -------------------------------------------------------------------------

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
        stats = self.stats()
        record_step(self, stats)  # the process-wide record keeps the latest, computing nothing
        self.plugin_manager.hook.swapopt_after_step(optimizer=self.optimizer, stats=stats)
        self.observers_owed = False

    def stats(self) -> SwapStats:
        """A snapshot of the memory and traffic of this engine."""
        return engine_stats(self)


def engine_of(optimizer: object) -> EngineBase | None:
    """The engine installed on ``optimizer`` (torch or MindSpore), if any."""
    return getattr(optimizer, ENGINE_ATTR, None)
