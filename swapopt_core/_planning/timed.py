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
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass

from swapopt_core._planning.bounds import floor_reason, format_bytes, min_feasible_budget
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ActionKind, ActivationTrace, ResidencySchedule
from swapopt_core._planning.recompute import plan_with_recompute
from swapopt_core._planning.simulate import Machine, TraceIndex, simulate

logger = logging.getLogger(__name__)

__all__ = ["TimedPlanner"]

_D2H, _RELEASE, _H2D, _RELEASE_HOST = (
    ActionKind.COPY_D2H,
    ActionKind.RELEASE_DEVICE,
    ActionKind.COPY_H2D,
    ActionKind.RELEASE_HOST,
)
# Gap states during a pass.
_WAIT, _OPEN, _OFF, _BACK = range(4)


@dataclass(frozen=True)
class _Gap:
    key: int
    sid: int
    size: int
    a: int  # last access before the gap
    b: int  # the reader after it
    w: int  # the copy out is issued after this op (last write at or before a)
    slack: float


@dataclass
class _Pass:
    schedule: ResidencySchedule
    deficits: list[tuple[int, int]]
    released: set[int]
    total_ms: float


def _start(ix: TraceIndex, op: int) -> float:
    """When op ``op`` starts with no stall; ``ix.n`` stands for the end of the step."""
    return ix.starts[op] if op < ix.n else ix.total_ms


class _RangeMax:
    """Sparse table: the maximum of ``values[lo:hi]`` in O(1)."""

    def __init__(self, values: list[int]) -> None:
        self.rows = [list(values)]
        width = 1
        while 2 * width <= len(values):
            prev = self.rows[-1]
            self.rows.append([max(prev[j], prev[j + width]) for j in range(len(prev) - width)])
            width *= 2

    def __call__(self, lo: int, hi: int) -> int:
        if hi <= lo:
            return 0
        level = (hi - lo).bit_length() - 1
        row = self.rows[level]
        return max(row[lo], row[hi - (1 << level)])


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
                "Activation plan peaks at %s, over the %s budget.",
                format_bytes(check.peak_bytes),
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

    def _search(self, ix: TraceIndex, budget: int, min_bytes: int) -> _Pass:
        gaps = self._gaps(ix)
        planner = _Placer(ix, budget)
        chosen: dict[int, _Gap] = {}
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
            logger.warning("timed planner: %d ops stay over budget", len(result.deficits))
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

    def _gaps(self, ix: TraceIndex) -> list[_Gap]:
        bw = (ix.trace.d2h_bandwidth_gbps * 1e6, ix.trace.h2d_bandwidth_gbps * 1e6)
        gaps: list[_Gap] = []
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
                idle = _start(ix, b) - (ix.starts[last_write] + ix.durations[last_write])
                slack = idle - size / bw[0] - size / bw[1]
                gaps.append(_Gap(len(gaps), sid, size, a, b, last_write, slack))
        return gaps

    @staticmethod
    def _extend(
        gaps: list[_Gap],
        chosen: dict[int, _Gap],
        deficits: list[tuple[int, int]],
        min_bytes: int,
    ) -> list[_Gap]:
        """Choose more gaps, best slack first, until each deficit op is covered."""
        by_open: dict[int, list[_Gap]] = defaultdict(list)
        for g in gaps:
            if g.key not in chosen:
                by_open[g.a + 1].append(g)
        big: list[tuple[float, int, int, _Gap]] = []
        small: list[tuple[float, int, int, _Gap]] = []
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


class _Placer:
    """One simulated pass that places copies and releases for a set of chosen gaps."""

    def __init__(self, ix: TraceIndex, budget: int) -> None:
        self.ix = ix
        self.budget = budget
        self.bw_h2d = ix.trace.h2d_bandwidth_gbps * 1e6
        self.range_max = _RangeMax(ix.natural)

    def leads(self, gaps: list[_Gap]) -> dict[int, int]:
        """The op before which each reload starts, as late as the H2D stream allows."""
        starts = self.ix.starts
        lead: dict[int, int] = {}
        stream_next = float("inf")
        for g in sorted(gaps, key=lambda g: (g.b, g.key), reverse=True):
            end = min(_start(self.ix, g.b), stream_next)
            begin = end - g.size / self.bw_h2d
            stream_next = begin
            # Walk back over op durations until the copy has started by ``begin``.
            q = bisect_right(starts, begin, 0, min(g.b + 1, self.ix.n)) - 1
            lead[g.key] = min(g.b, max(g.a + 1, q))
        return lead

    def _bump(self, op: int, reader: int) -> int:
        """How much the natural residency grows between ``op`` and ``reader``."""
        return max(0, self.range_max(op + 1, reader) - self.ix.natural[op])

    def run(self, chosen: dict[int, _Gap], reloads: set[int] | None) -> _Pass:
        ix, budget = self.ix, self.budget
        sizes = ix.sizes
        laid = [g for k, g in chosen.items() if reloads is None or k in reloads]
        lead = self.leads(laid)
        for k, g in chosen.items():
            if k not in lead:
                lead.update(self.leads([g]))
        copy_at: dict[int, list[_Gap]] = defaultdict(list)
        open_at: dict[int, list[_Gap]] = defaultdict(list)
        host_until: dict[int, int] = {}
        for g in chosen.values():
            copy_at[g.w].append(g)
            open_at[g.a].append(g)
            host_until[g.sid] = max(host_until.get(g.sid, -1), g.b)
        drop_host: dict[int, list[int]] = defaultdict(list)
        for sid, op in host_until.items():
            drop_host[op].append(sid)
        m = Machine(ix, record=False)
        sched = ResidencySchedule()
        state = {k: _WAIT for k in chosen}
        released_at: dict[int, int] = {}
        ready: list = []  # (-reader, key): copy done, releasable for free
        copying: list = []  # (copy end, key): copy still running
        back: list = []  # (-reader, key): reload issued, reader not run yet
        queue: list = []  # (reader, key): released, waiting for its reload
        deficits: list[tuple[int, int]] = []

        def release(g: _Gap, i: int) -> None:
            sched.add_pre(i, g.sid, _RELEASE)
            m.release_device(g.sid, "")
            state[g.key] = _OFF
            released_at[g.key] = i
            heapq.heappush(queue, (g.b, g.key))

        def make_room(i: int, over: int) -> int:
            # Free first (copy done, farthest reader first), then wait for running copies
            # (earliest end first), last re-release reloads still ahead of their reader.
            while over > 0:
                while copying and copying[0][0] <= m.t:
                    key = heapq.heappop(copying)[1]
                    heapq.heappush(ready, (-chosen[key].b, key))
                heap = ready or copying or back
                if not heap:
                    break
                key = heapq.heappop(heap)[1]
                g = chosen[key]
                if state[key] != (_BACK if heap is back else _OPEN) or g.b <= i:
                    continue
                release(g, i)
                over -= g.size
            return over

        for i in range(ix.n):
            created = sum(sizes[s] for s in ix.created_at[i] if s not in m.on_device)
            forced = []
            while queue and queue[0][0] <= i:
                forced.append(chosen[heapq.heappop(queue)[1]])
            over = m.resident + created + sum(g.size for g in forced) - budget
            if over > 0:
                over = make_room(i, over)
                if over > 0:
                    deficits.append((i, over))
            for g in forced:
                self._reload(sched, m, g, i, state, back)
            while queue:
                g = chosen[queue[0][1]]
                if lead[g.key] > i or released_at[g.key] >= i:
                    break
                if m.resident + created + g.size + self._bump(i, g.b) > budget:
                    break
                heapq.heappop(queue)
                self._reload(sched, m, g, i, state, back)
            m.run_op(i)
            for g in copy_at.get(i, ()):
                if g.sid in m.on_device and not m.host.get(g.sid):
                    sched.add_post(i, g.sid, _D2H)
                    m.copy_d2h(g.sid, "")
            for g in open_at.get(i, ()):
                if g.sid in m.on_device and m.host.get(g.sid):
                    state[g.key] = _OPEN
                    heapq.heappush(copying, (m.d2h_end.get(g.sid, 0.0), g.key))
            for sid in drop_host.get(i, ()):
                if sid in m.host and sid in m.on_device:
                    sched.add_post(i, sid, _RELEASE_HOST)
                    m.release_host(sid, "")
            if i == ix.n - 1:
                self._reload_kept(sched, m, chosen, queue, state)
            m.natural_free(i)
        m.finish()
        return _Pass(sched, deficits, set(released_at), m.t)

    def _reload_kept(
        self,
        sched: ResidencySchedule,
        m: Machine,
        chosen: dict[int, _Gap],
        queue: list,
        state: dict[int, int],
    ) -> None:
        """Kept outputs still off the device come back after the last op, where the budget
        allows (the rest the end of the step fetches, after the last op's frees)."""
        last = self.ix.n - 1
        while queue:
            g = chosen[heapq.heappop(queue)[1]]
            if m.resident + g.size <= self.budget:
                sched.add_post(last, g.sid, _H2D)
                m.copy_h2d(g.sid, "")
                state[g.key] = _BACK

    @staticmethod
    def _reload(
        sched: ResidencySchedule, m: Machine, g: _Gap, i: int, state: dict[int, int], back: list
    ) -> None:
        sched.add_pre(i, g.sid, _H2D)
        m.copy_h2d(g.sid, "")
        state[g.key] = _BACK
        heapq.heappush(back, (-g.b, g.key))
