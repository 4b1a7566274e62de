"""The whole-step device meter against independent counts.

On the loopback runtimes the meter follows storages incrementally (ops, the runtime's
allocations and releases, swapopt's in-place resizes). Two independent counts check it:

* ``MemTracker`` (torch's own tracker) on a plain step without swapopt;
* ``Census``, written here: it remembers every CPU storage it ever saw and, at each sample
  point (after every op, every ``alloc_device`` and every ``UntypedStorage.resize_``), sums
  the current sizes of those alive afresh, leaving out the runtime's host buffers and its
  pool by looking at them directly. Before each sample it drains the copy lanes, so no
  release runs on a lane between the meter's update and the sample: the peaks agree exactly.

On accelerators the meter reads the allocator; that is checked with ``torch.accelerator``
faked (this machine has no accelerator).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from swapopt_core import OffloadConfig, OffloadSession, SwapOptimizerConfig, swap_optimizer
from swapopt_core._device.accelerator import AcceleratorRuntime
from swapopt_core._device.lanes import ENV_JITTER_US
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._device.loopback_async import LoopbackAsyncRuntime
from swapopt_core._device.meter import AllocatorMeter, StorageMeter
from swapopt_core._device.registry import shared_runtime

MIB = 2**20
RUNTIMES = {"loopback": LoopbackRuntime, "loopback-async": LoopbackAsyncRuntime}


class Census(TorchDispatchMode):
    """Every storage seen, summed afresh at each sample point (see the module docstring)."""

    def __init__(self, runtime: LoopbackRuntime, held: list[torch.Tensor]) -> None:
        super().__init__()
        self.runtime = runtime
        self.known: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0
        self.learn(held)

    def learn(self, values: Any) -> None:
        for value in tree_leaves(values):
            if isinstance(value, torch.Tensor):
                self.learn_storage(value.untyped_storage())

    def learn_storage(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type == "cpu":
            self.known[storage._cdata] = weakref.ref(storage)

    def held_bytes(self) -> int:
        pooled = {s._cdata for s in self.runtime.pool.free_storages()}
        hosts = [(a, a + n) for a, n in self.runtime._pinned.items()]
        total = 0
        for key, ref in self.known.items():
            storage = ref()
            if storage is None or key in pooled or not storage.nbytes():
                continue
            if any(a <= storage.data_ptr() < b for a, b in hosts):
                continue  # a host buffer, or a piece of one
            total += storage.nbytes()
        return total

    def sample(self) -> None:
        self.peak = max(self.peak, self.held_bytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.runtime.synchronize()  # no release runs on a lane before the sample
        out = func(*args, **(kwargs or {}))
        self.learn((args, kwargs, out))
        self.sample()
        return out


@pytest.fixture
def census_hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Census]]:
    """Samples the active census after every ``alloc_device`` and storage resize too."""
    active: list[Census] = []
    resize = torch.UntypedStorage.resize_

    def resized(storage: torch.UntypedStorage, nbytes: int) -> Any:
        for census in active:
            census.runtime.synchronize()
        result = resize(storage, nbytes)
        for census in active:
            census.learn_storage(storage)
            census.sample()
        return result

    monkeypatch.setattr(torch.UntypedStorage, "resize_", resized)
    for cls in RUNTIMES.values():
        alloc = cls.alloc_device

        def allocated(self: LoopbackRuntime, *args: Any, _alloc: Any = alloc) -> torch.Tensor:
            self.synchronize()
            tensor = _alloc(self, *args)
            for census in active:
                census.learn_storage(tensor.untyped_storage())
                census.sample()
            return tensor

        monkeypatch.setattr(cls, "alloc_device", allocated)
    yield active


def _mlp(width: int = 256, depth: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(512, 256, generator=torch.Generator().manual_seed(step))


def _held(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> list:
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *grads, *state, x]


# ---- plain steps against torch's MemTracker ---------------------------------------------


def test_a_plain_step_meets_torchs_memtracker_exactly() -> None:
    model, x = _mlp(), _batch(0)
    opt = torch.optim.Adam(model.parameters())
    model(x).square().mean().backward()
    opt.step()  # the state exists from now on
    meter = LoopbackRuntime().step_meter()
    tracker = MemTracker()
    tracker.track_external(model, opt, x)  # what the step holds at its start, as ``held``
    depth = torch._C._len_torch_dispatch_stack()
    with tracker:
        meter.begin(_held(model, opt, x))
        start = meter.current_bytes
        model(x).square().mean().backward()  # the old gradients are accumulated into
        opt.step()
        peak = meter.end()
    # Both count every storage at its size from the op that made it until it dies, and
    # both sample after each op: the same number, to the byte.
    assert peak == tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert peak > start > 0
    assert torch._C._len_torch_dispatch_stack() == depth  # the meter's mode is gone


# ---- the window ---------------------------------------------------------------------------


def test_host_buffers_and_pieces_of_them_never_count() -> None:
    runtime = LoopbackRuntime()
    meter = runtime.step_meter()
    host = runtime.alloc_host(4096, torch.float32)
    piece = torch.empty(0).set_(host.untyped_storage()[4096:8192])  # as a swapped state
    device = torch.ones(1024)
    meter.begin([host, piece, device])
    assert meter.current_bytes == 4096
    more = runtime.alloc_host(256, torch.float32)  # made inside the window
    more.copy_(device[:256])
    device.copy_(piece)
    assert meter.current_bytes == 4096 and meter.end() == 4096


def test_device_buffers_count_until_the_runtime_takes_them_back() -> None:
    runtime = LoopbackAsyncRuntime()
    meter = runtime.step_meter()
    meter.begin()
    first = runtime.alloc_device(1000, torch.float32, torch.device("cpu"))
    assert meter.current_bytes == 4000
    ticket = runtime.copy_out([(first, runtime.alloc_host(1000, torch.float32))])
    runtime.release_device(first, (ticket,))  # freed on the lane once the copy ran
    runtime.synchronize()
    assert meter.current_bytes == 0
    again = runtime.alloc_device(1000, torch.float32, torch.device("cpu"))  # from the pool
    assert meter.current_bytes == 4000 and again.numel() == 1000
    del again
    assert meter.current_bytes == 0 and meter.end() == 4000


def test_resizes_swapopt_reports_are_followed() -> None:
    runtime = LoopbackRuntime()
    meter = runtime.step_meter()
    activation = torch.ones(2048)  # 8 KiB, made before the window: counted when held
    storage = activation.untyped_storage()
    meter.begin([activation])
    storage.resize_(0)
    runtime.note_resized(storage)
    assert meter.current_bytes == 0
    storage.resize_(8192)
    runtime.note_resized(storage)
    torch.ones(1024)  # 4 KiB more while it is back, dropped at once
    assert meter.current_bytes == 8192 and meter.end() == 8192 + 4096
    runtime.note_resized(storage)  # no window: nothing to follow
    assert meter.end() == 8192 + 4096  # the last window's peak, again


class _OpensAtFirstOp(TorchDispatchMode):
    """Opens the meter from inside its own handler, as a session entry's first op does."""

    def __init__(self, meter: StorageMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not self.meter.is_open:
            self.meter.begin(tree_leaves(args))
        return func(*args, **(kwargs or {}))


def test_a_window_opened_inside_another_mode_sees_its_ops_and_leaves_it_in_place() -> None:
    meter = LoopbackRuntime().step_meter()
    x = torch.ones(256)
    depth = torch._C._len_torch_dispatch_stack()
    outer = _OpensAtFirstOp(meter)
    with outer:
        y = x * 2  # opens the window: the meter's mode now sits under ``outer``
        z = y + 1
        assert meter.current_bytes == 3 * 1024
        meter.end()  # taken out from under ``outer``, which stays
        assert torch._C._get_dispatch_stack_at(depth) is outer
    assert torch._C._len_torch_dispatch_stack() == depth
    assert meter.peak_bytes == 3 * 1024 and z.sum() > 0


def test_begin_while_open_starts_a_new_window() -> None:
    meter = LoopbackRuntime().step_meter()
    depth = torch._C._len_torch_dispatch_stack()
    meter.begin()
    big = torch.ones(4096)
    meter.begin([big])  # restarts: the old window's peak is dropped
    assert torch._C._len_torch_dispatch_stack() == depth + 1  # one mode, not two
    small = torch.ones(16)
    assert meter.end() == 4096 * 4 + 16 * 4 and small.numel() == 16
    assert torch._C._len_torch_dispatch_stack() == depth


def test_each_runtime_instance_has_one_meter() -> None:
    runtime = shared_runtime(LoopbackRuntime)
    assert runtime.step_meter() is runtime.step_meter()
    assert isinstance(runtime.step_meter(), StorageMeter)
    assert isinstance(AcceleratorRuntime(torch.device("cuda", 0)).step_meter(), AllocatorMeter)


def test_the_accelerator_meter_reads_the_allocator_and_never_resets_its_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The allocator's peak is the user's (``max_memory_allocated``): the meter reads it and
    its current counters, allocated and reserved, and never resets them."""
    counters = {"now": 100, "peak": 700, "reserved": 1000, "max_reserved": 1500}
    resets: list[Any] = []
    monkeypatch.setattr(
        torch.accelerator, "reset_peak_memory_stats", lambda device=None: resets.append(device)
    )
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda d=None: counters["now"])
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda d=None: counters["peak"])
    monkeypatch.setattr(torch.accelerator, "memory_reserved", lambda d=None: counters["reserved"])
    monkeypatch.setattr(
        torch.accelerator, "max_memory_reserved", lambda d=None: counters["max_reserved"]
    )
    cuda1 = torch.device("cuda", 1)
    meter = AcceleratorRuntime(cuda1).step_meter()
    meter.begin([torch.ones(3)])  # the allocator counts what is held: nothing to add
    assert meter.is_open and meter.current_bytes == 100
    # The user's earlier high (700) is not this window's: only what was read in it.
    assert (meter.peak_bytes, meter.peak_reserved_bytes) == (100, 1000)
    counters["now"], counters["reserved"] = 400, 1200
    meter.resized(None)  # swapopt allocated: a reading
    counters["now"] = 150
    assert (meter.peak_bytes, meter.peak_reserved_bytes) == (400, 1200)
    counters["peak"], counters["max_reserved"] = 900, 1600  # a new high inside the window
    assert meter.end() == 900 and meter.peak_reserved_bytes == 1600
    counters["peak"] = 9000  # later allocations belong to no window
    assert meter.peak_bytes == 900 and meter.end() == 900 and not meter.is_open
    assert resets == []  # the user's max_memory_allocated is left alone


# ---- whole steps against the census --------------------------------------------------------


def _measured_step(
    runtime_name: str, census_hooks: list[Census], *, budget_mb: float | None, swapped: bool
) -> tuple[int, int, torch.nn.Module]:
    """Two steps (the session's warmup, the optimizer's first step), then a third metered
    one; returns (the meter's peak, the census's peak, the model)."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if swapped:
        swap_optimizer(opt, SwapOptimizerConfig(runtime=runtime_name, swap_times=3, min_numel=0))
    session = None
    if budget_mb is not None:
        config = OffloadConfig(
            max_resident_activation_mb=budget_mb, runtime=runtime_name, min_offload_kib=0
        )
        session = OffloadSession(config)

    def step(index: int) -> None:
        x = _batch(index)
        opt.zero_grad()
        if session is None:
            model(x).square().mean().backward()
        else:
            with session:
                model(x).square().mean().backward()
        opt.step()

    for index in range(2):
        step(index)
    runtime = shared_runtime(RUNTIMES[runtime_name])
    x = _batch(2)
    held = _held(model, opt, x)
    meter = runtime.step_meter()
    census = Census(runtime, held)  # type: ignore[arg-type]
    with census:
        census_hooks.append(census)
        meter.begin(held)
        opt.zero_grad()
        if session is None:
            model(x).square().mean().backward()
        else:
            with session:
                model(x).square().mean().backward()
        opt.step()
        runtime.synchronize()  # the step's last releases ran: the window ends with them
        peak = meter.end()
        census_hooks.remove(census)
    return peak, census.peak, model


@pytest.mark.parametrize("runtime_name", sorted(RUNTIMES))
def test_an_offloaded_step_meets_the_census_and_its_peak_drops(
    runtime_name: str, census_hooks: list[Census]
) -> None:
    plain, plain_census, _ = _measured_step(
        runtime_name, census_hooks, budget_mb=None, swapped=False
    )
    offloaded, offloaded_census, _ = _measured_step(
        runtime_name, census_hooks, budget_mb=2.0, swapped=False
    )
    assert plain == plain_census
    assert offloaded == offloaded_census
    # Six 512 KiB GELU inputs and six 512 KiB linear outputs are live at the peak of a
    # plain step; a 1 MiB activation budget leaves room for two of them.
    assert plain - offloaded >= 8 * 512 * 1024


@pytest.mark.parametrize("runtime_name", sorted(RUNTIMES))
def test_a_swapped_step_meets_the_census(
    runtime_name: str, census_hooks: list[Census], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_JITTER_US, "300")  # lane copies and frees land late (async only)
    swapped, swapped_census, _ = _measured_step(
        runtime_name, census_hooks, budget_mb=None, swapped=True
    )
    both, both_census, _ = _measured_step(runtime_name, census_hooks, budget_mb=2.0, swapped=True)
    assert swapped == swapped_census
    assert both == both_census
    plain, _, _ = _measured_step(runtime_name, census_hooks, budget_mb=None, swapped=False)
    # The Adam state (2 x 1.5 MiB) is off the device but for the batch being updated.
    assert swapped < plain
