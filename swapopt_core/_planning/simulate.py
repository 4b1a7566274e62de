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
* ``RELEASE_DEVICE(s)``: if ``s`` is on the device and has a valid host copy, compute waits
  until every copy using ``s`` has finished (``t = max(t, D2H end of s, H2D end of s)``), then
  ``s`` is freed. Without a valid host copy, or when ``s`` is not on the device, it does
  nothing (counted in ``ignored_actions``).
* ``COPY_H2D(s)``: if ``s`` is on the device nothing happens (ignored). Otherwise ``s`` needs a
  valid host copy; it is allocated at ``t`` (it counts as resident from then on, in flight or
  not) and copied on the H2D stream from ``max(t, H2D stream free, D2H end of s)``. Ops that
  access ``s`` wait for the end of that copy.
* ``RELEASE_HOST(s)``: drops a host copy of a storage that is on the device (host bytes only);
  otherwise ignored.

Op ``i``: a storage appears on the device at the start of its first access (normally the
write that creates it). An accessed storage that is not on the device is demand-fetched:
allocated, copied on the H2D stream (after whatever that stream is doing) while compute waits.
The op starts at ``max(t, ends of the copies into the storages it accesses)`` and runs for its
duration; a write makes the host copy stale (it is never copied back; a copy out still running
does not delay the write, it only fills that stale copy). Natural free: after the
post actions of op ``i``, every storage whose last access is op ``i`` and that is not retained
leaves the device, with its host copy. Storage ids absent from ``storage_sizes`` never count.

Errors (``ValueError`` naming the op and the storage): an action on a storage absent from
``storage_sizes`` or at an op index outside the trace, ``COPY_D2H`` of a storage that is not on
the device, ``COPY_H2D`` of a storage without a valid host copy, and a demand fetch of a storage
that has no valid host copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swapopt_core._planning.ir import ActionKind, ActivationTrace, ResidencySchedule

__all__ = ["CopySpan", "SimulationResult", "TraceIndex", "simulate"]

_D2H, _RELEASE, _H2D, _RELEASE_HOST = (
    ActionKind.COPY_D2H,
    ActionKind.RELEASE_DEVICE,
    ActionKind.COPY_H2D,
    ActionKind.RELEASE_HOST,
)


@dataclass(frozen=True)
class CopySpan:
    """One copy as it ran: direction ``"D2H"`` or ``"H2D"``, storage, times in ms, bytes."""

    direction: str
    storage_id: int
    start_ms: float
    end_ms: float
    nbytes: int


@dataclass(frozen=True)
class SimulationResult:
    """What replaying a schedule costs.

    Attributes:
        total_ms: When the last op finishes.
        compute_ms: Sum of op durations (the time with no stall).
        overhead: ``(total_ms - compute_ms) / compute_ms``.
        peak_bytes: Peak resident activation bytes, in-flight copies in.
        natural_peak_bytes: Peak with no actions at all.
        demand_fetches: Storages fetched on demand because no reload was issued.
        stall_ms: ``total_ms - compute_ms``.
        release_wait_ms: Part of the stall spent in releases waiting for copies.
        reload_wait_ms: Part spent by ops waiting for planned copies.
        demand_fetch_ms: Part spent by ops waiting for demand fetches.
        peak_host_bytes: Peak bytes of host copies.
        d2h_bytes: Bytes copied device to host.
        h2d_bytes: Bytes copied host to device (demand fetches included).
        ignored_actions: Actions that had no effect (see the module docstring).
        timeline: ``(time_ms, resident_bytes)`` after every change of residency.
        copies: Every copy that ran.
        op_start_ms: When each op started.
    """

    total_ms: float
    compute_ms: float
    overhead: float
    peak_bytes: int
    natural_peak_bytes: int
    demand_fetches: int
    stall_ms: float
    release_wait_ms: float
    reload_wait_ms: float
    demand_fetch_ms: float
    peak_host_bytes: int
    d2h_bytes: int
    h2d_bytes: int
    ignored_actions: int
    timeline: tuple[tuple[float, int], ...]
    copies: tuple[CopySpan, ...]
    op_start_ms: tuple[float, ...]


class TraceIndex:
    """Per-op and per-storage views of a trace that the simulator, planner and bounds share.

    Only storages listed in ``storage_sizes`` appear. ``accesses[i]`` holds ``(sid, wrote)``
    once per storage; ``first``/``last`` are access op indices; ``starts[i]`` is op ``i``'s
    start with no stall; ``natural[i]`` the resident bytes during op ``i`` with no actions;
    ``working[i]`` the bytes op ``i`` itself touches or creates.
    """

    def __init__(self, trace: ActivationTrace) -> None:
        sizes = trace.storage_sizes
        self.trace = trace
        self.sizes: dict[int, int] = dict(sizes)
        self.n = len(trace.ops)
        self.retained = trace.retained_sids
        self.durations = [float(op.duration_ms) for op in trace.ops]
        self.accesses: list[list[tuple[int, bool]]] = []
        self.by_storage: dict[int, list[tuple[int, bool]]] = {}
        starts, clock = [], 0.0
        for i, op in enumerate(trace.ops):
            starts.append(clock)
            clock += self.durations[i]
            merged: dict[int, bool] = {}
            for access in op.accesses:
                if access.storage_id in sizes:
                    wrote = access.kind.value == "WRITE"
                    merged[access.storage_id] = merged.get(access.storage_id, False) or wrote
            self.accesses.append(list(merged.items()))
            for sid, wrote in merged.items():
                self.by_storage.setdefault(sid, []).append((i, wrote))
        self.starts = starts
        self.total_ms = clock
        self.first = {sid: acc[0][0] for sid, acc in self.by_storage.items()}
        self.last = {sid: acc[-1][0] for sid, acc in self.by_storage.items()}
        self.created_at: list[list[int]] = [[] for _ in range(self.n)]
        self.freed_at: list[list[int]] = [[] for _ in range(self.n)]
        for sid, op in self.first.items():
            self.created_at[op].append(sid)
        for sid, op in self.last.items():
            if sid not in self.retained:
                self.freed_at[op].append(sid)
        natural, resident = [], 0
        for i in range(self.n):
            resident += sum(sizes[s] for s in self.created_at[i])
            natural.append(resident)
            resident -= sum(sizes[s] for s in self.freed_at[i])
        self.natural = natural
        self.natural_peak = max(natural, default=0)
        self.working = [sum(sizes[s] for s, _ in acc) for acc in self.accesses]
        # Retained storages past their last access stay on the device (nobody releases them).
        idle_retained, kept = [], 0
        ends = {}
        for sid in self.retained:
            if sid in self.last:
                ends.setdefault(self.last[sid], []).append(sid)
        for i in range(self.n):
            idle_retained.append(kept)
            kept += sum(sizes[s] for s in ends.get(i, ()))
        self.idle_retained = idle_retained


class Machine:
    """The device model, one step at a time. ``simulate`` drives it with a schedule; the
    planner drives it with its own decisions, so both follow the same rules."""

    def __init__(self, index: TraceIndex, *, record: bool = True) -> None:
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
        self.release_wait = self.reload_wait = self.fetch_wait = 0.0
        self.fetches = 0
        self.d2h_bytes = self.h2d_bytes = 0
        self.ignored = 0
        self.timeline: list[tuple[float, int]] = []
        self.copies: list[CopySpan] = []
        self.op_start: list[float] = []

    def _alloc(self, nbytes: int, at: float) -> None:
        self.resident += nbytes
        if self.resident > self.peak:
            self.peak = self.resident
        if self.record:
            self.timeline.append((at, self.resident))

    def _free(self, nbytes: int) -> None:
        self.resident -= nbytes
        if self.record:
            self.timeline.append((self.t, self.resident))

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
        if sid not in self.on_device or not self.host.get(sid):
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

    def apply(self, kind: ActionKind, sid: int, where: str) -> None:
        if kind is _D2H:
            self.copy_d2h(sid, where)
        elif kind is _RELEASE:
            self.release_device(sid, where)
        elif kind is _H2D:
            self.copy_h2d(sid, where)
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
        waited = start
        for sid, wrote in ix.accesses[i]:
            if sid not in self.on_device:
                if not self.host.get(sid):
                    raise ValueError(
                        f"op {i} accesses storage {sid}, which is released without a valid "
                        "host copy: it cannot be fetched back."
                    )
                self._alloc(sizes[sid], waited)
                self.on_device.add(sid)
                end = self._copy_in(sid, sizes[sid], waited)
                self.fetches += 1
                self.fetch_wait += end - waited
                waited = end
            ready = self.h2d_end.get(sid, 0.0)
            if wrote and sid in self.host:
                self.host[sid] = False  # a copy out still running only feeds a stale copy
            if ready > waited:
                self.reload_wait += ready - waited
                waited = ready
        self.op_start.append(waited)
        self.t = waited + ix.durations[i]

    def natural_free(self, i: int) -> None:
        sizes = self.ix.sizes
        for sid in self.ix.freed_at[i]:
            self.dead.add(sid)
            if sid in self.host:
                del self.host[sid]
                self.host_bytes -= sizes[sid]
            if sid in self.on_device:
                self.on_device.discard(sid)
                self._free(sizes[sid])

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
        )


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
    machine = Machine(ix, record=record)
    pre: dict[int, Sequence] = {}
    post: dict[int, Sequence] = {}
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
    return machine.result()
