"""The built-in time-aware residency planner (``"timed"``).

A *gap* is the idle stretch of one storage between two consecutive accesses ``a`` and ``b``
(at least one op in between). Offloading across it means: copy out right after the last
write at or before ``a``, release while idle, copy back before ``b``. The planner decides
*which* gaps to use and *where* each release and reload goes, with op durations and the two
copy bandwidths:

1. **Selection by cost.** Each gap is priced by its *slack*: the idle time from the end of
   the write to the reader, minus the time the two copies take (bytes moved against the time
   that hides them). Gaps of storages below the trace's ``min_offload_bytes`` are used only
   if nothing else fits.
2. **Placement by simulation.** One pass over the ops drives the simulator's device model
   (:class:`~swapopt_core._planning.simulate.Machine`), so every decision sees simulated
   times and stream occupancy. Copies out are issued right after the last write (one FIFO
   stream per direction). A storage is released only when an op needs the room: first
   storages whose copy has finished (farthest next use first: no stall), then those whose copy
   is still running (earliest to finish first: the compute stream waits, which is the only
   way to stay in budget). Each reload is issued just early enough: reloads are laid out
   as late as possible backwards from their readers on the H2D stream (walking back over op
   durations until the copy fits, after the reloads behind it), and are issued at that op
   when the memory they occupy until their reader fits in the budget, otherwise at the
   first op where it does; the reader waits for what is left.
3. **Repair loop.** Where an op still exceeds the budget, more gaps covering it are chosen
   (best slack first) and the pass runs again, until the peak fits. Gaps chosen but never
   released are dropped at the end (their copies out would only load the link).

Storages are never released at their last access (the natural free does it). A retained
storage (an output the caller keeps) has one more gap, from its last access to the end of the
step: released there, it is reloaded before the end (after the last op when nothing earlier
has room), so the step ends with it on the device. ``RELEASE_HOST`` follows the last reader
that needs the host copy.

With ``recompute`` (the default), ``swapopt_core._planning.recompute`` first decides which
storages to regenerate instead of moving, and runs this placer on a trace where those
recomputes are ops.
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict

from swapopt_core._planning.bounds import floor_reason, format_bytes, min_feasible_budget
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule
from swapopt_core._planning.placer import Gap, GapPlacer, Pass, gap_start
from swapopt_core._planning.recompute import plan_with_recompute
from swapopt_core._planning.simulate import TraceIndex, simulate

logger = logging.getLogger(__name__)

__all__ = ["TimedPlanner"]


class TimedPlanner(ResidencyPlanner):
    """Offloads the gaps that the copy streams can hide best, issues copies at simulated times.

    The size threshold is the trace's ``min_offload_bytes``: smaller storages are offloaded
    only when the budget cannot be met otherwise (per-copy overheads dominate small copies).

    With ``recompute`` (the default) it also regenerates storages whose producer can run
    again (``swapopt_core._planning.recompute``) where that costs less than moving them.

    Args:
        max_rounds: Repair passes before giving up on an over-budget op.
        recompute: Choose between keeping, offloading and recomputing; ``False`` plans
            offloads only (registered as ``"offload-only"``).
    """

    name = "timed"

    def __init__(self, max_rounds: int = 64, *, recompute: bool = True) -> None:
        self.max_rounds = int(max_rounds)
        self.recompute = bool(recompute)
        self.name = "timed" if self.recompute else "offload-only"

    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        """Plan ``trace`` under ``trace.memory_limit_bytes`` (see the module docstring)."""
        budget = trace.memory_limit_bytes
        ix = TraceIndex(trace)
        if budget is None or ix.natural_peak <= budget:
            return ResidencySchedule()
        floor = min_feasible_budget(trace, index=ix)
        if budget < floor:
            logger.warning(
                "Activation budget %s is infeasible: no schedule holds less than %s, since %s. "
                "Planning for %s instead.",
                format_bytes(budget),
                format_bytes(floor),
                floor_reason(trace, index=ix),
                format_bytes(floor),
            )
            budget = floor
        schedule = self._plan(ix, budget, trace.min_offload_bytes)
        check = simulate(trace, schedule, record=False, index=ix)
        if check.peak_bytes > budget:
            logger.warning(
                "Activation plan peaks at %s, %s over the %s budget.",
                format_bytes(check.peak_bytes),
                format_bytes(check.peak_bytes - budget),
                format_bytes(budget),
            )
        logger.info(
            "timed planner: %d actions (%d recomputes), simulated peak %s (budget %s), "
            "overhead %.1f %%",
            len(schedule),
            check.recomputes,
            format_bytes(check.peak_bytes),
            format_bytes(budget),
            100 * check.overhead,
        )
        return schedule

    def _plan(self, ix: TraceIndex, budget: int, min_bytes: int) -> ResidencySchedule:
        def place(index: TraceIndex, limit: int) -> ResidencySchedule:
            return self._search(index, limit, min_bytes).schedule

        if not self.recompute:
            return place(ix, budget)
        return plan_with_recompute(ix, budget, place)

    # ---- search --------------------------------------------------------------------------

    def _search(self, ix: TraceIndex, budget: int, min_bytes: int) -> Pass:
        gaps = self._gaps(ix)
        planner = GapPlacer(ix, budget)
        chosen: dict[int, Gap] = {}
        result = planner.run(chosen, None)
        for round_ in range(self.max_rounds):
            logger.debug(
                "timed planner round %d: %d gaps chosen, %d ops over budget",
                round_,
                len(chosen),
                len(result.deficits),
            )
            if not result.deficits:
                break
            added = self._extend(gaps, chosen, result.deficits, min_bytes)
            if not added:
                break
            chosen.update((g.key, g) for g in added)
            reloads = result.released | {g.key for g in added}
            result = planner.run(chosen, reloads)
        if result.deficits:
            logger.debug("timed planner: %d ops stay over budget", len(result.deficits))
            return result
        # Refine: drop gaps that were never released (their copies out only load the link)
        # and lay the reloads out for what was really released.
        for _ in range(3):
            kept = {k: g for k, g in chosen.items() if k in result.released}
            trial = planner.run(kept, result.released)
            if trial.deficits or trial.total_ms > result.total_ms + 1e-9:
                break
            done = kept.keys() == chosen.keys() and trial.released == result.released
            chosen, result = kept, trial
            if done:
                break
        return result

    def _gaps(self, ix: TraceIndex) -> list[Gap]:
        bw = (ix.trace.d2h_bandwidth_gbps * 1e6, ix.trace.h2d_bandwidth_gbps * 1e6)
        gaps: list[Gap] = []
        for sid, accesses in ix.by_storage.items():
            size = ix.sizes[sid]
            if size <= 0:
                continue
            last_write = accesses[0][0]
            pairs = list(zip(accesses, accesses[1:], strict=False))
            if sid in ix.retained:  # kept after the step: may stay off until the end
                pairs.append((accesses[-1], (ix.n, False)))
            for (a, wrote), (b, _) in pairs:
                if wrote:
                    last_write = a
                if b - a < 2:
                    continue
                idle = gap_start(ix, b) - (ix.starts[last_write] + ix.durations[last_write])
                slack = idle - size / bw[0] - size / bw[1]
                gaps.append(Gap(len(gaps), sid, size, a, b, last_write, slack))
        return gaps

    @staticmethod
    def _extend(
        gaps: list[Gap],
        chosen: dict[int, Gap],
        deficits: list[tuple[int, int]],
        min_bytes: int,
    ) -> list[Gap]:
        """Choose more gaps, best slack first, until each deficit op is covered."""
        by_open: dict[int, list[Gap]] = defaultdict(list)
        for g in gaps:
            if g.key not in chosen:
                by_open[g.a + 1].append(g)
        big: list[tuple[float, int, int, Gap]] = []
        small: list[tuple[float, int, int, Gap]] = []
        covering: list[tuple[int, int]] = []  # (b, size) of gaps added in this call
        cover, added, cursor = 0, [], 0
        for op, over in sorted(deficits):
            while cursor <= op:
                for g in by_open.get(cursor, ()):
                    heap = big if g.size >= min_bytes else small
                    heapq.heappush(heap, (-g.slack, -g.size, g.key, g))
                cursor += 1
            while covering and covering[0][0] <= op:
                cover -= heapq.heappop(covering)[1]
            need = over - cover
            for heap in (big, small):
                while need > 0 and heap:
                    g = heapq.heappop(heap)[3]
                    if g.b <= op:
                        continue  # its reader has passed: it covers no later op either
                    added.append(g)
                    heapq.heappush(covering, (g.b, g.size))
                    cover += g.size
                    need -= g.size
        return added
