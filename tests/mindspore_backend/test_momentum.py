"""``nn.Momentum`` and ``nn.SGD`` swapped on CPU, and what the MindSpore backend refuses.

Every configuration ends bit-identical to the same optimizer without swapopt, parameters
and every state Parameter (``moments``; ``accum`` and ``stat``), packed and per tensor;
checkpoints of a swapped optimizer load into a plain one. Optimizers no family serves and
flags that need the state resident are refused with ``UnsupportedOptimizerError``, which
the automatic ways in catch; a bad gradient at step time is a plain ``SwapOptError``.
"""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import Parameter, Tensor, nn  # noqa: E402

from swapopt_core import (  # noqa: E402
    SwapOptError,
    SwapOptimizerConfig,
    UnsupportedOptimizerError,
    is_swap_optimizer,
    swap_optimizer,
    swap_stats,
)

pytestmark = pytest.mark.mindspore

SHAPES = [(64, 32), (32,), (96, 48), (3,), (40, 40), (16, 64)]
STEPS = 6
#: See ``test_mindspore.ASYNC_JITTER_US``: MindSpore's launches take milliseconds.
ASYNC_JITTER_US = "2000"


@pytest.fixture(autouse=True)
def _pynative_cpu(monkeypatch):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    monkeypatch.setenv("SWAPOPT_LOOPBACK_JITTER_US", ASYNC_JITTER_US)


def make_params(seed: int = 0) -> list[Parameter]:
    rng = np.random.default_rng(seed)
    return [
        Parameter(Tensor(rng.standard_normal(s).astype(np.float32)), name=f"layer{i}.w")
        for i, s in enumerate(SHAPES)
    ]


def grads_for(step: int) -> tuple[Tensor, ...]:
    rng = np.random.default_rng(1000 + step)
    return tuple(Tensor(rng.standard_normal(s).astype(np.float32)) for s in SHAPES)


def groups(params: list[Parameter]) -> list[dict]:
    return [
        {"params": params[:3], "weight_decay": 0.1, "lr": 0.02},
        {"params": params[3:], "weight_decay": 0.0},
    ]


class StepDecay(nn.Cell):
    """A dynamic weight decay: it grows with the global step."""

    def construct(self, global_step):
        return ms.ops.cast(global_step, ms.float32) * 0.01 + 0.001


FAMILIES = {
    "momentum": lambda ps: nn.Momentum(ps, 0.01, 0.9),
    "momentum-nesterov-decay-lossscale": lambda ps: nn.Momentum(
        ps, 0.01, 0.9, weight_decay=0.01, loss_scale=128.0, use_nesterov=True
    ),
    "momentum-groups-schedule": lambda ps: nn.Momentum(
        groups(ps), nn.CosineDecayLR(1e-4, 1e-2, 4), 0.9
    ),
    "momentum-dynamic-decay": lambda ps: nn.Momentum(
        [{"params": ps[:3], "weight_decay": StepDecay()}, {"params": ps[3:]}], 0.01, 0.9
    ),
    "momentum-list-lr": lambda ps: nn.Momentum(ps, [0.01 * (i + 1) for i in range(STEPS)], 0.8),
    "sgd": lambda ps: nn.SGD(ps, 0.01, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd-nesterov-groups-lossscale": lambda ps: nn.SGD(
        groups(ps), 0.01, momentum=0.9, nesterov=True, loss_scale=64.0
    ),
    "sgd-no-momentum": lambda ps: nn.SGD(ps, 0.05, weight_decay=0.01),
}

#: Each family on the loopback; the two kernels with the pipeline's batches in flight on
#: ``loopback-async`` (each case compiles its own batch graphs).
EQUIVALENCE = [
    *[pytest.param(f, "loopback", 3, id=f"loopback-3-{f}") for f in sorted(FAMILIES)],
    pytest.param("momentum", "loopback", 6, id="loopback-6-momentum"),
    pytest.param("sgd", "loopback", 2, id="loopback-2-sgd"),
    *[
        pytest.param(f, "loopback-async", 3, id=f"loopback-async-3-{f}")
        for f in ("momentum-nesterov-decay-lossscale", "sgd-nesterov-groups-lossscale")
    ],
]


def config(**kwargs) -> SwapOptimizerConfig:
    kwargs.setdefault("runtime", "loopback")
    kwargs.setdefault("min_numel", 0)
    return SwapOptimizerConfig(**kwargs)


def assert_same(ref_params, params, ref_opt, opt) -> None:
    for a, b in zip(ref_params, params, strict=True):
        assert np.array_equal(a.asnumpy(), b.asnumpy()), a.name
    ref_state = {name: p.asnumpy() for name, p in ref_opt.parameters_dict().items()}
    state = {name: p.asnumpy() for name, p in opt.parameters_dict().items()}
    assert ref_state.keys() == state.keys()
    for name, value in ref_state.items():
        assert np.array_equal(value, state[name]), name


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
@pytest.mark.parametrize(("family", "runtime", "swap_times"), EQUIVALENCE)
def test_swapped_updates_equal_the_plain_optimizer(family, packed, runtime, swap_times):
    make = FAMILIES[family]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    assert swap_optimizer(opt, config(runtime=runtime, swap_times=swap_times, packed_swap=packed))
    for step in range(STEPS):
        ref(grads_for(step))
        opt(grads_for(step))
        assert swap_stats(opt).resident_state_bytes == 0
    assert_same(ref_params, params, ref, opt)
    assert not np.array_equal(params[0].asnumpy(), make_params()[0].asnumpy())  # it trained
    stats = swap_stats(opt)
    assert stats.batches == swap_times
    assert stats.h2d_bytes == stats.d2h_bytes == STEPS * stats.total_state_bytes
    per_param = 1 if family.startswith("momentum") else 2  # moments; accum and stat
    assert stats.swapped_tensors == per_param * len(SHAPES)


def test_sgd_without_momentum_swaps_the_buffers_its_kernel_ignores():
    # MindSpore allocates accum and stat on the device whatever the momentum; with none the
    # kernel neither reads nor writes them, so swapped they stay what they were.
    params = make_params()
    opt = nn.SGD(params, 0.05)
    swap_optimizer(opt, config(swap_times=2))
    for step in range(2):
        opt(grads_for(step))
    assert swap_stats(opt).total_state_bytes == 2 * sum(int(np.prod(s)) * 4 for s in SHAPES)
    assert all(not a.asnumpy().any() for a in opt.accum)
    assert all((s.asnumpy() == 1).all() for s in opt.stat)


def test_state_keys_keep_the_other_sgd_state_resident():
    ref_params, params = make_params(), make_params()
    ref, opt = FAMILIES["sgd"](ref_params), FAMILIES["sgd"](params)
    swap_optimizer(opt, config(swap_times=3, state_keys=("momentum_buffer",)))
    for step in range(STEPS):
        ref(grads_for(step))
        opt(grads_for(step))
    assert_same(ref_params, params, ref, opt)
    stats = swap_stats(opt)
    assert stats.swapped_tensors == len(SHAPES)
    assert stats.host_state_bytes == sum(int(np.prod(s)) * 4 for s in SHAPES)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
@pytest.mark.parametrize("family", ["momentum-nesterov-decay-lossscale", "sgd"])
def test_a_checkpoint_loads_into_a_swapped_and_a_plain_optimizer(tmp_path, family, packed):
    make = FAMILIES[family]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    swap_optimizer(opt, config(swap_times=3, packed_swap=packed))
    for step in range(3):
        ref(grads_for(step))
        opt(grads_for(step))
    path = str(tmp_path / "opt.ckpt")
    ms.save_checkpoint(opt, path)
    resumed_params, plain_params = make_params(seed=7), make_params(seed=8)
    resumed, plain = make(resumed_params), make(plain_params)
    swap_optimizer(resumed, config(swap_times=3, packed_swap=packed))
    for optimizer in (resumed, plain):
        ms.load_param_into_net(optimizer, ms.load_checkpoint(path))
    assert_same(ref_params, params, ref, plain)  # the checkpoint holds the swapped state
    for step in range(3, STEPS):
        for optimizer in (ref, opt, resumed, plain):
            optimizer(grads_for(step))
    assert_same(ref_params, params, ref, opt)
    assert_same(ref_params, resumed_params, ref, resumed)
    assert_same(ref_params, plain_params, ref, plain)
    assert swap_stats(resumed).resident_state_bytes == 0


def _parallel(params):
    opt = nn.Momentum(params, 0.01, 0.9)
    opt.use_parallel = True  # as the parallel optimizer's context would set it
    return opt


def _mindformers_swap(params):
    adamw = pytest.importorskip("mindformers.core.optim.adamw")
    return adamw.AdamW(params, swap=True)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (_parallel, r"mindspore\.nn\.Momentum.*use_parallel=True"),
        (lambda ps: nn.Adam(ps, use_lazy=True), "use_lazy=True"),
        (lambda ps: nn.Adam(ps, use_offload=True), "use_offload=True"),
        (_mindformers_swap, "swap=True"),
        (lambda ps: nn.Adagrad(ps), "Adagrad"),
        (lambda ps: nn.Lamb(ps, learning_rate=0.01), "Lamb"),
    ],
    ids=["parallel", "lazy", "offload", "mindformers-swap", "adagrad", "lamb"],
)
def test_what_cannot_be_swapped_is_refused_as_unsupported(build, match):
    opt = build(make_params())
    with pytest.raises(UnsupportedOptimizerError, match=match):
        swap_optimizer(opt, config())
    assert not is_swap_optimizer(opt)


def test_a_gradient_that_is_not_dense_is_an_error_of_the_step_not_of_the_optimizer():
    params = make_params()
    opt = nn.Momentum(params, 0.01, 0.9)
    swap_optimizer(opt, config(swap_times=2))
    grads = grads_for(0)
    with pytest.raises(SwapOptError, match=r"gradients\[1\] is a ndarray.*dense") as info:
        opt((grads[0], grads[1].asnumpy(), *grads[2:]))
    assert not isinstance(info.value, UnsupportedOptimizerError)
    ref_params = make_params()
    ref = nn.Momentum(ref_params, 0.01, 0.9)
    ref(grads)
    opt(grads)  # nothing was touched: the step runs as if the bad call never happened
    assert_same(ref_params, params, ref, opt)
