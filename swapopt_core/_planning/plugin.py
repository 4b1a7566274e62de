"""The built-in activation planners, registered like any plugin planner."""

from __future__ import annotations

from collections.abc import Iterable

from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.timed import TimedPlanner
from swapopt_core.hookspecs import hookimpl


@hookimpl
def swapopt_register_planners() -> Iterable[ResidencyPlanner]:
    """The time-aware planner ``"timed"`` (what ``OffloadConfig(planner="auto")`` picks), which
    chooses between keeping, offloading and recomputing, and ``"offload-only"``, the same
    planner moving bytes only (for ops whose recomputation should be avoided)."""
    return [TimedPlanner(), TimedPlanner(recompute=False)]
