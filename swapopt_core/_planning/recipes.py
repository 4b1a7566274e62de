"""How long a replay keeps each recipe, and so its producer's inputs: one rule for the replay
(``_activations/replay.py``) and the simulator (``simulate.py``).

A replay keeps a *recipe* for every storage the schedule may need to make again: one with a
``RECOMPUTE`` action, or one released without ever being copied out. The recipe is taken
when the producer runs and holds references to the producer's inputs, so those inputs stay
alive while it lasts, past their last access in the trace if need be (a chain that
recomputes through a storage the trace frees early relies on it). It is let go after the
post actions of its *drop op*: the op of the storage's last ``RECOMPUTE``, or, when the plan
releases the storage again after that without a new host copy (the release relies on the
recipe), the storage's last access. A storage still off the device without a host copy then
keeps its recipe until it dies (it may still be recomputed on demand).
"""

from __future__ import annotations

from dataclasses import dataclass

from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.ir import ActionKind, ResidencySchedule

__all__ = ["RecipeLife", "drop_op", "recipe_lives", "wants_recipe"]

_RECOMPUTE, _RELEASE, _D2H = ActionKind.RECOMPUTE, ActionKind.RELEASE_DEVICE, ActionKind.COPY_D2H


@dataclass(frozen=True)
class RecipeLife:
    """The recipe of one storage: taken after ``producer``, let go after ``drop``; it holds
    ``inputs`` (the activation storages the producer read and did not create)."""

    producer: int
    drop: int
    inputs: tuple[int, ...]


def wants_recipe(kinds: set[ActionKind]) -> bool:
    """Whether a storage whose actions are of ``kinds`` gets a recipe."""
    return _RECOMPUTE in kinds or (_RELEASE in kinds and _D2H not in kinds)


def drop_op(actions: list[tuple[int, ActionKind]], last_access: int) -> int:
    """The op after which a storage's recipe is let go.

    Args:
        actions: ``(op, kind)`` of the storage's actions, in issue order.
        last_access: The storage's last access in the trace.
    """
    recompute = max((op for op, kind in actions if kind is _RECOMPUTE), default=None)
    if recompute is None:
        return last_access
    after = actions[max(k for k, (_, kind) in enumerate(actions) if kind is _RECOMPUTE) + 1 :]
    copied = False
    for _, kind in after:
        if kind is _D2H:
            copied = True
        elif kind is _RELEASE and not copied:
            return max(last_access, recompute)  # that release relies on the recipe
    return recompute


def recipe_lives(ix: TraceIndex, schedule: ResidencySchedule | None) -> dict[int, RecipeLife]:
    """The recipe of every storage ``schedule`` gives one (whose producer is marked)."""
    if schedule is None:
        return {}
    actions: dict[int, list[tuple[int, ActionKind]]] = {}
    for _, op, action in schedule.actions():
        actions.setdefault(action.storage_id, []).append((op, action.kind))
    lives = {}
    for sid, done in actions.items():
        producer = ix.producer.get(sid)
        if producer is None or not wants_recipe({kind for _, kind in done}):
            continue
        last = ix.last.get(sid, producer)
        lives[sid] = RecipeLife(producer, drop_op(done, last), ix.recompute_inputs[sid])
    return lives
