"""Which runtime moves the activations: ``runtime="auto"`` follows the device they are on."""

from __future__ import annotations

import pytest
import torch

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._activations.entry import _device_of
from swapopt_core._activations.runtime import ActivationRuntime, choose_runtime
from tests.activations.test_session import Wide


@pytest.fixture
def cuda_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA says it is there, and anything that would really use it fails the test."""

    def touched(*args: object, **kwargs: object) -> None:
        raise AssertionError("CUDA was used for CPU activations")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("current_device", "Stream", "Event", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, touched)


def test_auto_offloads_cpu_activations_where_cuda_is_available(cuda_claimed: None) -> None:
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(0))
    reference, offloaded = Wide(), Wide()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.5, min_offload_kib=0))
    for _ in range(2):
        for model in (reference, offloaded):
            model.zero_grad()
        reference(x).backward()
        with session:
            offloaded(x).backward()
        for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
    stats = session.stats()
    assert stats.d2h_bytes > 0 and stats.h2d_bytes > 0  # the CPU activations moved
    assert stats.last_peak_resident_activation_bytes < 2048 * 64 * 4 * 8  # under the natural
    assert (stats.warmups, stats.replays) == (1, 1)


def test_auto_follows_the_device_of_the_first_tensor(cuda_claimed: None) -> None:
    for device in ("cpu", "meta"):
        assert type(choose_runtime("auto", torch.device(device))) is ActivationRuntime
    assert type(choose_runtime("loopback")) is ActivationRuntime
    cpu, meta, cuda = torch.ones(2), torch.ones(2, device="meta"), torch.device("cuda", 1)
    assert _device_of(((cpu, meta), {})) == torch.device("cpu")
    assert _device_of(((cpu,), {"device": cuda})) == cuda  # x.to("cuda") makes CUDA activations
    assert _device_of(((), {"size": [2], "device": torch.device("meta")})) == torch.device("cpu")
    assert _device_of(((), {"size": [2], "device": None})) == torch.device("cpu")


def test_cuda_without_cuda_fails_at_entry_and_names_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    session = OffloadSession(OffloadConfig(runtime="cuda"))
    with pytest.raises(RuntimeError, match=r"runtime='cuda' but CUDA is not available.*'loopback'"):
        session.__enter__()
    with OffloadSession(OffloadConfig(runtime="loopback")):  # nothing was left active
        pass
