"""A torch step for the engine's transaction: refusals before anything moves, and the update.

A batch's update either finishes or is undone. The swapped state needs no copy: its host
copy is only overwritten by the batch's copy out, which runs after the update succeeded.
What the update changes in place (the parameters, the step counter, state too small to be
swapped) is listed by ``TorchStep.changed`` for the engine's undo copy; state entries the
update creates or replaces are put back by ``TorchStep.update`` itself.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch

from swapopt_core._errors import SwapOptError
from swapopt_core._swap.ops import Target
from swapopt_core._torch.adapter import OptimizerAdapter
from swapopt_core._torch.bookkeeping import StateBook, Unit
from swapopt_core._torch.state import local_tensor, wrap_like

__all__ = ["TorchStep", "check_grads", "check_params"]


class TorchStep:
    """One call of a torch step: its units and how a batch of them is updated.

    Args:
        optimizer: The optimizer stepped.
        adapter: Runs the family's own update on one group's parameters.
        book: The slots; asked to adopt state an update creates and to forget it on undo.
        units: The parameters with a gradient, in order.
    """

    identity = None  # each unit carries its gradient in its token

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        adapter: OptimizerAdapter,
        book: StateBook,
        units: list[Unit],
    ) -> None:
        self.optimizer = optimizer
        self.adapter = adapter
        self.book = book
        self.units = units

    def prepare(self) -> Any:
        return None  # torch families have no once-per-step preamble outside ``update``

    def changed(self, batch: Sequence[Unit]) -> list[Target]:
        """The parameters and the tensor state that is not swapped, as local tensors."""
        targets: list[Target] = []
        for unit in batch:
            swapped = {slot.key for slot in unit.slots}
            for value in (
                unit.param,
                *(
                    v
                    for k, v in self.optimizer.state.get(unit.param, {}).items()
                    if k not in swapped and isinstance(v, torch.Tensor)
                ),
            ):
                local = local_tensor(value)
                targets.append((local, local.device))
        return targets

    def update(self, batch: Sequence[Unit], views: dict[Any, Any], prepared: Any) -> None:
        """Update ``batch``; on failure put back the state entries the update replaced."""
        state = self.optimizer.state
        # Looked up without creating: a parameter without state keeps none (torch's SGD
        # without momentum has no entry at all).
        entries = [state.get(unit.param) for unit in batch]
        saved = [None if entry is None else dict(entry) for entry in entries]
        try:
            self._update(batch, views)
        except BaseException:
            for unit, before in zip(batch, saved, strict=True):
                now = state.get(unit.param)
                if now is None:
                    continue
                for key in now.keys() - (before or {}).keys():
                    del now[key]
                    self.book.forget(unit.param, key)
                if before is None:
                    del state[unit.param]
                else:
                    now.update(before)
            raise

    def _update(self, units: Sequence[Unit], views: dict[Any, Any]) -> None:
        opt = self.optimizer
        # The generic path runs the family's own step, which reads each parameter's
        # gradient and keeps DTensor state as DTensors; the Adam path works on local shards.
        whole = getattr(self.adapter, "whole_tensors", False)
        by_group: dict[int, list[Unit]] = {}
        for unit in units:
            by_group.setdefault(unit.group, []).append(unit)
        for index, members in by_group.items():
            group = opt.param_groups[index]
            works = []
            for unit in members:
                state = opt.state.get(unit.param, {})
                work = {
                    k: v if whole or not isinstance(v, torch.Tensor) else local_tensor(v)
                    for k, v in state.items()
                }
                for slot in unit.slots:
                    view = views[slot]
                    work[slot.key] = wrap_like(view, state[slot.key]) if whole else view
                works.append(work)
            self.adapter.update(
                opt,
                group,
                [u.param if whole else local_tensor(u.param) for u in members],
                [u.grad if whole else local_tensor(u.grad) for u in members],
                works,
            )
            for unit, work in zip(members, works, strict=True):
                self._store(unit, work, self.book.keys(group, work), views)

    def _store(
        self, unit: Unit, work: dict[str, Any], keys: tuple[str, ...], views: dict[Any, Any]
    ) -> None:
        """Write back what the update created or replaced in its working copy of the state."""
        state = self.optimizer.state.get(unit.param, {})
        swapped = {slot.key: slot for slot in unit.slots}
        # The generic path's new entries are what the family's own step created, in the
        # layout it chose (a DTensor buffer beside a DTensor parameter, a plain 0-dim step
        # counter): kept as they are. The Adam path's are local shards, laid out again.
        whole = getattr(self.adapter, "whole_tensors", False)
        for key, value in work.items():
            slot = swapped.get(key)
            if slot is not None:
                local = local_tensor(value)
                if local is not views[slot]:
                    views[slot].copy_(local)
                continue
            old = state.get(key)
            if old is not None and (old is value or local_tensor(old) is value):
                continue
            if key in keys and self.book.swappable(unit.param, value):
                # Created by the update (SGD momentum): take it to host memory right away.
                laid = value if whole else _laid_out(value, unit.param)
                self.book.adopt(unit.param, key, laid, settled=True)
            elif whole or not isinstance(value, torch.Tensor):
                state = self.optimizer.state[unit.param]
                state[key] = value
            else:
                like = old if isinstance(old, torch.Tensor) else unit.param
                state = self.optimizer.state[unit.param]
                state[key] = _laid_out(value, like)


def _laid_out(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` with ``like``'s distributed layout, unless it has one of its own already."""
    return value if local_tensor(value) is not value else wrap_like(value, like)


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
