"""The process-wide record of what swapopt did: each swapped optimizer's latest ``SwapStats``
and each ``OffloadSession``'s latest ``OffloadStats``, which ``swapopt run`` sums up at exit.

Framework-free and cheap. The record holds no optimizer, engine or session alive: an
optimizer's figures are the ones its engine computes anyway after each step (for the
``swapopt_after_step`` hook), refreshed when the swap is removed (Lightning and Transformers
unswap at teardown, before the script returns) and at exit while it is still installed. A
session's figures are taken when the session is collected, or at exit while it lives; so a
script that drops its optimizer or session (one trained inside ``main()``) keeps its figures.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swapopt_core._activations.session_stats import OffloadStats
    from swapopt_core._stats import SwapStats
    from swapopt_core._swap.engine import EngineBase

logger = logging.getLogger(__name__)

__all__ = [
    "SessionEntry",
    "SwapEntry",
    "record_session",
    "record_step",
    "record_swap",
    "record_unswap",
    "session_entries",
    "swap_entries",
]


@dataclass
class SwapEntry:
    """One optimizer swapped in this process (swapped again: the same entry, newer figures).

    Attributes:
        name: The optimizer's class name, e.g. ``"AdamW"``.
        param_groups: Its parameter groups when it was (last) swapped; ``None`` where the
            optimizer keeps no count of them (MindSpore).
        stats: Its latest figures.
    """

    name: str
    param_groups: int | None
    stats: SwapStats
    optimizer: Any = None  # a weak reference to the optimizer, when it takes one


@dataclass
class SessionEntry:
    """One ``OffloadSession`` created in this process.

    Attributes:
        stats: Its figures, taken when it was collected; ``None`` while it lives (then
            ``snapshot`` takes them).
        snapshot: Computes its figures without holding the session; dropped with it.
    """

    stats: OffloadStats | None
    snapshot: Callable[[], OffloadStats] | None


_swaps: list[SwapEntry] = []
_by_engine: weakref.WeakKeyDictionary[EngineBase, SwapEntry] = weakref.WeakKeyDictionary()
_sessions: list[SessionEntry] = []


def _param_groups(optimizer: object) -> int | None:
    """Parameter groups of a torch optimizer; ``None`` for a MindSpore one (it spreads its
    groups' settings over the parameters and keeps no count of them)."""
    groups = getattr(optimizer, "param_groups", None)
    return len(groups) if isinstance(groups, list) else None


def _weak(optimizer: object) -> Any:
    try:
        return weakref.ref(optimizer)
    except TypeError:  # a class without weak references: each swap is an entry of its own
        return None


def record_swap(engine: EngineBase) -> None:
    """Note the swap ``engine`` just installed (called by ``swap_optimizer``)."""
    optimizer = engine.optimizer
    stats = engine.stats()
    entry = next(
        (e for e in _swaps if e.optimizer is not None and e.optimizer() is optimizer), None
    )
    if entry is None:
        entry = SwapEntry(type(optimizer).__name__, None, stats, _weak(optimizer))
        _swaps.append(entry)
    entry.param_groups, entry.stats = _param_groups(optimizer), stats
    _by_engine[engine] = entry


def record_step(engine: EngineBase, stats: SwapStats) -> None:
    """Keep the figures ``engine`` computed after a step (no computation of its own)."""
    entry = _by_engine.get(engine)
    if entry is not None:
        entry.stats = stats


def record_unswap(engine: EngineBase) -> None:
    """Take ``engine``'s figures before it is uninstalled (its slots go with it)."""
    entry = _by_engine.pop(engine, None)
    if entry is not None:
        entry.stats = engine.stats()


def swap_entries() -> list[SwapEntry]:
    """Every optimizer swapped in this process, in order, with its latest figures (those
    of a swap still installed taken now)."""
    from swapopt_core._swap.engine import engine_of  # here: it imports the swap machinery

    for engine, entry in list(_by_engine.items()):
        if engine_of(engine.optimizer) is engine:  # not uninstalled behind our back
            entry.stats = engine.stats()
    return list(_swaps)


def record_session(session: object, snapshot: Callable[[], OffloadStats]) -> None:
    """Note a new ``OffloadSession``.

    Args:
        session: The session; only a finalizer refers to it.
        snapshot: Computes its ``OffloadStats`` from what the session holds, without
            referring to the session itself (else it would never be collected).
    """
    entry = SessionEntry(None, snapshot)
    _sessions.append(entry)
    weakref.finalize(session, _session_gone, entry).atexit = False


def _session_gone(entry: SessionEntry) -> None:
    """The session was collected: keep its figures, let go of what it held."""
    snapshot, entry.snapshot = entry.snapshot, None
    if snapshot is None:
        return
    try:
        entry.stats = snapshot()
    except Exception:  # noqa: BLE001 - a finalizer must not raise; the figures are lost
        logger.debug("swapopt: the figures of a collected OffloadSession", exc_info=True)


def session_entries() -> list[OffloadStats]:
    """The latest figures of every ``OffloadSession`` created in this process, in order
    (those of a session still alive taken now)."""
    found = []
    for entry in _sessions:
        if entry.snapshot is not None:
            entry.stats = entry.snapshot()
        if entry.stats is not None:
            found.append(entry.stats)
    return found
