"""What a backend hands the step transaction, and what the transaction remembers of a step.

A backend's ``EngineBase.open_step`` returns a :class:`StepWork`: the call's units (one
parameter each, with its swapped slots and a ``token`` of what its update used) and how to
prepare, describe and update a batch of them. :class:`Interrupted` is the transaction's memory
of a call that did not finish: the units it updated and with what, so that a retry of the same
call skips them and reuses the values prepared once for the step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from swapopt_core._swap.ops import SwapSlot, Target

__all__ = ["Interrupted", "StepUnit", "StepWork"]


class StepUnit(Protocol):
    """One parameter taking part in a step, with its swapped slots."""

    @property
    def key(self) -> Hashable:
        """Which parameter (the same across calls)."""

    @property
    def token(self) -> tuple[Any, ...]:
        """What its update used (compared by identity, numbers by value): a retry skips the
        unit if an interrupted call finished it with the same token."""

    @property
    def slots(self) -> Sequence[SwapSlot]: ...

    @property
    def nbytes(self) -> int: ...


class StepWork(Protocol):
    """One call of the step, as the backend prepared it (``EngineBase.open_step``)."""

    @property
    def identity(self) -> Hashable:
        """Which call a retry must repeat to resume an interrupted step (MindSpore: the
        gradients themselves, compared by identity; torch: ``None``, its units carry their
        gradients in ``token``). Kept while the step is interrupted: never bare ids, which a
        new object could take once the old one died."""

    @property
    def units(self) -> Sequence[StepUnit]:
        """The units the call updates, in order."""

    def prepare(self) -> Any:
        """The once-per-step values of a fresh step (run once, also if the step is resumed)."""

    def changed(self, batch: Sequence[Any]) -> list[Target]:
        """What the update of ``batch`` changes in place, with its device (the undo copy)."""

    def update(self, batch: Sequence[Any], views: dict[Any, Any], prepared: Any) -> None:
        """Update ``batch`` given a device view per slot; if it raises, the undo copy puts
        the tensors of ``changed`` back and the backend restores anything else."""


@dataclass
class Interrupted:
    """The memory of a step that did not finish: a retry of the same call resumes it."""

    identity: Hashable
    prepared: Any
    done: dict[Hashable, tuple[Any, ...]] = field(default_factory=dict)  # key -> token

    def finished(self, unit: StepUnit) -> bool:
        """Whether ``unit`` was updated by the interrupted call with what it has now."""
        token = self.done.get(unit.key)
        return token is not None and _same(token, unit.token)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two tokens name the same inputs: the same objects, integers by value."""
    return len(a) == len(b) and all(
        x is y or (type(x) is int and type(y) is int and x == y) for x, y in zip(a, b, strict=True)
    )
