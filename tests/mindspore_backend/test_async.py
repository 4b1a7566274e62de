"""MindSpore's ``loopback-async`` runtime on its own: tickets, ordered releases, failures.

The equivalence, checkpoint and fault suites run whole steps on it with jitter
(test_mindspore.py, test_faults.py); these tests pin what a step rarely shows: a release
ordered after a copy that is still running, and a copy that fails on its lane.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import Parameter, Tensor, nn  # noqa: E402

from swapopt_core import SwapOptimizerConfig, swap_optimizer  # noqa: E402
from swapopt_core._device.lanes import CopyFailed  # noqa: E402
from swapopt_core._mindspore.loopback_async import MindSporeLoopbackAsyncRuntime  # noqa: E402
from swapopt_core._mindspore.runtime import MindSporeLoopbackRuntime  # noqa: E402
from swapopt_core._swap.engine import engine_of  # noqa: E402

pytestmark = pytest.mark.mindspore

NUMEL = 16384  # 64 KiB of float32


@pytest.fixture(autouse=True)
def _pynative_cpu():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


def _params() -> list[Parameter]:
    rng = np.random.default_rng(0)
    return [
        Parameter(Tensor(rng.standard_normal((32, 16)).astype(np.float32)), name=f"w{i}")
        for i in range(3)
    ]


def _pair(runtime: MindSporeLoopbackRuntime, numel: int = NUMEL) -> tuple[object, object, object]:
    """A device buffer, and a device and a host view of ``numel`` floats."""
    device = runtime.alloc_device(numel, ms.float32, "CPU")
    host = runtime.alloc_host(numel, ms.float32)
    return device, runtime.view(device, 0, numel, (numel,)), runtime.view(host, 0, numel, (numel,))


def test_the_name_selects_it_for_a_mindspore_optimizer() -> None:
    opt = nn.Adam(_params(), learning_rate=1e-2)
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback-async", min_numel=0))
    assert type(engine_of(opt).runtime) is MindSporeLoopbackAsyncRuntime
    opt(tuple(Tensor(np.ones((32, 16), np.float32)) for _ in range(3)))
    assert engine_of(opt).steps == 1


def test_a_released_buffer_is_reused_only_after_the_copy_that_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SWAPOPT_LOOPBACK_GBPS", "0.001")  # 1 MB/s: 64 KiB take 64 ms
    runtime = MindSporeLoopbackAsyncRuntime()
    device, device_view, host_view = _pair(runtime)
    device[:] = 3.0
    ticket = runtime.copy_out([(device_view, host_view)])
    runtime.release_device(device, (ticket,))
    assert not ticket.done()
    # Still being read: a request of the same size gets other memory.
    other = runtime.alloc_device(NUMEL, ms.float32, "CPU")
    assert not np.shares_memory(other, device)
    runtime.host_wait(ticket)
    runtime.synchronize()  # the release queued behind the copy has run too
    assert np.array_equal(host_view.asnumpy(), np.full(NUMEL, 3.0, np.float32))
    again = runtime.alloc_device(NUMEL, ms.float32, "CPU")
    assert np.shares_memory(again, device)


def test_a_copy_that_fails_on_its_lane_is_reported_and_keeps_its_memory() -> None:
    runtime = MindSporeLoopbackAsyncRuntime()
    device, device_view, _ = _pair(runtime)
    host = runtime.view(runtime.alloc_host(NUMEL + 1, ms.float32), 0, NUMEL + 1, (NUMEL + 1,))
    ticket = runtime.copy_out([(device_view, host)])  # the shapes differ: fails on the lane
    runtime.release_device(device, (ticket,))
    runtime.synchronize()
    assert isinstance(runtime.failure(ticket), ValueError)
    assert runtime.failure(None) is None
    again = runtime.alloc_device(NUMEL, ms.float32, "CPU")
    assert not np.shares_memory(again, device)  # the only copy of an update is not reused


@pytest.mark.parametrize("runtime_type", [MindSporeLoopbackRuntime, MindSporeLoopbackAsyncRuntime])
def test_staging_memory_is_reused_across_steps(runtime_type: type) -> None:
    runtime = runtime_type()
    device, _, _ = _pair(runtime)
    runtime.release_device(device)
    runtime.synchronize()
    assert np.shares_memory(runtime.alloc_device(NUMEL, ms.float32, "CPU"), device)
    assert not np.shares_memory(runtime.alloc_device(NUMEL, ms.float32, "CPU"), device)


def test_bad_lane_settings_are_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opt = nn.Adam(_params(), learning_rate=1e-2)
    for name, value in (("SWAPOPT_LOOPBACK_GBPS", "fast"), ("SWAPOPT_LOOPBACK_JITTER_US", "-1")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name}='{value}' is invalid"):
            swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback-async", min_numel=0))
        monkeypatch.delenv(name)
    assert engine_of(opt) is None


def test_a_copy_out_that_fails_on_its_lane_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    import swapopt_core._mindspore.loopback_async as lanes

    original, calls = lanes._copy, [0]

    def flaky(moves):  # noqa: ANN001, ANN202
        if threading.current_thread().name == "swapopt-d2h":
            calls[0] += 1
            if calls[0] == 1:  # the first copy out of the first step
                raise OSError("copy failed on its lane")
        return original(moves)

    monkeypatch.setattr(lanes, "_copy", flaky)
    ref_params, params = _params(), _params()
    ref, opt = nn.Adam(ref_params, learning_rate=1e-2), nn.Adam(params, learning_rate=1e-2)
    config = SwapOptimizerConfig(runtime="loopback-async", min_numel=0, swap_times=3)
    swap_optimizer(opt, config)
    for step in range(3):
        grads = tuple(Tensor(np.full((32, 16), step + 1.0, np.float32)) for _ in range(3))
        ref(grads)
        try:
            opt(grads)
        except CopyFailed:
            opt(grads)  # an error may be raised; the retry must then finish the step
    for a, b in zip(ref_params, params, strict=True):
        assert np.array_equal(a.asnumpy(), b.asnumpy())
