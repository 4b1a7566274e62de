"""Host state edited between backward and the step: the step sees the edit.

The prefetch during backward copies the first batches in before the step; an edit made
after that (zeroing ``exp_avg`` after a loss spike, say, once ``swap_stats`` says the copies
are done) must still be what the step updates from.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats
from tests.conftest import ASYNC_JITTER_US


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])


def _backward(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def _edit(opt: torch.optim.Optimizer, how: str) -> None:
    """Edit every parameter's moments in place, the ways a user would."""
    for state in opt.state.values():
        if how == "zero":
            state["exp_avg"].zero_()
        elif how == "scale":
            with torch.no_grad():
                state["exp_avg_sq"].mul_(0.25)
        else:  # copy_ from a tensor computed elsewhere
            state["exp_avg"].copy_(torch.full_like(state["exp_avg"], 0.01))


@pytest.mark.parametrize("runtime", ["loopback", "loopback-async"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
@pytest.mark.parametrize("how", ["zero", "scale", "copy"])
def test_an_edit_after_backward_is_what_the_step_updates(
    monkeypatch: pytest.MonkeyPatch, runtime: str, packed: bool, how: str
) -> None:
    # Before: the step updated from the copy the prefetch had brought in during backward.
    monkeypatch.setenv("SWAPOPT_LOOPBACK_JITTER_US", ASYNC_JITTER_US)
    plain_model, model = _mlp(), _mlp()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = SwapOptimizerConfig(runtime=runtime, min_numel=0, swap_times=3, packed_swap=packed)
    swap_optimizer(opt, config)
    for step in range(4):
        for m, o in ((plain_model, plain), (model, opt)):
            _backward(m, o, step)
            if o is opt:
                swap_stats(opt)  # the copies are done: host state may be edited now
                assert step == 0 or swap_stats(opt).resident_state_bytes > 0  # prefetched
            if step == 2:
                _edit(o, how)
            o.step()
    swap_stats(opt)
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain.state[a][key], opt.state[b][key]), key
    # Only the edited batches were copied again: at most the two prefetched ones.
    stats = swap_stats(opt)
    assert 4 * stats.total_state_bytes < stats.h2d_bytes < 5 * stats.total_state_bytes


def test_without_an_edit_nothing_is_copied_twice() -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback-async", min_numel=0, swap_times=3))
    for step in range(4):
        _backward(model, opt, step)
        _ = [state["exp_avg"].sum() for state in opt.state.values()]  # reads are not edits
        opt.step()
    stats = swap_stats(opt)
    assert stats.h2d_bytes == 4 * stats.total_state_bytes


@pytest.fixture
def one_rank(tmp_path) -> object:  # noqa: ANN001
    """A one-process gloo group and its device mesh, for DTensor state."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("runtime", ["loopback", "loopback-async"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_an_edit_of_dtensor_state_after_backward_is_seen(
    one_rank: object, runtime: str, packed: bool
) -> None:
    """Under FSDP2 the state entries are DTensors over the host tensors: an in-place edit
    of one moves the DTensor's version counter, not its local tensor's."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def params() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [
            torch.nn.Parameter(distribute_tensor(torch.randn(n), one_rank, [Shard(0)]))
            for n in (64, 48, 32, 16)
        ]

    plain_params, swapped_params = params(), params()
    plain = torch.optim.Adam(plain_params, lr=1e-2)
    opt = torch.optim.Adam(swapped_params, lr=1e-2)
    config = SwapOptimizerConfig(runtime=runtime, min_numel=0, swap_times=2, packed_swap=packed)
    swap_optimizer(opt, config)
    for step in range(3):
        for ps, o in ((plain_params, plain), (swapped_params, opt)):
            o.zero_grad()
            sum((p * (k + step + 1)).square().sum() for k, p in enumerate(ps)).backward()
            if o is opt:
                swap_stats(opt)
            if step == 2:
                for state in o.state.values():
                    state["exp_avg"].zero_()
            o.step()
    swap_stats(opt)
    for a, b in zip(plain_params, swapped_params, strict=True):
        assert torch.equal(a.to_local(), b.to_local())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain.state[a][key].to_local(), opt.state[b][key].to_local())
