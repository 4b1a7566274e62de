"""The warmup keeps the budget: it makes room before an op allocates its outputs, whose sizes
it knows beforehand from the op run on meta tensors (issue 18, defect 5)."""

from __future__ import annotations

import pytest
import torch

from swapopt_core import OffloadConfig, OffloadSession
from tests.activations.loops import backward, gpt, natural_peak, same_grads, tokens


def test_the_warmup_of_a_gpt_stays_within_the_budget(runtime_name: str) -> None:
    budget = 0.3 * natural_peak()
    reference, model = gpt(), gpt()
    session = OffloadSession(
        OffloadConfig(
            max_resident_activation_mb=budget / 2**20, runtime=runtime_name, min_offload_kib=64
        )
    )
    batch = tokens(1)
    ref_loss = backward(reference, batch)
    with session:  # the warmup
        loss = backward(model, batch)
    assert torch.equal(loss, ref_loss) and same_grads(reference, model)
    stats = session.stats()
    assert stats.warmups == 1 and stats.d2h_bytes > 0  # the budget binds
    # Before: 1.24x the budget, since the warmup evicted only once an op's outputs existed.
    assert stats.last_peak_resident_activation_bytes <= budget
    for step in range(2, 4):  # the replays hold it too, same bits
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
        batch = tokens(step)
        ref_loss = backward(reference, batch)
        with session:
            loss = backward(model, batch)
        assert torch.equal(loss, ref_loss) and same_grads(reference, model)
        assert session.stats().last_peak_resident_activation_bytes <= budget
    assert session.stats().replays == 2


@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_the_warmup_budget_holds_with_dropout_and_regions(
    fraction: float, runtime_name: str
) -> None:
    from tests.activations.test_session import Net, _batch, _step

    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, runtime="loopback"))
    with probe:
        _step(Net(), _batch(0), seed=0)
    from swapopt_core._planning.simulate import simulate

    budget = fraction * simulate(probe.trace).natural_peak_bytes
    reference, model = Net(), Net()
    ref_loss, _ = _step(reference, _batch(0), seed=0)
    session = OffloadSession(
        OffloadConfig(
            max_resident_activation_mb=budget / 2**20, runtime=runtime_name, min_offload_kib=0
        )
    )
    with session:
        loss, _ = _step(model, _batch(0), seed=0)
    assert torch.equal(loss, ref_loss) and same_grads(reference, model)
    assert session.stats().last_peak_resident_activation_bytes <= budget
