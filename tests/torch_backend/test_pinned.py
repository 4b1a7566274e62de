"""The pinning helper after a failed ``cudaHostRegister``, with a fake CUDA runtime binding.

A failed registration leaves CUDA's last error set; unless it is cleared, the next kernel
launch reports it as its own and the documented pageable fallback crashes.
"""

from __future__ import annotations

import logging

import pytest
import torch

from swapopt_core._device import pinned
from swapopt_core._device.accelerator import AcceleratorRuntime
from tests.fake_accelerator import CurrentDevice


class FakeCudart:
    """Registration fails with ``error``, which stays 'last' until read, as in CUDA."""

    def __init__(self, error: int = 2, *, can_clear: bool = True) -> None:
        self.error = error
        self.last_error = 0
        self.registered = 0
        if can_clear:
            self.cudaGetLastError = self._get_last_error

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.registered += 1
        self.last_error = self.error
        return self.error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return 0

    def _get_last_error(self) -> int:
        error, self.last_error = self.last_error, 0
        return error


def test_a_failed_registration_clears_the_sticky_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart(error=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    host, error = pinned.alloc_pinned(16, torch.float32)
    assert error == 2
    assert host.numel() == 16 and host.dtype == torch.float32
    assert fake.last_error == 0  # before: left set, and the next kernel launch raised


def test_without_a_binding_the_loaded_runtime_library_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCudart(error=2, can_clear=False)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(pinned, "_loaded_cudart_function", lambda name: fake._get_last_error)
    pinned.alloc_pinned(4, torch.float32)
    assert fake.last_error == 0


def test_no_runtime_library_loaded_is_a_warning_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeCudart(error=2, can_clear=False)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(pinned, "_CUDART_NAMES", ("libswapopt-no-such-cudart.so",))
    with caplog.at_level(logging.WARNING, logger=pinned.__name__):
        _, error = pinned.alloc_pinned(4, torch.float32)
    assert error == 2
    assert "could not clear CUDA's last error" in caplog.text


def test_the_cuda_runtime_tries_every_buffer_warns_once_and_counts_the_pageable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    CurrentDevice(0).install(monkeypatch)
    fake = FakeCudart(error=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    runtime = AcceleratorRuntime(torch.device("cuda", 0))  # constructs without a GPU
    with caplog.at_level(logging.WARNING):
        buffers = [runtime.alloc_host(8, torch.float32) for _ in range(3)]
    assert fake.registered == 3
    assert fake.last_error == 0
    assert sum("cudaHostRegister failed" in r.message for r in caplog.records) == 1
    assert all(b.numel() == 8 for b in buffers)
    assert runtime.pinned_bytes == 0
    assert runtime.pageable_buffers(buffers) == 3
