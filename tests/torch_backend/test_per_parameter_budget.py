"""The device budget of one ``OffloadSession`` over the whole step, with optimizers of the
generic per-parameter path: training ends bit for bit where plain training does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from swapopt_core import (
    OffloadConfig,
    OffloadSession,
    SwapOptimizerConfig,
    swap_optimizer,
    swap_stats,
)
from tests.activations.loops import backward, gpt, tokens
from tests.conftest import ASYNC_JITTER_US

MIB = 2**20
STEPS = 4

OPTIMIZERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "SGD_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "Adafactor": lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01),
    # Muon takes matrices only; the rest of the model keeps its gradients untouched.
    "Muon": lambda m: torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02),
}

pytestmark = pytest.mark.usefixtures("single_thread")


#: Adafactor's factored state is small (a row and a column per matrix): swapped ahead of the
#: session with a small ``min_numel``, which the session keeps, so some of it really moves.
PRE_SWAPPED = {"Adafactor"}


def _train(name: str, session_config: OffloadConfig | None) -> tuple:
    model = gpt()
    opt = OPTIMIZERS[name](model)
    if session_config is not None and name in PRE_SWAPPED:
        swap_optimizer(opt, SwapOptimizerConfig(runtime=session_config.runtime, min_numel=16))
    session = None if session_config is None else OffloadSession(session_config, optimizer=opt)
    for step in range(STEPS):
        if session is None:
            backward(model, tokens(step))
        else:
            with session:
                backward(model, tokens(step))
        opt.step()
        opt.zero_grad()
    return model, opt, session


def _assert_same(a: tuple, b: tuple) -> None:
    (model_a, opt_a, _), (model_b, opt_b, _) = a, b
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q)
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key, entries in state_a.items():
        assert entries.keys() == state_b[key].keys()
        for name, value in entries.items():
            if torch.is_tensor(value):
                assert torch.equal(value.cpu(), state_b[key][name].cpu()), (key, name)
            else:
                assert value == state_b[key][name], (key, name)


@pytest.mark.parametrize("runtime", ["loopback", "loopback-async"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_training_under_a_device_budget_is_bit_exact(
    name: str, runtime: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if runtime == "loopback-async":
        monkeypatch.setenv("SWAPOPT_LOOPBACK_JITTER_US", ASYNC_JITTER_US)
    # The whole step's peak when everything fits: the budget below is a share of it.
    roomy = OffloadConfig(device_budget_mb=1 << 20, runtime=runtime, min_offload_kib=0)
    *_, probe = _train(name, roomy)
    peak = probe.stats().planned_step_peak_device_bytes
    budget_mb = peak * 0.6 / MIB
    tight = OffloadConfig(device_budget_mb=budget_mb, runtime=runtime, min_offload_kib=0)
    budgeted = _train(name, tight)
    _assert_same(budgeted, _train(name, None))
    model, opt, session = budgeted
    stats = session.stats()
    assert stats.planned_step_peak_device_bytes <= budget_mb * MIB
    assert stats.resident_state_fraction < 1.0 or stats.activation_budget_bytes is not None
    assert swap_stats(opt).swapped_tensors > 0
