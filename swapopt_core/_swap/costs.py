"""What a swapped step costs, measured for the whole-step planner (``OptimizerCosts``).

A step is measured when asked (``CostMeter.wanted``: the first full step after install and
any step after ``EngineBase.measure_next_step``); other steps pay nothing. A measured step
stamps the compute queue around each batch's update and its undo copy
(``TransferRuntime.stamp``, after the batch's copy in was waited for, so the time is the
update's own) and reads the stamps once the step is over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from swapopt_core._planning.whole_step import OptimizerCosts

__all__ = ["CostMeter", "StepTiming"]


@dataclass
class StepTiming:
    """The stamps of one measured step: per batch, its update's start, end and bytes."""

    runtime: Any
    marks: list[tuple[Any, Any, int]] = field(default_factory=list)

    def start(self) -> Any:
        """A stamp before a batch's update (and its undo copy)."""
        return self.runtime.stamp()

    def stop(self, start: Any, nbytes: int) -> None:
        """The update of a batch of ``nbytes`` state bytes that began at ``start`` is done."""
        self.marks.append((start, self.runtime.stamp(), nbytes))

    def ms_per_byte(self) -> float:
        """Update time per state byte over the batches timed (0.0 if none had bytes)."""
        if not self.marks:
            return 0.0
        if self.runtime.stamps_need_sync:
            # The stamps are events on the compute queue: readable once they completed.
            self.runtime.wait_stamps()
        total_ms = sum(self.runtime.elapsed_ms(a, b) for a, b, _ in self.marks)
        total_bytes = sum(nbytes for _, _, nbytes in self.marks)
        return total_ms / total_bytes if total_bytes else 0.0


@dataclass
class CostMeter:
    """Measures a step when ``wanted`` and keeps the last result (``last``)."""

    wanted: bool = True
    last: OptimizerCosts | None = None

    def timing(self, runtime: Any, resumed: bool) -> StepTiming | None:
        """Stamps for this step if it is to be measured (a resumed step is not full)."""
        return StepTiming(runtime) if self.wanted and not resumed else None

    def record(
        self,
        timing: StepTiming,
        *,
        unit_bytes: Sequence[int],
        fixed_state_bytes: int,
        extra_peak_bytes: int,
        batches: Sequence[Sequence[int]],
    ) -> None:
        """Keep what the measured step cost.

        Args:
            timing: The step's stamps.
            unit_bytes: Swappable state bytes per unit in step order, resident ones included.
            fixed_state_bytes: State on the device that never moves.
            extra_peak_bytes: Peak device bytes of the swapped state and undo copies in the
                step, beyond the state resident for good.
            batches: State bytes of each unit of each batch of the step.
        """
        largest = max((sum(batch) for batch in batches), default=0)
        factor = extra_peak_bytes / largest if largest else 3.0
        self.last = OptimizerCosts(
            unit_bytes=tuple(unit_bytes),
            update_ms_per_byte=timing.ms_per_byte(),
            fixed_state_bytes=fixed_state_bytes,
            staging_factor=factor,
            batch_overhead_ms=0.0,
        )
        self.wanted = False
