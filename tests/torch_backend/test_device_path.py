"""The accelerator path against CUDA's rules (issue 30), checked on CPU with fakes that
behave as torch does for each case: the runtime's device, per-buffer page locking, the
per-op stream check, the duplex bandwidth, the eviction stall count and the lookup of a
bundled CUDA runtime library."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from swapopt_core import OffloadConfig, OffloadSession, SwapOptimizerConfig, new_plugin_manager
from swapopt_core._activations.residency import HostPool, Residency
from swapopt_core._api import _pick_runtime
from swapopt_core._device import pinned
from swapopt_core._device.accelerator import AcceleratorRuntime
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._device.loopback_async import LoopbackAsyncRuntime
from swapopt_core._device.meter import AllocatorMeter
from swapopt_core._torch.engine import SwapEngine
from tests.fake_accelerator import CurrentDevice
from tests.torch_backend.test_pinned import FakeCudart

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
#: A budget far under the step's activations: the warmup evicts at most ops.
TIGHT = OffloadConfig(
    max_resident_activation_mb=0.05, runtime="loopback", planner="offload-only", min_offload_kib=0
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 1))


def _step(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().mean()
    loss.backward()
    return loss


# ---- (3) the runtime is made for the parameters' device -----------------------------------


class _Placed(torch.Tensor):
    """A parameter that says it lives on ``device`` (no memory anywhere): what
    ``.to(f"cuda:{rank}")`` makes, as far as choosing a runtime looks."""

    @staticmethod
    def __new__(cls, device: torch.device) -> _Placed:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, (4,), device=device, dtype=torch.float32, requires_grad=True
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        raise AssertionError(f"choosing a runtime ran {func}")


@pytest.fixture
def cuda_present(monkeypatch: pytest.MonkeyPatch) -> CurrentDevice:
    """torch reports CUDA with current device 0 (``set_device`` never called)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("cuda"))
    return CurrentDevice(0).install(monkeypatch)


@pytest.mark.parametrize("runtime", ["auto", "cuda"])
def test_the_optimizer_runtime_is_made_for_the_parameters_device(
    cuda_present: CurrentDevice, runtime: str
) -> None:
    cpu = torch.nn.Parameter(torch.zeros(3))  # not the runtime's type: skipped
    opt = torch.optim.AdamW([cpu, _Placed(CUDA1), _Placed(torch.device("cuda", 2))])
    chosen = _pick_runtime(
        opt,
        SwapOptimizerConfig(runtime=runtime),
        new_plugin_manager(load_entrypoints=False),
        SwapEngine,
    )
    assert isinstance(chosen, AcceleratorRuntime)
    assert chosen.device == CUDA1  # was cuda:0, the current device: every rank on GPU 0
    meter = chosen.step_meter()
    assert isinstance(meter, AllocatorMeter) and meter.device == CUDA1
    assert SwapEngine.runtime_device(opt, ("cuda",)) == CUDA1  # the first served parameter
    assert SwapEngine.runtime_device(opt, ("xpu",)) is None


def test_page_locking_runs_on_the_runtimes_device(
    cuda_present: CurrentDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    current = cuda_present
    fake = FakeCudart(error=0)
    on_device: list[int] = []
    register = fake.cudaHostRegister

    def recording(ptr: int, nbytes: int, flags: int) -> int:
        on_device.append(current.index)  # CUDA registers with the current device's context
        return register(ptr, nbytes, flags)

    fake.cudaHostRegister = recording  # type: ignore[method-assign]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    runtime = AcceleratorRuntime(CUDA1)
    runtime.alloc_host(16, torch.float32)
    assert on_device == [1]  # was [0]: a context on GPU 0 in every rank
    assert current.index == 0  # the caller's device is back


# ---- (7) page locking is tried for every buffer --------------------------------------------


class _Flaky(FakeCudart):
    """Registration returns the next code of ``errors`` (then succeeds)."""

    def __init__(self, errors: list[int]) -> None:
        super().__init__()
        self.errors = errors

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.error = self.errors.pop(0) if self.errors else 0
        return super().cudaHostRegister(ptr, nbytes, flags)


def test_each_host_buffer_is_registered_again_after_a_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    CurrentDevice(0).install(monkeypatch)
    fake = _Flaky([2, 0, 2, 0])
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    runtime = AcceleratorRuntime(CUDA0)
    with caplog.at_level(logging.DEBUG, logger="swapopt_core._device.accelerator"):
        buffers = [runtime.alloc_host(8, torch.float32) for _ in range(4)]
    assert fake.registered == 4  # was 1: pageable for good after the first failure
    assert fake.last_error == 0
    assert runtime.pinned_bytes == 2 * 8 * 4
    assert runtime.pageable_buffers(buffers) == 2
    assert runtime.pageable_buffers([buffers[0][:2], buffers[0].view(2, 4)]) == 1  # one buffer
    assert runtime.pageable_buffers(buffers[1::2]) == 0
    levels = [r.levelno for r in caplog.records if "cudaHostRegister failed" in r.message]
    assert levels == [logging.WARNING, logging.DEBUG]  # warned once, then debug
    del buffers
    gc.collect()
    assert not runtime._pageable  # freed buffers leave the count


class _HalfPageable(LoopbackRuntime):
    """Loopback copies; every other host buffer counts as pageable, as the accelerator
    runtime counts those whose registration failed."""

    def __init__(self) -> None:
        super().__init__()
        self._pageable: set[int] = set()
        self.made = 0

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        host = super().alloc_host(numel, dtype)
        self.made += 1
        if self.made % 2:
            self._pageable.add(self._buffer_key(host))
        return host

    pageable_buffers = AcceleratorRuntime.pageable_buffers


def test_offload_stats_count_the_sessions_pageable_host_buffers() -> None:
    runtime = _HalfPageable()
    session = OffloadSession(TIGHT, plugin_manager=new_plugin_manager(load_entrypoints=False))
    session._executor._use(runtime)
    with session:
        _step(_model())
    buffers = session._executor.pool.buffers()
    assert len(buffers) >= 2
    assert session.stats().pinned_fallback_buffers == (len(buffers) + 1) // 2 > 0


# ---- (8a) evictions that stall compute are counted -----------------------------------------


def test_an_eviction_that_copies_out_on_the_spot_counts_a_stall() -> None:
    runtime = LoopbackRuntime()
    residency = Residency(runtime, HostPool(runtime, 2**20))
    kept = [torch.ones(256) for _ in range(3)]
    first, second, third = (residency.track(t.untyped_storage(), i, i) for i, t in enumerate(kept))
    assert residency.evict(first)
    assert residency.eviction_stalls == 1  # copied out and released at once
    residency.copy_out(second)  # a copy out ahead of the release (a plan's COPY_D2H)
    assert residency.evict(second)
    assert residency.eviction_stalls == 1
    assert not first.resident and not second.resident and third.resident
    residency.copy_in(first)
    residency.ready(first)
    assert torch.equal(kept[0], torch.ones(256))


def test_a_session_reports_its_eviction_stalls_and_stays_exact() -> None:
    session = OffloadSession(TIGHT, plugin_manager=new_plugin_manager(load_entrypoints=False))
    model, reference = _model(), _model()
    with session:
        loss = _step(model)
    assert torch.equal(loss, _step(reference))
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    stats = session.stats()
    assert stats.warmups == 1 and stats.eviction_stalls > 0  # the warmup evicts on the spot


# ---- (8b) duplex bandwidth --------------------------------------------------------------


class _Logged(LoopbackRuntime):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def copy_out(self, pairs: Any, *args: Any, **kwargs: Any) -> Any:
        self.log.append("out")
        return super().copy_out(pairs, *args, **kwargs)

    def copy_in(self, pairs: Any, *args: Any, **kwargs: Any) -> Any:
        self.log.append("in")
        return super().copy_in(pairs, *args, **kwargs)

    def host_wait(self, ticket: Any) -> None:
        self.log.append("wait")
        super().host_wait(ticket)


def test_duplex_bandwidth_queues_both_directions_before_waiting() -> None:
    runtime = _Logged()
    d2h, h2d = runtime.measure_duplex_bandwidth(nbytes=2**16, repeats=2)
    assert d2h > 0 and h2d > 0
    assert runtime.log == ["out", "in", "wait", "wait"] * 6  # 3 rounds, each direction first
    assert runtime.pinned_bytes == 0  # its host buffers are gone again
    single = runtime.measure_bandwidth(nbytes=2**16, repeats=2)  # unchanged: two floats
    assert isinstance(single, tuple) and len(single) == 2


def test_duplex_bandwidth_through_copy_lanes() -> None:
    d2h, h2d = LoopbackAsyncRuntime().measure_duplex_bandwidth(nbytes=2**16, repeats=2)
    assert d2h > 0 and h2d > 0


# ---- (8c) the per-op stream check is cheap ----------------------------------------------


def test_the_per_op_stream_check_builds_no_stream_object(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"current": "main", "capturing": False}
    ids: dict[str, int] = {}
    built: list[object] = []

    def current_stream(device: object = None) -> str:
        built.append(device)  # torch builds a new torch.Stream object here
        return state["current"]

    def stream_data(index: int) -> tuple[int, int, int]:
        # What torch._C._cuda_getCurrentStream returns: (stream id, device index, type).
        return (ids.setdefault(state["current"], len(ids)), index, 1)

    monkeypatch.setattr(torch.accelerator, "current_stream", current_stream)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", stream_data, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    runtime = AcceleratorRuntime(CUDA0)
    check = runtime.begin_entry(CUDA0)
    assert check is not None
    for _ in range(1000):
        check()
    assert len(built) <= 2  # was 1001: one torch.Stream per op
    state["current"] = "side"
    with pytest.raises(RuntimeError, match="on CUDA stream side, but the session's entry"):
        check()
    state["current"], state["capturing"] = "main", True
    with pytest.raises(RuntimeError, match="CUDA graph was being captured"):
        check()


# ---- (8d) a bundled CUDA runtime library --------------------------------------------------


def test_a_bundled_cudart_is_found_through_the_process_maps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bundled = "/opt/build/lib/libcudart-5b2a3c4d.so.12"
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 11 /usr/lib/libc.so.6\n"
        f"7f02-7f03 r-xp 00000000 08:01 12 {bundled}\n"
        f"7f03-7f04 r--p 00010000 08:01 12 {bundled}\n"
        "7f05-7f06 rw-p 00000000 00:00 0\n"
        "7ffd-7ffe rw-p 00000000 00:00 0 [stack]\n"
    )
    fake = FakeCudart(error=2, can_clear=False)
    opened: list[tuple[str, int]] = []

    class Library:
        cudaGetLastError = staticmethod(fake._get_last_error)  # noqa: N815

    def dlopen(name: str, mode: int = 0) -> Library:
        # dlopen with RTLD_NOLOAD finds only a library already loaded: here the bundled one.
        opened.append((name, mode))
        if name != bundled or not mode & os.RTLD_NOLOAD:
            raise OSError(f"{name}: cannot open shared object file")
        return Library()

    monkeypatch.setattr(pinned, "_MAPS_PATH", str(maps))
    monkeypatch.setattr(pinned, "_CUDART_NAMES", ("libcudart.so.12",))
    monkeypatch.setattr(ctypes, "CDLL", dlopen)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    _, error = pinned.alloc_pinned(4, torch.float32)
    assert error == 2
    assert fake.last_error == 0  # was left set: the next kernel launch raised it
    assert [name for name, _ in opened] == ["libcudart.so.12", bundled]
    assert all(mode & os.RTLD_NOLOAD for _, mode in opened)  # never loaded anew


def test_no_maps_file_means_no_bundled_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(pinned, "_MAPS_PATH", str(tmp_path / "absent"))
    assert pinned._mapped_cudart_paths() == []
