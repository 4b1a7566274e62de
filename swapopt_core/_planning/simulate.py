"""Replay a residency schedule against a trace in simulated time.

The model has one compute stream and one copy stream per direction. Host issue order for op
``i`` is: the ``pre`` actions in list order, op ``i``, the ``post`` actions in list order, then
the natural frees of op ``i``. ``t`` is the compute clock: the time at which all compute work
issued so far has finished. Copy durations are ``bytes / (bandwidth * 1e9)`` seconds.

Actions, issued at compute time ``t``:

* ``COPY_D2H(s)``: ``s`` must be on the device. If its host copy is already valid nothing
  happens. Otherwise the copy runs on the D2H stream from ``max(t, D2H stream free, end of a
  copy into s still running)``; the host copy counts in host bytes from the issue on. ``s``
  stays on the device.
* ``RELEASE_DEVICE(s)``: if ``s`` is on the device and has a valid host copy, or can be
  recomputed (below), compute waits until every copy using ``s`` has finished
  (``t = max(t, D2H end of s, H2D end of s)``), then ``s`` is freed. Otherwise it does nothing
  (counted in ``ignored_actions``).
* ``COPY_H2D(s)``: if ``s`` is on the device nothing happens (ignored). Otherwise ``s`` needs a
  valid host copy; it is allocated at ``t`` (it counts as resident from then on, in flight or
  not) and copied on the H2D stream from ``max(t, H2D stream free, D2H end of s)``. Ops that
  access ``s`` wait for the end of that copy.
* ``RELEASE_HOST(s)``: drops a host copy of a storage that is on the device (host bytes only);
  otherwise ignored.
* ``RECOMPUTE(s)``: if ``s`` is on the device nothing happens (ignored). Otherwise the op that
  made ``s`` runs again on the compute stream: ``s`` must be recomputable and its producer's
  inputs on the device (a reload in flight counts: the recompute waits for it). ``s`` is
  allocated when the recompute starts and the compute clock advances by the producer's
  duration. A valid host copy of ``s`` stays valid (the bytes are the same).

**Recomputable** (``recomputable.py``). The producer of ``s`` is the op of its first access,
a write by an op marked ``recompute``. With ``k`` the last op that has run (``i - 1`` in
``pre`` of op ``i``, ``i`` in ``post``), ``s`` is recomputable when nothing in ops
``producer+1 .. k`` wrote ``s`` or any of the producer's *inputs* (the storages it accessed
and did not create), and no input has been freed. A release without a host copy asks more:
that ``s`` has a recipe (below) and that this holds until ``s`` is next read (or until the
end, for a kept output; now, for a storage past its last access). Other outputs of the
producer are temporaries of the recompute and are not counted.

**Recipes** (``recipes.py``). As the replay does, the simulator keeps a recipe for every
storage with a ``RECOMPUTE`` action or released without ever being copied out, from its
producer to its drop op (or, when it is off the device without a host copy then, until it
dies). A recipe holds its producer's inputs: an input whose last access passed while a recipe
still holds it stays alive (on the device, unless released) and dies when the last such
recipe goes.

Op ``i``: a storage appears on the device at the start of its first access (normally the
write that creates it). An accessed storage that is not on the device is brought back on
demand: with a valid host copy it is allocated and copied on the H2D stream (after whatever
that stream is doing) while compute waits (``demand_fetches``); without one, a recomputable
storage is recomputed, its inputs brought back first by the same rule
(``demand_recomputes``). The op starts at ``max(t, ends of the copies into the storages it
accesses, ends of the copies out of the storages it writes)`` and runs for its duration; a
write makes the host copy stale (it is never copied back). Natural free: after the post
actions of op ``i``, every storage freed then (its last access, or the trace's ``freed_after``
for one the caller held longer) that is not retained and no recipe holds leaves the device,
with its host copy; its memory returns when the copies still using it end
(at ``t`` when none runs). Retained storages must be on the device when the step ends: one
still off is brought back then, and the step ends when the last copy into one lands. Storage
ids absent from ``storage_sizes`` never count.

Errors (``ValueError`` naming the op and the storage): an action on a storage absent from
``storage_sizes`` or at an op index outside the trace, ``COPY_D2H`` of a storage that is not on
the device, ``COPY_H2D`` of a storage without a valid host copy, ``RECOMPUTE`` of a storage that
cannot be recomputed there or whose inputs are off the device, and an access to a storage that
has neither a valid host copy nor a way to be recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.ir import Action, ActionKind, ActivationTrace, ResidencySchedule
from swapopt_core._planning.recipes import RecipeLife, recipe_lives
from swapopt_core._planning.recomputable import needed_until, recomputable
from swapopt_core._planning.resources import CopyLink, DeviceMemory, HostCopies, RecipeHolds
from swapopt_core._planning.results import CopySpan, RecomputeSpan, SimulationResult

__all__ = [
    "CopySpan",
    "Machine",
    "RecomputeSpan",
    "SimulationResult",
    "TraceIndex",
    "simulate",
]


def _check_ops(side: dict, n: int, name: str) -> None:
    for op in side:
        if not 0 <= op < n:
            raise ValueError(f"The schedule has {name} actions at op {op}; the trace has {n} ops.")


def simulate(
    trace: ActivationTrace,
    schedule: ResidencySchedule | None = None,
    *,
    record: bool = True,
    index: TraceIndex | None = None,
) -> SimulationResult:
    """Replay ``schedule`` on ``trace`` with the rules of the module docstring.

    Args:
        trace: The ops, storages and bandwidths.
        schedule: The actions; ``None`` replays the trace with no actions.
        record: Keep ``timeline`` and ``copies`` (turn off for speed when only totals matter).
        index: A ``TraceIndex`` of ``trace`` built earlier, to save rebuilding it.

    Returns:
        The timing, memory and copy figures of the replay.

    Raises:
        ValueError: The schedule names an unknown storage or op, copies out a storage that is
            not on the device, or needs a host copy that does not exist.
    """
    ix = index if index is not None else TraceIndex(trace)
    machine = Machine(ix, record=record, recipes=recipe_lives(ix, schedule))
    pre: Mapping[int, Sequence[Action]] = {}
    post: Mapping[int, Sequence[Action]] = {}
    if schedule is not None:
        _check_ops(schedule.pre, ix.n, "pre")
        _check_ops(schedule.post, ix.n, "post")
        pre, post = schedule.pre, schedule.post
    for i in range(ix.n):
        for action in pre.get(i, ()):
            machine.apply(action.kind, action.storage_id, f"before op {i}")
        machine.run_op(i)
        for action in post.get(i, ()):
            machine.apply(action.kind, action.storage_id, f"after op {i}")
        machine.natural_free(i)
    machine.finish()
    return machine.result()


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
        self.record = record
        self.t = 0.0
        self.copies: list[CopySpan] = []
        spans = self.copies if record else None
        self.d2h = CopyLink("D2H", trace.d2h_bandwidth_gbps, spans)
        self.h2d = CopyLink("H2D", trace.h2d_bandwidth_gbps, spans)
        self.memory = DeviceMemory(record)
        self.on_device: set[int] = set()
        self.dead: set[int] = set()
        self.host = HostCopies()
        self.release_wait = self.reload_wait = self.fetch_wait = self.recompute_ms = 0.0
        self.fetches = self.recomputes = self.demand_recomputes = 0
        self.done = -1  # the last op that has run
        self.ignored = 0
        self.op_start: list[float] = []
        self.recomputed: list[RecomputeSpan] = []
        # The replay's recipes (``recipes.py``): each holds its producer's inputs alive.
        self.holds = RecipeHolds(recipes or {})

    def recomputable(self, sid: int, upto: int | None = None) -> bool:
        """Whether re-running ``sid``'s producer gives its bytes now (``upto=None``), or until
        op ``upto`` (the rule **Recomputable**, in ``recomputable.py``)."""
        dead, recipes = self.dead, self.holds.live
        return recomputable(self.ix, sid, done=self.done, dead=dead, recipes=recipes, upto=upto)

    def _known(self, sid: int, where: str, kind: ActionKind) -> int:
        size = self.ix.sizes.get(sid)
        if size is None:
            raise ValueError(f"{kind.value} {where} names storage {sid}, which the trace lacks.")
        return size

    def copy_d2h(self, sid: int, where: str) -> None:
        size = self._known(sid, where, ActionKind.COPY_D2H)
        if sid not in self.on_device:
            raise ValueError(f"COPY_D2H {where}: storage {sid} is not on the device.")
        if self.host.valid(sid):
            self.ignored += 1
            return
        self.d2h.copy(sid, size, max(self.t, self.h2d.end.get(sid, 0.0)))
        self.host.write(sid, size)

    def release_device(self, sid: int, where: str) -> None:
        size = self._known(sid, where, ActionKind.RELEASE_DEVICE)
        if sid not in self.on_device or not (
            self.host.valid(sid)
            or (
                sid in self.holds.live
                and self.recomputable(sid, needed_until(self.ix, sid, self.done))
            )
        ):
            self.ignored += 1
            return
        ready = max(self.d2h.end.get(sid, 0.0), self.h2d.end.get(sid, 0.0))
        if ready > self.t:
            self.release_wait += ready - self.t
            self.t = ready
        self.on_device.discard(sid)
        self.memory.free(size, self.t)

    def copy_h2d(self, sid: int, where: str) -> None:
        size = self._known(sid, where, ActionKind.COPY_H2D)
        if sid in self.on_device:
            self.ignored += 1
            return
        if not self.host.valid(sid) or sid in self.dead:
            raise ValueError(f"COPY_H2D {where}: storage {sid} has no valid host copy.")
        self.memory.alloc(size, self.t)
        self.on_device.add(sid)
        self._copy_in(sid, size, self.t)

    def _copy_in(self, sid: int, size: int, issued: float) -> float:
        return self.h2d.copy(sid, size, max(issued, self.d2h.end.get(sid, 0.0)))

    def release_host(self, sid: int, where: str) -> None:
        size = self._known(sid, where, ActionKind.RELEASE_HOST)
        if sid not in self.host or sid not in self.on_device:
            self.ignored += 1
            return
        self.host.drop(sid, size)

    def recompute(self, sid: int, where: str, *, demand: bool = False) -> None:
        """Make ``sid`` again by re-running its producer (``RECOMPUTE``, or on demand)."""
        size = self._known(sid, where, ActionKind.RECOMPUTE)
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
        ready = max((self.h2d.end.get(x, 0.0) for x in inputs), default=0.0)
        if ready > self.t:  # the producer's inputs are still being copied in
            self.reload_wait += ready - self.t
            self.t = ready
        self.memory.alloc(size, self.t)
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
        if self.host.valid(sid) and sid not in self.dead:
            self.memory.alloc(size, self.t)
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
        if kind is ActionKind.COPY_D2H:
            self.copy_d2h(sid, where)
        elif kind is ActionKind.RELEASE_DEVICE:
            self.release_device(sid, where)
        elif kind is ActionKind.COPY_H2D:
            self.copy_h2d(sid, where)
        elif kind is ActionKind.RECOMPUTE:
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
                self.memory.alloc(sizes[sid], start)
        for sid, _ in ix.accesses[i]:
            if sid not in self.on_device:
                self.demand(sid, f"op {i}")
        waited = self.t
        for sid, wrote in ix.accesses[i]:
            ready = self.h2d.end.get(sid, 0.0)
            if wrote:
                # A writer waits for a copy out still reading the storage.
                ready = max(ready, self.d2h.end.get(sid, 0.0))
                self.host.stale(sid)
            if ready > waited:
                self.reload_wait += ready - waited
                waited = ready
        self.op_start.append(waited)
        self.t = waited + ix.durations[i]
        self.done = i
        for sid in self.holds.taken.get(i, ()):
            if sid in self.on_device:  # the replay takes the recipe as the op returns
                self.holds.take(sid)

    def natural_free(self, i: int) -> None:
        """After op ``i``'s post actions: recipes whose drop op it is go (those of storages
        off the device without a host copy stay until they die), then the storages whose
        last access it is die, unless a recipe holds them."""
        holds = self.holds
        for sid in holds.drops.get(i, ()):
            if sid in holds.live and (sid in self.on_device or self.host.valid(sid)):
                self._let_go(sid)
        for sid in self.ix.freed_at[i]:
            if holds.holders.get(sid):
                holds.held.add(sid)
            else:
                self._die(sid)

    def _die(self, sid: int) -> None:
        size = self.ix.sizes[sid]
        self.dead.add(sid)
        self.holds.held.discard(sid)
        self.host.drop(sid, size)
        if sid in self.on_device:
            self.on_device.discard(sid)
            busy = max(self.d2h.end.get(sid, 0.0), self.h2d.end.get(sid, 0.0))
            self.memory.free(size, self.t, busy)
        if sid in self.holds.live:
            self._let_go(sid)

    def _let_go(self, sid: int) -> None:
        """Drop the recipe of ``sid``: inputs it alone held past their last access die."""
        for x in self.holds.let_go(sid):
            self._die(x)

    def finish(self) -> None:
        """The step ends once every retained storage is back on the device."""
        for sid in sorted(self.ix.retained):
            if sid not in self.ix.sizes or sid not in self.ix.first:
                continue
            if sid not in self.on_device:
                self.demand(sid, "the end of the step")
            self.t = max(self.t, self.h2d.end.get(sid, 0.0))

    def result(self) -> SimulationResult:
        compute = self.ix.total_ms
        stall = max(0.0, self.t - compute)
        return SimulationResult(
            total_ms=self.t,
            compute_ms=compute,
            overhead=stall / compute if compute > 0 else 0.0,
            peak_bytes=self.memory.peak,
            natural_peak_bytes=self.ix.natural_peak,
            demand_fetches=self.fetches,
            stall_ms=stall,
            release_wait_ms=self.release_wait,
            reload_wait_ms=self.reload_wait,
            demand_fetch_ms=self.fetch_wait,
            peak_host_bytes=self.host.peak,
            d2h_bytes=self.d2h.bytes,
            h2d_bytes=self.h2d.bytes,
            ignored_actions=self.ignored,
            timeline=tuple(self.memory.timeline),
            copies=tuple(self.copies),
            op_start_ms=tuple(self.op_start),
            recomputes=self.recomputes,
            demand_recomputes=self.demand_recomputes,
            recompute_ms=self.recompute_ms,
            recomputed=tuple(self.recomputed),
        )
