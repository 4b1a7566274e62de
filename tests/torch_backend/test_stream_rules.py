"""The accelerator runtime against streams faked by PyTorch's rules (no GPU here).

``torch.Stream``, ``torch.Event`` and ``torch.accelerator``'s stream calls are replaced by a
small model that keeps what the real ones keep: the current stream per thread, each
stream's waits and recorded events in order, events that complete when the test says.
Copies run on the CPU inside it. Each test checks one rule the device path must keep, and
fails with the wait or the fix it names taken out.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import pytest
import torch

from swapopt_core._device.accelerator import AcceleratorRuntime
from swapopt_core._device.interface import ACTIVATIONS, OPTIMIZER
from tests.fake_accelerator import CurrentDevice

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


class FakeEvent:
    """An event recorded on a stream; complete once the test says (``done``)."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True


class FakeStream:
    """A stream: what was queued on it, in order. Entering it as a context manager is
    refused, as builds that check it refuse a second entry of one object."""

    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name = name
        self.device = CUDA
        self.log = log

    def __repr__(self) -> str:
        return self.name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self, other))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self, event.stream))

    def record_event(self) -> FakeEvent:
        self.log.append(("record", self))
        return FakeEvent(self)

    def synchronize(self) -> None:
        self.log.append(("synchronize", self))

    def __enter__(self) -> None:
        raise RuntimeError("Stream's context should not be initialized")

    def __exit__(self, *exc: object) -> None:
        raise AssertionError("never entered")


class Streams:
    """The fake streams and the per-thread current stream; copies log the stream they ran on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.compute = FakeStream("compute", self.log)
        self.made: list[FakeStream] = []
        self._current = threading.local()
        self.record_streams: list[object] = []
        monkeypatch.setattr(torch, "Stream", self._make)
        monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.accelerator, "set_stream", self._set)
        monkeypatch.setattr(
            torch.Tensor, "record_stream", lambda tensor, s: self.record_streams.append(s)
        )
        copy = torch.Tensor.copy_

        def logged_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
            self.log.append(("copy", self.current))
            return copy(dst, src, non_blocking)

        monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
        CurrentDevice(0).install(monkeypatch)

    def _make(self, device: object = None) -> FakeStream:
        stream = FakeStream(f"copy{len(self.made)}", self.log)
        self.made.append(stream)
        return stream

    @property
    def current(self) -> FakeStream:
        return getattr(self._current, "stream", self.compute)

    def _set(self, stream: FakeStream) -> None:
        self._current.stream = stream


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> Streams:
    return Streams(monkeypatch)


def _pair(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n), torch.arange(float(n))


def test_a_copy_waits_for_compute_runs_on_its_stream_and_restores_the_threads(
    streams: Streams,
) -> None:
    runtime = AcceleratorRuntime(CUDA)
    device, host = _pair()
    runtime.copy_in([(device, host)])
    copy_stream = streams.made[0]
    # The copy stream first waits for the compute queued so far, then copies on itself.
    wait = streams.log.index(("wait_stream", copy_stream, streams.compute))
    assert streams.log.index(("copy", copy_stream)) > wait
    assert streams.current is streams.compute  # switched back, without ``with stream:``
    assert torch.equal(device, host)


def test_copies_from_two_threads_switch_streams_without_shared_state(streams: Streams) -> None:
    # ``with stream:`` keeps the stream it replaced on the shared object: the autograd
    # thread's copies and the main thread's would restore each other's streams (or raise).
    runtime = AcceleratorRuntime(CUDA)
    errors: list[BaseException] = []

    def copies() -> None:
        try:
            for _ in range(50):
                runtime.copy_out([_pair()])
                assert streams.current is streams.compute
        except BaseException as error:  # reported to the main thread
            errors.append(error)

    threads = [threading.Thread(target=copies) for _ in range(2)]
    for thread in threads:
        thread.start()
    copies()
    for thread in threads:
        thread.join()
    assert errors == []


def test_each_half_copies_on_its_own_streams(streams: Streams) -> None:
    # One FIFO stream per direction for both halves held every activation page-in behind
    # the optimizer's prefetch.
    runtime = AcceleratorRuntime(CUDA)
    optimizer = runtime.copy_in([_pair()], queue=OPTIMIZER)
    activation = runtime.copy_in([_pair()], queue=ACTIVATIONS)
    assert optimizer.marks[0][0] is not activation.marks[0][0]
    assert runtime.copy_out([_pair()], queue=OPTIMIZER).marks[0][0] not in (
        optimizer.marks[0][0],
        activation.marks[0][0],
    )
    assert activation.marks[0][0] is runtime.copy_in([_pair()]).marks[0][0]  # the default


def test_a_block_released_in_compute_order_takes_no_record_stream(streams: Streams) -> None:
    # ``record_stream`` kept every staged block out of the pool until the host saw its copy
    # finish: a whole step's batches reserved at once.
    runtime = AcceleratorRuntime(CUDA)
    device, host = _pair()
    ticket = runtime.copy_out([(device, host)], queue=OPTIMIZER)
    copy_stream = ticket.marks[0][0]
    before = len(streams.log)
    runtime.release_ordered(device, (ticket,))
    assert streams.record_streams == []
    # Compute waits for the copy still reading the block before it is freed.
    assert ("wait_event", streams.compute, copy_stream) in streams.log[before:]
    assert device.untyped_storage().nbytes() == 0


def test_host_memory_of_a_queued_copy_lives_until_its_event_completes(streams: Streams) -> None:
    # Nothing tied a host buffer to its copy: an owner dropped right after ``step()`` freed
    # (and unregistered) memory DMA was still writing.
    runtime = AcceleratorRuntime(CUDA)
    device = torch.ones(1024)
    host = torch.empty(1024)
    storage = weakref.ref(host.untyped_storage())
    ticket = runtime.copy_out([(device, host)], queue=OPTIMIZER)
    del host
    gc.collect()
    runtime.copy_out([_pair()])  # a later call lets go of what finished: not this one
    assert storage() is not None
    for _, event, _ in ticket.marks:
        event.complete = True
    runtime.copy_out([_pair()])
    gc.collect()
    assert storage() is None


def test_every_wait_is_queued_where_it_orders(streams: Streams) -> None:
    # A copy in waits for the copies still using its memory; compute waits for a copy in
    # before it reads it; the host waits on the event before it reads host memory.
    runtime = AcceleratorRuntime(CUDA)
    out = runtime.copy_out([_pair()], queue=OPTIMIZER)
    before = len(streams.log)
    into = runtime.copy_in([_pair()], after=(out,), queue=OPTIMIZER)
    in_stream, out_stream = into.marks[0][0], out.marks[0][0]
    assert ("wait_event", in_stream, out_stream) in streams.log[before:]
    before = len(streams.log)
    runtime.wait(into)
    assert streams.log[before:] == [("wait_event", streams.compute, in_stream)]
    event = into.marks[0][1]
    assert not event.query()
    runtime.host_wait(into)
    assert event.query()  # the host blocked on the event itself
