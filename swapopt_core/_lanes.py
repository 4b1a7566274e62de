"""Copy lanes: worker threads that play a device's copy streams on the CPU.

A ``Lane`` runs the operations queued on it one after another, in queue order, on its own
thread, as a CUDA stream runs its copies. Queuing returns a ``Ticket``, which plays a
recorded event: it is done once its operation and everything queued before it on that
lane ran. The caller keeps going, so a wait that the stream code forgot shows up on CPU
as a read of memory that is still being copied.

Two knobs make a lane behave like a real link (both read from the environment when a
runtime builds its lanes, see ``LaneSettings.from_env``):

* ``SWAPOPT_LOOPBACK_GBPS``: each copy takes at least bytes / bandwidth; the rest of the
  time is slept with the GIL released, so a link slower than the computation can be
  emulated on a CPU.
* ``SWAPOPT_LOOPBACK_JITTER_US``: every queued operation first sleeps a random 0..N
  microseconds, so the order in which lanes and the caller meet changes from run to run.

This module imports no tensor library: the operations are plain callables.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from swapopt_core._options import Option, parse_int, parse_rate, read_options

logger = logging.getLogger(__name__)

__all__ = ["ENV_GBPS", "ENV_JITTER_US", "CopyFailed", "Lane", "LaneSettings", "Ticket", "wait_all"]

ENV_GBPS = "SWAPOPT_LOOPBACK_GBPS"
ENV_JITTER_US = "SWAPOPT_LOOPBACK_JITTER_US"

_OPTIONS = {
    "gbps": Option(parse_rate, "a bandwidth in GB/s > 0 (unset: as fast as memcpy)"),
    "jitter_us": Option(parse_int(0), "an integer number of microseconds >= 0"),
}
_LABELS = {"gbps": ENV_GBPS, "jitter_us": ENV_JITTER_US}


@dataclass(frozen=True)
class LaneSettings:
    """How a lane paces its copies.

    Attributes:
        gbps: Emulated bandwidth per lane in GB/s (1e9 bytes per second); ``None``: no limit.
        jitter_us: Upper bound of the random delay before each operation, microseconds.
    """

    gbps: float | None = None
    jitter_us: int = 0

    def __post_init__(self) -> None:
        read_options(
            _OPTIONS,
            {"gbps": self.gbps, "jitter_us": self.jitter_us},
            source="LaneSettings",
        )

    @classmethod
    def from_env(cls) -> LaneSettings:
        """The settings the environment asks for.

        Raises:
            ValueError: A variable holds a value it does not accept; the message names it.
        """
        given = {
            field: os.environ[name]
            for field, name in _LABELS.items()
            if os.environ.get(name, "").strip()
        }
        return cls(**read_options(_OPTIONS, given, source="environment", labels=_LABELS))


class Ticket:
    """A point in one lane's queue; done once everything queued up to it has run.

    Attributes:
        lane: The lane it was queued on.
    """

    __slots__ = ("_done", "_error", "lane")

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the operation ran (successfully or not)."""
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the operation ran; raise what it raised, if anything.

        Raises:
            CopyFailed: The operation raised; the original error is its cause.
        """
        self._done.wait()
        if self._error is not None:
            raise CopyFailed(f"an operation on copy lane {self.lane.name!r} failed") from (
                self._error
            )

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


class CopyFailed(RuntimeError):
    """An operation queued on a lane raised on the lane's thread."""


def wait_all(tickets: Iterable[Ticket | None]) -> None:
    """Block until every ticket (``None`` ones are skipped) is done; raise the first error."""
    for ticket in tickets:
        if ticket is not None:
            ticket.wait()


_STOP = object()


class Lane:
    """One worker thread running queued operations in order: a copy stream on the CPU.

    The thread starts with the first operation and ends once the lane is garbage
    collected (after running what was queued).

    Args:
        name: Shown in thread names and errors (``"h2d"``, ``"d2h"``).
        settings: Pacing of the copies.
    """

    def __init__(self, name: str, settings: LaneSettings | None = None) -> None:
        self.name = name
        self.settings = settings or LaneSettings()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(
        self,
        operation: Callable[[], int | None],
        *,
        after: Iterable[Ticket | None] = (),
    ) -> Ticket:
        """Queue ``operation``; it runs once the earlier ones and the ``after`` tickets are done.

        Args:
            operation: Runs on the lane's thread. If it returns a byte count and the lane
                has a bandwidth, the lane sleeps until the copy took bytes / bandwidth.
            after: Tickets of other lanes this operation must wait for (a stream waiting
                on another stream's event). A failure there fails this operation too.

        Returns:
            The ticket of this operation.
        """
        ticket = Ticket(self)
        waits = tuple(t for t in after if t is not None and t.lane is not self)
        self._start()
        self._queue.put((operation, waits, ticket))
        return ticket

    def marker(self) -> Ticket:
        """A ticket done once everything queued so far has run (a recorded event)."""
        return self.submit(_nothing)

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(
                    target=_work,
                    args=(self._queue, self.settings),
                    name=f"swapopt-{self.name}",
                    daemon=True,
                )
                thread.start()
                # The worker must not keep the lane alive; the lane stops it when collected.
                weakref.finalize(self, self._queue.put, _STOP)
                self._thread = thread


def _nothing() -> None:
    return None


def _work(jobs: queue.SimpleQueue, settings: LaneSettings) -> None:
    """The lane's thread: run each job in order, pacing and jittering as configured."""
    rng = random.Random()
    rate = None if settings.gbps is None else settings.gbps * 1e9
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        operation, waits, ticket = job
        error: BaseException | None = None
        try:
            if settings.jitter_us:
                time.sleep(rng.randint(0, settings.jitter_us) / 1e6)
            for other in waits:
                other.wait()
            start = time.perf_counter()
            nbytes = operation()
            if rate is not None and nbytes:
                left = nbytes / rate - (time.perf_counter() - start)
                if left > 0:
                    time.sleep(left)
        except BaseException as exc:  # handed to whoever waits on the ticket
            error = exc
            logger.debug("operation on lane %s failed", threading.current_thread().name)
        ticket._finish(error)
        del job, operation, waits, ticket
