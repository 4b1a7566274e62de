"""The device model the simulator and the planner drive, one op or action at a time. The
rules it follows are those of ``simulate.py``'s docstring; what a replay of it costs is a
``SimulationResult`` (``results.py``)."""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Mapping

from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.ir import ActionKind
from swapopt_core._planning.recipes import RecipeLife
from swapopt_core._planning.results import CopySpan, RecomputeSpan, SimulationResult

__all__ = ["CopySpan", "Machine", "RecomputeSpan", "SimulationResult"]

_D2H, _RELEASE, _H2D, _RELEASE_HOST, _RECOMPUTE = (
    ActionKind.COPY_D2H,
    ActionKind.RELEASE_DEVICE,
    ActionKind.COPY_H2D,
    ActionKind.RELEASE_HOST,
    ActionKind.RECOMPUTE,
)


class Machine:
    """The device model, one step at a time. ``simulate`` drives it with a schedule; the
    planner drives it with its own decisions, so both follow the same rules."""

    def __init__(
        self,
        index: TraceIndex,
        *,
        record: bool = True,
        recipes: Mapping[int, RecipeLife] | None = None,
    ) -> None:
        trace = index.trace
        self.ix = index
        self.bw_d2h = trace.d2h_bandwidth_gbps * 1e6  # bytes per ms
        self.bw_h2d = trace.h2d_bandwidth_gbps * 1e6
        self.record = record
        self.t = 0.0
        self.d2h_free = 0.0
        self.h2d_free = 0.0
        self.resident = 0
        self.peak = 0
        self.host_bytes = 0
        self.peak_host = 0
        self.on_device: set[int] = set()
        self.dead: set[int] = set()
        self.host: dict[int, bool] = {}  # sid -> host copy valid
        self.d2h_end: dict[int, float] = {}
        self.h2d_end: dict[int, float] = {}
        self.release_wait = self.reload_wait = self.fetch_wait = self.recompute_ms = 0.0
        self.fetches = self.recomputes = self.demand_recomputes = 0
        self.done = -1  # the last op that has run
        self.pending: list[tuple[float, int]] = []  # (copy end, bytes): frees waiting on copies
        self.d2h_bytes = self.h2d_bytes = 0
        self.ignored = 0
        self.timeline: list[tuple[float, int]] = []
        self.copies: list[CopySpan] = []
        self.op_start: list[float] = []
        self.recomputed: list[RecomputeSpan] = []
        # The replay's recipes (``recipes.py``): each holds its producer's inputs alive.
        self.recipes: Mapping[int, RecipeLife] = recipes or {}
        self.taken: dict[int, list[int]] = {}  # producer op -> storages whose recipe it takes
        self.drops: dict[int, list[int]] = {}  # drop op -> storages whose recipe goes then
        for sid, life in self.recipes.items():
            self.taken.setdefault(life.producer, []).append(sid)
            self.drops.setdefault(life.drop, []).append(sid)
        self.live_recipes: set[int] = set()
        self.holders: dict[int, int] = {}  # storage -> live recipes that hold it
        self.held: set[int] = set()  # past its last access, alive only for recipes

    def _alloc(self, nbytes: int, at: float) -> None:
        pending = self.pending
        while pending and pending[0][0] <= at:
            when, freed = heapq.heappop(pending)
            self.resident -= freed
            if self.record:
                self.timeline.append((when, self.resident))
        self.resident += nbytes
        if self.resident > self.peak:
            self.peak = self.resident
        if self.record:
            self.timeline.append((at, self.resident))

    def _free(self, nbytes: int, when: float | None = None) -> None:
        if when is not None and when > self.t:  # a copy still uses the block until ``when``
            heapq.heappush(self.pending, (when, nbytes))
            return
        self.resident -= nbytes
        if self.record:
            self.timeline.append((self.t, self.resident))

    def _written(self, sid: int, after: int, upto: int) -> bool:
        """Whether an op in ``after+1 .. upto`` writes ``sid``."""
        ops = self.ix.writes.get(sid, ())
        return bisect_right(ops, upto) > bisect_right(ops, after)

    def recomputable(self, sid: int, upto: int | None = None) -> bool:
        """Whether re-running ``sid``'s producer gives its bytes now (``upto=None``), or at
        any point until op ``upto`` starts its successor (what a release needs: nothing may
        spoil the recipe before the storage is read again)."""
        ix = self.ix
        op = ix.producer.get(sid)
        if op is None or op > self.done or sid in self.dead:
            return False
        until = self.done if upto is None else upto
        if self._written(sid, op, until):
            return False
        held = sid in self.live_recipes  # its recipe keeps the inputs alive
        for x in ix.recompute_inputs[sid]:
            if x in self.dead or self._written(x, op, until):
                return False
            if upto is not None and not held and x not in ix.retained and ix.end[x] <= upto:
                return False  # freed before the storage is needed again
        return True

    def _needed_until(self, sid: int) -> int:
        """The op before the next access of ``sid`` (the last op for a kept output; now,
        for a storage past its last access that only recipes hold)."""
        ops = [op for op, _ in self.ix.by_storage.get(sid, ())]
        k = bisect_right(ops, self.done)
        if k < len(ops):
            return ops[k] - 1
        return self.ix.n - 1 if sid in self.ix.retained else self.done

    def _known(self, sid: int, where: str, kind: ActionKind) -> int:
        size = self.ix.sizes.get(sid)
        if size is None:
            raise ValueError(f"{kind.value} {where} names storage {sid}, which the trace lacks.")
        return size

    def copy_d2h(self, sid: int, where: str) -> None:
        size = self._known(sid, where, _D2H)
        if sid not in self.on_device:
            raise ValueError(f"COPY_D2H {where}: storage {sid} is not on the device.")
        if self.host.get(sid):
            self.ignored += 1
            return
        start = max(self.t, self.d2h_free, self.h2d_end.get(sid, 0.0))
        end = start + size / self.bw_d2h
        self.d2h_free = end
        self.d2h_end[sid] = end
        if sid not in self.host:
            self.host_bytes += size
            self.peak_host = max(self.peak_host, self.host_bytes)
        self.host[sid] = True
        self.d2h_bytes += size
        if self.record:
            self.copies.append(CopySpan("D2H", sid, start, end, size))

    def release_device(self, sid: int, where: str) -> None:
        size = self._known(sid, where, _RELEASE)
        if sid not in self.on_device or not (
            self.host.get(sid)
            or (sid in self.live_recipes and self.recomputable(sid, self._needed_until(sid)))
        ):
            self.ignored += 1
            return
        ready = max(self.d2h_end.get(sid, 0.0), self.h2d_end.get(sid, 0.0))
        if ready > self.t:
            self.release_wait += ready - self.t
            self.t = ready
        self.on_device.discard(sid)
        self._free(size)

    def copy_h2d(self, sid: int, where: str) -> None:
        size = self._known(sid, where, _H2D)
        if sid in self.on_device:
            self.ignored += 1
            return
        if not self.host.get(sid) or sid in self.dead:
            raise ValueError(f"COPY_H2D {where}: storage {sid} has no valid host copy.")
        self._alloc(size, self.t)
        self.on_device.add(sid)
        self._copy_in(sid, size, self.t)

    def _copy_in(self, sid: int, size: int, issued: float) -> float:
        start = max(issued, self.h2d_free, self.d2h_end.get(sid, 0.0))
        end = start + size / self.bw_h2d
        self.h2d_free = end
        self.h2d_end[sid] = end
        self.h2d_bytes += size
        if self.record:
            self.copies.append(CopySpan("H2D", sid, start, end, size))
        return end

    def release_host(self, sid: int, where: str) -> None:
        size = self._known(sid, where, _RELEASE_HOST)
        if sid not in self.host or sid not in self.on_device:
            self.ignored += 1
            return
        del self.host[sid]
        self.host_bytes -= size

    def recompute(self, sid: int, where: str, *, demand: bool = False) -> None:
        """Make ``sid`` again by re-running its producer (``RECOMPUTE``, or on demand)."""
        size = self._known(sid, where, _RECOMPUTE)
        if sid in self.on_device:
            self.ignored += 1
            return
        if not self.recomputable(sid):
            raise ValueError(
                f"RECOMPUTE {where}: storage {sid} cannot be recomputed there (its producer is "
                "not marked recompute, or it or the producer's inputs were written or freed "
                "since)."
            )
        op = self.ix.producer[sid]
        inputs = self.ix.recompute_inputs[sid]
        for x in inputs:
            if x not in self.on_device:
                if not demand:
                    raise ValueError(
                        f"RECOMPUTE {where}: storage {sid} needs storage {x}, the input of op "
                        f"{op}, on the device; bring it back first."
                    )
                self.demand(x, where)
        ready = max((self.h2d_end.get(x, 0.0) for x in inputs), default=0.0)
        if ready > self.t:  # the producer's inputs are still being copied in
            self.reload_wait += ready - self.t
            self.t = ready
        self._alloc(size, self.t)
        self.on_device.add(sid)
        start, self.t = self.t, self.t + self.ix.durations[op]
        self.recompute_ms += self.ix.durations[op]
        if demand:
            self.demand_recomputes += 1
        else:
            self.recomputes += 1
        if self.record:
            self.recomputed.append(RecomputeSpan(sid, op, start, self.t))

    def demand(self, sid: int, where: str) -> None:
        """Bring ``sid`` back because something needs it now: fetch it, or recompute it."""
        size = self.ix.sizes[sid]
        if self.host.get(sid) and sid not in self.dead:
            self._alloc(size, self.t)
            self.on_device.add(sid)
            end = self._copy_in(sid, size, self.t)
            self.fetches += 1
            self.fetch_wait += end - self.t
            self.t = end
        elif self.recomputable(sid):
            self.recompute(sid, where, demand=True)
        else:
            raise ValueError(
                f"{where} accesses storage {sid}, which is released without a valid host copy "
                "and cannot be recomputed: it cannot be brought back."
            )

    def apply(self, kind: ActionKind, sid: int, where: str) -> None:
        if kind is _D2H:
            self.copy_d2h(sid, where)
        elif kind is _RELEASE:
            self.release_device(sid, where)
        elif kind is _H2D:
            self.copy_h2d(sid, where)
        elif kind is _RECOMPUTE:
            self.recompute(sid, where)
        else:
            self.release_host(sid, where)

    def run_op(self, i: int) -> None:
        ix = self.ix
        sizes = ix.sizes
        start = self.t
        for sid in ix.created_at[i]:
            if sid not in self.on_device:
                self.on_device.add(sid)
                self._alloc(sizes[sid], start)
        for sid, _ in ix.accesses[i]:
            if sid not in self.on_device:
                self.demand(sid, f"op {i}")
        waited = self.t
        for sid, wrote in ix.accesses[i]:
            ready = self.h2d_end.get(sid, 0.0)
            if wrote:
                # A writer waits for a copy out still reading the storage.
                ready = max(ready, self.d2h_end.get(sid, 0.0))
                if sid in self.host:
                    self.host[sid] = False
            if ready > waited:
                self.reload_wait += ready - waited
                waited = ready
        self.op_start.append(waited)
        self.t = waited + ix.durations[i]
        self.done = i
        for sid in self.taken.get(i, ()):
            if sid in self.on_device:  # the replay takes the recipe as the op returns
                self.live_recipes.add(sid)
                for x in self.recipes[sid].inputs:
                    self.holders[x] = self.holders.get(x, 0) + 1

    def natural_free(self, i: int) -> None:
        """After op ``i``'s post actions: recipes whose drop op it is go (those of storages
        off the device without a host copy stay until they die), then the storages whose
        last access it is die, unless a recipe holds them."""
        for sid in self.drops.get(i, ()):
            if sid in self.live_recipes and (sid in self.on_device or self.host.get(sid)):
                self._let_go(sid)
        for sid in self.ix.freed_at[i]:
            if self.holders.get(sid):
                self.held.add(sid)
            else:
                self._die(sid)

    def _die(self, sid: int) -> None:
        size = self.ix.sizes[sid]
        self.dead.add(sid)
        self.held.discard(sid)
        if sid in self.host:
            del self.host[sid]
            self.host_bytes -= size
        if sid in self.on_device:
            self.on_device.discard(sid)
            busy = max(self.d2h_end.get(sid, 0.0), self.h2d_end.get(sid, 0.0))
            self._free(size, busy)
        if sid in self.live_recipes:
            self._let_go(sid)

    def _let_go(self, sid: int) -> None:
        """Drop the recipe of ``sid``: inputs it alone held past their last access die."""
        self.live_recipes.discard(sid)
        for x in self.recipes[sid].inputs:
            self.holders[x] -= 1
            if not self.holders[x] and x in self.held:
                self._die(x)

    def finish(self) -> None:
        """The step ends once every retained storage is back on the device."""
        for sid in sorted(self.ix.retained):
            if sid not in self.ix.sizes or sid not in self.ix.first:
                continue
            if sid not in self.on_device:
                self.demand(sid, "the end of the step")
            self.t = max(self.t, self.h2d_end.get(sid, 0.0))

    def result(self) -> SimulationResult:
        compute = self.ix.total_ms
        stall = max(0.0, self.t - compute)
        return SimulationResult(
            total_ms=self.t,
            compute_ms=compute,
            overhead=stall / compute if compute > 0 else 0.0,
            peak_bytes=self.peak,
            natural_peak_bytes=self.ix.natural_peak,
            demand_fetches=self.fetches,
            stall_ms=stall,
            release_wait_ms=self.release_wait,
            reload_wait_ms=self.reload_wait,
            demand_fetch_ms=self.fetch_wait,
            peak_host_bytes=self.peak_host,
            d2h_bytes=self.d2h_bytes,
            h2d_bytes=self.h2d_bytes,
            ignored_actions=self.ignored,
            timeline=tuple(self.timeline),
            copies=tuple(self.copies),
            op_start_ms=tuple(self.op_start),
            recomputes=self.recomputes,
            demand_recomputes=self.demand_recomputes,
            recompute_ms=self.recompute_ms,
            recomputed=tuple(self.recomputed),
        )
