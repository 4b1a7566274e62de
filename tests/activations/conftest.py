"""Shared by the activation tests: a planner that exercises every action, registered on a
fresh plugin manager, and the runtimes the equivalence tests run on."""

from __future__ import annotations

import pytest

from swapopt_core import (
    ActivationTrace,
    ResidencyPlanner,
    ResidencySchedule,
    hookimpl,
    new_plugin_manager,
)
from swapopt_core._device.lanes import ENV_GBPS, ENV_JITTER_US
from swapopt_core._planning.ir import AccessKind, ActionKind

#: Each op queued on a ``loopback-async`` lane first sleeps a random 0..JITTER_US
#: microseconds, so a missing wait meets a copy still in flight.
JITTER_US = 300


class OffloadEveryGap(ResidencyPlanner):
    """Offloads every storage across every idle gap: exercises all four actions."""

    name = "every-gap"

    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        schedule = ResidencySchedule()
        seen: dict[int, list[tuple[int, AccessKind]]] = {}
        for index, op in enumerate(trace.ops):
            for access in op.accesses:
                if access.storage_id in trace.storage_sizes:  # not parameter gradients
                    seen.setdefault(access.storage_id, []).append((index, access.kind))
        for sid, accesses in seen.items():
            offloaded = False
            for (here, _), (there, _) in zip(accesses, accesses[1:], strict=False):
                if there - here < 2:
                    continue
                last_write = max(
                    i for i, kind in accesses if i <= here and kind is AccessKind.WRITE
                )
                schedule.add_post(last_write, sid, ActionKind.COPY_D2H)
                schedule.add_post(here, sid, ActionKind.RELEASE_DEVICE)
                schedule.add_pre(there - 1, sid, ActionKind.COPY_H2D)
                offloaded = True
            if offloaded and sid not in trace.retained_sids:
                schedule.add_post(accesses[-1][0], sid, ActionKind.RELEASE_HOST)
        return schedule


class RecomputeEveryGap(ResidencyPlanner):
    """Recomputes every storage it can across every idle gap and offloads the others: each
    marked op that made a storage read later runs again before that reader.

    A gap from access ``a`` to reader ``b`` is recomputed when the producer is marked, nothing
    writes the storage or the producer's inputs before ``b``, the inputs live until ``b`` and
    none of them is itself away at ``b`` (gaps are chosen in creation order, inputs first).
    """

    name = "recompute-every-gap"

    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        schedule = ResidencySchedule()
        seen: dict[int, list[tuple[int, AccessKind]]] = {}
        for index, op in enumerate(trace.ops):
            for access in op.accesses:
                if access.storage_id in trace.storage_sizes:
                    seen.setdefault(access.storage_id, []).append((index, access.kind))
        away: dict[int, list[tuple[int, int]]] = {}  # sid -> gaps (a, b) it is off the device

        def writes(sid: int, after: int, before: int) -> bool:
            return any(after < i < before and k is AccessKind.WRITE for i, k in seen[sid])

        for sid, accesses in sorted(seen.items(), key=lambda item: item[1][0][0]):
            producer, kind = accesses[0]
            marked = kind is AccessKind.WRITE and trace.ops[producer].recompute
            inputs = [
                other
                for other in {a.storage_id for a in trace.ops[producer].accesses}
                if other in seen and other != sid and seen[other][0][0] < producer
            ]
            offloaded = False
            for (here, _), (there, _) in zip(accesses, accesses[1:], strict=False):
                if there - here < 2:
                    continue
                if (
                    marked
                    and not writes(sid, producer, there)
                    and all(
                        not writes(x, producer, there)
                        and (seen[x][-1][0] >= there or x in trace.retained_sids)
                        and not any(a < there < b for a, b in away.get(x, ()))
                        for x in inputs
                    )
                ):
                    schedule.add_post(here, sid, ActionKind.RELEASE_DEVICE)
                    schedule.add_pre(there, sid, ActionKind.RECOMPUTE)
                else:
                    last_write = max(
                        i for i, kind in accesses if i <= here and kind is AccessKind.WRITE
                    )
                    schedule.add_post(last_write, sid, ActionKind.COPY_D2H)
                    schedule.add_post(here, sid, ActionKind.RELEASE_DEVICE)
                    schedule.add_pre(there - 1, sid, ActionKind.COPY_H2D)
                    offloaded = True
                away.setdefault(sid, []).append((here, there))
            if offloaded and sid not in trace.retained_sids:
                schedule.add_post(accesses[-1][0], sid, ActionKind.RELEASE_HOST)
        return schedule


class _Plugin:
    @hookimpl
    def swapopt_register_planners(self) -> list[ResidencyPlanner]:
        return [OffloadEveryGap(), RecomputeEveryGap()]


@pytest.fixture
def manager():
    manager = new_plugin_manager(load_entrypoints=False)
    manager.register(_Plugin())
    return manager


@pytest.fixture(params=["loopback", "loopback-async"])
def runtime_name(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The runtime an equivalence test runs on: synchronous loopback, and the asynchronous
    one (copy lanes playing the CUDA streams) with jitter on and no bandwidth limit."""
    if request.param == "loopback-async":
        monkeypatch.setenv(ENV_JITTER_US, str(JITTER_US))
        monkeypatch.delenv(ENV_GBPS, raising=False)
    return request.param
