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

At exit every lane runs what is queued and its thread ends (``close``), before the
interpreter abandons daemon threads: a lane left inside a copy kernel then used to abort the
process. A lane closed that way runs later operations on the calling thread.

This module imports no tensor library: the operations are plain callables.
"""

from __future__ import annotations

import atexit
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

    __slots__ = ("_done", "_error", "lane", "seq")

    def __init__(self, lane: Lane, seq: int = 0) -> None:
        self.lane = lane
        self.seq = seq  #: its place in the lane's queue (1, 2, ...)
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the operation ran (successfully or not)."""
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """What the operation raised, once it ran; ``None`` while it has not, or if it
        succeeded. An operation waiting for a failed ticket of another lane fails too."""
        return self._error if self._done.is_set() else None

    @property
    def seen(self) -> bool:
        """Whether the host waited for this point of the lane (``Lane.observe``): what a
        host that may run any distance ahead of its device knows to be finished."""
        return self.seq <= self.lane.observed

    def settle(self) -> None:
        """Block until the operation ran, without raising what it raised."""
        self._done.wait()

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


#: One queued operation: what to run, the tickets it waits for, the ticket it finishes.
_Job = tuple[Callable[[], "int | None"], tuple["Ticket", ...], "Ticket"]


class Lane:
    """One worker thread running queued operations in order: a copy stream on the CPU.

    The thread starts with the first operation and ends once the lane is garbage
    collected, or at exit (``close``), after running what was queued.

    Args:
        name: Shown in thread names and errors (``"h2d"``, ``"d2h"``).
        settings: Pacing of the copies.
    """

    def __init__(self, name: str, settings: LaneSettings | None = None) -> None:
        self.name = name
        self.settings = settings or LaneSettings()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._drained = threading.Event()  # set once a closed lane's thread has ended
        self._rng = random.Random()  # jitter of operations run on the caller's thread
        self._issued = 0  # tickets handed out (the last one's ``seq``)
        #: The last ``seq`` the host waited for: every ticket up to it is ``seen``.
        self.observed = 0

    def observe(self, ticket: Ticket) -> None:
        """The host waited for ``ticket``: it and everything queued before it are ``seen``."""
        with self._lock:
            if ticket.lane is self and ticket.seq > self.observed:
                self.observed = ticket.seq

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
            The ticket of this operation (already done if the lane is closed: the
            operation then ran on the calling thread, after everything queued before).
        """
        waits = tuple(t for t in after if t is not None and t.lane is not self)
        with self._lock:  # a job is queued before the stop of a concurrent close, or not
            self._issued += 1
            ticket = Ticket(self, self._issued)
            job = (operation, waits, ticket)
            if not self._closed:
                self._start()
                self._queue.put(job)
                return ticket
        # Closed at exit: what was queued before runs first, then this, here.
        self._drained.wait()
        _run(job, self.settings, self._rng)
        return ticket

    def marker(self) -> Ticket:
        """A ticket done once everything queued so far has run (a recorded event)."""
        return self.submit(_nothing)

    def close(self) -> None:
        """Run everything queued, end the thread; later operations run on the caller's thread.

        Called for every lane at exit. Blocks until the queued operations ran.
        """
        with self._lock:
            if self._closed:
                thread = None
            else:
                self._closed = True
                thread, self._thread = self._thread, None
                if thread is not None:
                    self._queue.put(None)  # after every job queued so far
        if thread is not None and thread is not threading.current_thread():
            # What was queued must have run (and the thread left torch's kernels) before exit.
            thread.join()
        self._drained.set()

    def _start(self) -> None:
        """Start the thread if it is not running (called with ``_lock`` held)."""
        if self._thread is not None:
            return
        thread = threading.Thread(
            target=_work,
            args=(self._queue, self.settings),
            name=f"swapopt-{self.name}",
            daemon=True,
        )
        thread.start()
        # The worker must not keep the lane alive; the lane stops it when collected. At
        # exit ``_close_all`` stops it instead (and waits), so this one does not run then.
        weakref.finalize(self, self._queue.put, None).atexit = False
        self._thread = thread
        _LIVE.add(self)


#: Lanes whose thread was started, held weakly: the exit hook keeps no lane alive.
_LIVE: weakref.WeakSet[Lane] = weakref.WeakSet()


def _close_all() -> None:
    """At exit: run what every lane has queued and end its thread."""
    for lane in list(_LIVE):
        try:
            lane.close()
        except BaseException:  # one lane's failure must not keep the others running
            logger.warning("swapopt: closing copy lane %s at exit failed", lane.name, exc_info=True)


# ``atexit`` rather than ``threading._register_atexit``: atexit hooks run after the
# interpreter has joined every non-daemon thread (so no training thread queues a copy
# after the lanes were drained) and before it abandons daemon threads (a lane abandoned
# inside a copy kernel aborts the process). Hooks registered after this import run first
# and find the lanes working; any that run later find them closed and run copies inline.
atexit.register(_close_all)


def _nothing() -> None:
    return None


def _work(jobs: queue.SimpleQueue[_Job | None], settings: LaneSettings) -> None:
    """The lane's thread: run each job in order, pacing and jittering as configured."""
    rng = random.Random()
    while True:
        job = jobs.get()
        if job is None:  # the lane was closed: everything queued before has run
            return
        _run(job, settings, rng)
        del job


def _run(job: _Job, settings: LaneSettings, rng: random.Random) -> None:
    """Run one queued operation after the tickets it waits for; finish its ticket."""
    operation, waits, ticket = job
    error: BaseException | None = None
    try:
        if settings.jitter_us:
            time.sleep(rng.randint(0, settings.jitter_us) / 1e6)
        for other in waits:
            other.wait()
        start = time.perf_counter()
        nbytes = operation()
        if settings.gbps is not None and nbytes:
            left = nbytes / (settings.gbps * 1e9) - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)
    except BaseException as exc:  # handed to whoever waits on the ticket
        error = exc
        logger.debug("operation on lane %s failed", ticket.lane.name)
    ticket._finish(error)
