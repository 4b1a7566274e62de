"""A cheap watch on how much a step's forward saves for backward.

Where the whole-step plan keeps every activation on the device, the session's entries run
without the tracer (no cost per op), so nothing would notice a batch that grows past what the
plan was made for. ``SavedBytes`` adds the bytes of every tensor autograd saves (one Python
call per saved tensor, through ``torch.autograd.graph.saved_tensors_hooks``): the same count
for the traced step and for later ones tells whether the step grew. It is a size check, not
an identity: nothing is kept or keyed. What is saved is a detached alias of the tensor (same
storage and version counter, no ``grad_fn``: a saved output must not refer to its own node).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SavedBytes"]


class SavedBytes:
    """Bytes of the tensors autograd saves while open (a tensor saved twice counts twice).

    Attributes:
        total: The bytes counted since ``open``.
    """

    def __init__(self) -> None:
        self.total = 0
        self._hooks: Any = None

    def open(self) -> None:
        """Start counting (from 0)."""
        self.close()
        self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def close(self) -> int:
        """Stop counting; returns the bytes counted."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        return self.total

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.total += tensor.numel() * tensor.element_size()
        return tensor.detach()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
