"""Prefetch during backward: the next step's first batches come in while backward runs.

The optimizer state does not depend on the gradients, so nothing stops it from moving
before the step. At the first gradient a backward accumulates into a parameter of the
optimizer (``register_post_accumulate_grad_hook``), the first ``ahead`` batches of the
last step's plan (``SwapOptimizerConfig.prefetch_batches``, clamped to the number of
batches; 0 turns the hooks into no-ops) are staged and their copies in queued. The step
then continues that ``Pipeline`` if its batches are the same slots over the same host
memory, and otherwise gives it back (``abandon``) and starts afresh.

Host state edited between the prefetch and the step (``opt.state[p]["exp_avg"].zero_()``
after ``swap_stats``) is what the step updates from: the version counters of each
prefetched slot's host tensor and state entry (a DTensor over it under FSDP2 counts its
in-place edits on itself) are noted when the copies are queued, and ``take`` copies again
each batch whose counters moved, or whose copy in is known to have failed.

The hooks live on the parameters, which outlive a dropped optimizer: they hold this object
(and so the engine, its copy threads and host state) only weakly, and are removed once it
is collected.

Memory: from the first gradient of a backward until the step, ``ahead`` batches of the
swapped state (about ``ahead / swap_times`` of it) are on the device on top of what backward
uses. The step stages at most three batches at a time of its own; prefetched batches it has
not reached yet stay staged until their turn, so with ``ahead`` above three the step starts
with ``ahead`` batches on the device and the peak of the step is that many. Set
``prefetch_batches=0`` (or ``prefetch_during_backward=False``) to keep backward's peak as it
was.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from swapopt_core._device.interface import TransferRuntime
from swapopt_core._swap.pipeline import Pipeline
from swapopt_core._torch.state import Slot

logger = logging.getLogger(__name__)

__all__ = ["BackwardPrefetch"]

#: What tells an in-place edit of a slot: the version counters of its host tensor and of
#: its state entry (the same tensor, or a DTensor over it).
Stamp = tuple[int, int]


def _stamp_of(batch: Sequence[Slot]) -> list[Stamp]:
    return [(slot.host._version, slot.value._version) for slot in batch]


def _weak_hook(prefetch: BackwardPrefetch) -> Callable[[torch.Tensor], None]:
    """A gradient hook that calls ``prefetch`` while it lives and keeps it from nothing."""
    target = weakref.ref(prefetch)

    def on_grad(param: torch.Tensor) -> None:
        live = target()
        if live is not None:
            live._on_grad(param)

    return on_grad


def _remove(handles: WeakIdKeyDictionary) -> None:
    for handle in list(handles.values()):
        handle.remove()
    handles.clear()


#: Builds the pipeline a prefetch starts for a plan, or says no (``None``).
PipelineFactory = Callable[[list[list[Slot]]], Pipeline | None]


class BackwardPrefetch:
    """The hooks and the pipeline one ``SwapEngine`` starts during backward.

    Args:
        runtime: Tells whether a prefetched copy in failed.
        open_pipeline: The engine's pipeline for a plan, or ``None`` when the engine wants
            no prefetch now (switched off, or batches kept on the device).
        ahead: Batches to copy in (``SwapOptimizerConfig.effective_prefetch_batches``);
            0: the hooks do nothing.
    """

    def __init__(
        self, runtime: TransferRuntime, open_pipeline: PipelineFactory, ahead: int = 2
    ) -> None:
        self.runtime = runtime
        self.open_pipeline = open_pipeline
        self.ahead = ahead
        self.plan: list[list[Slot]] | None = None  #: the last step's batches
        self.pipeline: Pipeline | None = None
        self._hosts: list[torch.Tensor] = []  # the host memory the prefetch reads
        self._stamps: list[list[Stamp]] = []  # per prefetched batch, when it was queued
        # The hook of each watched parameter, keyed by the parameter itself, weakly and by
        # identity: an entry goes with its parameter, so a new parameter that lands at a
        # dead one's address is not taken for watched already.
        self._handles = WeakIdKeyDictionary()
        self._hook = _weak_hook(self)
        # Not at exit: the parameters' hooks die with the process anyway.
        weakref.finalize(self, _remove, self._handles).atexit = False
        self._tried = False  # a prefetch was tried since the last step
        self._failed = False

    def watch(self, params: Sequence[torch.Tensor]) -> None:
        """Hook the parameters not hooked yet (new groups are watched at their first step)."""
        for param in params:
            if param not in self._handles and param.requires_grad:
                self._handles[param] = param.register_post_accumulate_grad_hook(self._hook)

    def remember(self, batches: list[list[Slot]]) -> None:
        """The plan the next step is expected to follow."""
        self.plan = batches if batches else None
        self._tried = False

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._tried or self.plan is None or self.ahead <= 0:
            return
        self._tried = True  # once per step, even if it fails
        if torch.compiler.is_compiling():  # traced, not run: nothing to copy yet
            return
        pipeline = self.open_pipeline(self.plan)
        if pipeline is None:
            return
        try:
            # Outside any dispatch mode (an OffloadSession's tracer among them): these copies
            # are the optimizer's, not ops of the model's backward.
            with _disable_current_modes():
                pipeline.start(self.ahead)
        except Exception:  # the step will bring the batches in itself; backward goes on
            if not self._failed:
                logger.warning("prefetching optimizer state during backward failed", exc_info=True)
            self._failed = True
            return
        ahead = self.plan[: self.ahead]
        self._hosts = [slot.host for batch in ahead for slot in batch]
        self._stamps = [_stamp_of(batch) for batch in ahead]
        self.pipeline = pipeline

    def take(self, batches: list[list[Slot]]) -> Pipeline | None:
        """The prefetched pipeline if it was built for ``batches``; else give it back.

        A prefetched batch whose host state was edited since its copy in was queued, or
        whose copy in is known to have failed, is copied in again.

        Raises:
            BaseException: Queuing a copy again failed; the prefetch was given back.
        """
        pipeline, self.pipeline = self.pipeline, None
        stamps, self._stamps = self._stamps, []
        if pipeline is None:
            return None
        hosts = [slot.host for batch in batches[: len(stamps)] for slot in batch]
        same_memory = len(hosts) == len(self._hosts) and all(
            a is b for a, b in zip(hosts, self._hosts, strict=True)
        )
        self._hosts = []
        if not (same_memory and pipeline.matches(batches)):
            pipeline.abandon()
            return None
        runtime = self.runtime
        try:
            for j, noted in enumerate(stamps):
                failed = runtime.failure(pipeline.tickets[j]) is not None
                if failed or noted != _stamp_of(batches[j]):
                    logger.debug(
                        "prefetched batch %d %s: copied in again",
                        j,
                        "failed" if failed else "edited",
                    )
                    pipeline.refetch(j)
        except BaseException:
            pipeline.abandon()
            raise
        return pipeline

    def drop(self) -> None:
        """Give back a prefetch (host state is about to change, or the swap is removed)."""
        pipeline, self.pipeline, self._hosts, self._stamps = self.pipeline, None, [], []
        if pipeline is not None:
            pipeline.abandon()

    def detach(self) -> None:
        """Remove the hooks and drop the prefetch."""
        self.drop()
        _remove(self._handles)
        self.plan = None
