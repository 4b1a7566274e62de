"""The Ascend runtime's buffer release, with fake copy tickets (no Ascend device here).

A device buffer released right after its copy out was queued must stay alive until that
copy's ticket completes: MindSpore's pool could otherwise give the memory to compute while
the copy stream still reads it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

from swapopt_core._mindspore import runtime as runtime_module  # noqa: E402

pytestmark = pytest.mark.mindspore


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class FakeStream:
    def __init__(self, events: list[FakeEvent]) -> None:
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.done = True


class OfflineAscend(runtime_module.MindSporeAscendRuntime):
    """The real runtime with its stream and events replaced by fakes."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[FakeEvent] = []
        self._stream = FakeStream(self.events)

    def _on_stream(self, pairs, inward):  # noqa: ANN001, ANN202
        event = FakeEvent()
        self.events.append(event)
        return event


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> OfflineAscend:
    monkeypatch.setattr(runtime_module, "_warned_unverified", True)
    return OfflineAscend()


def test_a_buffer_is_held_until_its_copy_out_completes(runtime: OfflineAscend) -> None:
    buffer = object()
    ticket = runtime.copy_out([(buffer, object())])
    runtime.release_device(buffer)
    assert runtime.held_buffers == 1  # before: dropped while the copy could still read it
    ticket.done = True
    runtime.release_device(object())  # the next release reaps finished tickets
    assert runtime.held_buffers == 0


def test_synchronize_lets_every_held_buffer_go(runtime: OfflineAscend) -> None:
    for _ in range(3):
        runtime.copy_out([])
        runtime.release_device(object())
    assert runtime.held_buffers == 3
    runtime.synchronize()
    assert runtime.held_buffers == 0


def test_nothing_is_held_once_the_copies_have_finished(runtime: OfflineAscend) -> None:
    runtime.release_device(object())  # no copy out yet
    ticket = runtime.copy_out([])
    ticket.done = True
    runtime.release_device(object())
    assert runtime.held_buffers == 0
