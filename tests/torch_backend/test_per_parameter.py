"""The generic per-parameter path beyond the optimizer database: checkpoints of every family
(round trips and cross-loads with the unswapped optimizer), closures, schedulers, state_keys,
a resident share, reconfiguration and parameters of every shape and layout."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from swapopt_core import (
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._api import reconfigure_swap
from swapopt_core._swap.engine import engine_of
from tests.conftest import assert_same
from tests.torch_backend.per_parameter_cases import (
    FAMILIES,
    config,
    lockstep,
    make_net,
    make_opt,
    pair,
    step,
)

#: Each test runs on the synchronous loopback and on loopback-async with jitter.
pytestmark = pytest.mark.usefixtures("swap_runtime", "single_thread")

optim = torch.optim
PACKED = pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])


def _round_trip(state_dict: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


# ---- checkpoints ---------------------------------------------------------------------------


@PACKED
@pytest.mark.parametrize("saved_after", [2, 3], ids=["new_state_pending", "laid_out"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_state_dict_round_trip_keeps_training_exactly(
    name: str, saved_after: int, packed: bool
) -> None:
    """Swapped -> state_dict -> a fresh swapped optimizer: equal to an uninterrupted run.

    After 2 steps, the state ``odd``'s first step created is not packed yet; after 3 it is.
    The optimizer saved from goes on exactly too.
    """
    cls, kwargs = FAMILIES[name]
    plain_model, plain, model, opt = pair(cls, kwargs, config(packed))
    lockstep(plain_model, plain, model, opt, saved_after)
    twin_model, twin = copy.deepcopy((plain_model, plain))
    saved = _round_trip(opt.state_dict())
    assert all(
        v.device.type == "cpu"
        for s in saved["state"].values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    resumed_model = copy.deepcopy(model)
    resumed = make_opt(cls, resumed_model, kwargs)
    swap_optimizer(resumed, config(packed))
    resumed.load_state_dict(saved)
    assert swap_stats(resumed).h2d_bytes == 0  # loading moved nothing to the device
    lockstep(plain_model, plain, resumed_model, resumed, 3, start=saved_after)
    lockstep(twin_model, twin, model, opt, 3, start=saved_after)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_swapped_checkpoint_loads_into_the_plain_optimizer(name: str) -> None:
    cls, kwargs = FAMILIES[name]
    plain_model, plain, model, opt = pair(cls, kwargs, config())
    lockstep(plain_model, plain, model, opt, 3)
    other_model = copy.deepcopy(model)
    other = make_opt(cls, other_model, kwargs)
    other.load_state_dict(_round_trip(opt.state_dict()))
    for index in range(3, 6):
        step(plain_model, plain, index)
        step(other_model, other, index)
        assert_same(plain, other, plain_model, other_model)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_plain_checkpoint_loads_into_a_swapped_optimizer(name: str) -> None:
    cls, kwargs = FAMILIES[name]
    plain_model = make_net(cls)
    plain = make_opt(cls, plain_model, kwargs)
    for index in range(3):
        step(plain_model, plain, index)
    model = copy.deepcopy(plain_model)
    opt = make_opt(cls, model, kwargs)
    swap_optimizer(opt, config())
    opt.load_state_dict(_round_trip(plain.state_dict()))
    lockstep(plain_model, plain, model, opt, 3, start=3)


# ---- the step's other ways of use ----------------------------------------------------------


@pytest.mark.parametrize("name", ["SGD", "Rprop", "Adafactor", "Muon", "RMSprop"])
def test_a_closure_runs_once_and_its_loss_is_returned(name: str) -> None:
    cls, kwargs = FAMILIES[name]
    plain_model, plain, model, opt = pair(cls, kwargs, config())
    for index in range(4):
        losses: list[torch.Tensor] = []
        calls: list[int] = []
        for each_model, each in ((plain_model, plain), (model, opt)):

            def closure(
                m: Any = each_model, o: Any = each, i: int = index, seen: list[int] = calls
            ) -> torch.Tensor:
                seen.append(i)
                o.zero_grad()
                loss = m.loss(i)
                loss.backward()
                return loss

            losses.append(each.step(closure))
        assert torch.equal(losses[0], losses[1]) and len(calls) == 2
        assert_same(plain, opt, plain_model, model)


@PACKED
def test_state_keys_choose_what_the_generic_path_swaps(packed: bool) -> None:
    cls, kwargs = FAMILIES["RMSprop"]
    swap_config = config(packed, state_keys=("momentum_buffer",))
    plain_model, plain, model, opt = pair(cls, kwargs, swap_config)
    for index in range(4):
        step(plain_model, plain, index)
        step(model, opt, index)
        assert_same(plain, opt, plain_model, model)
    assert {key for _, key in engine_of(opt).slots} == {"momentum_buffer"}


@PACKED
@pytest.mark.parametrize("name", ["SGD", "Adagrad", "RMSprop", "Adafactor"])
def test_a_resident_share_of_the_state(name: str, packed: bool) -> None:
    cls, kwargs = FAMILIES[name]
    swap_config = config(packed, resident_state_fraction=0.5)
    plain_model, plain, model, opt = pair(cls, kwargs, swap_config)
    for index in range(5):
        step(plain_model, plain, index)
        step(model, opt, index)
        assert_same(plain, opt, plain_model, model)
    stats = swap_stats(opt)
    assert stats.resident_for_good_bytes > 0 and stats.swapped_tensors > 0


def test_unswap_and_swap_again_mid_training() -> None:
    cls, kwargs = FAMILIES["NAdam"]
    plain_model, plain, model, opt = pair(cls, kwargs, config())
    lockstep(plain_model, plain, model, opt, 3)
    unswap_optimizer(opt)
    for index in range(3, 5):
        step(plain_model, plain, index)
        step(model, opt, index)
        assert_same(plain, opt, plain_model, model)
    swap_optimizer(opt, config(False))
    lockstep(plain_model, plain, model, opt, 3, start=5)


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Muon", "SparseAdam"])
def test_a_tensor_learning_rate_under_a_scheduler(name: str) -> None:
    cls, kwargs = FAMILIES[name]
    kwargs = {**kwargs, "lr": torch.tensor(0.02)}
    plain_model, plain, model, opt = pair(cls, kwargs, config())
    scheds = tuple(optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain, opt))
    lockstep(plain_model, plain, model, opt, 4, schedulers=scheds)


@PACKED
@pytest.mark.parametrize("name", ["ASGD", "Rprop", "Adafactor", "SparseAdam"])
def test_installed_after_training_started_and_reconfigured(name: str, packed: bool) -> None:
    """State the family created before install is taken to host memory; ``min_numel``
    changes move entries in and out."""
    cls, kwargs = FAMILIES[name]
    plain_model = make_net(cls)
    model = copy.deepcopy(plain_model)
    plain, opt = make_opt(cls, plain_model, kwargs), make_opt(cls, model, kwargs)
    for index in range(2):
        step(plain_model, plain, index)
        step(model, opt, index)
    swap_optimizer(opt, config(packed))
    assert swap_stats(opt).swapped_tensors > 0
    lockstep(plain_model, plain, model, opt, 3, start=2)
    reconfigure_swap(opt, config(packed, min_numel=0, swap_times=2))
    lockstep(plain_model, plain, model, opt, 2, start=5, min_numel=0)
    reconfigure_swap(opt, config(packed, min_numel=600))
    lockstep(plain_model, plain, model, opt, 2, start=7, min_numel=600)


class ConvMixed(torch.nn.Module):
    """A 4-D convolution (optionally channels_last), a 3-D parameter and a bfloat16 head."""

    def __init__(self, channels_last: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.cube = torch.nn.Parameter(torch.randn(4, 6, 5))
        self.head = torch.nn.Linear(8, 4).to(torch.bfloat16)
        self.channels_last = channels_last
        if channels_last:
            self.conv.to(memory_format=torch.channels_last)

    def loss(self, index: int) -> torch.Tensor:
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(index))
        if self.channels_last:
            x = x.to(memory_format=torch.channels_last)
        h = self.conv(x).mean((2, 3))
        return self.head(h.bfloat16()).float().sum() + 0.01 * self.cube.square().sum()


@PACKED
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("name", ["SGD", "Adafactor", "Adagrad", "RMSprop"])
def test_conv_cube_and_bfloat16_parameters(name: str, channels_last: bool, packed: bool) -> None:
    """State of every shape and two dtypes; channels_last state (not contiguous) stays put."""
    cls, kwargs = FAMILIES[name]
    plain_model = ConvMixed(channels_last)
    model = copy.deepcopy(plain_model)
    plain, opt = cls(plain_model.parameters(), **kwargs), cls(model.parameters(), **kwargs)
    swap_optimizer(opt, config(packed, min_numel=0))
    for index in range(4):
        step(plain_model, plain, index)
        step(model, opt, index)
        assert_same(plain, opt, plain_model, model)
    tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    contiguous = sum(1 for v in tensors if v.is_contiguous())
    assert swap_stats(opt).swapped_tensors == contiguous > 0
