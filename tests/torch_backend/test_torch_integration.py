"""A swapped optimizer keeps working with the PyTorch machinery that holds on to it: gradient
scalers, step hooks, ``zero_grad`` variants, state-dict copies, and the install API itself."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from swapopt_core import (
    SwapOptError,
    is_swap_optimizer,
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._swap.engine import engine_of
from tests.conftest import (
    assert_nothing_resident,
    assert_same,
    loopback,
    loss_of,
    make_model,
    train,
    twin,
)

PACKED = pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])


def pair(flags=None, config=None):
    flags = {"lr": 0.01, **(flags or {})}
    ma = make_model()
    mb = twin(ma)
    oa = torch.optim.AdamW(ma.parameters(), **flags)
    ob = torch.optim.AdamW(mb.parameters(), **flags)
    if config is not None:
        swap_optimizer(ob, config)
    return ma, oa, mb, ob


def snapshot(model, opt):
    """Deep copies of the parameters and the optimizer state, keyed by position."""
    params = [p.detach().clone() for p in model.parameters()]
    state = [
        {k: v.clone() for k, v in opt.state.get(p, {}).items()}
        for g in opt.param_groups
        for p in g["params"]
    ]
    return params, state


def assert_snapshots_equal(a, b) -> None:
    params_a, state_a = a
    params_b, state_b = b
    assert len(params_a) == len(params_b)
    for x, y in zip(params_a, params_b, strict=True):
        assert torch.equal(x, y)
    for sa, sb in zip(state_a, state_b, strict=True):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


# ---- GradScaler ---------------------------------------------------------------------------

INF_STEP = 4


@PACKED
@pytest.mark.parametrize("clip", [False, True], ids=["no_clip", "unscale_and_clip"])
@pytest.mark.parametrize(
    "flags",
    [{}, {"fused": True}, {"foreach": True, "amsgrad": True}],
    ids=["for_loop", "fused", "foreach_amsgrad"],
)
def test_grad_scaler_skips_the_inf_step(flags, clip, packed):
    ma, oa, mb, ob = pair(flags, loopback(swap_times=3, min_numel=0, packed_swap=packed))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3) for _ in range(2)]
    for step in range(12):
        for model, opt, scaler in ((ma, oa, scalers[0]), (mb, ob, scalers[1])):
            opt.zero_grad()
            scaler.scale(loss_of(model, step)).backward()
            if step == INF_STEP:
                model.fc2.weight.grad[0, 0] = float("inf")
                before = snapshot(model, opt)
                steps_before = swap_stats(opt).steps if opt is ob else None
            scale = scaler.get_scale()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
            if step == INF_STEP:
                assert scaler.get_scale() < scale  # the scaler saw the inf
                assert_snapshots_equal(before, snapshot(model, opt))
                if opt is ob and not flags.get("fused"):
                    # Unfused: the scaler does not call step() at all.
                    assert swap_stats(ob).steps == steps_before
        if step == INF_STEP and not flags.get("fused"):
            # The skipped step leaves what its backward prefetched on the device, for the
            # next step to use.
            assert swap_stats(ob).resident_state_bytes > 0
        else:
            assert_nothing_resident(ob)
        assert_same(oa, ob, ma, mb)
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert not hasattr(ob, "grad_scale") and not hasattr(ob, "found_inf")
    assert swap_stats(ob).swapped_tensors > 0


# ---- step hooks ---------------------------------------------------------------------------


class Recorder:
    """A step hook that records what it sees: the first fc1 weight and its exp_avg."""

    def __init__(self, opt, model) -> None:
        self.opt, self.model, self.seen = opt, model, []

    def __call__(self, optimizer, args, kwargs):
        assert optimizer is self.opt
        state = optimizer.state.get(self.model.fc1.weight, {})
        exp_avg = state.get("exp_avg")
        self.seen.append(
            (
                self.model.fc1.weight.detach().clone(),
                None if exp_avg is None else exp_avg.clone(),
                len(args),
                sorted(kwargs),
                args[0] is optimizer,
            )
        )


def assert_same_records(plain: Recorder, swapped: Recorder) -> None:
    assert len(plain.seen) == len(swapped.seen) > 0
    for (wa, ea, na, ka, sa), (wb, eb, nb, kb, sb) in zip(plain.seen, swapped.seen, strict=True):
        assert torch.equal(wa, wb)
        assert (ea is None) == (eb is None)
        if ea is not None:
            assert torch.equal(ea, eb)
        assert (na, ka) == (nb, kb)
        assert sa and sb


@PACKED
@pytest.mark.parametrize("closure", [False, True], ids=["no_closure", "closure"])
def test_user_step_hooks_see_the_right_values(closure, packed):
    ma, oa, mb, ob = pair()
    plain_pre, plain_post = Recorder(oa, ma), Recorder(oa, ma)
    oa.register_step_pre_hook(plain_pre)
    oa.register_step_post_hook(plain_post)
    early_pre, early_post = Recorder(ob, mb), Recorder(ob, mb)
    ob.register_step_pre_hook(early_pre)
    ob.register_step_post_hook(early_post)
    swap_optimizer(ob, loopback(swap_times=3, min_numel=0, packed_swap=packed))
    late_pre, late_post = Recorder(ob, mb), Recorder(ob, mb)
    ob.register_step_pre_hook(late_pre)
    ob.register_step_post_hook(late_post)

    weights = []
    for step in range(10):
        weights.append(ma.fc1.weight.detach().clone())
        train(ma, oa, 1, start=step, closure=closure)
        train(mb, ob, 1, start=step, closure=closure)
        assert_same(oa, ob, ma, mb)
    for swapped_pre in (early_pre, late_pre):
        assert_same_records(plain_pre, swapped_pre)
    for swapped_post in (early_post, late_post):
        assert_same_records(plain_post, swapped_post)
    # Pre-hooks see the parameters before the update, post-hooks after it.
    for step, (pre, post) in enumerate(zip(plain_pre.seen, plain_post.seen, strict=True)):
        assert torch.equal(pre[0], weights[step])
        assert not torch.equal(post[0], pre[0])
    assert early_pre.seen[0][1] is None and early_post.seen[0][1] is not None


def test_step_hook_args_carry_the_optimizer():
    """torch calls step hooks with ``args`` whose first item is the optimizer itself; no
    stand-in may show up there for hooks registered before or after install."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    seen = []

    def hook(optimizer, args, kwargs):
        seen.append((args[0] is optimizer, len(args[0].param_groups)))

    opt.register_step_pre_hook(hook)  # before install: runs before the engine's pre-hook
    opt.register_step_post_hook(hook)
    swap_optimizer(opt, loopback(min_numel=0))
    opt.register_step_pre_hook(hook)  # after install
    opt.register_step_post_hook(hook)
    train(model, opt, 1)
    assert seen == [(True, 1)] * 4


@PACKED
def test_global_step_hooks_see_the_right_values(packed):
    ma, oa, mb, ob = pair(config=loopback(swap_times=3, min_numel=0, packed_swap=packed))
    seen = {"pre": [], "post": []}

    def record(kind):
        def hook(optimizer, args, kwargs):
            model = ma if optimizer is oa else mb
            seen[kind].append((optimizer is ob, model.fc2.weight.detach().clone()))

        return hook

    handles = [
        register_optimizer_step_pre_hook(record("pre")),
        register_optimizer_step_post_hook(record("post")),
    ]
    try:
        for step in range(10):
            train(ma, oa, 1, start=step)
            train(mb, ob, 1, start=step)
    finally:
        for handle in handles:
            handle.remove()
    assert_same(oa, ob, ma, mb)
    for kind in ("pre", "post"):
        plain = [w for swapped, w in seen[kind] if not swapped]
        ours = [w for swapped, w in seen[kind] if swapped]
        assert len(plain) == len(ours) == 10
        for wa, wb in zip(plain, ours, strict=True):
            assert torch.equal(wa, wb)


# ---- zero_grad ----------------------------------------------------------------------------


@PACKED
@pytest.mark.parametrize(
    "flags", [{}, {"foreach": True}, {"fused": True}], ids=["for_loop", "foreach", "fused"]
)
def test_zero_grad_without_set_to_none(flags, packed):
    """Zeroed (not None) gradients still take part in the step, as in torch."""
    ma, oa, mb, ob = pair(flags, loopback(swap_times=3, min_numel=0, packed_swap=packed))
    for step in range(10):
        for model, opt in ((ma, oa), (mb, ob)):
            opt.zero_grad(set_to_none=False)
            loss_of(model, step).backward()
            opt.step()
        assert_nothing_resident(ob)
        assert_same(oa, ob, ma, mb)
        if step >= 1:
            # The odd branch keeps a zero gradient on even steps and is stepped anyway.
            assert mb.odd.weight.grad is not None
    assert ob.state[mb.odd.weight]["step"] == 9


# ---- state dict copies --------------------------------------------------------------------


@PACKED
def test_state_dict_pickles_and_deepcopies(packed):
    ma, oa, mb, ob = pair(
        {"amsgrad": True}, loopback(swap_times=3, min_numel=0, packed_swap=packed)
    )
    train(ma, oa, 5)
    train(mb, ob, 5)
    sd_a = oa.state_dict()
    copies = [
        copy.deepcopy(ob.state_dict()),
        pickle.loads(pickle.dumps(ob.state_dict())),
    ]
    for sd in copies:
        assert sd["param_groups"] == sd_a["param_groups"]
        assert sd["state"].keys() == sd_a["state"].keys()
        for index, entry in sd_a["state"].items():
            assert sd["state"][index].keys() == entry.keys()
            for key, value in entry.items():
                assert torch.equal(sd["state"][index][key], value)
                # A true copy: nothing shared with the live state.
                live = ob.state_dict()["state"][index][key]
                assert sd["state"][index][key].untyped_storage().data_ptr() != (
                    live.untyped_storage().data_ptr()
                )
    train(mb, ob, 5, start=5)
    train(ma, oa, 5, start=5)
    assert_same(oa, ob, ma, mb)
    # The copies kept the values of step 5 and load into a fresh swapped optimizer.
    model = make_model()
    fresh = torch.optim.AdamW(model.parameters(), lr=0.01, amsgrad=True)
    swap_optimizer(fresh, loopback(min_numel=0, packed_swap=packed))
    fresh.load_state_dict(copies[1])
    assert all(int(s["step"]) in (2, 5) for s in fresh.state.values())


@PACKED
def test_deepcopy_of_a_swapped_optimizer(packed):
    """``copy.deepcopy`` of model and optimizer together gives an independent optimizer that
    trains like the plain one; the original keeps its swap."""
    ma, oa, mb, ob = pair(
        {"amsgrad": True}, loopback(swap_times=3, min_numel=0, packed_swap=packed)
    )
    train(ma, oa, 5)
    train(mb, ob, 5)
    mc, oc = copy.deepcopy((mb, ob))
    assert oc is not ob and engine_of(oc) is not engine_of(ob)
    assert is_swap_optimizer(ob)
    assert_same(oa, oc, ma, mc)
    for model, opt in ((ma, oa), (mb, ob), (mc, oc)):
        train(model, opt, 5, start=5)
    assert_same(oa, ob, ma, mb)
    assert_same(oa, oc, ma, mc)
    assert_nothing_resident(ob)


# ---- the install API ----------------------------------------------------------------------


def test_identity_and_detection():
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    assert not is_swap_optimizer(opt)
    assert not is_swap_optimizer(object())
    assert not is_swap_optimizer(None)
    config = loopback(swap_times=2, min_numel=0)
    assert swap_optimizer(opt, config) is opt
    assert is_swap_optimizer(opt)
    assert type(opt) is torch.optim.Adam
    assert isinstance(opt, torch.optim.Optimizer)
    train(model, opt, 2)
    assert swap_stats(opt).steps == 2


@PACKED
def test_installing_twice_with_the_same_config_is_a_no_op(packed):
    config = loopback(swap_times=3, min_numel=0, packed_swap=packed)
    ma, oa, mb, ob = pair(config=config)
    train(ma, oa, 3)
    train(mb, ob, 3)
    engine = engine_of(ob)
    hooks = (
        len(ob._optimizer_step_pre_hooks),
        len(ob._optimizer_step_post_hooks),
        len(ob._optimizer_load_state_dict_pre_hooks),
    )
    stats = swap_stats(ob)
    same = loopback(swap_times=3, min_numel=0, packed_swap=packed)
    assert same == config and same is not config
    assert swap_optimizer(ob, same) is ob
    assert engine_of(ob) is engine
    assert hooks == (
        len(ob._optimizer_step_pre_hooks),
        len(ob._optimizer_step_post_hooks),
        len(ob._optimizer_load_state_dict_pre_hooks),
    )
    assert swap_stats(ob) == stats
    for step in range(3, 10):
        train(ma, oa, 1, start=step)
        train(mb, ob, 1, start=step)
        assert swap_stats(ob).steps == step + 1  # one swapped update per step, not two
        assert_same(oa, ob, ma, mb)


def test_installing_another_config_raises_and_changes_nothing():
    config = loopback(swap_times=3, min_numel=0)
    ma, oa, mb, ob = pair(config=config)
    train(ma, oa, 2)
    train(mb, ob, 2)
    engine = engine_of(ob)
    for other in (
        loopback(swap_times=4, min_numel=0),
        loopback(swap_times=3, min_numel=1),
        loopback(swap_times=3, min_numel=0, packed_swap=False),
    ):
        with pytest.raises(SwapOptError, match="already swapped"):
            swap_optimizer(ob, other)
        assert engine_of(ob) is engine and engine.config == config
    train(ma, oa, 8, start=2)
    train(mb, ob, 8, start=2)
    assert_same(oa, ob, ma, mb)
    # After unswapping, another config installs fine and still matches.
    unswap_optimizer(ob)
    other = loopback(swap_times=5, min_numel=1024, packed_swap=False)
    assert swap_optimizer(ob, other) is ob
    assert engine_of(ob).config == other
    train(ma, oa, 4, start=10)
    train(mb, ob, 4, start=10)
    assert_same(oa, ob, ma, mb)
