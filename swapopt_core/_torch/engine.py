"""The swap engine installed on one torch optimizer: install, uninstall and the step.

The engine owns a ``StateBook`` (its slots, ``swapopt_core._torch.bookkeeping``), a
``BackwardPrefetch`` (``swapopt_core._torch.prefetch``) and ``CheckpointHooks``
(``swapopt_core._torch.checkpoint``) and asks each of them; the step transaction itself is
the neutral one of ``swapopt_core._swap.engine``, over a ``TorchStep``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import pluggy
import torch

from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._device.interface import TransferRuntime
from swapopt_core._planning.partition import partition
from swapopt_core._step.hooks import StepHooks
from swapopt_core._swap.engine import ENGINE_ATTR, EngineBase
from swapopt_core._swap.pipeline import Pipeline
from swapopt_core._swap.step import StepUnit
from swapopt_core._torch.adapter import OptimizerAdapter
from swapopt_core._torch.bookkeeping import SlotKey, StateBook, Unit
from swapopt_core._torch.checkpoint import CheckpointHooks
from swapopt_core._torch.prefetch import BackwardPrefetch
from swapopt_core._torch.state import Slot, local_tensor
from swapopt_core._torch.tensor_ops import TorchTensorOps
from swapopt_core._torch.transaction import TorchStep, check_grads, check_params

logger = logging.getLogger(__name__)

__all__ = ["SwapEngine"]


class SwapEngine(EngineBase):
    """Keeps an optimizer's swappable state in host memory and runs its step as a pipeline.

    Installed through the optimizer's own hooks, so the object keeps its identity: the
    adapter silences the family's own update (``step`` still runs the closure and returns
    its loss, but finds no parameter to update), and a step post-hook runs the pipeline.
    """

    framework = "torch"
    install_note = ", new state starts in host memory at its first step"
    prefetches = True
    reconfigurable = EngineBase.reconfigurable | {"resident_state_fraction", "min_numel"}
    optimizer: torch.optim.Optimizer
    adapter: OptimizerAdapter

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: SwapOptimizerConfig,
        adapter: OptimizerAdapter,
        runtime: TransferRuntime,
        plugin_manager: pluggy.PluginManager,
    ) -> None:
        super().__init__(optimizer, config, adapter, runtime, plugin_manager)
        self.book = StateBook(
            optimizer,
            config,
            adapter,
            runtime,
            packed=self.staging.packed,
            before_bring_in=self.before_host_rewrite,
        )
        self.checkpoint = CheckpointHooks(self)
        self.prefetch = BackwardPrefetch(
            runtime, self._prefetch_pipeline, config.effective_prefetch_batches
        )
        self._handles: list[Any] = []
        self._unsilence: Callable[[], None] | None = None
        self._leave_step: Callable[[], None] | None = None

    @staticmethod
    def tensor_ops(runtime: TransferRuntime) -> TorchTensorOps:
        return TorchTensorOps()

    @property
    def slots(self) -> dict[SlotKey, Slot]:
        return self.book.slots

    # ---- install / uninstall -------------------------------------------------------------

    @classmethod
    def serves(cls, optimizer: object) -> bool:
        return isinstance(optimizer, torch.optim.Optimizer)

    @classmethod
    def param_devices(cls, optimizer: torch.optim.Optimizer) -> set[str]:
        return {
            local_tensor(p).device.type for group in optimizer.param_groups for p in group["params"]
        }

    @classmethod
    def runtime_device(
        cls, optimizer: torch.optim.Optimizer, device_types: tuple[str, ...]
    ) -> torch.device | None:
        """The device of the first parameter (in group order) on one of ``device_types``;
        parameters on several such devices: the first one's (see the base class)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                device = local_tensor(p).device
                if device.type in device_types:
                    return device
        return None

    @classmethod
    def runtime_serves(cls, runtime: TransferRuntime, optimizer: torch.optim.Optimizer) -> bool:
        return any(runtime.serves(torch.device(t)) for t in cls.param_devices(optimizer))

    def install(self) -> None:
        opt = self.optimizer
        self.adapter.validate(opt)
        check_params(opt.param_groups)
        try:
            # Offload state that exists already, so it is not resident through the next
            # forward/backward. Done first: a failure here leaves no hook behind.
            self._sync()
        except BaseException:
            self._restore_state()
            raise
        # The update runs in the step's post-hooks, ahead of the user's (StepHooks orders
        # swapopt's parts: what the adapter adds to silence the family's update goes first).
        self._leave_step = StepHooks.of(opt).join("engine", post=self._post_step)
        self._unsilence = self.adapter.silence(opt)
        self._handles = list(self.checkpoint.attach())
        self.prefetch.watch(self._params())
        setattr(opt, ENGINE_ATTR, self)

    def uninstall(self) -> None:
        """Move every swapped state back to its device and remove the hooks."""
        self.prefetch.detach()
        self._restore_state()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._leave_step is not None:
            self._leave_step()
            self._leave_step = None
        if self._unsilence is not None:
            self._unsilence()
            self._unsilence = None
        self.checkpoint.detach()
        delattr(self.optimizer, ENGINE_ATTR)

    def _restore_state(self) -> None:
        self.quiesce()  # the host tensors are read below
        self.book.restore_all()

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # ---- host state ----------------------------------------------------------------------

    def _sync(self, *, stepping: bool = False) -> list[Unit]:
        """Bring ``optimizer.state`` in line with the slots and the packed layout."""
        with torch.no_grad():
            units, ordered = self.book.sync(stepping=stepping)
            self.ledger.hold(self.book.resident_bytes)
            self.lay_out(ordered)
        return units

    def publish(self, slot: Slot) -> None:
        self.book.publish(slot)

    def offload(self) -> int:
        """Take swappable entries that are not our host tensors into host memory now."""
        self.before_host_rewrite()  # the layout may change below
        moved = self.book.unswapped()
        self._sync()
        return moved

    def before_host_rewrite(self) -> None:
        """Host state is about to be replaced: give back a prefetch that read it, write back
        kept batches and wait for every copy into it."""
        self.prefetch.drop()
        self.quiesce()

    def swapped_keys(self, group: dict[str, Any], state: dict[str, Any]) -> tuple[str, ...]:
        """The state keys swapped for a parameter of ``group`` whose state is ``state``."""
        return self.book.keys(group, state)

    def swappable(self, param: torch.Tensor, value: object) -> bool:
        """Whether state entry ``value`` of ``param`` can live in host memory."""
        return self.book.swappable(param, value)

    def load_swapped(self, pending: dict[SlotKey, torch.Tensor]) -> None:
        """Make the swapped entries a checkpoint load set aside the state, in host memory."""
        self.book.adopt_loaded(pending)
        self._sync()

    def configured(self) -> None:
        """Move the state the new config places elsewhere, one entry at a time: entries that
        become resident (or too small to swap) come in, those that stop being go out."""
        self.book.config = self.config
        self.prefetch.ahead = self.config.effective_prefetch_batches
        # The last step's plan names batches that no longer exist: no prefetch until a step
        # made a new one.
        self.prefetch.remember([])
        self._sync()

    def unit_bytes(self, units: Sequence[StepUnit]) -> list[int]:
        """Every parameter with swappable state, in ``param_groups`` order (with a gradient
        this step or not): the order ``resident_state_fraction`` takes its prefix in."""
        return [nbytes for nbytes in self.book.unit_bytes if nbytes]

    def fixed_state_bytes(self) -> int:
        return self.book.fixed_bytes()

    def host_changing(self) -> None:
        # A prefetch read the host state a write back is about to replace.
        self.prefetch.drop()

    # ---- the step ------------------------------------------------------------------------

    def _post_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        inside = getattr(self.adapter, "inside_step", None)
        if inside is not None and inside(opt):
            return  # a subclass's super().step(): the outermost call's hooks step
        self.step()

    def step(self) -> None:
        """Run one swapped update of every parameter that has a gradient (``run_step``)."""
        self.run_step(None)

    def open_step(self, call: Any) -> TorchStep:
        opt = self.optimizer
        try:
            self.adapter.validate(opt)
            check_params(opt.param_groups)
            if not getattr(self.adapter, "whole_tensors", False):
                # The generic path hands each gradient to the family's own step, which knows
                # whether it takes sparse ones (SparseAdam does).
                check_grads(opt.param_groups, self.adapter.family)
            self.prefetch.watch(self._params())
            return TorchStep(opt, self.adapter, self.book, self._sync(stepping=True))
        except BaseException:
            # No pipeline takes the batches prefetched during backward: give them back now
            # rather than hold them on the device until the next step.
            self.prefetch.drop()
            raise

    def computing(self) -> contextlib.AbstractContextManager[Any]:
        return torch.no_grad()

    def split_resident(
        self, units: Sequence[StepUnit]
    ) -> tuple[list[list[StepUnit]], list[StepUnit]]:
        """The resident units in batches about the size of one batch of all the state (so
        their undo copy stays one batch's), and the swapped rest.

        ``swap_times`` batches the swapped rest; the resident part gets as many as its share
        of all the bytes in ``swap_times`` batches would be.
        """
        lead = [u for u in units if isinstance(u, Unit) and u.resident]
        if not lead:
            return [], list(units)
        rest = [u for u in units if not (isinstance(u, Unit) and u.resident)]
        held = sum(u.nbytes for u in lead)
        total = held + sum(u.nbytes for u in rest)
        parts = max(1, math.ceil(held * self.config.swap_times / total)) if total else 1
        runs = partition([u.nbytes for u in lead], parts)
        return [[lead[k] for k in run] for run in runs], rest

    def start_pipeline(self, plan: list[list[Any]]) -> Pipeline:
        return self.prefetch.take(plan) or super().start_pipeline(plan)

    def _prefetch_pipeline(self, plan: list[list[Slot]]) -> Pipeline | None:
        """The pipeline a prefetch during backward may start, if one may start now."""
        if self.kept or not self.config.prefetch_during_backward:
            return None
        return super().start_pipeline(plan)

    def step_queued(self, plan: list[list[Any]], resumed: bool) -> None:
        self.prefetch.remember(plan)
