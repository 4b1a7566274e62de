"""What keeps a torch step a transaction: refusals before anything moves, and an undo copy.

A batch's update either finishes or is undone. The swapped state needs no copy: its host
copy is only overwritten by the batch's copy out, which runs after the update succeeded.
What the update changes directly (the parameters, the step counter, state too small to be
swapped) is copied on its device first.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swapopt_core._errors import SwapOptError
from swapopt_core._torch.state import local_tensor

__all__ = ["Undo", "UndoArena", "check_grads", "check_params", "snapshot"]


@dataclass
class Undo:
    """One parameter as it was before its batch's update."""

    param: torch.Tensor
    entries: dict[str, Any]  #: the state dict's entries (the objects themselves)
    values: dict[str, torch.Tensor]  #: copies of its resident tensor entries
    saved: torch.Tensor  #: copy of the parameter's local tensor

    def roll_back(self, state: MutableMapping[str, Any], slots: dict) -> None:
        """Put ``param`` and its ``state`` back; forget slots the update created."""
        local_tensor(self.param).copy_(self.saved)
        for key in state.keys() - self.entries.keys():
            del state[key]
            slots.pop((id(self.param), key), None)
        state.update(self.entries)
        for key, value in self.values.items():
            local_tensor(self.entries[key]).copy_(value)


class UndoArena:
    """Device memory for the parameter copies of one step, reused from batch to batch.

    One flat buffer per device and dtype, sized for the largest batch, lives for one step:
    a batch's copy is no longer needed once its update finished, so the next batch takes
    the same memory. Allocating once per step rather than once per parameter keeps the
    cost of the undo copy at the copy itself.

    Args:
        batches: The parameters of each batch of the step.
    """

    def __init__(self, batches: Sequence[Sequence[torch.Tensor]]) -> None:
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        for params in batches:
            for key, numel in _needs(params).items():
                sizes[key] = max(sizes.get(key, 0), numel)
        self._buffers = {
            key: torch.empty(numel, dtype=key[1], device=key[0]) for key, numel in sizes.items()
        }

    def copies(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A copy of the local tensor of each of ``params``, in this arena."""
        offsets = dict.fromkeys(self._buffers, 0)
        out = []
        for param in params:
            local = local_tensor(param)
            key = (local.device, local.dtype)
            start = offsets[key]
            offsets[key] = start + local.numel()
            out.append(self._buffers[key][start : offsets[key]].view(local.shape).copy_(local))
        return out


def _needs(params: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], int]:
    needs: dict[tuple[torch.device, torch.dtype], int] = {}
    for param in params:
        local = local_tensor(param)
        key = (local.device, local.dtype)
        needs[key] = needs.get(key, 0) + local.numel()
    return needs


def snapshot(
    state: MutableMapping[str, Any], param: torch.Tensor, swapped: set[str], saved: torch.Tensor
) -> Undo:
    """Save what an update of ``param`` changes in place, but for the ``swapped`` keys.

    ``saved`` is already a copy of the parameter's local tensor (see ``UndoArena``).
    """
    entries = dict(state)
    values = {
        key: local_tensor(value).clone()
        for key, value in entries.items()
        if key not in swapped and isinstance(value, torch.Tensor)
    }
    return Undo(param, entries, values, saved)


def check_params(groups: Sequence[MutableMapping[str, Any]]) -> None:
    """Refuse a parameter listed twice in a group (torch only warns about it)."""
    for index, group in enumerate(groups):
        seen: dict[int, int] = {}
        for position, param in enumerate(group["params"]):
            first = seen.setdefault(id(param), position)
            if first != position:
                raise SwapOptError(
                    f"param_groups[{index}]['params'][{position}] is the same tensor as "
                    f"param_groups[{index}]['params'][{first}]; swapopt does not swap a "
                    "parameter listed twice (torch would update it twice per step). Pass "
                    "each parameter once, e.g. list(dict.fromkeys(model.parameters()))."
                )


def check_grads(groups: Sequence[MutableMapping[str, Any]], family: str) -> None:
    """Refuse sparse gradients, before anything moves."""
    for index, group in enumerate(groups):
        for position, param in enumerate(group["params"]):
            if param.grad is not None and param.grad.layout != torch.strided:
                raise SwapOptError(
                    f"param_groups[{index}]['params'][{position}] has a {param.grad.layout} "
                    f"gradient; {family} under swapopt needs dense gradients. Use a dense "
                    "embedding (sparse=False) or a sparse optimizer unswapped."
                )
