"""Property tests (hypothesis): the packed layout over random shapes, dtypes and min_numel,
and a swapped optimizer equal to the plain one over small random models."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._swap.ledger import DeviceLedger
from swapopt_core._swap.staging import PackedStaging
from swapopt_core._torch.state import Slot
from swapopt_core._torch.tensor_ops import TorchTensorOps

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
tensors = st.tuples(shapes, st.sampled_from(DTYPES))


@settings(max_examples=60, deadline=None)
@given(st.lists(tensors, max_size=8), st.integers(1, 4), st.data())
def test_packed_layout_round_trips_every_slot(specs, parts, data) -> None:  # noqa: ANN001
    staging = PackedStaging(LoopbackRuntime(), TorchTensorOps(), DeviceLedger())
    slots = []
    for k, (shape, dtype) in enumerate(specs):
        value = torch.arange(k, k + torch.Size(shape).numel()).to(dtype).view(shape)
        slots.append(Slot(torch.empty(0), f"s{k}", value, value, torch.device("cpu")))
    expected = [s.host.clone() for s in slots]
    staging.layout(slots)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(slots)), max_size=parts - 1)))
    bounds = [0, *cuts, len(slots)]
    batches = [slots[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    staging.begin(batches)
    for i, batch in enumerate(batches):
        staged = staging.stage(i, batch)
        for device, host in staged.pairs:
            device.copy_(host)
        for slot in batch:
            view = staged.views[slot]
            assert view.shape == slot.host.shape and view.dtype == slot.host.dtype
            assert torch.equal(view, expected[slots.index(slot)])
            view.add_(1)
        for device, host in staged.pairs:
            host.copy_(device)
        staging.unstage(staged)
    staging.end()
    for slot, before in zip(slots, expected, strict=True):
        assert torch.equal(slot.host, before + 1)
    assert staging.ledger.current == 0


models = st.lists(st.tuples(shapes, st.sampled_from((torch.float32, torch.float64))), min_size=1)


@settings(max_examples=25, deadline=None)
@given(
    models.filter(lambda m: len(m) <= 6),
    st.integers(0, 8),
    st.integers(1, 5),
    st.booleans(),
    st.booleans(),
)
def test_swapped_equals_plain_on_random_models(specs, min_numel, swap_times, packed, ams) -> None:  # noqa: ANN001
    def build() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
        gen = torch.Generator().manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
            for shape, dtype in specs
        ]
        return params, torch.optim.Adam(params, lr=1e-2, amsgrad=ams)

    plain_params, plain = build()
    params, opt = build()
    config = SwapOptimizerConfig(
        swap_times=swap_times, min_numel=min_numel, runtime="loopback", packed_swap=packed
    )
    swap_optimizer(opt, config)
    for step in range(3):
        for ps, o in ((plain_params, plain), (params, opt)):
            gen = torch.Generator().manual_seed(step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            o.step()
    for a, b in zip(plain_params, params, strict=True):
        assert torch.equal(a, b)
        assert plain.state[a].keys() == opt.state[b].keys()
        for key, value in plain.state[a].items():
            assert torch.equal(value, opt.state[b][key])
    assert swap_stats(opt).resident_state_bytes == 0
