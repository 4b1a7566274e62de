"""The compiled batch update of each MindSpore family and its undo copy.

Each batch's update is one jit-compiled graph, built on the first step and called again on
every later one; the undo copy of a batch lives in an arena reused from batch to batch (or
in a buffer per tensor where the runtime has no views at an offset) and restores the
parameters and the resident state exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import Parameter, Tensor, nn  # noqa: E402
from mindspore.ops import functional as F  # noqa: E402

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats  # noqa: E402
from swapopt_core._mindspore import graphs, momentum_graphs  # noqa: E402
from swapopt_core._mindspore.adapter import GraphCache  # noqa: E402
from swapopt_core._mindspore.runtime import MindSporeLoopbackRuntime  # noqa: E402
from swapopt_core._mindspore.state import MindSporeTensorOps  # noqa: E402
from swapopt_core._swap.engine import engine_of  # noqa: E402
from swapopt_core._swap.undo import UndoArena  # noqa: E402

pytestmark = pytest.mark.mindspore

SHAPES = [(12, 8), (8,), (16, 4), (3,), (10, 6)]


@pytest.fixture(autouse=True)
def _pynative_cpu():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


def _params(seed: int = 0) -> list[Parameter]:
    rng = np.random.default_rng(seed)
    return [
        Parameter(Tensor(rng.standard_normal(s).astype(np.float32)), name=f"w{i}")
        for i, s in enumerate(SHAPES)
    ]


def _grads(step: int) -> tuple[Tensor, ...]:
    rng = np.random.default_rng(100 + step)
    return tuple(Tensor(rng.standard_normal(s).astype(np.float32)) for s in SHAPES)


FAMILIES = {
    "adam": (lambda ps: nn.Adam(ps, learning_rate=1e-2), graphs.AdamBatch),
    "adamwd": (
        lambda ps: nn.AdamWeightDecay(ps, learning_rate=1e-2, weight_decay=0.01),
        graphs.AdamWeightDecayBatch,
    ),
    "momentum": (lambda ps: nn.Momentum(ps, 1e-2, 0.9), momentum_graphs.MomentumBatch),
    "sgd": (lambda ps: nn.SGD(ps, 1e-2, momentum=0.9), momentum_graphs.SGDBatch),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_batch_is_compiled_once_and_called_again(family, monkeypatch):
    make, batch_cell = FAMILIES[family]
    built: list[object] = []
    original = batch_cell.__init__

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(batch_cell, "__init__", counting)
    ref_params, params = _params(), _params()
    ref, opt = make(ref_params), make(params)
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", min_numel=0, swap_times=3))
    for step in range(4):
        ref(_grads(step))
        opt(_grads(step))
    batches = swap_stats(opt).batches
    assert len(built) == batches  # one graph per batch, built on the first step only
    assert len(engine_of(opt).graphs) == batches + 1  # and the preamble's
    for a, b in zip(ref_params, params, strict=True):
        assert np.array_equal(a.asnumpy(), b.asnumpy())
    names = {p.name for p in opt.parameters_dict().values()}
    assert names == {p.name for p in ref.parameters_dict().values()}  # nothing renamed


def test_a_new_batch_split_compiles_anew_and_drops_the_old_graphs():
    params = _params()
    opt = nn.Adam(params, learning_rate=1e-2)
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", min_numel=0, swap_times=2))
    opt(_grads(0))
    engine = engine_of(opt)
    assert len(engine.graphs) == 2 + 1
    engine.config = SwapOptimizerConfig(runtime="loopback", min_numel=0, swap_times=5)
    opt(_grads(1))
    assert len(engine.graphs) == 5 + 1


def test_the_graph_cache_keeps_what_the_last_step_used():
    cache = GraphCache()
    assert cache.get("a", lambda: 1) == 1
    assert cache.get("a", lambda: 2) == 1  # built once
    cache.get("b", lambda: 3)
    cache.prune()
    cache.get("b", lambda: 4)
    cache.prune()
    assert len(cache) == 1 and cache.get("b", lambda: 5) == 3
    cache.clear()
    assert len(cache) == 0


class _NoOffsets(MindSporeLoopbackRuntime):
    """The loopback runtime as a runtime without device views at an offset."""

    name = "loopback-no-offsets"
    views_at_offset = False

    def __init__(self) -> None:
        super().__init__()
        self.released = 0

    def release_device(self, tensor, after=()):  # noqa: ANN001, ANN201
        self.released += 1


@pytest.mark.parametrize("runtime_type", [MindSporeLoopbackRuntime, _NoOffsets])
def test_the_undo_copy_puts_every_target_back(runtime_type):
    targets = [(p, "CPU") for p in _params()]
    before = [p.asnumpy().copy() for p, _ in targets]
    runtime = runtime_type()
    arena = UndoArena(MindSporeTensorOps(runtime), [targets[:2], targets[2:]])
    for batch in (targets[:2], targets[2:]):
        saved = arena.save(batch)
        for target, _ in batch:
            F.assign(target, target * 3.0)
        arena.restore(saved)
    arena.release()
    for (target, _), value in zip(targets, before, strict=True):
        assert np.array_equal(target.asnumpy(), value)
    if isinstance(runtime, _NoOffsets):
        assert runtime.released == len(targets)  # a buffer per tensor, each given back
