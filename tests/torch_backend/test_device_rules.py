"""The emulated device keeps CUDA's rules of memory and order, and the swap keeps within them.

``loopback-async`` is held to be at least as strict as a GPU where memory is decided: a copy
is finished for the host only once it waited for it, a block freed while copies still use
it (``record_stream``) is not reused before that, host memory is kept alive by nobody but
the code, each copy queue is FIFO. Under those rules the optimizer's step reserves three
staged batches, not all of them; the prefetch does not hold back activation copies; a
dropped optimizer's last copies never write freed host memory. Each test here failed
before the fix it guards (see the note on each).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from swapopt_core import (
    OffloadConfig,
    OffloadSession,
    SwapOptimizerConfig,
    swap_optimizer,
    swap_stats,
)
from swapopt_core._device.interface import ACTIVATIONS, OPTIMIZER, HostKeeper
from swapopt_core._device.lanes import ENV_GBPS
from swapopt_core._device.loopback_async import LoopbackAsyncRuntime
from swapopt_core._swap.engine import engine_of

SWAP_TIMES = 16
STEPS = 10


def _layers(seed: int = 0) -> torch.nn.Module:
    """Equal layers: the state cuts into 16 batches of equal bytes."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(32)])


def _backward(model: torch.nn.Module, step: int) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()


def _assert_equal(plain: torch.optim.Optimizer, swapped: torch.optim.Optimizer) -> None:
    for group_a, group_b in zip(plain.param_groups, swapped.param_groups, strict=True):
        for p, q in zip(group_a["params"], group_b["params"], strict=True):
            assert torch.equal(p, q)
    state_a, state_b = plain.state_dict()["state"], swapped.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key, entry in state_a.items():
        for name, value in entry.items():
            assert torch.equal(value, state_b[key][name]), (key, name)


def _train(*, prefetch: bool = False, budget_mb: float | None = None) -> tuple:
    """Ten steps of plain AdamW and of the swapped one on a 0.5 GB/s emulated link."""
    plain_model, model = _layers(), _layers()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = None
    if budget_mb is None:
        config = SwapOptimizerConfig(
            runtime="loopback-async",
            swap_times=SWAP_TIMES,
            min_numel=0,
            prefetch_during_backward=prefetch,
        )
        swap_optimizer(opt, config)
    else:
        session = OffloadSession(
            OffloadConfig(device_budget_mb=budget_mb, runtime="loopback-async", min_offload_kib=0),
            optimizer=opt,
        )
    for step in range(STEPS):
        for m, o in ((plain_model, plain), (model, opt)):
            o.zero_grad()
            if session is not None and o is opt:
                with session:
                    _backward(m, step)
            else:
                _backward(m, step)
            o.step()
    return plain, opt


@pytest.fixture(autouse=True)
def _slow_link(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.5 GB/s: each 64 KiB batch takes about 130 us on its lane, so the host, which queues
    # the next batch at once, always meets copies still running.
    monkeypatch.setenv(ENV_GBPS, "0.5")


@pytest.mark.parametrize("prefetch", [False, True], ids=["step", "prefetch-during-backward"])
def test_a_step_reserves_three_batches_not_all(prefetch: bool) -> None:
    # Before: staging released each batch with record_stream; under the rule that the
    # allocator reuses such a block only once the host saw its copy finish, every batch of
    # the step took new memory: reserved 16 of 16 batches.
    plain, opt = _train(prefetch=prefetch)
    _assert_equal(plain, opt)
    stats = swap_stats(opt)
    assert stats.batches == SWAP_TIMES and stats.steps == STEPS
    assert 0 < stats.peak_reserved_state_bytes <= stats.total_state_bytes * 4 / SWAP_TIMES
    assert stats.peak_resident_state_bytes <= stats.peak_reserved_state_bytes


def test_a_step_under_a_device_budget_reserves_three_batches() -> None:
    state = 2 * 32 * 64 * 64 * 4  # AdamW's two moments
    params_and_grads = 2 * 32 * 64 * 64 * 4
    # Room for the parameters, gradients, activations and about a quarter of the state.
    plain, opt = _train(budget_mb=(params_and_grads + state / 4 + 64 * 1024) / 2**20)
    _assert_equal(plain, opt)
    stats = swap_stats(opt)
    swapped = stats.total_state_bytes - stats.resident_for_good_bytes
    assert stats.batches >= 3 and swapped > 0
    limit = stats.resident_for_good_bytes + swapped * 4 / stats.batches
    assert stats.peak_reserved_state_bytes <= limit


def test_the_emulation_catches_a_release_by_record_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The strict allocator is what the test above stands on: released the old way (the
    # allocator holding each block until the host sees its copy done), the step reserves
    # memory for nearly every batch, and the figure says so.
    monkeypatch.setattr(
        LoopbackAsyncRuntime, "release_ordered", LoopbackAsyncRuntime.release_device
    )
    plain, opt = _train()
    _assert_equal(plain, opt)
    stats = swap_stats(opt)
    assert stats.peak_reserved_state_bytes > stats.total_state_bytes * 8 / SWAP_TIMES


# ---- the allocator's two rules -------------------------------------------------------------


def test_a_block_released_after_a_copy_is_reused_only_once_the_host_saw_it() -> None:
    runtime = LoopbackAsyncRuntime()
    cpu = torch.device("cpu")
    host = runtime.alloc_host(1024, torch.float32)
    block = runtime.alloc_device(1024, torch.float32, cpu)
    ticket = runtime.copy_out([(block, host)], queue=OPTIMIZER)
    runtime.wait(ticket)  # compute waited: the host learns nothing from that
    assert not runtime.done(ticket)
    runtime.release_device(block, (ticket,))
    assert runtime.pool.held_blocks == 1
    again = runtime.alloc_device(1024, torch.float32, cpu)  # new memory: the block is held
    assert runtime.pool.reserved == 2 * 4096
    runtime.host_wait(ticket)
    assert runtime.done(ticket)
    third = runtime.alloc_device(1024, torch.float32, cpu)  # takes the block given back
    assert runtime.pool.reserved == 2 * 4096 and runtime.pool.held_blocks == 0
    assert again.numel() == third.numel() == 1024


def test_a_block_released_in_compute_order_is_reused_at_once() -> None:
    runtime = LoopbackAsyncRuntime()
    cpu = torch.device("cpu")
    gate = threading.Event()
    runtime.lane("d2h", OPTIMIZER).submit(gate.wait)  # the copy below cannot run yet
    host = runtime.alloc_host(1024, torch.float32)
    block = runtime.alloc_device(1024, torch.float32, cpu).fill_(3.0)
    ticket = runtime.copy_out([(block, host)], queue=OPTIMIZER)
    runtime.release_ordered(block, (ticket,))  # returns at once: no host wait
    assert runtime.pool.allocated == 0 and runtime.pool.reserved == 4096
    threading.Timer(0.05, gate.set).start()
    again = runtime.alloc_device(1024, torch.float32, cpu)  # compute waits for the copy
    again.fill_(7.0)
    runtime.host_wait(ticket)
    assert runtime.pool.reserved == 4096  # the same block
    assert torch.equal(host, torch.full((1024,), 3.0))  # the copy read it before the reuse


# ---- one pair of copy queues per half ----------------------------------------------------------


def test_the_optimizer_prefetch_never_holds_back_an_activation_copy() -> None:
    # Before: both halves queued on one FIFO lane per direction: an activation page-in
    # queued behind the optimizer's prefetch waited for all of it.
    runtime = LoopbackAsyncRuntime()
    gate = threading.Event()
    try:
        runtime.lane("h2d", OPTIMIZER).submit(gate.wait)  # a prefetch that takes forever
        device = torch.zeros(256)
        prefetch = runtime.copy_in([(torch.zeros(256), torch.ones(256))], queue=OPTIMIZER)
        page_in = runtime.copy_in([(device, torch.full((256,), 2.0))], queue=ACTIVATIONS)
        finished = threading.Event()
        threading.Thread(target=lambda: (runtime.host_wait(page_in), finished.set())).start()
        assert finished.wait(10), "the activation copy waited behind the optimizer's"
        assert torch.equal(device, torch.full((256,), 2.0)) and not prefetch.done()
    finally:
        gate.set()
    runtime.synchronize()


def test_the_swap_copies_on_the_optimizer_queues() -> None:
    model = _layers()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback-async", swap_times=4, min_numel=0))
    runtime = engine_of(opt).runtime
    assert isinstance(runtime, LoopbackAsyncRuntime)
    _backward(model, 0)
    opt.step()
    gate = threading.Event()
    try:
        for direction in ("h2d", "d2h"):  # the activations' lanes stop
            runtime.lane(direction, ACTIVATIONS).submit(gate.wait)
        _backward(model, 1)
        opt.step()  # would wait forever behind the gates if it used those lanes
        assert engine_of(opt).last_out.lane is runtime.lane("d2h", OPTIMIZER)
    finally:
        gate.set()
    assert swap_stats(opt).steps == 2


# ---- host memory outlives the copies that use it ---------------------------------------------


def _drop_right_after_a_step() -> LoopbackAsyncRuntime:
    model = _layers()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Two batches: no allocation of the gated step takes a block whose copy is held back
    # by the gate (the CPU's compute queue, its caller, would wait for it there).
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback-async", swap_times=2, min_numel=0))
    runtime = engine_of(opt).runtime
    assert isinstance(runtime, LoopbackAsyncRuntime)
    _backward(model, 0)
    opt.step()
    runtime.synchronize()
    gate = threading.Event()
    runtime.lane("d2h", OPTIMIZER).submit(gate.wait)  # the next step's copies out wait
    _backward(model, 1)
    opt.step()
    del opt, model  # dropped while its copies out are queued
    gc.collect()
    gate.set()
    runtime.synchronize()
    return runtime


def test_a_dropped_optimizer_never_has_its_host_memory_freed_under_a_copy() -> None:
    runtime = _drop_right_after_a_step()
    assert list(runtime.violations) == []
    assert len(runtime.hosts) == 0  # let go once the copies finished


def test_the_emulation_catches_host_memory_freed_under_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: nothing tied a host buffer to its queued copies (the emulation's lanes held
    # them, hiding it): a dropped optimizer freed, and unregistered, memory DMA still wrote.
    monkeypatch.setattr(HostKeeper, "keep", lambda self, ticket, hosts: None)
    runtime = _drop_right_after_a_step()
    assert runtime.violations and "freed before the copy ran" in runtime.violations[0]
