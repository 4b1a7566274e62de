"""The CUDA runtime, run where a CUDA device is present (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA"),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).cuda()


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("flags", [{}, {"foreach": True}, {"fused": True}, {"amsgrad": True}])
def test_cuda_swap_is_bit_exact_and_leaves_nothing_resident(packed: bool, flags: dict) -> None:
    plain_model, swapped_model = _model(), _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3, **flags)
    swapped = torch.optim.AdamW(swapped_model.parameters(), lr=1e-3, **flags)
    swap_optimizer(swapped, SwapOptimizerConfig(swap_times=4, packed_swap=packed))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(10):
        x = torch.randn(32, 256, device="cuda", generator=gen)
        for model, opt in ((plain_model, plain), (swapped_model, swapped)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        stats = swap_stats(swapped)
        assert stats.runtime == "cuda" and stats.resident_state_bytes == 0
    for a, b in zip(plain_model.parameters(), swapped_model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in plain.state[a].items():
            host = swapped.state[b][key]
            assert torch.equal(value.cpu(), host.cpu()), key
            if key != "step" and host.numel() >= 1024:
                assert host.device.type == "cpu" and host.is_pinned()
    assert stats.pinned_host_bytes <= 1.05 * stats.total_state_bytes


def test_cuda_device_memory_of_swapped_state_is_freed_between_steps() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    swap_optimizer(opt, SwapOptimizerConfig(swap_times=4))
    x = torch.randn(32, 256, device="cuda")
    model(x).sum().backward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    # Only tiny (below min_numel) states and step counters may remain on the device.
    assert torch.cuda.memory_allocated() - before < 64 * 1024
    # Three of the four batches at the peak: one coming in, one updating, one going out.
    assert swap_stats(opt).peak_resident_state_bytes <= 0.76 * swap_stats(opt).total_state_bytes


def test_cuda_activation_offload_is_bit_exact_and_within_budget() -> None:
    from swapopt_core import OffloadConfig, OffloadSession

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(8)]
        ).cuda()

    reference, offloaded = net(), net()
    x = torch.randn(4096, 1024, device="cuda")
    session = OffloadSession(
        OffloadConfig(max_resident_activation_mb=96, runtime="cuda", min_offload_kib=64)
    )
    for step in range(4):
        for model in (reference, offloaded):
            model.zero_grad()
        reference(x * (step + 1)).square().mean().backward()
        with session:
            offloaded(x * (step + 1)).square().mean().backward()
        for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
    stats = session.stats()
    assert stats.replays == 3 and stats.d2h_bytes > 0
    assert stats.last_peak_resident_activation_bytes <= 1.15 * 96 * 2**20 + 64 * 2**20


@pytest.mark.parametrize("packed", [True, False])
def test_cuda_resident_part_and_reconfigure_are_bit_exact(packed: bool) -> None:
    """Half the state resident for good, then all swapped, then a quarter: bit for bit."""
    import dataclasses

    from swapopt_core._api import reconfigure_swap
    from swapopt_core._swap.engine import engine_of

    plain_model, swapped_model = _model(), _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    swapped = torch.optim.AdamW(swapped_model.parameters(), lr=1e-3)
    config = SwapOptimizerConfig(swap_times=4, packed_swap=packed, resident_state_fraction=0.5)
    swap_optimizer(swapped, config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(9):
        if step in (3, 6):
            fraction = 0.0 if step == 3 else 0.25
            config = dataclasses.replace(config, resident_state_fraction=fraction)
            reconfigure_swap(swapped, config)
        x = torch.randn(32, 256, device="cuda", generator=gen)
        for model, opt in ((plain_model, plain), (swapped_model, swapped)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        stats = swap_stats(swapped)
        assert stats.resident_state_bytes == stats.resident_for_good_bytes
        assert (stats.resident_for_good_bytes > 0) == (config.resident_state_fraction > 0)
    for a, b in zip(plain_model.parameters(), swapped_model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in plain.state[a].items():
            assert torch.equal(value.cpu(), swapped.state[b][key].cpu()), key
    costs = engine_of(swapped).costs()
    assert costs is not None and costs.update_ms_per_byte > 0
