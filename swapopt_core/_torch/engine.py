"""The swap engine installed on one torch optimizer: install, uninstall and the step.

Its state bookkeeping is in ``swapopt_core._torch.bookkeeping``, its checkpoint hooks in
``swapopt_core._torch.checkpoint``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pluggy
import torch

from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._device.interface import TransferRuntime
from swapopt_core._engine_base import ENGINE_ATTR, EngineBase
from swapopt_core._partition import partition
from swapopt_core._pipeline import Pipeline, deferred_interrupt
from swapopt_core._torch.adapter import OptimizerAdapter
from swapopt_core._torch.bookkeeping import StateBook, Unit
from swapopt_core._torch.checkpoint import CheckpointHooks
from swapopt_core._torch.prefetch import BackwardPrefetch
from swapopt_core._torch.staging import PackedStaging, PerTensorStaging
from swapopt_core._torch.state import Slot, local_tensor, wrap_like
from swapopt_core._torch.transaction import UndoArena, check_grads, check_params, snapshot

logger = logging.getLogger(__name__)


class SwapEngine(StateBook, EngineBase):
    """Keeps an optimizer's swappable state in host memory and runs its step as a pipeline.

    Installed through the optimizer's own hooks, so the object keeps its identity: the
    adapter silences the family's own update (``step`` still runs the closure and returns
    its loss, but finds no parameter to update), and a step post-hook runs the pipeline.
    """

    framework = "torch"
    install_note = ", new state starts in host memory at its first step"
    packed_staging = PackedStaging
    per_tensor_staging = PerTensorStaging
    optimizer: torch.optim.Optimizer
    adapter: OptimizerAdapter
    staging: PackedStaging | PerTensorStaging
    slots: dict[tuple[int, str], Slot]

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: SwapOptimizerConfig,
        adapter: OptimizerAdapter,
        runtime: TransferRuntime,
        plugin_manager: pluggy.PluginManager,
    ) -> None:
        super().__init__(optimizer, config, adapter, runtime, plugin_manager)
        self._handles: list[Any] = []
        self.checkpoint = CheckpointHooks(self)
        self.prefetch = BackwardPrefetch(self)
        # Units finished by a step that was then interrupted, with the grad they used.
        self._finished: dict[int, tuple[torch.Tensor, int]] = {}
        self._unsilence: Callable[[], None] | None = None

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
    def runtime_serves(cls, runtime: TransferRuntime, optimizer: torch.optim.Optimizer) -> bool:
        return any(runtime.serves(torch.device(t)) for t in cls.param_devices(optimizer))

    def install(self) -> None:
        opt = self.optimizer
        self.adapter.validate(opt)
        check_params(self.optimizer.param_groups)
        try:
            # Offload state that exists already, so it is not resident through the next
            # forward/backward. Done first: a failure here leaves no hook behind.
            self.sync_state()
        except BaseException:
            self._restore_state()
            raise
        self._unsilence = self.adapter.silence(opt)
        step_post = opt.register_step_post_hook(self._post_step)
        # Before post-hooks the user registered earlier: they expect an updated model.
        opt._optimizer_step_post_hooks.move_to_end(step_post.id, last=False)
        self._handles = [step_post, *self.checkpoint.attach()]
        self.prefetch.watch([p for group in opt.param_groups for p in group["params"]])
        setattr(opt, ENGINE_ATTR, self)

    def uninstall(self) -> None:
        """Move every swapped state back to its device and remove the hooks."""
        self.prefetch.detach()
        self._restore_state()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._unsilence is not None:
            self._unsilence()
            self._unsilence = None
        self.checkpoint.detach()
        delattr(self.optimizer, ENGINE_ATTR)

    def _restore_state(self) -> None:
        self.quiesce()  # the host tensors are read below
        for slot in self.slots.values():
            local = torch.empty_like(slot.host, device=slot.device)
            local.copy_(slot.host)
            self.optimizer.state[slot.param][slot.key] = wrap_like(local, slot.value)
        self.slots.clear()

    # ---- the step ------------------------------------------------------------------------

    def _post_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.step()

    def step(self) -> None:
        """Run one swapped update of every parameter that has a gradient.

        If anything raises, each parameter was updated completely or not at all, its state
        is in host memory (or kept on the device until the next call) and the updated ones
        are remembered: calling ``step`` again with the same gradients finishes the step.
        """
        with deferred_interrupt():
            self._step()

    def _step(self) -> None:
        opt = self.optimizer
        self.settle()
        self.adapter.validate(opt)
        check_params(self.optimizer.param_groups)
        check_grads(opt.param_groups, self.adapter.family)
        self.prefetch.watch([p for group in opt.param_groups for p in group["params"]])
        with torch.no_grad():
            units = self.sync_state(stepping=True)
            remaining = [u for u in units if not self._already_done(u)]
            resumed = len(remaining) < len(units)
            units = remaining
            runs = partition([u.nbytes for u in units], self.config.swap_times)
            batches = [[units[k] for k in run] for run in runs]
            done: dict[int, tuple[torch.Tensor, int]] = {}
            arena = UndoArena([[u.param for u in b] for b in batches])

            def update(i: int, views: dict[Slot, torch.Tensor]) -> None:
                saved = arena.copies([u.param for u in batches[i]])
                undo = [
                    snapshot(opt.state[u.param], u.param, {s.key for s in u.slots}, copy)
                    for u, copy in zip(batches[i], saved, strict=True)
                ]
                try:
                    self._update_batch(batches[i], views)
                except BaseException:
                    for saved in undo:
                        saved.roll_back(opt.state[saved.param], self.slots)
                    raise
                for unit in batches[i]:
                    done[id(unit.param)] = (unit.grad, unit.grad._version)

            plan = [[s for u in b for s in u.slots] for b in batches]
            pipeline = self.prefetch.take(plan) or Pipeline(
                plan, self.staging, self.runtime, self.previous
            )
            try:
                pipeline.run(update, self.kept)
            except BaseException:
                self._finished.update(done)
                self._drain_after_failure()
                raise
            h2d, d2h = pipeline.h2d, pipeline.d2h
            # The step ends with its copies queued; the next one's copies in wait for these.
            # A step without batches queued none: the copies before it are still the ones.
            if pipeline.batches:
                self.previous = pipeline
            self.prefetch.remember(plan)
        # Until the observers have seen the step, a call with the same gradients only
        # tells them again.
        self._finished.update(done)
        self.finish_step(h2d, d2h, len(batches), resumed=resumed)
        self._finished.clear()

    def _drain_after_failure(self) -> None:
        """Learn which copies out of the last step failed (their batches join ``kept``)."""
        try:
            # The recovery drained the queues: this only collects what they reported.
            self.wait_copies()
        except BaseException:  # the next entry tries again; the step's own error propagates
            logger.warning("swapopt: draining the copies after a failed step failed", exc_info=True)

    def host_changing(self) -> None:
        # A prefetch read the host state a write back is about to replace.
        self.prefetch.drop()

    def _already_done(self, unit: Unit) -> bool:
        record = self._finished.get(id(unit.param))
        return record is not None and record[0] is unit.grad and record[1] == unit.grad._version

    def _update_batch(self, units: list[Unit], views: dict[Slot, torch.Tensor]) -> None:
        opt = self.optimizer
        by_group: dict[int, list[Unit]] = {}
        for unit in units:
            by_group.setdefault(unit.group, []).append(unit)
        for index, members in by_group.items():
            group = opt.param_groups[index]
            keys = self.keys(group)
            works = []
            for unit in members:
                work = {
                    k: local_tensor(v) if isinstance(v, torch.Tensor) else v
                    for k, v in opt.state[unit.param].items()
                }
                for slot in unit.slots:
                    work[slot.key] = views[slot]
                works.append(work)
            self.adapter.update(
                opt,
                group,
                [local_tensor(u.param) for u in members],
                [local_tensor(u.grad) for u in members],
                works,
            )
            for unit, work in zip(members, works, strict=True):
                self._store(unit, work, keys, views)

    def _store(self, unit: Unit, work: dict, keys: tuple[str, ...], views: dict) -> None:
        """Write back what the update created or replaced in its working copy of the state."""
        state = self.optimizer.state[unit.param]
        swapped = {slot.key: slot for slot in unit.slots}
        for key, value in work.items():
            slot = swapped.get(key)
            if slot is not None:
                if value is not views[slot]:
                    views[slot].copy_(value)
                continue
            old = state.get(key)
            if old is not None and (old is value or local_tensor(old) is value):
                continue
            if key in keys and self.swappable(unit.param, value):
                # Created by the update (SGD momentum): take it to host memory right away.
                self._adopt(unit.param, key, wrap_like(value, unit.param), settled=True)
            else:
                like = old if isinstance(old, torch.Tensor) else unit.param
                state[key] = wrap_like(value, like) if isinstance(value, torch.Tensor) else value

    # ---- reporting -----------------------------------------------------------------------

    def host_state_bytes(self) -> int:
        if isinstance(self.staging, PackedStaging) and self.staging.buffers:
            return sum(b.numel() * b.element_size() for b in self.staging.buffers.values())
        return super().host_state_bytes()
