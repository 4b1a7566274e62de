"""swap_stats is honest: it matches what the runtime really allocated and moved."""

from __future__ import annotations

import pytest
import torch

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats
from swapopt_core._device.loopback import LoopbackRuntime


class _Ledger:
    """Counts live device bytes from the runtime's own allocations and releases."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tensors: list[torch.Tensor] = []
        self.live = self.peak = 0
        alloc, release = LoopbackRuntime.alloc_device, LoopbackRuntime.release_device

        def alloc_device(runtime, numel, dtype, device):  # noqa: ANN001, ANN202
            tensor = alloc(runtime, numel, dtype, device)
            self.tensors.append(tensor)
            self.live += tensor.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
            return tensor

        def release_device(runtime, tensor, after=()):  # noqa: ANN001, ANN202
            self.live -= tensor.untyped_storage().nbytes()
            release(runtime, tensor, after)

        monkeypatch.setattr(LoopbackRuntime, "alloc_device", alloc_device)
        monkeypatch.setattr(LoopbackRuntime, "release_device", release_device)


def _layers(n: int = 32, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n)])


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("packed", [True, False])
def test_peak_and_traffic_on_32_equal_layers(monkeypatch: pytest.MonkeyPatch, packed: bool) -> None:
    ledger = _Ledger(monkeypatch)
    model = _layers()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    swap_optimizer(opt, SwapOptimizerConfig(swap_times=8, runtime="loopback", packed_swap=packed))
    state_bytes = 32 * 64 * 64 * 4 * 2  # exp_avg and exp_avg_sq, fp32
    for step in range(1, 4):
        _step(model, opt)
        stats = swap_stats(opt)
        assert stats.total_state_bytes == state_bytes
        assert stats.swapped_tensors == 64
        assert stats.batches == 8
        # Between steps nothing swapped is on the device, and the runtime agrees.
        assert stats.resident_state_bytes == 0
        assert ledger.live == 0
        assert all(t.untyped_storage().nbytes() == 0 for t in ledger.tensors)
        assert stats.h2d_bytes == stats.d2h_bytes == step * state_bytes
    assert stats.peak_resident_state_bytes == ledger.peak
    # Three batches at the peak: one coming in, one updating, one going out.
    assert stats.peak_resident_state_bytes == 3 * stats.total_state_bytes // 8
    assert stats.host_state_bytes == state_bytes
    if packed:
        assert stats.pinned_host_bytes <= 1.05 * state_bytes


@pytest.mark.parametrize("packed", [True, False])
def test_state_between_steps_is_host_memory_not_device_storage(
    monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    ledger = _Ledger(monkeypatch)
    model = _layers(4)
    opt = torch.optim.Adam(model.parameters())
    swap_optimizer(opt, SwapOptimizerConfig(swap_times=2, runtime="loopback", packed_swap=packed))
    _step(model, opt)
    device_ptrs = {t.untyped_storage().data_ptr() for t in ledger.tensors}
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].device.type == "cpu"
            assert state[key].untyped_storage().nbytes() > 0
            assert state[key].untyped_storage().data_ptr() not in device_ptrs


def test_state_created_before_install_is_offloaded_at_install() -> None:
    model = _layers(4)
    opt = torch.optim.Adam(model.parameters())
    _step(model, opt)
    before = {id(v) for s in opt.state.values() for v in s.values()}
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", min_numel=0))
    stats = swap_stats(opt)
    assert stats.swapped_tensors == 8
    assert stats.resident_state_bytes == 0 and stats.steps == 0
    after = {id(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")}
    assert not before & after  # every swapped entry was replaced by its host copy


def test_tiny_states_stay_resident_and_are_not_counted() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)  # weight 4096 elements, bias 64
    opt = torch.optim.Adam(model.parameters())
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", min_numel=1024))
    opt.zero_grad()
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    stats = swap_stats(opt)
    assert stats.swapped_tensors == 2
    assert stats.total_state_bytes == 2 * 4096 * 4


def test_packed_entries_are_pieces_of_one_buffer_that_save_on_their_own() -> None:
    import io

    model = _layers(8)
    opt = torch.optim.Adam(model.parameters())
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", packed_swap=True))
    _step(model, opt)
    entries = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    spans = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in entries)
    # One contiguous host buffer, carved into one storage per entry (each at offset 0).
    assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all(t.storage_offset() == 0 for t in entries)
    buffer = io.BytesIO()
    torch.save(entries[0], buffer)
    assert len(buffer.getvalue()) < 2 * entries[0].numel() * entries[0].element_size()


@pytest.mark.parametrize("packed", [True, False])
def test_state_moved_back_by_a_framework_is_offloaded_on_request(packed: bool) -> None:
    from swapopt_core import offload_optimizer_state

    model = _layers(4)
    opt = torch.optim.Adam(model.parameters())
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", packed_swap=packed))
    _step(model, opt)
    before = opt.state_dict()
    for state in opt.state.values():  # what Lightning's _optimizer_to_device does
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = state[key].clone()
    assert offload_optimizer_state(opt) == 8
    assert offload_optimizer_state(opt) == 0
    assert offload_optimizer_state(torch.optim.Adam(_layers(1).parameters())) == 0
    after = opt.state_dict()
    for index, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(value, after["state"][index][key])
    assert swap_stats(opt).resident_state_bytes == 0
