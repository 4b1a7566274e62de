"""Residency on the asynchronous loopback runtime: host buffers come back to the pool with
their copies' tickets (no host wait), and a writer waits for a copy out still reading."""

from __future__ import annotations

import torch

from swapopt_core._activations.residency import HostPool, Residency
from swapopt_core._device.lanes import LaneSettings
from swapopt_core._device.loopback_async import LoopbackAsyncRuntime

#: Slow enough that a 4 MiB copy is still running when the next line runs (about 40 ms).
_SLOW = LaneSettings(gbps=0.1)
_NBYTES = 4 * 2**20


def _residency() -> tuple[Residency, torch.Tensor]:
    runtime = LoopbackAsyncRuntime(_SLOW)
    residency = Residency(runtime, HostPool(runtime, 1 << 30))
    tensor = torch.arange(_NBYTES, dtype=torch.uint8)
    residency.track(tensor.untyped_storage(), 1, 0)
    return residency, tensor


def test_a_host_buffer_goes_back_with_its_ticket_and_is_reused_once_done() -> None:
    residency, tensor = _residency()
    entry = residency.by_sid[1]
    assert residency.copy_out(entry)
    ticket = entry.d2h
    residency.release_host(entry)  # the copy still runs: no host wait here
    assert entry.host is None
    host = residency.pool.acquire(_NBYTES)  # the only buffer: waits for its copy first
    assert ticket.done()
    assert torch.equal(host, tensor)  # the copy finished before the buffer was handed out
    residency.runtime.synchronize()


def test_a_write_waits_for_a_copy_out_still_reading() -> None:
    residency, tensor = _residency()
    entry = residency.by_sid[1]
    assert residency.copy_out(entry)
    residency.written(entry)
    assert entry.d2h.done() and not entry.host_valid
    tensor.fill_(7)  # the write the op makes: the copy out saw the old bytes only
    assert torch.equal(entry.host, torch.arange(_NBYTES, dtype=torch.uint8))
    residency.runtime.synchronize()
