"""Traces and schedules the bound and floor tests share: small hand-made traces, random
traces and schedules, and a schedule that holds each op's own bytes only."""

from __future__ import annotations

import dataclasses
import random

from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.simulate import TraceIndex

MB = 10**6
D2H, RELEASE, H2D, RECOMPUTE = (
    ActionKind.COPY_D2H,
    ActionKind.RELEASE_DEVICE,
    ActionKind.COPY_H2D,
    ActionKind.RECOMPUTE,
)


def any_size(trace: ActivationTrace) -> ActivationTrace:
    """``trace`` without a size threshold: storages of any size may be offloaded."""
    return dataclasses.replace(trace, min_offload_bytes=0)


def make_trace(ops, sizes, *, retained=(), limit=None, bw=1.0, ms=None, pure=()):
    """``ops``: one ``{sid: "R" | "W"}`` per op, 1 ms each unless ``ms`` says; ops listed in
    ``pure`` are marked ``recompute``; copies at 10**6 bytes per ms."""
    built = tuple(
        TraceOp(
            f"op{i}",
            1.0 if ms is None else ms[i],
            tuple(
                Access(sid, AccessKind.READ if kind == "R" else AccessKind.WRITE)
                for sid, kind in op.items()
            ),
            i in pure,
        )
        for i, op in enumerate(ops)
    )
    return ActivationTrace(built, sizes, frozenset(retained), limit, bw, bw)


def long_gap(extra: dict[int, dict[int, str]], sizes: dict[int, int], limit: int, **kw):
    """Storage 1 (1 MB) written by op 0 and read by op 5, plus ``extra`` accesses."""
    ops = [{1: "W"}, {}, {}, {}, {}, {1: "R"}]
    for op, accesses in extra.items():
        ops[op] = {**ops[op], **accesses}
    return make_trace(ops, {1: MB, **sizes}, limit=limit, **kw)


def schedule(pre=(), post=()) -> ResidencySchedule:
    plan = ResidencySchedule()
    for op, sid, kind in pre:
        plan.add_pre(op, sid, kind)
    for op, sid, kind in post:
        plan.add_post(op, sid, kind)
    return plan


# (trace, expected stall in ms): each is also reached by the planner, so the bound is tight.
def old_floor(ix: TraceIndex) -> int:
    """The floor before issue 12: kept outputs unmovable after their last access."""
    return max(w + r for w, r in zip(ix.working, ix.idle_retained, strict=True))


def floor_schedule(trace: ActivationTrace) -> ResidencySchedule:
    """Before each op, move out everything it does not touch and bring back what it
    touches: each op holds only its own bytes; kept outputs come back at the end."""
    ix = TraceIndex(trace)
    plan = ResidencySchedule()
    on: set[int] = set()
    for i in range(ix.n):
        touched = {sid for sid, _ in ix.accesses[i]}
        for sid in sorted(on - touched):
            plan.add_pre(i, sid, D2H)
            plan.add_pre(i, sid, RELEASE)
        for sid in sorted(touched - on):
            if ix.first[sid] < i:
                plan.add_pre(i, sid, H2D)
        on = {sid for sid in touched if sid in ix.retained or ix.last[sid] > i}
    return plan


def random_trace(
    rng: random.Random, n_ops: int, n_storages: int, *, kept: int = 2, pure: float = 0.0
) -> ActivationTrace:
    ops: list[dict[int, str]] = [{} for _ in range(n_ops)]
    sizes = {}
    for sid in range(n_storages):
        created = rng.randrange(n_ops - 1)
        sizes[sid] = rng.randint(1, 8) * MB // 4
        ops[created][sid] = "W"
        for op in rng.sample(
            range(created + 1, n_ops), min(rng.randint(0, 3), n_ops - created - 1)
        ):
            ops[op][sid] = rng.choice("RRRW")
    built = tuple(
        TraceOp(
            f"op{i}",
            rng.choice([0.0, rng.uniform(0.05, 2.0)]),
            tuple(
                Access(s, AccessKind.READ if k == "R" else AccessKind.WRITE) for s, k in op.items()
            ),
            rng.random() < pure,
        )
        for i, op in enumerate(ops)
    )
    retained = frozenset(rng.sample(range(n_storages), min(kept, n_storages)))
    return ActivationTrace(
        built, sizes, retained, None, rng.uniform(0.2, 4.0), rng.uniform(0.2, 4.0)
    )


def random_schedule(rng: random.Random, trace: ActivationTrace) -> ResidencySchedule:
    """Move random gaps (kept outputs after their last access too) with random release and
    reload points; storages of ops marked recompute are sometimes released without a copy
    and made again (planned, or on demand at their reader)."""
    ix = TraceIndex(trace)
    plan = ResidencySchedule()
    for sid, accesses in ix.by_storage.items():
        uses = [*accesses, (ix.n, False)] if sid in ix.retained else accesses
        last_write = accesses[0][0]
        for (a, wrote), (b, _) in zip(uses, uses[1:], strict=False):
            last_write = a if wrote else last_write
            if b - a < 2 or rng.random() < 0.4:
                continue
            release = rng.randint(a + 1, b - 1)
            reload = rng.randint(release + 1, b)
            if sid in ix.producer and rng.random() < 0.5:
                plan.add_pre(release, sid, RELEASE)
                if reload < ix.n and rng.random() < 0.7:
                    plan.add_pre(reload, sid, RECOMPUTE)
                continue
            plan.add_post(last_write, sid, D2H)
            plan.add_pre(release, sid, RELEASE)
            if reload < ix.n:
                plan.add_pre(reload, sid, H2D)
            elif rng.random() < 0.5:
                plan.add_post(ix.n - 1, sid, H2D)
    return plan
