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
from swapopt_core._lanes import ENV_GBPS, ENV_JITTER_US
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


class _Plugin:
    @hookimpl
    def swapopt_register_planners(self) -> list[ResidencyPlanner]:
        return [OffloadEveryGap()]


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
