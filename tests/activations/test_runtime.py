"""Which runtime moves the activations: ``runtime="auto"`` follows the device they are on;
``"loopback-async"`` queues its copies on worker threads and paces them as asked."""

from __future__ import annotations

import importlib
import threading

import pytest
import torch

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._activations.calls import device_of
from swapopt_core._device.accelerator import AcceleratorRuntime
from swapopt_core._device.interface import TorchRuntime, byte_view
from swapopt_core._device.lanes import ENV_GBPS, ENV_JITTER_US, LaneSettings
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._device.loopback_async import LoopbackAsyncRuntime
from swapopt_core._device.registry import choose_runtime, resolve_runtime
from swapopt_core._plugins import get_plugin_manager, new_plugin_manager, runtime_classes
from swapopt_core.hookspecs import hookimpl
from tests.activations.test_session import Wide


@pytest.fixture
def cuda_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA says it is there, and anything that would really use it fails the test."""

    def touched(*args: object, **kwargs: object) -> None:
        raise AssertionError("CUDA was used for CPU activations")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("current_device", "Stream", "Event", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, touched)
    # The device-generic API the accelerator runtime is written against. torch._dynamo
    # (which ops import lazily) subclasses torch.Stream at import: imported before the patch.
    importlib.import_module("torch._dynamo")

    for name in ("Stream", "Event"):
        monkeypatch.setattr(torch, name, touched)
    for name in (
        "current_stream",
        "set_stream",
        "synchronize",
        "current_device_index",
        "device_index",
        "memory_allocated",
        "max_memory_allocated",
        "reset_peak_memory_stats",
    ):
        monkeypatch.setattr(torch.accelerator, name, touched)


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
        assert type(choose_runtime("auto", torch.device(device))) is LoopbackRuntime
    assert type(choose_runtime("loopback")) is LoopbackRuntime
    assert type(choose_runtime("loopback-async")) is LoopbackAsyncRuntime
    cpu, meta, cuda = torch.ones(2), torch.ones(2, device="meta"), torch.device("cuda", 1)
    assert device_of(((cpu, meta), {})) == torch.device("cpu")
    assert device_of(((cpu,), {"device": cuda})) == cuda  # x.to("cuda") makes CUDA activations
    assert device_of(((), {"size": [2], "device": torch.device("meta")})) == torch.device("cpu")
    assert device_of(((), {"size": [2], "device": None})) == torch.device("cpu")


def test_cuda_without_cuda_fails_at_entry_and_names_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    session = OffloadSession(OffloadConfig(runtime="cuda"))
    with pytest.raises(RuntimeError, match=r"runtime='cuda' but CUDA is not available.*'loopback'"):
        session.__enter__()
    with OffloadSession(OffloadConfig(runtime="loopback")):  # nothing was left active
        pass


# ---- runtimes from plugins ---------------------------------------------------------------


class _Xpu(LoopbackRuntime):
    """A runtime for a device type no built-in serves, made for the device it is given."""

    name = "xpu-test"
    device_types = ("xpu",)

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    @classmethod
    def create(cls, device: torch.device | None) -> _Xpu:
        return cls(device if device is not None else torch.device("xpu", 0))

    def serves(self, device: torch.device) -> bool:
        return device == self.device


def _builtins(*extra: type[TorchRuntime]) -> dict[str, type[TorchRuntime]]:
    runtimes = runtime_classes(new_plugin_manager(load_entrypoints=False), "torch")
    return {**runtimes, **{cls.name: cls for cls in extra}}


def test_auto_picks_the_runtime_declaring_the_device_type() -> None:
    auto = resolve_runtime("auto", _builtins(_Xpu))
    assert auto.class_for(torch.device("cuda", 1)) is AcceleratorRuntime
    assert auto.class_for(torch.device("cpu")) is LoopbackRuntime
    assert auto.class_for(torch.device("mps")) is LoopbackRuntime  # nobody declares it
    made = auto.make(torch.device("xpu", 1))
    assert type(made) is _Xpu and made.device == torch.device("xpu", 1)
    assert resolve_runtime("auto", _builtins()).class_for(torch.device("xpu")) is LoopbackRuntime


def test_auto_replaces_a_runtime_only_when_another_would_serve_better() -> None:
    auto = resolve_runtime("auto", _builtins(_Xpu))
    xpu0, loopback = _Xpu(torch.device("xpu", 0)), LoopbackRuntime()
    assert auto.keeps(xpu0, torch.device("xpu", 0))
    assert not auto.keeps(xpu0, torch.device("xpu", 1))  # another device: its own runtime
    assert not auto.keeps(xpu0, torch.device("cpu"))  # back to loopback
    assert auto.keeps(loopback, torch.device("cpu"))
    assert auto.keeps(loopback, torch.device("mps"))  # a new loopback would serve it no better
    assert not auto.keeps(loopback, torch.device("xpu", 0))
    named = resolve_runtime("xpu-test", _builtins(_Xpu))
    assert named.keeps(xpu0, torch.device("cpu"))  # a named runtime serves every entry
    assert named.make().device == torch.device("xpu", 0)


def test_runtime_names_are_resolved_with_a_clear_error() -> None:
    runtimes = _builtins(_Xpu)
    with pytest.raises(
        ValueError,
        match=r"^OffloadConfig\.runtime='tpu' is not a registered activation runtime\. Choose "
        r"one of \['auto', 'cuda', 'loopback', 'loopback-async', 'xpu-test'\], or install",
    ):
        resolve_runtime("tpu", runtimes)
    twin = type("XpuTwin", (_Xpu,), {"name": "xpu-twin"})
    with pytest.raises(ValueError, match=r"'auto' is ambiguous for tensors on 'xpu'.*'xpu-test'"):
        resolve_runtime("auto", {**runtimes, "xpu-twin": twin})
    assert resolve_runtime("xpu-twin", {**runtimes, "xpu-twin": twin}).named is twin
    del runtimes["loopback"]
    with pytest.raises(ValueError, match=r"'auto' needs the activation runtime 'loopback'"):
        resolve_runtime("auto", runtimes)


def test_a_create_that_returns_no_runtime_is_refused() -> None:
    odd = type("Odd", (LoopbackRuntime,), {"name": "odd", "create": classmethod(lambda c, d: 1)})
    with pytest.raises(TypeError, match=r"Odd\.create returned 1; an activation runtime's"):
        resolve_runtime("odd", {"odd": odd}).make()


class _XpuPlugin:
    @hookimpl
    def swapopt_register_runtimes(self) -> list[type[TorchRuntime]]:
        return [_Xpu]


def test_options_accept_the_runtimes_registered_with_the_default_manager() -> None:
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_options({"runtime": "xpu-test"})
    assert "swapopt_register_runtimes" in str(info.value)
    manager = get_plugin_manager()
    plugin = _XpuPlugin()
    manager.register(plugin)
    try:
        assert OffloadConfig.from_options({"runtime": "xpu-test"}).runtime == "xpu-test"
        session = OffloadSession(OffloadConfig(runtime="xpu-test"))  # the default manager
        assert type(session._executor.runtimes.make()) is _Xpu
    finally:
        manager.unregister(plugin)


# ---- loopback-async ----------------------------------------------------------------------


def _storage(nbytes: int, value: int) -> torch.UntypedStorage:
    return torch.full((nbytes,), value, dtype=torch.uint8).untyped_storage()


def test_async_copies_are_queued_and_the_caller_goes_on() -> None:
    runtime = LoopbackAsyncRuntime(LaneSettings())
    gate = threading.Event()
    runtime.d2h.submit(gate.wait)  # the D2H lane is busy until the test lets it go
    storage, host = _storage(4096, 7), runtime.alloc_host(4096, torch.uint8).zero_()
    out = runtime.copy_out([(byte_view(storage), host)])
    assert not out.done() and int(host.sum()) == 0  # queued behind the busy copy
    # The other direction has a lane of its own: a copy in finishes meanwhile (full duplex).
    back, source = _storage(4096, 0), torch.full((4096,), 3, dtype=torch.uint8)
    incoming = runtime.copy_in([(byte_view(back), source)])
    runtime.wait(incoming)
    assert torch.equal(byte_view(back), source) and not out.done()
    gate.set()
    runtime.wait(out)
    assert torch.equal(host, byte_view(storage))
    runtime.synchronize()
    assert not any(runtime._held.values())  # finished copies hold no tensors


def test_async_copies_take_the_emulated_bandwidth() -> None:
    # 1 MiB at 1 MB/s: the copy takes at least a second of the lane's time.
    runtime = LoopbackAsyncRuntime(LaneSettings(gbps=0.001))
    storage, host = _storage(2**20, 5), runtime.alloc_host(2**20, torch.uint8)
    ticket = runtime.copy_out([(byte_view(storage), host)])
    assert not ticket.done()  # still in flight right after it was queued
    runtime.host_wait(ticket)
    assert torch.equal(host, byte_view(storage))


def test_async_bandwidth_is_measured_through_the_lanes() -> None:
    # Each copy takes at least bytes / bandwidth, so the measured rate cannot exceed it.
    d2h, h2d = LoopbackAsyncRuntime(LaneSettings(gbps=0.5)).measure_bandwidth(repeats=2)
    assert 0 < d2h <= 0.5 and 0 < h2d <= 0.5


def test_a_session_on_loopback_async_reads_the_lane_settings(monkeypatch) -> None:
    monkeypatch.setenv(ENV_GBPS, "2.5")
    monkeypatch.setenv(ENV_JITTER_US, "50")
    session = OffloadSession(OffloadConfig(runtime="loopback-async"))
    with session:
        torch.ones(4).sum()
    runtime = session._executor.runtime
    assert isinstance(runtime, LoopbackAsyncRuntime)
    assert runtime.settings == LaneSettings(gbps=2.5, jitter_us=50)


@pytest.mark.parametrize(
    ("name", "value"),
    [(ENV_GBPS, "fast"), (ENV_GBPS, "0"), (ENV_JITTER_US, "-5"), (ENV_JITTER_US, "1.5")],
)
def test_bad_lane_settings_fail_at_entry_and_name_the_variable(
    monkeypatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    session = OffloadSession(OffloadConfig(runtime="loopback-async"))
    with pytest.raises(ValueError, match=rf"{name}='{value}' is invalid; accepted: "):
        session.__enter__()
    monkeypatch.delenv(name)
    with OffloadSession(OffloadConfig(runtime="loopback")):  # nothing was left active
        pass
