"""The accounts the ``Machine`` (``simulate.py``) keeps: the device bytes over time, whose
frees may wait on the copies still using them; the host copies and their bytes; one copy link
per direction; and the storages the replay's recipes hold alive. The machine decides what
happens when; these keep count."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping

from swapopt_core._planning.recipes import RecipeLife
from swapopt_core._planning.results import CopySpan

__all__ = ["CopyLink", "DeviceMemory", "HostCopies", "RecipeHolds"]


class DeviceMemory:
    """The device bytes of the simulated step, their peak and (when recorded) timeline.

    Args:
        record: Keep the timeline of ``(time, resident bytes)`` points.
    """

    def __init__(self, record: bool) -> None:
        self.record = record
        self.resident = 0
        self.peak = 0
        self.pending: list[tuple[float, int]] = []  # (copy end, bytes): frees waiting on copies
        self.timeline: list[tuple[float, int]] = []

    def alloc(self, nbytes: int, at: float) -> None:
        """Take ``nbytes`` at time ``at``, after the frees that waited for copies ending
        by then."""
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

    def free(self, nbytes: int, now: float, when: float | None = None) -> None:
        """Give back ``nbytes`` at ``now``, or at ``when`` if a copy uses them until later."""
        if when is not None and when > now:  # a copy still uses the block until ``when``
            heapq.heappush(self.pending, (when, nbytes))
            return
        self.resident -= nbytes
        if self.record:
            self.timeline.append((now, self.resident))


class HostCopies:
    """The host copies of the simulated step: which storages have one, whether it is still
    valid (a write on the device makes it stale), and the bytes they take with their peak."""

    def __init__(self) -> None:
        self.copies: dict[int, bool] = {}  # sid -> host copy valid
        self.bytes = 0
        self.peak = 0

    def __contains__(self, sid: object) -> bool:
        """Whether ``sid`` has a host copy, valid or stale."""
        return sid in self.copies

    def valid(self, sid: int) -> bool:
        """Whether ``sid`` has a host copy that holds its current bytes."""
        return self.copies.get(sid, False)

    def write(self, sid: int, size: int) -> None:
        """A copy out of ``sid`` (``size`` bytes) was issued: its host copy is valid."""
        if sid not in self.copies:
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
        self.copies[sid] = True

    def stale(self, sid: int) -> None:
        """``sid`` was written on the device: a host copy of it no longer holds its bytes."""
        if sid in self.copies:
            self.copies[sid] = False

    def drop(self, sid: int, size: int) -> None:
        """Free the host copy of ``sid`` (``size`` bytes), if it has one."""
        if self.copies.pop(sid, None) is not None:
            self.bytes -= size


class CopyLink:
    """One copy stream: one copy at a time, in the order they are issued.

    Args:
        direction: ``"D2H"`` or ``"H2D"``, as ``CopySpan`` names it.
        gbps: The link's bandwidth in GB/s.
        spans: Where each copy is noted, shared by both links (in issue order); ``None``
            notes nothing.
    """

    def __init__(self, direction: str, gbps: float, spans: list[CopySpan] | None) -> None:
        self.direction = direction
        self.rate = gbps * 1e6  # bytes per ms
        self.free = 0.0  # when the copies issued so far have finished
        self.end: dict[int, float] = {}  # sid -> end of its last copy on this link
        self.bytes = 0
        self.spans = spans

    def copy(self, sid: int, size: int, ready: float) -> float:
        """Copy ``size`` bytes of ``sid`` once the link is free and ``ready`` has passed;
        returns when the copy ends."""
        start = max(ready, self.free)
        end = start + size / self.rate
        self.free = end
        self.end[sid] = end
        self.bytes += size
        if self.spans is not None:
            self.spans.append(CopySpan(self.direction, sid, start, end, size))
        return end


class RecipeHolds:
    """The replay's recipes (``recipes.py``) and the storages they hold alive: a live
    recipe keeps its producer's inputs, past their last access too, until it goes.

    Args:
        recipes: The life of every recipe the replay keeps, by storage.
    """

    def __init__(self, recipes: Mapping[int, RecipeLife]) -> None:
        self.recipes = recipes
        self.taken: dict[int, list[int]] = {}  # producer op -> storages whose recipe it takes
        self.drops: dict[int, list[int]] = {}  # drop op -> storages whose recipe goes then
        for sid, life in recipes.items():
            self.taken.setdefault(life.producer, []).append(sid)
            self.drops.setdefault(life.drop, []).append(sid)
        self.live: set[int] = set()
        self.holders: dict[int, int] = {}  # storage -> live recipes that hold it
        self.held: set[int] = set()  # past its last access, alive only for recipes

    def take(self, sid: int) -> None:
        """The recipe of ``sid`` is kept from now on: it holds its inputs."""
        self.live.add(sid)
        for x in self.recipes[sid].inputs:
            self.holders[x] = self.holders.get(x, 0) + 1

    def let_go(self, sid: int) -> Iterator[int]:
        """Drop the recipe of ``sid``; yields, one at a time, each input it alone held past
        its last access (the caller frees it before the next is let go)."""
        self.live.discard(sid)
        for x in self.recipes[sid].inputs:
            self.holders[x] -= 1
            if not self.holders[x] and x in self.held:
                yield x
