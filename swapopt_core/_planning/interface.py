"""The interface a residency planner implements, and how a planner name is resolved.

A planner is a function of the trace alone: everything it may use is in the
``ActivationTrace`` (the ops, their durations, the storage sizes, the measured bandwidths,
the budget ``memory_limit_bytes`` and the size threshold ``min_offload_bytes``). The session
and ``swapopt plan`` both find planners by name through :func:`resolve_planner`, so ``"auto"``
and the defaults mean the same thing everywhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

from swapopt_core._planning.ir import DEFAULT_MIN_OFFLOAD_BYTES, ActivationTrace, ResidencySchedule

__all__ = [
    "AUTO",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "DEFAULT_PLANNER",
    "ResidencyPlanner",
    "resolve_planner",
]

#: The name that selects :data:`DEFAULT_PLANNER` (``OffloadConfig.planner``, ``--planner``).
AUTO = "auto"
#: The planner ``"auto"`` selects: the built-in time-aware planner.
DEFAULT_PLANNER = "timed"


class ResidencyPlanner(ABC):
    """Turns a recorded trace into a residency schedule that keeps activations in budget.

    Subclass it, give it a unique ``name`` and return an instance from the
    ``swapopt_register_planners`` hook. The same instance serves every session, so ``plan``
    must not keep state between calls.
    """

    #: Name selected by ``OffloadConfig.planner`` and ``swapopt plan --planner`` (a class
    #: attribute, or set per instance where one class registers under several names).
    name: str

    @abstractmethod
    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        """Plan ``trace`` under ``trace.memory_limit_bytes``.

        Args:
            trace: The step to plan. ``memory_limit_bytes`` is the budget (``None``: no
                limit, return an empty schedule); storages smaller than
                ``min_offload_bytes`` should be moved only when the budget cannot be met
                otherwise.

        Returns:
            The actions to issue around each op (``docs/formats.md`` defines them).
        """


def resolve_planner(
    name: str, planners: Mapping[str, ResidencyPlanner], *, label: str = "planner"
) -> ResidencyPlanner:
    """The planner that ``name`` selects: ``"auto"`` is :data:`DEFAULT_PLANNER`.

    Args:
        name: A registered planner name, or ``"auto"``.
        planners: The registered planners by name.
        label: How to name the setting in the error (``"OffloadConfig.planner"``).

    Raises:
        ValueError: No planner is registered under that name; the message lists the names
            that are.
    """
    wanted = DEFAULT_PLANNER if name == AUTO else name
    planner = planners.get(wanted)
    if planner is None:
        what = f" (it means {DEFAULT_PLANNER!r}, which no plugin registers)" if name == AUTO else ""
        raise ValueError(
            f"{label}={name!r} is not a registered planner{what}. Choose one of "
            f"{sorted({AUTO, *planners})}, or install or register the plugin that provides it "
            "(swapopt_register_planners)."
        )
    return planner
