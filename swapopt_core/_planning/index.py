"""Per-op and per-storage views of a trace, built once and shared by the simulator, the
planners and the bounds."""

from __future__ import annotations

from swapopt_core._planning.ir import ActivationTrace

__all__ = ["TraceIndex"]


class TraceIndex:
    """Per-op and per-storage views of a trace that the simulator, planner and bounds share.

    Only storages listed in ``storage_sizes`` appear. ``accesses[i]`` holds ``(sid, wrote)``
    once per storage; ``first``/``last`` are access op indices, ``end`` the op after which
    each storage is freed (its last access, or later for one the caller held: the trace's
    ``freed_after``; retained storages are never freed); ``starts[i]`` is op ``i``'s
    start with no stall; ``natural[i]`` the resident bytes during op ``i`` with no actions;
    ``working[i]`` the bytes op ``i`` itself touches or creates. ``producer`` maps each
    storage made by an op marked ``recompute`` to that op, ``recompute_inputs`` to the storages
    the producer reads (those it did not create), ``writes`` each storage to its write ops.
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
        starts: list[float] = []
        clock = 0.0
        for i, trace_op in enumerate(trace.ops):
            starts.append(clock)
            clock += self.durations[i]
            merged: dict[int, bool] = {}
            for access in trace_op.accesses:
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
        freed = trace.freed_after
        self.end = {sid: max(last, freed.get(sid, last)) for sid, last in self.last.items()}
        self.writes = {
            sid: [op for op, wrote in acc if wrote] for sid, acc in self.by_storage.items()
        }
        self.producer: dict[int, int] = {}
        self.recompute_inputs: dict[int, tuple[int, ...]] = {}
        for sid, acc in self.by_storage.items():
            op, wrote = acc[0]
            if wrote and trace.ops[op].recompute:
                self.producer[sid] = op
                self.recompute_inputs[sid] = tuple(
                    other for other, _ in self.accesses[op] if self.first[other] < op
                )
        self.created_at: list[list[int]] = [[] for _ in range(self.n)]
        self.freed_at: list[list[int]] = [[] for _ in range(self.n)]
        for sid, op in self.first.items():
            self.created_at[op].append(sid)
        for sid, op in self.end.items():
            if sid not in self.retained:
                self.freed_at[min(op, self.n - 1)].append(sid)
        natural: list[int] = []
        resident = 0
        for i in range(self.n):
            resident += sum(sizes[s] for s in self.created_at[i])
            natural.append(resident)
            resident -= sum(sizes[s] for s in self.freed_at[i])
        self.natural = natural
        self.natural_peak = max(natural, default=0)
        self.working = [sum(sizes[s] for s, _ in acc) for acc in self.accesses]
        # Retained storages past their last access stay on the device (nobody releases them).
        idle_retained: list[int] = []
        kept = 0
        ends: dict[int, list[int]] = {}
        for sid in self.retained:
            if sid in self.last:
                ends.setdefault(self.last[sid], []).append(sid)
        for i in range(self.n):
            idle_retained.append(kept)
            kept += sum(sizes[s] for s in ends.get(i, ()))
        self.idle_retained = idle_retained
