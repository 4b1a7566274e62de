"""One simulated placement pass of the timed planner: where the copies out, releases and
reloads of a set of chosen gaps go (step 2 of ``timed.py``'s docstring)."""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass

from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.ir import ActionKind, ResidencySchedule
from swapopt_core._planning.simulate import Machine

__all__ = ["Gap", "GapPlacer", "Pass", "gap_start"]

# Gap states during a pass.
_WAIT, _OPEN, _OFF, _BACK = range(4)


@dataclass(frozen=True)
class Gap:
    """A gap the planner may offload across (see ``timed.py``)."""

    key: int
    sid: int
    size: int
    a: int  # last access before the gap
    b: int  # the reader after it
    w: int  # the copy out is issued after this op (last write at or before a)
    slack: float


@dataclass
class Pass:
    """What one placement pass produced."""

    schedule: ResidencySchedule
    deficits: list[tuple[int, int]]
    released: set[int]
    total_ms: float


def gap_start(ix: TraceIndex, op: int) -> float:
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


class GapPlacer:
    """One simulated pass that places copies and releases for a set of chosen gaps."""

    def __init__(self, ix: TraceIndex, budget: int) -> None:
        self.ix = ix
        self.budget = budget
        self.bw_h2d = ix.trace.h2d_bandwidth_gbps * 1e6
        self.range_max = _RangeMax(ix.natural)

    def leads(self, gaps: list[Gap]) -> dict[int, int]:
        """The op before which each reload starts, as late as the H2D stream allows."""
        starts = self.ix.starts
        lead: dict[int, int] = {}
        stream_next = float("inf")
        for g in sorted(gaps, key=lambda g: (g.b, g.key), reverse=True):
            end = min(gap_start(self.ix, g.b), stream_next)
            begin = end - g.size / self.bw_h2d
            stream_next = begin
            # Walk back over op durations until the copy has started by ``begin``.
            q = bisect_right(starts, begin, 0, min(g.b + 1, self.ix.n)) - 1
            lead[g.key] = min(g.b, max(g.a + 1, q))
        return lead

    def _bump(self, op: int, reader: int) -> int:
        """How much the natural residency grows between ``op`` and ``reader``."""
        return max(0, self.range_max(op + 1, reader) - self.ix.natural[op])

    def run(self, chosen: dict[int, Gap], reloads: set[int] | None) -> Pass:
        ix, budget = self.ix, self.budget
        sizes = ix.sizes
        laid = [g for k, g in chosen.items() if reloads is None or k in reloads]
        lead = self.leads(laid)
        for k, g in chosen.items():
            if k not in lead:
                lead.update(self.leads([g]))
        copy_at: dict[int, list[Gap]] = defaultdict(list)
        open_at: dict[int, list[Gap]] = defaultdict(list)
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

        def release(g: Gap, i: int) -> None:
            sched.add_pre(i, g.sid, ActionKind.RELEASE_DEVICE)
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
            over = m.memory.resident + created + sum(g.size for g in forced) - budget
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
                if m.memory.resident + created + g.size + self._bump(i, g.b) > budget:
                    break
                heapq.heappop(queue)
                self._reload(sched, m, g, i, state, back)
            m.run_op(i)
            for g in copy_at.get(i, ()):
                if g.sid in m.on_device and not m.host.valid(g.sid):
                    sched.add_post(i, g.sid, ActionKind.COPY_D2H)
                    m.copy_d2h(g.sid, "")
            for g in open_at.get(i, ()):
                if g.sid in m.on_device and m.host.valid(g.sid):
                    state[g.key] = _OPEN
                    heapq.heappush(copying, (m.d2h.end.get(g.sid, 0.0), g.key))
            for sid in drop_host.get(i, ()):
                if sid in m.host and sid in m.on_device:
                    sched.add_post(i, sid, ActionKind.RELEASE_HOST)
                    m.release_host(sid, "")
            if i == ix.n - 1:
                self._reload_kept(sched, m, chosen, queue, state)
            m.natural_free(i)
        m.finish()
        return Pass(sched, deficits, set(released_at), m.t)

    def _reload_kept(
        self,
        sched: ResidencySchedule,
        m: Machine,
        chosen: dict[int, Gap],
        queue: list,
        state: dict[int, int],
    ) -> None:
        """Kept outputs still off the device come back after the last op, where the budget
        allows (the rest the end of the step fetches, after the last op's frees)."""
        last = self.ix.n - 1
        while queue:
            g = chosen[heapq.heappop(queue)[1]]
            if m.memory.resident + g.size <= self.budget:
                sched.add_post(last, g.sid, ActionKind.COPY_H2D)
                m.copy_h2d(g.sid, "")
                state[g.key] = _BACK

    @staticmethod
    def _reload(
        sched: ResidencySchedule, m: Machine, g: Gap, i: int, state: dict[int, int], back: list
    ) -> None:
        sched.add_pre(i, g.sid, ActionKind.COPY_H2D)
        m.copy_h2d(g.sid, "")
        state[g.key] = _BACK
        heapq.heappush(back, (-g.b, g.key))
