"""Parameter gradients seen by a warmup: not activations, so not in the budget or the trace.

Autograd accumulates each leaf tensor's gradient (``.grad``) into a storage that an op inside
the session made, so the warmup tracks it like an activation at first. The warmup hooks every
leaf tensor that requires grad as soon as an op reads it; when autograd has set its
``.grad``, the hook untracks that storage: it no longer counts toward the resident bytes, the
warmup never evicts it, and it is left out of the trace's ``storage_sizes`` (so the planner
and the replay ignore it, as they ignore parameters). Its bytes are reported apart
(``OffloadStats.gradient_bytes``).

Until its hook runs, a gradient counted like an activation. So that the warmup's peak is a
peak of activations, the watch also samples the resident bytes at each op (after its inputs
are paged in, and once its outputs exist) and takes every gradient out of the samples it was
counted in (``peak``).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from swapopt_core._activations.residency import Residency, Tracked

logger = logging.getLogger(__name__)

__all__ = ["GradientWatch"]


class GradientWatch:
    """The leaf tensors one entry hooked, and the gradient storages it untracked.

    Args:
        residency: The entry's residency, which tracks the storages.
    """

    def __init__(self, residency: Residency) -> None:
        self._residency = weakref.ref(residency)  # hooks must not keep a finished entry alive
        self._hooked: dict[int, tuple[weakref.ref, Any]] = {}
        self.sids: set[int] = set()
        self.nbytes = 0
        self.closed = False
        self._samples: list[int] = []  # resident bytes at each op's begin and end
        self._end_sample: dict[int, int] = {}  # op -> its end sample
        self._discounts: list[tuple[int, int, int]] = []  # samples [start, stop) hold nbytes
        self._since: dict[int, int] = {}  # sid -> the sample it is resident from (paged in)
        self._held: dict[int, list[tuple[int, int]]] = {}  # sid -> samples it was resident in
        self._op = -1  # the last op whose outputs were tracked
        #: ``(op, bytes)`` of each gradient autograd stored, the op being the last one that
        #: ran before: when it lands on the device for good (the whole-step planner's input).
        self.ready: list[tuple[int, int]] = []

    def sample(self, resident_bytes: int, op: int | None = None) -> None:
        """Note the resident bytes now; ``op``: the op whose outputs were just tracked."""
        residency = self._residency()
        if not self._samples and residency is not None:
            # The peak before the first sample: that of a replay that then left its plan.
            self._samples.append(residency.peak_bytes)
        if op is not None:
            self._end_sample[op] = len(self._samples)
            self._op = op
        self._samples.append(resident_bytes)

    def released(self, tracked: Tracked) -> None:
        """The warmup evicted ``tracked``: the samples from now on do not count it."""
        start = self._since.pop(tracked.sid, None)
        if start is None and tracked.sid not in self._held:  # resident since it was made
            start = self._end_sample.get(tracked.produced_at)
        if start is not None:
            self._held.setdefault(tracked.sid, []).append((start, len(self._samples)))

    def paged_in(self, tracked: Tracked) -> None:
        """The warmup brought ``tracked`` back: the samples from now on count it."""
        self._since[tracked.sid] = len(self._samples)

    def peak(self) -> int | None:
        """The highest sampled resident bytes, gradients taken out; ``None`` if nothing
        was sampled."""
        if not self._samples:
            return None
        delta = [0] * (len(self._samples) + 1)
        for start, stop, nbytes in self._discounts:
            delta[start] -= nbytes
            delta[stop] += nbytes
        best, offset = 0, 0
        for sample, change in zip(self._samples, delta, strict=False):
            offset += change
            best = max(best, sample + offset)
        return best

    def watch(self, tensor: torch.Tensor) -> None:
        """Hook ``tensor`` if it is a leaf that requires grad and is not hooked yet."""
        if self.closed or not (tensor.requires_grad and tensor.is_leaf):
            return
        known = self._hooked.get(id(tensor))
        if known is not None and known[0]() is tensor:
            return
        handle = tensor.register_post_accumulate_grad_hook(self._accumulated)
        self._hooked[id(tensor)] = (weakref.ref(tensor), handle)

    def leaves(self) -> list[weakref.ref]:
        """Weak references to the leaf tensors hooked so far (the parameters, typically)."""
        return [ref for ref, _ in self._hooked.values() if ref() is not None]

    def watch_all(self, refs: list[weakref.ref]) -> None:
        """Hook the still-alive leaves of ``refs``: a warmup that starts in the middle of a
        step (a replay fell back) has not seen the parameters its forward read."""
        for ref in refs:
            tensor = ref()
            if tensor is not None:
                self.watch(tensor)

    def _accumulated(self, tensor: torch.Tensor) -> None:
        residency = self._residency()
        grad = tensor.grad
        if self.closed or residency is None or grad is None:
            return
        if grad.layout != torch.strided:
            return
        tracked = residency.by_storage.get(grad.untyped_storage())
        if tracked is None or tracked.sid in self.sids:
            return
        if tracked.resident:
            self.released(tracked)  # counted up to now (unless paged in some other way)
        for start, stop in self._held.pop(tracked.sid, ()):
            self._discounts.append((start, stop, tracked.nbytes))
        residency.untrack(tracked)
        self.sids.add(tracked.sid)
        self.nbytes += tracked.nbytes
        self.ready.append((max(self._op, 0), tracked.nbytes))
        logger.debug("storage %d is a parameter gradient: untracked", tracked.sid)

    def close(self) -> None:
        """Remove every hook (the entry ended)."""
        self.closed = True
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
