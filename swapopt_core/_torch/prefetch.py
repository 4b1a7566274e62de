"""Prefetch during backward: the next step's first batches come in while backward runs.

The optimizer state does not depend on the gradients, so nothing stops it from moving
before the step. At the first gradient a backward accumulates into a parameter of the
optimizer (``register_post_accumulate_grad_hook``), the first ``AHEAD`` batches of the
last step's plan are staged and their copies in queued. The step then continues that
``Pipeline`` if its batches are the same slots over the same host memory, and otherwise
gives it back (``abandon``) and starts afresh.

Memory: from the first gradient of a backward until the step, ``AHEAD`` batches of state
(``AHEAD / swap_times`` of it, packed: two arenas) are on the device on top of what
backward uses; the step itself never holds more than three batches. Set
``SwapOptimizerConfig.prefetch_during_backward=False`` to keep backward's peak as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from swapopt_core._pipeline import Pipeline
from swapopt_core._torch.state import Slot

if TYPE_CHECKING:
    from swapopt_core._torch.engine import SwapEngine

logger = logging.getLogger(__name__)

__all__ = ["AHEAD", "BackwardPrefetch"]

#: Batches copied in ahead of a step: the ring holds three, one stays free for the step.
AHEAD = 2


class BackwardPrefetch:
    """The hooks and the pipeline one ``SwapEngine`` starts during backward."""

    def __init__(self, engine: SwapEngine) -> None:
        self.engine = engine
        self.plan: list[list[Slot]] | None = None  #: the last step's batches
        self.pipeline: Pipeline | None = None
        self._hosts: list[torch.Tensor] = []  # the host memory the prefetch reads
        self._handles: dict[int, Any] = {}
        self._tried = False  # a prefetch was tried since the last step
        self._failed = False

    def watch(self, params: Sequence[torch.Tensor]) -> None:
        """Hook the parameters not hooked yet (new groups are watched at their first step)."""
        for param in params:
            if id(param) not in self._handles and param.requires_grad:
                self._handles[id(param)] = param.register_post_accumulate_grad_hook(self._on_grad)

    def remember(self, batches: list[list[Slot]]) -> None:
        """The plan the next step is expected to follow."""
        self.plan = batches if batches else None
        self._tried = False

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._tried or self.plan is None:
            return
        self._tried = True  # once per step, even if it fails
        engine = self.engine
        if engine.kept or not engine.config.prefetch_during_backward:
            return
        if torch.compiler.is_compiling():  # traced, not run: nothing to copy yet
            return
        pipeline = Pipeline(self.plan, engine.staging, engine.runtime, engine.previous)
        try:
            # Outside any dispatch mode (an OffloadSession's tracer among them): these copies
            # are the optimizer's, not ops of the model's backward.
            with _disable_current_modes():
                pipeline.start(AHEAD)
        except Exception:  # the step will bring the batches in itself; backward goes on
            if not self._failed:
                logger.warning("prefetching optimizer state during backward failed", exc_info=True)
            self._failed = True
            return
        self._hosts = [slot.host for batch in self.plan[:AHEAD] for slot in batch]
        self.pipeline = pipeline

    def take(self, batches: list[list[Slot]]) -> Pipeline | None:
        """The prefetched pipeline if it was built for ``batches``; else give it back."""
        pipeline, self.pipeline = self.pipeline, None
        if pipeline is None:
            return None
        hosts = [slot.host for batch in batches[:AHEAD] for slot in batch]
        same_memory = len(hosts) == len(self._hosts) and all(
            a is b for a, b in zip(hosts, self._hosts, strict=True)
        )
        self._hosts = []
        if same_memory and pipeline.matches(batches):
            return pipeline
        pipeline.abandon()
        return None

    def drop(self) -> None:
        """Give back a prefetch (host state is about to change, or the swap is removed)."""
        pipeline, self.pipeline, self._hosts = self.pipeline, None, []
        if pipeline is not None:
            pipeline.abandon()

    def detach(self) -> None:
        """Remove the hooks and drop the prefetch."""
        self.drop()
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self.plan = None
