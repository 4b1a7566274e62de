"""Checkpoints of a swapped optimizer: the standard format, round trips that keep training and
match an uninterrupted plain run bit for bit, and loading that moves nothing to the device."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from swapopt_core import (
    SwapOptWarning,
    is_swap_optimizer,
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._swap.engine import engine_of
from tests.conftest import assert_nothing_resident, assert_same, loopback, make_model, train, twin

#: Each test runs on the synchronous loopback and on loopback-async with jitter.
pytestmark = pytest.mark.usefixtures("swap_runtime")

TOTAL, MIDDLE = 12, 5

SETUPS = {
    "amsgrad_wd": {"amsgrad": True, "weight_decay": 0.05},
    "fused": {"fused": True},
    "foreach": {"foreach": True},
}


def make_opt(model, flags):
    return torch.optim.AdamW(model.parameters(), lr=0.01, **flags)


def swapped(model, flags, packed, min_numel=0):
    opt = make_opt(model, flags)
    swap_optimizer(opt, loopback(swap_times=3, min_numel=min_numel, packed_swap=packed))
    return opt


def save(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def reference(flags, steps=TOTAL):
    """An uninterrupted plain run."""
    model = make_model()
    opt = make_opt(model, flags)
    train(model, opt, steps)
    return model, opt


def swapped_keys(opt):
    return {(id(slot.param), slot.key): slot for slot in engine_of(opt).slots.values()}


def assert_engine_host(opt, param, key):
    """``opt.state[param][key]`` is the engine's own host tensor (the packed buffer when packed)."""
    engine = engine_of(opt)
    slot = engine.slots[(id(param), key)]
    value = opt.state[param][key]
    assert value is slot.value and value is slot.host
    assert value.device.type == "cpu"
    if engine.staging.packed:
        buffer = engine.staging.buffers[value.dtype]
        # A piece of the packed buffer, carved out with a storage of its own.
        start = buffer.untyped_storage().data_ptr()
        end = start + buffer.untyped_storage().nbytes()
        piece = value.untyped_storage()
        assert start <= piece.data_ptr() and piece.data_ptr() + piece.nbytes() <= end


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("min_numel", [0, 1024])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_state_dict_is_standard_and_serialisable(setup, min_numel, packed):
    flags = SETUPS[setup]
    ma, oa = reference(flags, MIDDLE)
    mb = make_model()
    ob = swapped(mb, flags, packed, min_numel)
    train(mb, ob, MIDDLE)
    sd_a, sd_b = oa.state_dict(), ob.state_dict()
    assert sd_b["param_groups"] == sd_a["param_groups"]
    assert sd_b["state"].keys() == sd_a["state"].keys()
    slots = swapped_keys(ob)
    assert slots
    params = [p for g in ob.param_groups for p in g["params"]]
    for index, entry in sd_b["state"].items():
        param = params[index]
        for key, value in entry.items():
            if (id(param), key) in slots:
                assert value.device.type == "cpu"
                assert value is slots[(id(param), key)].host
            elif key != "step":
                assert min_numel and value.numel() < min_numel
    loaded = load(save(sd_b))
    assert loaded["param_groups"] == sd_a["param_groups"]
    for index, entry in sd_a["state"].items():
        assert loaded["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            got = loaded["state"][index][key]
            assert got.dtype == value.dtype and got.device == value.device
            assert torch.equal(got, value), (index, key)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("resume", ["plain", "swap_then_load", "load_then_swap"])
def test_resume_from_swapped_checkpoint(resume, setup, packed):
    flags = SETUPS[setup]
    ref_model, ref_opt = reference(flags)
    model = make_model()
    opt = swapped(model, flags, packed)
    train(model, opt, MIDDLE)
    blob = save({"model": model.state_dict(), "opt": opt.state_dict()})
    del model, opt
    ckpt = load(blob)

    model = make_model(seed=123)  # different weights: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt = make_opt(model, flags)
    config = loopback(swap_times=4, min_numel=0, packed_swap=packed)
    if resume == "swap_then_load":
        swap_optimizer(opt, config)
    opt.load_state_dict(ckpt["opt"])
    if resume == "load_then_swap":
        swap_optimizer(opt, config)
    if resume != "plain":
        assert_nothing_resident(opt)
        for p, state in opt.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert_engine_host(opt, p, key)
            assert state["step"] == (MIDDLE // 2 if p is model.odd.weight else MIDDLE)
    train(model, opt, TOTAL - MIDDLE, start=MIDDLE)
    assert is_swap_optimizer(opt) == (resume != "plain")
    assert_same(ref_opt, opt, ref_model, model)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_plain_checkpoint_loads_into_swapped_optimizer(setup, packed):
    flags = SETUPS[setup]
    ref_model, ref_opt = reference(flags)
    model, opt = reference(flags, MIDDLE)
    ckpt = load(save({"model": model.state_dict(), "opt": opt.state_dict()}))

    model = make_model(seed=7)
    model.load_state_dict(ckpt["model"])
    opt = swapped(model, flags, packed)
    opt.load_state_dict(ckpt["opt"])
    keys = 3 if flags.get("amsgrad") else 2
    assert swap_stats(opt).swapped_tensors == keys * len(opt.state)
    for step in range(MIDDLE, TOTAL):
        train(model, opt, 1, start=step)
        assert_nothing_resident(opt)
    assert_same(ref_opt, opt, ref_model, model)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "trained"])
def test_load_moves_nothing_to_the_device(fresh, packed, monkeypatch):
    flags = {"amsgrad": True}
    _, source = reference(flags, MIDDLE)
    ckpt = load(save(source.state_dict()))
    model = make_model()
    opt = swapped(model, flags, packed)
    if not fresh:
        train(model, opt, 2)
    engine = engine_of(opt)
    before = swap_stats(opt)
    calls = []
    for name in ("alloc_device", "copy_in", "copy_out"):
        original = getattr(engine.runtime, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(engine.runtime, name, spy)
    opt.load_state_dict(ckpt)
    after = swap_stats(opt)
    assert calls == []
    assert after.h2d_bytes == before.h2d_bytes and after.d2h_bytes == before.d2h_bytes
    assert after.resident_state_bytes == 0
    assert after.peak_resident_state_bytes == before.peak_resident_state_bytes
    assert after.swapped_tensors == 3 * len(opt.state)
    for p in opt.state:
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert_engine_host(opt, p, key)
            # The checkpoint's tensors are copied into the engine's host memory.
            assert opt.state[p][key].untyped_storage().data_ptr() != (
                ckpt["state"][0][key].untyped_storage().data_ptr()
            )
    monkeypatch.undo()
    # Continue from the checkpoint with the weights it was taken with.
    with torch.no_grad():
        for p, q in zip(model.parameters(), source.param_groups[0]["params"], strict=True):
            p.copy_(q)
    ref_model, ref_opt = reference(flags, MIDDLE + 3)
    train(model, opt, 3, start=MIDDLE)
    assert_same(ref_opt, opt, ref_model, model)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("flags", [{}, {"fused": True}], ids=["for_loop", "fused"])
def test_load_casts_state_to_the_param_dtype(flags, packed):
    """fp32 state loaded for fp64 params becomes fp64 host state, as torch's loader does."""
    model32, opt32 = reference(flags, MIDDLE)
    blob = save(opt32.state_dict())
    plain = twin(model32).double()
    swapped64 = twin(model32).double()
    opt_a = make_opt(plain, flags)
    opt_b = swapped(swapped64, flags, packed)
    # Separate copies: torch's loader keeps the checkpoint's "step" tensors (and same-dtype
    # state) by reference, so two optimizers loaded from one dict would share them.
    opt_a.load_state_dict(load(blob))
    opt_b.load_state_dict(load(blob))
    assert_same(opt_a, opt_b, plain, swapped64)
    for p, state in opt_b.state.items():
        assert state["exp_avg"].dtype == torch.float64
        assert state["step"].dtype == torch.float32
        assert_engine_host(opt_b, p, "exp_avg_sq")
    if packed:
        assert set(engine_of(opt_b).staging.buffers) == {torch.float64}
    for step in range(MIDDLE, TOTAL):
        train(plain, opt_a, 1, start=step)
        train(swapped64, opt_b, 1, start=step)
        assert_same(opt_a, opt_b, plain, swapped64)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_unswap_then_continue(setup, packed):
    flags = SETUPS[setup]
    ref_model, ref_opt = reference(flags)
    model = make_model()
    opt = swapped(model, flags, packed)
    train(model, opt, MIDDLE)
    hosts = [slot.host for slot in engine_of(opt).slots.values()]
    assert unswap_optimizer(opt) is opt
    assert not is_swap_optimizer(opt)
    assert engine_of(opt) is None
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert not opt._optimizer_load_state_dict_pre_hooks
    live = {id(v) for state in opt.state.values() for v in state.values()}
    assert not live & {id(h) for h in hosts}
    with pytest.raises(ValueError, match="not swapped"):
        swap_stats(opt)
    with pytest.warns(SwapOptWarning, match="AdamW is not swapped, so nothing was undone"):
        assert unswap_optimizer(opt) is opt  # a second call undoes nothing, and says so
    train(model, opt, TOTAL - MIDDLE, start=MIDDLE)
    assert_same(ref_opt, opt, ref_model, model)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_state_dict_references_behave_like_torch(packed):
    """torch's ``state_dict()`` shares the state tensors (and each per-parameter dict) with the
    optimizer while ``param_groups`` are copied; later steps show through the first but not the
    second. The swapped optimizer must hand out the same kind of references."""
    flags = {"amsgrad": True}
    runs = {}
    for kind in ("plain", "swapped"):
        model = make_model()
        opt = make_opt(model, flags) if kind == "plain" else swapped(model, flags, packed)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        train(model, opt, MIDDLE, scheduler=sched)
        sd = opt.state_dict()
        snapshot = copy.deepcopy(sd)
        # Unfreezing makes new state appear (and, when packed, the host layout is rebuilt).
        model.frozen.requires_grad_(True)
        train(model, opt, TOTAL - MIDDLE, start=MIDDLE, scheduler=sched)
        runs[kind] = (model, opt, sd, snapshot)

    model_a, opt_a, sd_a, snap_a = runs["plain"]
    model_b, opt_b, sd_b, snap_b = runs["swapped"]
    assert_same(opt_a, opt_b, model_a, model_b)
    assert snap_b["param_groups"] == snap_a["param_groups"]
    assert sd_b["param_groups"] == sd_a["param_groups"] == snap_a["param_groups"]
    assert sd_a["param_groups"][0]["lr"] != opt_a.param_groups[0]["lr"]
    assert sd_b.keys() == sd_a.keys() and sd_b["state"].keys() == sd_a["state"].keys()
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    params_b = [p for g in opt_b.param_groups for p in g["params"]]
    for index in sd_a["state"]:
        live_a, live_b = opt_a.state[params_a[index]], opt_b.state[params_b[index]]
        # What torch shares stays shared under the swap.
        assert (sd_a["state"][index] is live_a) == (sd_b["state"][index] is live_b)
        for key, value in sd_a["state"][index].items():
            other = sd_b["state"][index][key]
            assert (value is live_a[key]) == (other is live_b[key]), (index, key)
            assert torch.equal(other, live_b[key]) == torch.equal(value, live_a[key])
            # The deep copy taken at the middle is a true snapshot in both.
            assert torch.equal(snap_b["state"][index][key], snap_a["state"][index][key])
            assert torch.equal(other, value)
    # Later steps did change the state: the shared tensors show it, the snapshots do not.
    first = next(iter(sd_a["state"]))
    assert not torch.equal(snap_a["state"][first]["exp_avg"], sd_a["state"][first]["exp_avg"])
    assert not torch.equal(snap_b["state"][first]["exp_avg"], sd_b["state"][first]["exp_avg"])


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_reload_own_state_dict_mid_training(packed):
    flags = {"amsgrad": True, "weight_decay": 0.1}
    ref_model, ref_opt = reference(flags)
    model = make_model()
    opt = swapped(model, flags, packed)
    train(model, opt, MIDDLE)
    opt.load_state_dict(opt.state_dict())
    assert_nothing_resident(opt)
    train(model, opt, TOTAL - MIDDLE, start=MIDDLE)
    assert_same(ref_opt, opt, ref_model, model)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_state_moved_back_by_a_framework_is_offloaded_again(packed):
    """A restore path that replaces state entries with new (device) tensors between steps."""
    flags = {"amsgrad": True}
    ref_model, ref_opt = reference(flags)
    model = make_model()
    opt = swapped(model, flags, packed)
    train(model, opt, MIDDLE)
    swap_stats(opt)  # the host state is read directly below: the step's copies must be done
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            state[key] = state[key].clone()
    train(model, opt, 1, start=MIDDLE)
    assert_nothing_resident(opt)
    for p in opt.state:
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert_engine_host(opt, p, key)
    train(model, opt, TOTAL - MIDDLE - 1, start=MIDDLE + 1)
    assert_same(ref_opt, opt, ref_model, model)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("when", ["before_install", "after_install"])
def test_user_load_state_dict_pre_hook_sees_and_edits_the_whole_state(when, packed):
    """A ``load_state_dict`` pre-hook gets the checkpoint as given and may return an edited
    one (here: ``exp_avg`` halved), whether it was registered before or after install."""
    _, source = reference({}, MIDDLE)
    blob = save(source.state_dict())

    def halve(opt, state_dict):
        seen.append({i: sorted(entry) for i, entry in state_dict["state"].items()})
        edited = copy.deepcopy(state_dict)
        for entry in edited["state"].values():
            entry["exp_avg"] = entry["exp_avg"] * 0.5
        return edited

    results = []
    for kind in ("plain", "swapped"):
        seen = []
        model = make_model()
        opt = make_opt(model, {})
        if kind == "swapped" and when == "after_install":
            swap_optimizer(opt, loopback(min_numel=0, packed_swap=packed))
        opt.register_load_state_dict_pre_hook(halve)
        if kind == "swapped" and when == "before_install":
            swap_optimizer(opt, loopback(min_numel=0, packed_swap=packed))
        opt.load_state_dict(load(blob))
        results.append((model, opt, seen))
    (model_a, opt_a, seen_a), (model_b, opt_b, seen_b) = results
    assert seen_b == seen_a
    assert_same(opt_a, opt_b, model_a, model_b)
    ckpt = load(blob)
    first = opt_b.param_groups[0]["params"][0]
    assert torch.equal(opt_b.state[first]["exp_avg"], ckpt["state"][0]["exp_avg"] * 0.5)
    train(model_a, opt_a, 3, start=MIDDLE)
    train(model_b, opt_b, 3, start=MIDDLE)
    assert_same(opt_a, opt_b, model_a, model_b)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("when", ["before_install", "after_install"])
def test_user_load_state_dict_post_hook_sees_the_loaded_state(when, packed):
    """A ``load_state_dict`` post-hook runs on the fully loaded optimizer, as in torch."""
    _, source = reference({"amsgrad": True}, MIDDLE)
    blob = save(source.state_dict())
    seen = {}

    def record(opt):
        seen[kind] = [
            {k: v.clone() for k, v in opt.state.get(p, {}).items()}
            for g in opt.param_groups
            for p in g["params"]
        ]

    for kind in ("plain", "swapped"):
        opt = make_opt(make_model(), {"amsgrad": True})
        if kind == "swapped" and when == "after_install":
            swap_optimizer(opt, loopback(min_numel=0, packed_swap=packed))
        opt.register_load_state_dict_post_hook(record)
        if kind == "swapped" and when == "before_install":
            swap_optimizer(opt, loopback(min_numel=0, packed_swap=packed))
        opt.load_state_dict(load(blob))
    assert len(seen["plain"]) == len(seen["swapped"])
    assert any(seen["plain"])
    for plain, swapped in zip(seen["plain"], seen["swapped"], strict=True):
        assert plain.keys() == swapped.keys()
        for key in plain:
            assert torch.equal(plain[key], swapped[key]), key
