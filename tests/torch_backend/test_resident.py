"""``resident_state_fraction``: the leading state stays on the device, bit for bit as plain.

The resident part is a prefix of the parameters in ``param_groups`` order, chosen by
``resident_count`` over the bytes of every parameter's swappable state (with a gradient this
step or not), updated first in the step and never copied.
"""

from __future__ import annotations

import pytest
import torch

from swapopt_core import swap_optimizer, swap_stats, unswap_optimizer
from swapopt_core._planning.resident import resident_count
from swapopt_core._swap.engine import engine_of
from tests.conftest import assert_same, loopback, make_model, train, twin

#: Each test runs on the synchronous loopback and on loopback-async with jitter.
pytestmark = pytest.mark.usefixtures("swap_runtime")


def _unit_bytes(opt: torch.optim.Optimizer, min_numel: int) -> list[int]:
    """Swappable state bytes of every parameter, in ``param_groups`` order."""
    costs = []
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            costs.append(
                sum(
                    v.numel() * v.element_size()
                    for k, v in state.items()
                    if k != "step" and v.numel() >= min_numel
                )
            )
    return costs


def _expected_resident(opt: torch.optim.Optimizer, fraction: float, min_numel: int) -> int:
    costs = _unit_bytes(opt, min_numel)
    return sum(costs[: resident_count(costs, fraction)]) if fraction > 0 else 0


#: The parameters of the first group (the rest, ``odd`` among them, form the second).
FIRST = ("fc1", "fc2.w")


def _adam(model: torch.nn.Module, **flags) -> torch.optim.Optimizer:
    return torch.optim.Adam(
        [
            {"params": [model.fc1.weight, model.fc1.bias, model.fc2.weight]},
            {"params": [p for n, p in model.named_parameters() if not n.startswith(FIRST)]},
        ],
        lr=0.01,
        **flags,
    )


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("fraction", [0.3, 0.6, 1.0])
@pytest.mark.parametrize(
    "how",
    [{}, {"clip": 0.5, "accumulate": 2}, {"flags": {"amsgrad": True, "foreach": False}}],
    ids=["plain", "clip_accumulate", "amsgrad"],
)
def test_resident_part_trains_bit_for_bit(fraction: float, packed: bool, how: dict) -> None:
    how = dict(how)
    flags = how.pop("flags", {})
    ma = make_model()
    mb = twin(ma)
    oa, ob = _adam(ma, **flags), _adam(mb, **flags)
    config = loopback(
        swap_times=3, min_numel=64, packed_swap=packed, resident_state_fraction=fraction
    )
    swap_optimizer(ob, config)
    sa = torch.optim.lr_scheduler.StepLR(oa, 2, 0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, 2, 0.5)
    engine = engine_of(ob)
    chosen = None
    for step in range(8):
        assert train(ma, oa, 1, start=step, scheduler=sa, **how) == train(
            mb, ob, 1, start=step, scheduler=sb, **how
        )
        assert_same(oa, ob, ma, mb)
        stats = swap_stats(ob)
        held = _expected_resident(ob, fraction, 64)
        assert stats.resident_for_good_bytes == held > 0
        # Between steps only the resident part is on the device.
        assert stats.resident_state_bytes == held
        assert stats.total_state_bytes == sum(_unit_bytes(ob, 64))
        assert stats.resident_state_fraction == fraction
        # The resident entries are plain tensors, not host slots.
        assert all(key[0] not in engine.book.resident for key in engine.book.slots)
        # ``odd`` has a gradient on odd steps only: which parameters are resident holds still.
        if step >= 1:
            chosen = dict(engine.book.resident) if chosen is None else chosen
            assert engine.book.resident == chosen
    if fraction == 1.0:
        # Never copied: the state came in once, at the first step, outside the pipeline.
        assert stats.h2d_bytes == stats.d2h_bytes == 0 and stats.host_state_bytes == 0


def test_resident_units_are_updated_first() -> None:
    model = make_model()
    opt = _adam(model, foreach=False)
    swap_optimizer(opt, loopback(swap_times=4, min_numel=64, resident_state_fraction=0.5))
    engine = engine_of(opt)
    train(model, opt, 1)
    seen: list[list[int]] = []
    update = engine.adapter.update

    def spy(optimizer, group, params, grads, states):  # noqa: ANN001, ANN202
        seen.append([id(p) for p in params])
        return update(optimizer, group, params, grads, states)

    engine.adapter.update = spy  # type: ignore[method-assign]
    train(model, opt, 1, start=2)
    resident = set(engine.book.resident)
    order = [pid for call in seen for pid in call]
    firsts = order[: len(resident)]
    assert resident and set(firsts) == resident


def test_state_dict_round_trip_with_a_resident_part() -> None:
    """A swapped optimizer's checkpoint (resident part and host part) loads into a plain one
    and back, and training goes on bit for bit."""
    ma = make_model()
    mb, mc = twin(ma), twin(ma)
    oa, ob = _adam(ma), _adam(mb)
    swap_optimizer(ob, loopback(swap_times=3, min_numel=64, resident_state_fraction=0.5))
    train(ma, oa, 3)
    train(mb, ob, 3)
    # Swapped -> plain.
    oc = _adam(mc)
    mc.load_state_dict(mb.state_dict())
    oc.load_state_dict(ob.state_dict())
    train(ma, oa, 2, start=3)
    train(mc, oc, 2, start=3)
    assert_same(oa, oc, ma, mc)
    # Plain -> swapped (a fresh swapped optimizer, before its first step).
    md = twin(mc)
    od = _adam(md)
    swap_optimizer(od, loopback(swap_times=3, min_numel=64, resident_state_fraction=0.5))
    od.load_state_dict(oc.state_dict())
    assert swap_stats(od).resident_for_good_bytes == _expected_resident(od, 0.5, 64) > 0
    train(ma, oa, 2, start=5)
    train(md, od, 2, start=5)
    assert_same(oa, od, ma, md)
    unswap_optimizer(od)
    assert_same(oa, od, ma, md)


def test_a_failed_resident_update_is_undone_and_retried() -> None:
    ma = make_model()
    mb = twin(ma)
    oa, ob = _adam(ma), _adam(mb)
    swap_optimizer(ob, loopback(swap_times=3, min_numel=64, resident_state_fraction=0.5))
    train(ma, oa, 2)
    train(mb, ob, 2)
    engine = engine_of(ob)
    update = engine.adapter.update
    calls = {"n": 0}

    def failing(optimizer, group, params, grads, states):  # noqa: ANN001, ANN202
        calls["n"] += 1
        update(optimizer, group, params, grads, states)
        if calls["n"] == 1:
            raise RuntimeError("injected")

    engine.adapter.update = failing  # type: ignore[method-assign]
    for opt, model in ((oa, ma), (ob, mb)):
        opt.zero_grad()
        train_loss = torch.nn.functional.mse_loss(model(torch.ones(8, 16), 2), torch.zeros(8, 4))
        train_loss.backward()
    oa.step()
    with pytest.raises(RuntimeError, match="injected"):
        ob.step()
    ob.step()  # the retry with the same gradients finishes the step
    assert_same(oa, ob, ma, mb)
    engine.adapter.update = update  # type: ignore[method-assign]
    train(ma, oa, 2, start=3)
    train(mb, ob, 2, start=3)
    assert_same(oa, ob, ma, mb)
