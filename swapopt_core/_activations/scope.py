"""What the warmup and the replay of one session entry share, and the op they pass around.

An entry starts as a ``ReplayEntry`` (``replay_entry.py``) or a ``WarmupEntry``
(``warmup.py``); a replay that leaves its plan hands over to a warmup in the middle of the
step. Both work on one ``Scope``: the runtime chosen at the entry's first op, the
``Residency`` of its storages, the ``GradientWatch`` of its parameter gradients, the budget,
and the ``Quiet`` guard under which swapopt's own bookkeeping runs ops that the dispatch mode
must let through untouched.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from swapopt_core._activations.gradients import GradientWatch
from swapopt_core._activations.quiet import Quiet
from swapopt_core._activations.residency import HostPool, Residency, Tracked
from swapopt_core._device.interface import TorchRuntime
from swapopt_core._planning.ir import AccessKind

__all__ = ["Open", "Scope", "away_bytes"]


@dataclass
class Open:
    """An op between its begin and its end (a region may end under another phase)."""

    index: int
    name: str
    start: Any
    inputs: set[torch.UntypedStorage] = field(default_factory=set)
    accesses: dict[int, AccessKind] = field(default_factory=dict)
    outputs: dict[int, int] = field(default_factory=dict)  # sid -> output position
    devices: frozenset[str] | None = None  # recording: set when it may be recomputed


class Scope:
    """The state one entry's phases share (see the module doc).

    ``runtime``, ``residency`` and ``gradients`` exist once ``start`` ran (the entry's first
    op: the runtime follows the device of its tensors); ``started`` says whether it did.

    Args:
        budget: Device bytes the activations may hold.
        min_offload: Storages at least this large are evicted first.
        leaves: Weak references to the leaf tensors the last recording hooked (a warmup
            that starts in the middle of a step hooks them too).
    """

    runtime: TorchRuntime
    residency: Residency
    gradients: GradientWatch

    def __init__(self, budget: int, min_offload: int, leaves: list[weakref.ref]) -> None:
        self.budget = budget
        self.min_offload = min_offload
        self.leaves = leaves
        self.quiet = Quiet()
        self.started = False
        #: Whether a storage made before the entry, read by it, takes room from the budget
        #: (a whole-step budget's first step: the batch); ``None``: none does.
        self.outside_counts: Callable[[torch.UntypedStorage], bool] | None = None

    def start(self, runtime: TorchRuntime, pool: HostPool) -> None:
        """The first op: its runtime and the host pool that goes with it."""
        self.runtime = runtime
        self.residency = Residency(runtime, pool, self.quiet)
        self.gradients = GradientWatch(self.residency)
        self.started = True

    def sizes(self, seeded: dict[int, int]) -> dict[int, int]:
        """The size of every storage the entry tracked (the ``seeded`` one where larger)."""
        by_sid = self.residency.by_sid if self.started else {}
        return {sid: max(e.nbytes, seeded.get(sid, 0)) for sid, e in by_sid.items()}

    def unresizable(self) -> set[int]:
        """Live storages that cannot be released: shared with NumPy or foreign memory."""
        return self.residency.unresizable() if self.started else set()

    def retained(self) -> frozenset[int]:
        """The storages still alive (the step's caller holds them)."""
        by_sid = self.residency.by_sid if self.started else {}
        return frozenset(e.sid for e in by_sid.values() if e.alive)


def away_bytes(entry: Tracked, needed: dict[int, int] | None = None) -> dict[int, int]:
    """The bytes that bringing ``entry`` back allocates, by storage: its own, and, when it
    is recomputed, those of its recipe's inputs that are away (recursively)."""
    needed = {} if needed is None else needed
    if entry.sid in needed or not entry.alive or entry.resident:
        return needed
    needed[entry.sid] = entry.nbytes
    if not entry.host_valid and entry.recipe is not None:
        for source in entry.recipe.inputs:
            away_bytes(source, needed)
    return needed
