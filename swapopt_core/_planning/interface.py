"""The interface a residency planner implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule

__all__ = ["ResidencyPlanner"]


class ResidencyPlanner(ABC):
    """Turns a recorded trace into a residency schedule that keeps activations in budget."""

    #: Name selected by ``OffloadConfig.planner``.
    name: ClassVar[str]

    @abstractmethod
    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        """Plan ``trace`` under ``trace.memory_limit_bytes`` (``None``: no limit, no actions)."""
