"""Bad input fails early with a message naming the field, the value and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch

import swapopt_core._api as api
from swapopt_core import (
    SwapOptError,
    SwapOptimizerConfig,
    SwapOptWarning,
    UnsupportedOptimizerError,
    is_swap_optimizer,
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._plugins import new_plugin_manager
from swapopt_core._swap.ledger import DeviceLedger
from swapopt_core._swap.staging import PackedStaging
from swapopt_core._torch.state import Slot
from swapopt_core._torch.tensor_ops import TorchTensorOps
from swapopt_core.hookspecs import hookimpl

LOOPBACK = SwapOptimizerConfig(runtime="loopback")


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return list(torch.nn.Linear(64, 64).parameters())


def test_lbfgs_is_refused_by_what_it_is() -> None:
    opt = torch.optim.LBFGS(_params())
    with pytest.raises(UnsupportedOptimizerError) as info:
        swap_optimizer(opt, LOOPBACK)
    message = str(info.value)
    assert "torch.optim.lbfgs.LBFGS" in message
    assert "closure over all parameters" in message
    assert not is_swap_optimizer(opt)


def test_undeclared_optimizer_is_told_how_to_declare_itself() -> None:
    class Lion(torch.optim.Optimizer):
        def __init__(self, params) -> None:  # noqa: ANN001
            super().__init__(params, {"lr": 1e-4})

        def step(self, closure=None):  # noqa: ANN001, ANN201
            return None

    with pytest.raises(UnsupportedOptimizerError) as info:
        swap_optimizer(Lion(_params()), LOOPBACK)
    message = str(info.value)
    assert "Lion" in message
    assert "torch.optim.Adam / torch.optim.AdamW" in message
    assert "swapopt_per_parameter = True" in message


def test_adam_subclass_with_its_own_step_is_not_mistaken_for_adam() -> None:
    class Custom(torch.optim.Adam):
        def step(self, closure=None):  # noqa: ANN001, ANN201
            return super().step(closure)

    with pytest.raises(SwapOptError, match="cannot swap .*Custom"):
        swap_optimizer(Custom(_params()), LOOPBACK)


@pytest.mark.parametrize("flag", ["differentiable", "capturable"])
def test_unsupported_flags_name_the_group_and_the_fix(flag: str) -> None:
    opt = torch.optim.AdamW(_params(), **{flag: True})
    with pytest.raises(SwapOptError, match=rf"param_groups\[0\] has {flag}=True.*{flag}=False"):
        swap_optimizer(opt, LOOPBACK)
    assert not is_swap_optimizer(opt)


def test_flag_in_a_group_added_after_install_fails_at_the_next_step() -> None:
    params = _params()
    opt = torch.optim.Adam(params[:1])
    swap_optimizer(opt, LOOPBACK)
    extra = torch.nn.Parameter(torch.randn(64))
    opt.add_param_group({"params": [extra], "capturable": True})
    extra.grad = torch.ones(64)
    with pytest.raises(SwapOptError, match=r"param_groups\[1\] has capturable=True"):
        opt.step()


def test_sparse_gradients_are_refused_before_anything_moves() -> None:
    embedding = torch.nn.Embedding(2048, 8, sparse=True)
    opt = torch.optim.Adam(embedding.parameters())
    swap_optimizer(opt, LOOPBACK)
    embedding(torch.tensor([1, 2, 3])).sum().backward()
    pattern = r"param_groups\[0\]\['params'\]\[0\].*sparse_coo.*dense"
    with pytest.raises(SwapOptError, match=pattern):
        opt.step()
    assert swap_stats(opt).h2d_bytes == 0
    assert not opt.state


def test_unknown_runtime_lists_the_registered_ones() -> None:
    opt = torch.optim.Adam(_params())
    match = r"runtime='tpu' is not a registered torch runtime.*'loopback'"
    with pytest.raises(ValueError, match=match):
        swap_optimizer(opt, SwapOptimizerConfig(runtime="tpu"))


def test_state_keys_the_family_does_not_keep() -> None:
    opt = torch.optim.Adam(_params())
    with pytest.raises(ValueError, match=r"state_keys has \['momentum_buffer'\].*'exp_avg'"):
        swap_optimizer(
            opt, SwapOptimizerConfig(state_keys=("momentum_buffer",), runtime="loopback")
        )


def test_master_params_on_a_family_without_them() -> None:
    opt = torch.optim.Adam(_params())
    config = SwapOptimizerConfig(include_master_params=True, runtime="loopback")
    with pytest.raises(ValueError, match="include_master_params=True.*keeps no master weights"):
        swap_optimizer(opt, config)


def test_not_an_optimizer_points_at_the_wrapped_one() -> None:
    with pytest.raises(TypeError, match=r"needs a torch\.optim\.Optimizer.*\.optimizer"):
        swap_optimizer(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a SwapOptimizerConfig"):
        swap_optimizer(torch.optim.Adam(_params()), {"swap_times": 4})  # type: ignore[arg-type]


def test_only_the_torch_engine_serves_a_torch_optimizer() -> None:
    from swapopt_core._mindspore.engine import MindSporeSwapEngine
    from swapopt_core._torch.engine import SwapEngine

    opt = torch.optim.Adam(_params())
    assert SwapEngine.serves(opt) and not MindSporeSwapEngine.serves(opt)
    assert not SwapEngine.serves(object())
    assert SwapEngine.param_devices(opt) == {"cpu"}
    assert api._engine_class(opt) is SwapEngine


def test_second_install_with_another_config_is_refused() -> None:
    opt = torch.optim.Adam(_params())
    assert swap_optimizer(opt, LOOPBACK) is opt
    assert swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback")) is opt  # same config
    with pytest.raises(SwapOptError, match="already swapped.*unswap_optimizer"):
        swap_optimizer(opt, SwapOptimizerConfig(swap_times=2, runtime="loopback"))
    unswap_optimizer(opt)
    assert swap_optimizer(opt, SwapOptimizerConfig(swap_times=2, runtime="loopback")) is opt


def test_stats_of_an_unswapped_optimizer() -> None:
    with pytest.raises(ValueError, match="is not swapped; call swap_optimizer"):
        swap_stats(torch.optim.Adam(_params()))


def test_auto_on_cpu_swaps_nothing_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "_warned_cpu_auto", False)
    first, second = torch.optim.Adam(_params()), torch.optim.Adam(_params())
    with pytest.warns(SwapOptWarning, match="nothing is swapped.*runtime='loopback'"):
        assert swap_optimizer(first) is first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swap_optimizer(second)
    assert not is_swap_optimizer(first) and not is_swap_optimizer(second)


def test_packed_states_on_several_devices_are_refused() -> None:
    staging = PackedStaging(LoopbackRuntime(), TorchTensorOps(), DeviceLedger())
    slots = [
        Slot(torch.empty(4), "exp_avg", torch.zeros(4), torch.zeros(4), torch.device("cuda", i))
        for i in range(2)
    ]
    with pytest.raises(SwapOptError, match=r"\['cuda:0', 'cuda:1'\].*packed_swap=False"):
        staging.layout(slots)


@pytest.mark.parametrize("packed", [True, False])
def test_a_failed_install_leaves_a_plain_working_optimizer(
    monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
        opt.zero_grad()
        model(torch.randn(4, 64, generator=torch.Generator().manual_seed(seed))).sum().backward()
        opt.step()

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)))
    plain, victim = (torch.optim.Adam(m.parameters()) for m in models)
    for model, opt in zip(models, (plain, victim), strict=True):
        train(model, opt, 0)

    def no_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise MemoryError("host full")

    monkeypatch.setattr(LoopbackRuntime, "alloc_host", no_memory)
    config = SwapOptimizerConfig(runtime="loopback", min_numel=0, packed_swap=packed)
    with pytest.raises(MemoryError):
        swap_optimizer(victim, config)
    assert not is_swap_optimizer(victim)
    assert not victim._optimizer_step_post_hooks
    assert not victim._optimizer_load_state_dict_pre_hooks
    for model, opt in zip(models, (plain, victim), strict=True):
        train(model, opt, 1)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
        assert all(torch.equal(v, victim.state[b][k]) for k, v in plain.state[a].items())


def test_an_adapter_without_the_torch_protocol_is_refused_by_name() -> None:
    class HalfAdapter:
        framework = "torch"
        family = "half"
        state_key_names = ("exp_avg",)

        def matches(self, optimizer: object) -> bool:
            return True

    class Plugin:
        @hookimpl
        def swapopt_register_optimizer_adapters(self) -> list[object]:
            return [HalfAdapter()]

    manager = new_plugin_manager(load_entrypoints=False)
    manager.register(Plugin())
    with pytest.raises(SwapOptError, match=r"HalfAdapter.*it lacks .*state_keys.*update"):
        swap_optimizer(torch.optim.Adam(_params()), LOOPBACK, plugin_manager=manager)


def test_a_family_that_keeps_no_state_gets_no_state_entries() -> None:
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1)  # no momentum: torch's SGD keeps nothing
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", min_numel=8))
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    assert opt.state_dict()["state"] == {}
    unswap_optimizer(opt)
    assert opt.state_dict()["state"] == {}
