"""The device runtimes without a device: the accelerator runtime imports and constructs on a
CPU-only machine, and the registry shares one instance per class and device."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from swapopt_core._device import accelerator
from swapopt_core._device.accelerator import AcceleratorRuntime, accelerator_runtime
from swapopt_core._device.lanes import ENV_JITTER_US
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._device.loopback_async import LoopbackAsyncRuntime
from swapopt_core._device.registry import shared_runtime


def test_the_accelerator_runtime_constructs_without_a_device() -> None:
    runtime = AcceleratorRuntime(torch.device("cuda", 0))  # no stream is made yet
    assert runtime.name == "cuda" and runtime.device_types == ("cuda",)
    assert runtime.serves(torch.device("cuda", 1)) and not runtime.serves(torch.device("cpu"))
    assert runtime.stamps_need_sync and runtime.pinned_bytes == 0


@pytest.mark.skipif(torch.accelerator.is_available(), reason="an accelerator is present")
def test_without_an_accelerator_the_named_runtime_names_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"runtime='cuda' but CUDA is not available.*loopback"):
        AcceleratorRuntime.create(None)


def test_the_class_is_registered_under_the_accelerator_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    accelerator_runtime.cache_clear()
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    try:
        xpu = accelerator_runtime()
        assert issubclass(xpu, AcceleratorRuntime) and xpu is not AcceleratorRuntime
        assert (xpu.name, xpu.device_types) == ("xpu", ("xpu",))
        assert xpu(torch.device("xpu", 0)).serves(torch.device("xpu", 0))
    finally:
        accelerator_runtime.cache_clear()
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    try:
        assert accelerator_runtime() is AcceleratorRuntime  # CUDA and ROCm: "cuda"
    finally:
        accelerator_runtime.cache_clear()
    assert accelerator.__name__ == "swapopt_core._device.accelerator"


def test_one_instance_per_class_and_device_while_it_is_used() -> None:
    cuda0 = shared_runtime(AcceleratorRuntime, torch.device("cuda", 0))
    assert shared_runtime(AcceleratorRuntime, torch.device("cuda", 0)) is cuda0
    assert shared_runtime(AcceleratorRuntime, torch.device("cuda", 1)) is not cuda0
    loopback = shared_runtime(LoopbackRuntime)
    assert shared_runtime(LoopbackRuntime, torch.device("cpu")) is loopback  # CPU is one device
    mine = type("Mine", (LoopbackRuntime,), {"name": "mine"})
    held = weakref.ref(shared_runtime(mine))
    gc.collect()
    assert held() is None  # held weakly: nobody uses it, so it is gone


def test_lane_settings_are_read_when_an_instance_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_JITTER_US, raising=False)
    calm = shared_runtime(LoopbackAsyncRuntime)
    assert shared_runtime(LoopbackAsyncRuntime) is calm
    monkeypatch.setenv(ENV_JITTER_US, "7")
    jittered = shared_runtime(LoopbackAsyncRuntime)
    assert jittered is not calm and jittered.settings.jitter_us == 7


def test_each_owner_reports_its_own_pinned_bytes() -> None:
    runtime = LoopbackRuntime()
    mine = runtime.alloc_host(256, torch.float32)
    theirs = runtime.alloc_host(64, torch.float32)
    assert runtime.pinned_bytes == 320 * 4
    assert runtime.pinned_nbytes([mine[:10], mine.view(16, 16)]) == 256 * 4  # one buffer once
    assert runtime.pinned_nbytes([theirs]) == 64 * 4
    del theirs
    gc.collect()
    assert runtime.pinned_bytes == 256 * 4
