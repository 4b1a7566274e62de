"""The MindSpore backend on CPU: bit-exact swapped updates, checkpoints, errors, stats.

Every test runs real MindSpore kernels in PyNative mode on the loopback runtime, which
really allocates and frees the staged buffers and copies every byte; the equivalence,
checkpoint and transaction tests run on ``loopback-async`` with jitter too, where every
copy runs on a worker thread and a missing wait shows up as wrong bits.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import Parameter, ParameterTuple, Tensor, nn  # noqa: E402
from mindspore.ops import functional as F  # noqa: E402

from swapopt_core import (  # noqa: E402
    SwapOptError,
    SwapOptimizerConfig,
    SwapOptWarning,
    is_swap_optimizer,
    offload_optimizer_state,
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._mindspore.engine import MindSporeSwapEngine  # noqa: E402

pytestmark = pytest.mark.mindspore

SHAPES = [(64, 32), (32,), (96, 48), (3,), (40, 40), (16, 64)]
STEPS = 10
#: Jitter (microseconds) of ``loopback-async`` here. MindSpore hands each launch to its
#: worker thread, which takes milliseconds, so the 300 us of the torch suites never let a
#: copy land after an update that forgot to wait for it; 2 ms does.
ASYNC_JITTER_US = "2000"
RUNTIMES = ["loopback", "loopback-async"]


@pytest.fixture(autouse=True)
def _pynative_cpu(monkeypatch):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    # Read by loopback-async when a swap builds it; the synchronous loopback ignores it.
    monkeypatch.setenv("SWAPOPT_LOOPBACK_JITTER_US", ASYNC_JITTER_US)
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)


def make_params(seed: int = 0, dtype=np.float32) -> list[Parameter]:
    rng = np.random.default_rng(seed)
    return [
        Parameter(Tensor(rng.standard_normal(s).astype(dtype)), name=f"layer{i}.w")
        for i, s in enumerate(SHAPES)
    ]


def grads_for(step: int, params: list[Parameter]) -> tuple[Tensor, ...]:
    rng = np.random.default_rng(1000 + step)
    return tuple(
        Tensor(rng.standard_normal(p.shape).astype(ms.dtype_to_nptype(p.dtype))) for p in params
    )


def groups(params: list[Parameter]) -> list[dict]:
    return [
        {"params": params[:3], "weight_decay": 0.1, "lr": 0.02},
        {"params": params[3:], "weight_decay": 0.0},
    ]


def mf_adamw():
    mf = pytest.importorskip("mindformers.core.optim.adamw")
    return mf.AdamW


FAMILIES = {
    "adam": lambda ps: nn.Adam(ps, learning_rate=1e-2, weight_decay=0.01),
    "adam-amsgrad-groups": lambda ps: nn.Adam(groups(ps), learning_rate=1e-2, use_amsgrad=True),
    "adam-lossscale": lambda ps: nn.Adam(
        ps, learning_rate=1e-2, weight_decay=0.01, loss_scale=128.0
    ),
    "adamwd": lambda ps: nn.AdamWeightDecay(ps, learning_rate=1e-2, weight_decay=0.01),
    "adamwd-groups-schedule": lambda ps: nn.AdamWeightDecay(
        groups(ps), learning_rate=nn.CosineDecayLR(1e-4, 1e-2, 8), weight_decay=0.05
    ),
    "mindformers-adamw": lambda ps: mf_adamw()(ps, learning_rate=1e-2, weight_decay=0.01),
    "mindformers-adamw-groups": lambda ps: mf_adamw()(
        groups(ps), learning_rate=1e-2, betas=(0.9, 0.95)
    ),
}


def unfused(ps):
    opt = nn.AdamWeightDecay(ps, learning_rate=1e-2, weight_decay=0.01)
    opt.use_fused_opt = False
    return opt


FAMILIES["adamwd-unfused"] = unfused


def state_arrays(opt) -> dict[str, np.ndarray]:
    return {name: p.asnumpy() for name, p in opt.parameters_dict().items()}


def assert_same(ref_params, params, ref_opt, opt) -> None:
    for a, b in zip(ref_params, params, strict=True):
        assert np.array_equal(a.asnumpy(), b.asnumpy()), a.name
    ref_state, state = state_arrays(ref_opt), state_arrays(opt)
    assert ref_state.keys() == state.keys()
    for name, value in ref_state.items():
        assert np.array_equal(value, state[name]), name


def config(**kwargs) -> SwapOptimizerConfig:
    kwargs.setdefault("runtime", "loopback")
    kwargs.setdefault("min_numel", 0)
    return SwapOptimizerConfig(**kwargs)


#: Every family at every ``swap_times`` on the loopback; on ``loopback-async`` the three
#: families (and amsgrad's third state) at 3, the pipeline's three batches in flight: each
#: case compiles its own batch graphs, which is most of the suite's time.
ASYNC_FAMILIES = ("adam", "adam-amsgrad-groups", "adamwd", "mindformers-adamw")
EQUIVALENCE = [
    pytest.param(family, runtime, swap_times, id=f"{runtime}-{swap_times}-{family}")
    for runtime in RUNTIMES
    for swap_times in ([1, 3, 16] if runtime == "loopback" else [3])
    for family in sorted(FAMILIES)
    if runtime == "loopback" or family in ASYNC_FAMILIES
]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
@pytest.mark.parametrize(("family", "runtime", "swap_times"), EQUIVALENCE)
def test_swapped_updates_equal_the_plain_optimizer(family, packed, runtime, swap_times):
    make = FAMILIES[family]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    cfg = config(runtime=runtime, swap_times=swap_times, packed_swap=packed)
    assert swap_optimizer(opt, cfg) is opt
    for step in range(STEPS):
        grads = grads_for(step, params)
        ref(grads)
        opt(grads)
        assert swap_stats(opt).resident_state_bytes == 0
    assert_same(ref_params, params, ref, opt)
    stats = swap_stats(opt)
    assert stats.steps == STEPS and stats.packed is packed
    assert stats.h2d_bytes == stats.d2h_bytes == STEPS * stats.total_state_bytes


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_min_numel_and_state_keys_leave_the_rest_resident(packed):
    ref_params, params = make_params(), make_params()
    ref = nn.Adam(ref_params, learning_rate=1e-2, use_amsgrad=True)
    opt = nn.Adam(params, learning_rate=1e-2, use_amsgrad=True)
    cfg = config(min_numel=1024, state_keys=("exp_avg", "max_exp_avg_sq"), packed_swap=packed)
    swap_optimizer(opt, cfg)
    big = [i for i, s in enumerate(SHAPES) if int(np.prod(s)) >= 1024]
    assert swap_stats(opt).swapped_tensors == 2 * len(big)
    for step in range(STEPS):
        ref(grads_for(step, params))
        opt(grads_for(step, params))
    assert_same(ref_params, params, ref, opt)


def test_state_lives_in_host_memory_between_steps():
    params = make_params()
    opt = nn.AdamWeightDecay(params, learning_rate=1e-2)
    swap_optimizer(opt, config(swap_times=4, packed_swap=False))
    opt(grads_for(0, params))
    engine = opt._swapopt_engine
    assert isinstance(engine, MindSporeSwapEngine)
    for slot in engine.slots.values():
        assert slot.state.data_ptr() == slot.host.data_ptr()
    stats = swap_stats(opt)
    assert stats.resident_state_bytes == 0
    assert (
        stats.host_state_bytes
        == stats.total_state_bytes
        == 2 * sum(int(np.prod(s)) * 4 for s in SHAPES)
    )
    assert stats.pinned_host_bytes == stats.total_state_bytes


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_peak_follows_swap_times_for_equal_layers(runtime):
    rng = np.random.default_rng(3)
    params = [
        Parameter(Tensor(rng.standard_normal((32, 32)).astype(np.float32)), name=f"w{i}")
        for i in range(16)
    ]
    for packed in (False, True):
        opt = nn.Adam(params, learning_rate=1e-3)
        swap_optimizer(opt, config(runtime=runtime, swap_times=8, packed_swap=packed))
        opt(tuple(Tensor(np.ones((32, 32), np.float32)) for _ in params))
        stats = swap_stats(opt)
        # Three of eight batches: one coming in, one updating, one going out.
        assert stats.peak_resident_state_bytes * 8 == 3 * stats.total_state_bytes, packed
        unswap_optimizer(opt)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
@pytest.mark.parametrize("family", ["adam", "adamwd", "mindformers-adamw"])
def test_checkpoint_mid_run_resumes_exactly(tmp_path, family, packed, runtime):
    make = FAMILIES[family]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    swap_optimizer(opt, config(runtime=runtime, swap_times=3, packed_swap=packed))
    for step in range(5):
        ref(grads_for(step, params))
        opt(grads_for(step, params))
    path = str(tmp_path / "opt.ckpt")
    ms.save_checkpoint(opt, path)

    # A fresh swapped optimizer (and model) restored from the checkpoint.
    resumed_params = make_params(seed=7)
    resumed = make(resumed_params)
    swap_optimizer(resumed, config(runtime=runtime, swap_times=3, packed_swap=packed))
    ms.load_param_into_net(resumed, ms.load_checkpoint(path))
    assert offload_optimizer_state(resumed) == swap_stats(resumed).swapped_tensors
    engine = resumed._swapopt_engine
    assert all(s.state.data_ptr() == s.host.data_ptr() for s in engine.slots.values())
    assert swap_stats(resumed).resident_state_bytes == 0
    # The same checkpoint loads into the optimizer without swapopt.
    plain_params = make_params(seed=8)
    plain = make(plain_params)
    ms.load_param_into_net(plain, ms.load_checkpoint(path))
    for step in range(5, STEPS):
        grads = grads_for(step, params)
        for optimizer in (ref, opt, resumed, plain):
            optimizer(grads)
    assert_same(ref_params, params, ref, opt)
    assert_same(ref_params, resumed_params, ref, resumed)
    assert_same(ref_params, plain_params, ref, plain)


def test_a_load_without_offload_is_taken_back_at_the_next_step(tmp_path):
    ref_params, params = make_params(), make_params()
    ref = nn.Adam(ref_params, learning_rate=1e-2)
    opt = nn.Adam(params, learning_rate=1e-2)
    swap_optimizer(opt, config(swap_times=2))
    for step in range(3):
        ref(grads_for(step, params))
        opt(grads_for(step, params))
    path = str(tmp_path / "opt.ckpt")
    ms.save_checkpoint(opt, path)
    ms.load_param_into_net(opt, ms.load_checkpoint(path))
    for step in range(3, 6):
        ref(grads_for(step, params))
        opt(grads_for(step, params))
    assert_same(ref_params, params, ref, opt)
    assert all(s.state.data_ptr() == s.host.data_ptr() for s in opt._swapopt_engine.slots.values())


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_an_interrupted_step_finishes_exactly_when_repeated(packed, runtime):
    ref_params, params = make_params(), make_params()
    ref = nn.Adam(ref_params, learning_rate=1e-2)
    opt = nn.Adam(params, learning_rate=1e-2)
    swap_optimizer(opt, config(runtime=runtime, swap_times=4, packed_swap=packed))
    runtime = opt._swapopt_engine.runtime
    original = runtime.copy_in
    calls = {"n": 0}

    def flaky(pairs, after=(), **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # the third batch of the step: the first is already updated
            raise RuntimeError("copy engine hiccup")
        return original(pairs, after, **kw)

    for step in range(4):
        grads = grads_for(step, params)
        ref(grads)
        if step == 1:
            runtime.copy_in = flaky
            with pytest.raises(RuntimeError, match="hiccup"):
                opt(grads)
            runtime.copy_in = original
            assert swap_stats(opt).resident_state_bytes == 0
            assert swap_stats(opt).steps == 1
        opt(grads)
    assert_same(ref_params, params, ref, opt)


def test_unswap_restores_a_plain_optimizer():
    ref_params, params = make_params(), make_params()
    ref = nn.Adam(ref_params, learning_rate=1e-2)
    opt = nn.Adam(params, learning_rate=1e-2)
    swap_optimizer(opt, config(swap_times=2))
    assert is_swap_optimizer(opt)
    for step in range(3):
        ref(grads_for(step, params))
        opt(grads_for(step, params))
    assert unswap_optimizer(opt) is opt
    assert not is_swap_optimizer(opt)
    assert "construct" not in vars(opt)
    for step in range(3, 6):
        ref(grads_for(step, params))
        opt(grads_for(step, params))
    assert_same(ref_params, params, ref, opt)


def test_swapping_twice_with_the_same_config_is_a_no_op_and_another_config_is_refused():
    opt = nn.Adam(make_params(), learning_rate=1e-2)
    swap_optimizer(opt, config())
    assert swap_optimizer(opt, config()) is opt
    with pytest.raises(SwapOptError, match="already swapped"):
        swap_optimizer(opt, config(swap_times=3))


class MixedPrecisionAdamW:
    """Factory for a MindFormers AdamW that keeps fp32 masters of fp16 model parameters."""

    @staticmethod
    def build(params):
        base = mf_adamw()
        from mindformers.core.optim.adamw import _adamw_opt

        class _MixedPrecision(base):
            def __init__(self, params, **kwargs):
                super().__init__(params, **kwargs)
                self.fp32_params = ParameterTuple(
                    [
                        Parameter(Tensor(p.asnumpy().astype(np.float32)), name=f"master.{p.name}")
                        for p in self._parameters
                    ]
                )

            def construct(self, gradients):
                weight_decay, lr = self.get_weight_decay(), self.get_lr()
                F.assign_add(self.global_step, self.global_step_increase_tensor)
                for i, param in enumerate(self._parameters):
                    _adamw_opt(
                        self.beta1,
                        self.beta2,
                        self.eps,
                        self.global_step,
                        lr,
                        weight_decay,
                        self.fp32_params[i],
                        gradients[i],
                        self.exp_avg[i],
                        self.exp_avg_sq[i],
                        self.optim_filter[i],
                    )
                    F.assign(param, F.cast(self.fp32_params[i], F.dtype(param)))
                return True

        return _MixedPrecision(params, learning_rate=1e-2, weight_decay=0.01)


@pytest.mark.parametrize(
    ("masters", "runtime"),
    [(True, "loopback"), (False, "loopback"), (True, "loopback-async")],
    ids=["masters-swapped", "masters-resident", "masters-swapped-async"],
)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_fp32_masters_are_swapped_on_request(masters, runtime, packed):
    ref_params, params = make_params(dtype=np.float16), make_params(dtype=np.float16)
    ref, opt = MixedPrecisionAdamW.build(ref_params), MixedPrecisionAdamW.build(params)
    cfg = config(runtime=runtime, swap_times=3, include_master_params=masters, packed_swap=packed)
    swap_optimizer(opt, cfg)
    keys = {s.key for s in opt._swapopt_engine.slots.values()}
    assert ("master_param" in keys) is masters
    for step in range(STEPS):
        grads = grads_for(step, params)
        ref(grads)
        opt(grads)
    assert_same(ref_params, params, ref, opt)


# ---- errors ----------------------------------------------------------------------------


def test_include_master_params_without_masters_is_refused():
    opt = mf_adamw()(make_params(), learning_rate=1e-2)
    with pytest.raises(ValueError, match="include_master_params=True.*no master weights"):
        swap_optimizer(opt, config(include_master_params=True))
    assert not is_swap_optimizer(opt)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda ps: nn.Adam(ps, use_lazy=True), "use_lazy=True"),
        (lambda ps: nn.Adam(ps, use_offload=True), "use_offload=True"),
        (lambda ps: mf_adamw()(ps, swap=True), "swap=True"),
        (lambda ps: nn.Adagrad(ps), "mindspore optimizer families"),
    ],
    ids=["lazy", "offload", "mindformers-swap", "adagrad"],
)
def test_unsupported_flags_and_families_are_refused(build, match):
    opt = build(make_params())
    with pytest.raises(SwapOptError, match=match):
        swap_optimizer(opt, config())
    assert not is_swap_optimizer(opt)


def test_unknown_state_key_and_runtime_name_the_choices():
    with pytest.raises(ValueError, match=r"state_keys.*\['exp_avg', 'exp_avg_sq'\]"):
        swap_optimizer(nn.AdamWeightDecay(make_params()), config(state_keys=("momentum",)))
    choices = r"\['ascend', 'auto', 'loopback', 'loopback-async'\]"
    with pytest.raises(ValueError, match=rf"runtime='cuda'.*{choices}"):
        swap_optimizer(nn.Adam(make_params()), config(runtime="cuda"))


def test_graph_mode_is_refused_with_the_way_out():
    opt = nn.Adam(make_params())
    ms.set_context(mode=ms.GRAPH_MODE)
    with pytest.raises(SwapOptError, match="PyNative.*swap: True"):
        swap_optimizer(opt, config())
    assert not is_swap_optimizer(opt)


def test_bad_call_arguments_fail_before_anything_moves():
    params = make_params()
    opt = nn.Adam(params, learning_rate=1e-2)
    swap_optimizer(opt, config())
    before = state_arrays(opt)
    with pytest.raises(ValueError, match="6 parameters but got 2 gradients"):
        opt(grads_for(0, params)[:2])
    with pytest.raises(TypeError, match="exactly one argument"):
        opt(grads_for(0, params), grads_for(1, params))
    after = state_arrays(opt)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert swap_stats(opt).steps == 0


def test_only_the_mindspore_engine_serves_a_cell():
    from swapopt_core._api import _engine_class
    from swapopt_core._torch.engine import SwapEngine

    opt = nn.Adam(make_params())
    assert MindSporeSwapEngine.serves(opt) and not SwapEngine.serves(opt)
    assert MindSporeSwapEngine.param_devices(opt) == {"CPU"}
    assert _engine_class(opt) is MindSporeSwapEngine


def test_auto_on_cpu_parameters_installs_nothing_and_says_so(monkeypatch):
    monkeypatch.setattr("swapopt_core._api._warned_cpu_auto", False)
    opt = nn.Adam(make_params())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert swap_optimizer(opt, SwapOptimizerConfig()) is opt
    assert not is_swap_optimizer(opt)
    assert any(issubclass(w.category, SwapOptWarning) and "CPU" in str(w.message) for w in caught)


def _train(swap: SwapOptimizerConfig | None, steps: int = 6) -> tuple[list[np.ndarray], object]:
    ms.set_seed(0)
    net = nn.SequentialCell([nn.Dense(32, 64), nn.ReLU(), nn.Dense(64, 4)])
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2, weight_decay=0.01)
    if swap is not None:
        swap_optimizer(opt, swap)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        step(
            Tensor(rng.standard_normal((8, 32)).astype(np.float32)),
            Tensor(rng.standard_normal((8, 4)).astype(np.float32)),
        )
    return [p.asnumpy() for p in net.trainable_params()], opt


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_train_one_step_cell_drives_the_swapped_optimizer(runtime):
    plain, _ = _train(None)
    swapped, opt = _train(config(runtime=runtime, swap_times=2))
    assert all(np.array_equal(a, b) for a, b in zip(plain, swapped, strict=True))
    assert swap_stats(opt).steps == 6


def test_the_ascend_runtime_warns_it_is_unverified_and_refuses_packed(monkeypatch):
    monkeypatch.setattr("swapopt_core._mindspore.runtime._warned_unverified", False)
    opt = nn.Adam(make_params())
    with (
        pytest.warns(SwapOptWarning, match="not been run on an Ascend device"),
        pytest.raises(SwapOptError, match="packed_swap=True needs device views"),
    ):
        swap_optimizer(opt, config(runtime="ascend", packed_swap=True))
    assert not is_swap_optimizer(opt)
