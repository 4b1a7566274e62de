"""A retry resumes an interrupted MindSpore step only with the very gradients it failed with.

The step remembers which call it was; new gradients that land at the addresses of the dead
ones (CPython hands a freed object's address to the next object of its size) are another
call, which starts a fresh step.
"""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import Parameter, Tensor, nn  # noqa: E402

from swapopt_core import SwapOptimizerConfig, swap_optimizer, unswap_optimizer  # noqa: E402
from swapopt_core._swap.engine import engine_of  # noqa: E402

pytestmark = pytest.mark.mindspore

SHAPE = (8, 4)
TRIES = 1000


class Injected(Exception):
    pass


@pytest.fixture(autouse=True)
def _pynative_cpu() -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


def _grads(seed: int) -> tuple[Tensor, ...]:
    rng = np.random.default_rng(seed)
    return tuple(Tensor(rng.standard_normal(SHAPE).astype(np.float32)) for _ in range(2))


def _fail_second_batch(opt: object) -> None:
    """The next step updates its first batch, then its second batch's update raises."""
    adapter = engine_of(opt).adapter
    original, calls = adapter.update_batch, [0]

    def faulty(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == 2:
            adapter.update_batch = original
            raise Injected("second batch")
        return original(*args, **kwargs)

    adapter.update_batch = faulty


def test_new_gradients_at_the_dead_ones_addresses_start_a_fresh_step() -> None:
    params = [Parameter(Tensor(np.ones(SHAPE, np.float32)), name=f"w{i}") for i in range(2)]
    # With weight decay the step prepares decayed copies of the gradients: nothing of the
    # interrupted step but its identity could keep the gradients themselves alive.
    opt = nn.Adam(params, learning_rate=0.1, weight_decay=0.01)
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", min_numel=0, swap_times=2))
    try:
        opt(_grads(0))
        grads = _grads(1)
        _fail_second_batch(opt)
        try:
            opt(grads)
        except Injected:
            pass
        else:  # pragma: no cover - the injection did not fire
            pytest.fail("the step did not fail")
        # The script gives up on these gradients and computes new ones.
        addresses = {id(g) for g in grads}
        rng = np.random.default_rng(2)
        arrays = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(TRIES)]
        del grads
        tries = []
        for array in arrays:
            tries.append(Tensor(array))
            if addresses <= {id(t) for t in tries}:
                break
        landed = [t for t in tries if id(t) in addresses]
        fresh = tuple(landed + tries[: 2 - len(landed)])  # at those addresses where it could
        before = [p.asnumpy().copy() for p in params]
        opt(fresh)
        # A fresh step: every parameter moves, the one the failed call updated included.
        for was, param in zip(before, params, strict=True):
            assert not np.array_equal(was, param.asnumpy()), param.name
    finally:
        unswap_optimizer(opt)
