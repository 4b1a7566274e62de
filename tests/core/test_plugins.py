"""The plugin system: built-ins are plain plugins, and a test plugin adds an optimizer family."""

from __future__ import annotations

import importlib.metadata
import inspect
import types
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import pluggy
import pytest
import torch
from torch.optim.sgd import sgd

import swapopt_core
from swapopt_core import (
    OffloadConfig,
    OffloadSession,
    OptimizerAdapter,
    PerParameterAdapter,
    SwapOptError,
    SwapOptimizerConfig,
    TransferRuntime,
    UnsupportedOptimizerError,
    hookimpl,
    hookspecs,
    new_plugin_manager,
    swap_optimizer,
    swap_stats,
)
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._planning.interface import resolve_planner
from swapopt_core._plugins import residency_planners, runtime_classes
from swapopt_core._swap.engine import engine_of


class SgdMomentumAdapter(OptimizerAdapter):
    """SGD with momentum: the momentum buffer is created by the first update."""

    family = "torch.optim.SGD (test plugin)"
    state_key_names = ("momentum_buffer",)

    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        return type(optimizer) is torch.optim.SGD

    def state_keys(self, group: MutableMapping[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] else ()

    def update(
        self,
        optimizer: torch.optim.Optimizer,
        group: MutableMapping[str, Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        states: Sequence[MutableMapping[str, Any]],
    ) -> None:
        buffers = [s.get("momentum_buffer") for s in states]
        sgd(
            list(params),
            list(grads),
            buffers,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            fused=group["fused"],
        )
        if group["momentum"]:
            for state, buffer in zip(states, buffers, strict=True):
                state["momentum_buffer"] = buffer


class SgdPlugin:
    @hookimpl
    def swapopt_register_optimizer_adapters(self) -> list[OptimizerAdapter]:
        return [SgdMomentumAdapter()]


@pytest.fixture
def plugin_manager() -> pluggy.PluginManager:
    return new_plugin_manager(load_entrypoints=False)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 40), torch.nn.Linear(40, 4)
    )


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_builtins_are_registered_as_plugins(plugin_manager: pluggy.PluginManager) -> None:
    names = {name for name, _ in plugin_manager.list_name_plugin()}
    assert {
        "swapopt_core._torch.plugin",
        "swapopt_core._planning.plugin",
        "swapopt_core._device.plugin",
        "swapopt_core._mindspore.plugin",
    } <= names
    assert sorted(runtime_classes(plugin_manager, "torch")) == [
        "cuda",
        "loopback",
        "loopback-async",
    ]
    runtimes = [
        (r.framework, r.name)
        for batch in plugin_manager.hook.swapopt_register_runtimes()
        for r in batch
    ]
    assert sorted(runtimes) == [
        ("mindspore", "ascend"),
        ("mindspore", "loopback"),
        ("mindspore", "loopback-async"),
        ("torch", "cuda"),
        ("torch", "loopback"),
        ("torch", "loopback-async"),
    ]


def test_every_hook_is_prefixed_and_documented() -> None:
    specs = [n for n, _ in inspect.getmembers(hookspecs.SwapOptSpecs) if not n.startswith("_")]
    assert specs
    for name in specs:
        assert name.startswith("swapopt_"), name
        assert inspect.getdoc(getattr(hookspecs.SwapOptSpecs, name)), name


PLUGINS_DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def test_every_hook_is_in_the_plugin_docs() -> None:
    specs = [n for n, _ in inspect.getmembers(hookspecs.SwapOptSpecs) if not n.startswith("_")]
    text = PLUGINS_DOC.read_text()
    assert [name for name in specs if f"`{name}(" not in text] == []


def _documented_module(heading: str) -> types.ModuleType:
    """The first Python block under ``heading`` in docs/plugins.md, run as a module."""
    section = PLUGINS_DOC.read_text().split(f"## {heading}\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    module = types.ModuleType("plugins_md_example")
    exec(compile(code, str(PLUGINS_DOC), "exec"), module.__dict__)
    return module


def _documented_sgd_plugin() -> types.ModuleType:
    return _documented_module("Adding an optimizer family")


def _lion_run(cls: type, manager: pluggy.PluginManager | None) -> list[torch.Tensor]:
    model = _model(3)
    opt = cls(model.parameters(), lr=1e-3)
    if manager is not None:
        config = SwapOptimizerConfig(runtime="loopback", swap_times=2, min_numel=8)
        swap_optimizer(opt, config, plugin_manager=manager)
        engine = engine_of(opt)
        assert engine is not None and isinstance(engine.adapter, PerParameterAdapter)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    if manager is not None:
        assert swap_stats(opt).swapped_tensors == 5  # the last bias (4 values) stays
    return [*model.parameters(), *(s["exp_avg"] for s in opt.state.values())]


def test_the_documented_per_parameter_optimizers_swap_bit_exactly(
    plugin_manager: pluggy.PluginManager,
) -> None:
    doc = _documented_module("Declaring an optimizer per parameter")
    with pytest.raises(UnsupportedOptimizerError, match="VendorLion"):
        swap_optimizer(
            doc.VendorLion(_model().parameters()), SwapOptimizerConfig(runtime="loopback")
        )
    plugin_manager.register(doc, name="lion-doc")
    for cls in (doc.Lion, doc.VendorLion):
        plain, swapped = _lion_run(cls, None), _lion_run(cls, plugin_manager)
        assert all(torch.equal(a, b) for a, b in zip(plain, swapped, strict=True))


def test_the_documented_planner_is_found_by_its_name(plugin_manager: pluggy.PluginManager) -> None:
    planner = _documented_module("Adding an activation planner").MyPlanner()

    class PlannerPlugin:
        @hookimpl
        def swapopt_register_planners(self) -> list[swapopt_core.ResidencyPlanner]:
            return [planner]

    plugin_manager.register(PlannerPlugin())
    assert resolve_planner("mine", residency_planners(plugin_manager)) is planner
    assert resolve_planner("auto", residency_planners(plugin_manager)).name == "timed"


def _wide_step(layers: torch.nn.ModuleList, x: torch.Tensor) -> None:
    for layer in layers:
        x = torch.tanh(layer(x))
    x.sum().backward()


@pytest.mark.parametrize("runtime", ["counting", "auto"])
def test_the_documented_activation_runtime_runs_a_session_bit_exactly(
    plugin_manager: pluggy.PluginManager, runtime: str
) -> None:
    module = _documented_module("Adding a runtime")
    counting = module.CountingRuntime
    if runtime == "auto":  # the same runtime, declared for CPU tensors: "auto" picks it
        counting = type("CountingCpu", (counting,), {"name": "counting-cpu"})
        counting.device_types = ("cpu",)
    plugin = types.SimpleNamespace(swapopt_register_runtimes=lambda: [counting])
    hookimpl(plugin.swapopt_register_runtimes)
    plugin_manager.register(plugin)
    torch.manual_seed(0)
    reference = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
    offloaded = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
    offloaded.load_state_dict(reference.state_dict())
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(1))
    config = OffloadConfig(max_resident_activation_mb=2, min_offload_kib=0, runtime=runtime)
    session = OffloadSession(config, plugin_manager=plugin_manager)
    for _ in range(2):  # a warmup, then a replay of its plan
        reference.zero_grad()
        offloaded.zero_grad()
        _wide_step(reference, x)
        with session:
            _wide_step(offloaded, x)
        for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
    used = session._executor.runtime
    assert type(used) is counting
    stats = session.stats()
    assert (stats.warmups, stats.replays) == (1, 1)
    # Six layers keep 12 activations of 512 KiB without the session; the budget binds.
    assert stats.peak_resident_activation_bytes < 0.5 * 12 * 2048 * 64 * 4
    # The warmup measures the bandwidth through the runtime's own copies: 6 x 32 MiB each way.
    probe = 6 * 32 * 2**20
    assert used.copied == {"out": stats.d2h_bytes + probe, "in": stats.h2d_bytes + probe}
    assert stats.d2h_bytes > 0 and stats.h2d_bytes > 0


def test_the_documented_runtime_serves_both_halves_as_one_instance_bit_exactly(
    plugin_manager: pluggy.PluginManager,
) -> None:
    plugin_manager.register(_documented_module("Adding a runtime"))
    torch.manual_seed(0)
    plain_model = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
    swapped_model = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
    swapped_model.load_state_dict(plain_model.state_dict())
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    swapped = torch.optim.AdamW(swapped_model.parameters(), lr=1e-3)
    config = SwapOptimizerConfig(swap_times=3, min_numel=64, runtime="counting")
    swap_optimizer(swapped, config, plugin_manager=plugin_manager)
    offload = OffloadConfig(max_resident_activation_mb=2, min_offload_kib=0, runtime="counting")
    session = OffloadSession(offload, plugin_manager=plugin_manager)
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(3):  # a warmup, then replays; the optimizer steps after each
        plain.zero_grad()
        swapped.zero_grad()
        _wide_step(plain_model, x)
        with session:
            _wide_step(swapped_model, x)
        plain.step()
        swapped.step()
    for a, b in zip(plain_model.parameters(), swapped_model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in plain.state[a].items():
            assert torch.equal(value, swapped.state[b][key])
    runtime = engine_of(swapped).runtime
    assert type(runtime).__name__ == "CountingRuntime"
    assert session._executor.runtime is runtime  # one instance serves both halves
    stats, offloaded = swap_stats(swapped), session.stats()
    assert stats.runtime == "counting" and stats.h2d_bytes > 0 and offloaded.h2d_bytes > 0
    # Both halves copied through it, and each kept its own counts.
    probe = 6 * 32 * 2**20  # the warmup's bandwidth measurement, through the same copies
    assert runtime.copied["in"] == stats.h2d_bytes + offloaded.h2d_bytes + probe
    assert runtime.copied["out"] == stats.d2h_bytes + offloaded.d2h_bytes + probe


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_documented_plugin_swaps_sgd_bit_exactly(
    plugin_manager: pluggy.PluginManager, momentum: float
) -> None:
    plugin_manager.register(_documented_sgd_plugin())
    plain_model, swapped_model = _model(), _model()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.05, momentum=momentum)
    swapped = torch.optim.SGD(swapped_model.parameters(), lr=0.05, momentum=momentum)
    config = SwapOptimizerConfig(swap_times=2, min_numel=64, runtime="loopback")
    assert swap_optimizer(swapped, config, plugin_manager=plugin_manager) is swapped
    _train(plain_model, plain, 6)
    _train(swapped_model, swapped, 6)
    pairs = list(zip(plain_model.parameters(), swapped_model.parameters(), strict=True))
    for a, b in pairs:
        assert torch.equal(a, b)
        state_a, state_b = plain.state.get(a, {}), swapped.state.get(b, {})
        assert state_a.keys() == state_b.keys()
        for key in state_a:
            assert torch.equal(state_a[key], state_b[key])
    assert swap_stats(swapped).swapped_tensors == (3 if momentum else 0)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize(
    "options",
    [
        {"momentum": 0.9},
        {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
        {"momentum": 0.8, "nesterov": True},
    ],
)
def test_plugin_adds_sgd_momentum_swapped_bit_exactly(
    plugin_manager: pluggy.PluginManager, packed: bool, options: dict
) -> None:
    plugin_manager.register(SgdPlugin())
    plain_model, swapped_model = _model(), _model()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.05, **options)
    swapped = torch.optim.SGD(swapped_model.parameters(), lr=0.05, **options)
    config = SwapOptimizerConfig(swap_times=2, min_numel=64, runtime="loopback", packed_swap=packed)
    assert swap_optimizer(swapped, config, plugin_manager=plugin_manager) is swapped
    _train(plain_model, plain, 10)
    _train(swapped_model, swapped, 10)
    for a, b in zip(plain_model.parameters(), swapped_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain_model.parameters(), swapped_model.parameters(), strict=True):
        assert torch.equal(plain.state[a]["momentum_buffer"], swapped.state[b]["momentum_buffer"])
    stats = swap_stats(swapped)
    # Weights of the three layers are above min_numel; the biases stay resident.
    assert stats.swapped_tensors == 3
    assert stats.resident_state_bytes == 0
    assert stats.h2d_bytes > 0 and stats.d2h_bytes > 0


def test_sgd_without_the_plugin_takes_the_built_in_generic_path(
    plugin_manager: pluggy.PluginManager,
) -> None:
    opt = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback"), plugin_manager=plugin_manager)
    engine = engine_of(opt)
    assert engine is not None and isinstance(engine.adapter, PerParameterAdapter)


class _NamedLoopback(TransferRuntime):
    name = "loopback"

    def serves(self, device: torch.device) -> bool:
        return False

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def alloc_device(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def release_device(self, tensor: torch.Tensor, after: Sequence = ()) -> None:
        raise NotImplementedError

    def copy_in(self, pairs: Sequence, after: Sequence = ()) -> None:
        raise NotImplementedError

    def copy_out(self, pairs: Sequence) -> None:
        raise NotImplementedError

    def wait(self, ticket: object) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError


class _DuplicateRuntimePlugin:
    @hookimpl
    def swapopt_register_runtimes(self) -> list[type[TransferRuntime]]:
        return [_NamedLoopback]


def test_duplicate_runtime_names_are_refused(plugin_manager: pluggy.PluginManager) -> None:
    plugin_manager.register(_DuplicateRuntimePlugin())
    opt = torch.optim.Adam(_model().parameters())
    with pytest.raises(SwapOptError, match="Two plugins register a torch runtime named 'loopback'"):
        swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback"), plugin_manager=plugin_manager)


class _Loopback2(LoopbackRuntime):
    """Inherits the loopback runtime's name."""


@pytest.mark.parametrize(
    ("registered", "pattern"),
    [
        ([_Loopback2], r"Two plugins register a torch runtime named 'loopback'.*_Loopback2"),
        ([LoopbackRuntime()], r"must return subclasses of swapopt_core\.TransferRuntime"),
        ([type("Auto", (LoopbackRuntime,), {"name": "auto"})], r"named 'auto'; give it"),
    ],
)
def test_bad_activation_runtime_registrations_are_refused(
    plugin_manager: pluggy.PluginManager, registered: list, pattern: str
) -> None:
    plugin = types.SimpleNamespace(swapopt_register_runtimes=lambda: registered)
    hookimpl(plugin.swapopt_register_runtimes)
    plugin_manager.register(plugin)
    with pytest.raises(SwapOptError, match=pattern):
        OffloadSession(OffloadConfig(runtime="loopback"), plugin_manager=plugin_manager)


class _Observer:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    @hookimpl
    def swapopt_on_install(self, optimizer: torch.optim.Optimizer, config: Any) -> None:
        self.events.append(("install", config.swap_times))

    @hookimpl
    def swapopt_after_step(self, optimizer: torch.optim.Optimizer, stats: Any) -> None:
        self.events.append(("step", stats.steps))

    @hookimpl
    def swapopt_on_uninstall(self, optimizer: torch.optim.Optimizer) -> None:
        self.events.append(("uninstall", 0))


def test_observers_see_install_steps_and_uninstall(plugin_manager: pluggy.PluginManager) -> None:
    observer = _Observer()
    plugin_manager.register(observer)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    swap_optimizer(
        opt, SwapOptimizerConfig(swap_times=2, runtime="loopback"), plugin_manager=plugin_manager
    )
    _train(model, opt, 3)
    swapopt_core.unswap_optimizer(opt)
    assert observer.events == [
        ("install", 2),
        ("step", 1),
        ("step", 2),
        ("step", 3),
        ("uninstall", 0),
    ]


def test_unknown_hook_name_is_rejected(plugin_manager: pluggy.PluginManager) -> None:
    class Typo:
        @hookimpl
        def swapopt_register_runtime(self) -> list:  # missing "s"
            return []

    plugin_manager.register(Typo())
    with pytest.raises(pluggy.PluginValidationError):
        plugin_manager.check_pending()


class _FakeEntryPoint:
    name = "sgd-plugin"
    group = "swapopt"
    value = "tests.test_plugins:SgdPlugin"

    def load(self) -> object:
        return SgdPlugin()


class _FakeDistribution:
    entry_points = (_FakeEntryPoint(),)
    metadata = {"name": "swapopt-sgd"}


def test_entry_point_plugins_are_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWAPOPT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [_FakeDistribution()])
    manager = new_plugin_manager()
    assert manager.get_plugin("sgd-plugin") is not None
    opt = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback"), plugin_manager=manager)
    assert swapopt_core.is_swap_optimizer(opt)


def test_entry_points_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWAPOPT_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [_FakeDistribution()])
    assert new_plugin_manager().get_plugin("sgd-plugin") is None


class _BrokenEntryPoint:
    name = "broken"
    group = "swapopt"
    value = "missing_module:plugin"

    def load(self) -> object:
        raise ImportError("No module named 'missing_module'")


class _TwoPluginDistribution:
    entry_points = (_BrokenEntryPoint(), _FakeEntryPoint())
    metadata = {"name": "swapopt-mixed"}


def test_a_broken_plugin_warns_and_the_others_still_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWAPOPT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [_TwoPluginDistribution()])
    with pytest.warns(swapopt_core.SwapOptWarning, match=r"'broken' \(missing_module:plugin\)"):
        manager = new_plugin_manager()
    assert manager.get_plugin("broken") is None
    assert manager.get_plugin("sgd-plugin") is not None
