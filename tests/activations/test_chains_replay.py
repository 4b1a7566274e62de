"""Replays of plans that recompute through storages the trace frees early (revived inputs the
recipes hold), release held storages for good (tails), and write recomputes straight into
their storage: the same bits as without the session, within the plan's peak."""

from __future__ import annotations

import dataclasses

import torch

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._activations.recipe import Recipe
from swapopt_core._cli.demo import _TinyGPT
from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.ir import ActionKind
from swapopt_core._planning.simulate import simulate
from swapopt_core._planning.timed import TimedPlanner

aten = torch.ops.aten
VOCAB, SEQ = 64, 16


def _gpt() -> _TinyGPT:
    torch.manual_seed(0)
    return _TinyGPT(vocab=VOCAB, width=32, layers=2, heads=2, max_len=SEQ)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(step))


def _step(model: _TinyGPT, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # held through backward: freed after its last access
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def test_the_warmup_records_storages_held_past_their_last_access() -> None:
    session, model, tokens = OffloadSession(OffloadConfig(runtime="loopback")), _gpt(), _tokens(0)
    with session:
        _step(model, tokens)
    trace = session.trace
    ix = TraceIndex(trace)
    assert trace.freed_after
    for sid, op in trace.freed_after.items():
        assert ix.last[sid] < op < len(trace.ops) and sid not in trace.retained_sids
    log_softmax = next(op for op in trace.ops if op.name == "_log_softmax.default")
    logits = next(a.storage_id for a in log_softmax.accesses if a.output is None)
    assert ix.end[logits] > ix.last[logits] + 10  # the logits outlive the loss by far


def test_a_plan_that_revives_and_drops_tails_replays_the_same_bits(runtime_name: str) -> None:
    recorder, model, tokens = (
        OffloadSession(OffloadConfig(runtime=runtime_name)),
        _gpt(),
        _tokens(0),
    )
    with recorder:
        _step(model, tokens)
    recorded = recorder.trace
    ix = TraceIndex(recorded)
    # Even op times (the recorded ones swing with the machine's load) and a link so slow that
    # the planner recomputes what it has to drop.
    trace = dataclasses.replace(
        recorded,
        ops=tuple(dataclasses.replace(op, duration_ms=0.01) for op in recorded.ops),
        d2h_bandwidth_gbps=1e-4,
        h2d_bandwidth_gbps=1e-4,
        memory_limit_bytes=int(0.6 * ix.natural_peak),
        min_offload_bytes=0,
    )
    schedule = TimedPlanner().plan(trace)
    planned = simulate(trace, schedule)
    revived = {
        a.storage_id
        for _, op, a in schedule.actions()
        if a.kind is ActionKind.RECOMPUTE and op > ix.last[a.storage_id]
    }
    assert revived, "the plan should make again a storage the trace freed before"
    assert planned.peak_bytes <= 0.6 * ix.natural_peak
    session = OffloadSession(OffloadConfig(runtime=runtime_name, min_offload_kib=0))
    session.load_plan(trace, schedule)
    reference, replayed = _gpt(), _gpt()
    for step in range(1, 3):
        tokens = _tokens(step)
        ref_loss = _step(reference, tokens)
        with session:
            loss = _step(replayed, tokens)
        assert torch.equal(loss, ref_loss)
        for a, b in zip(reference.parameters(), replayed.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
            a.grad = b.grad = None
    stats = session.stats()
    assert (stats.replays, stats.retraces) == (2, 0)
    assert stats.recomputes == 2 * planned.recomputes and stats.demand_recomputes == 0
    assert stats.last_peak_resident_activation_bytes <= 1.05 * planned.peak_bytes


def _recomputed_bytes(recipe: Recipe, out: torch.Tensor) -> bytes:
    target = torch.empty(0).untyped_storage()
    recipe.run_into(target, out.untyped_storage().nbytes())
    return bytes(target)


def test_a_recompute_writes_through_the_out_variant_when_it_has_one() -> None:
    bias, x, w = torch.randn(8), torch.randn(4, 16), torch.randn(8, 16)
    args = (bias, x, w.t())
    out = aten.addmm.default(*args)
    recipe = Recipe(1, "addmm.default", aten.addmm.default, args, {}, 0, (), out)
    assert recipe.into is not None and recipe.into[0] is aten.addmm.out
    assert _recomputed_bytes(recipe, out) == bytes(out.untyped_storage())
    # Of several outputs, the one asked for, in the layout the op left it.
    norm_args = (torch.randn(4, 6, 8), [8], torch.randn(8), torch.randn(8), 1e-5)
    outs = aten.native_layer_norm.default(*norm_args)
    for position, value in enumerate(outs):
        recipe = Recipe(2, "ln", aten.native_layer_norm.default, norm_args, {}, position, (), outs)
        assert recipe.into is not None
        assert _recomputed_bytes(recipe, value) == bytes(value.untyped_storage())


def test_an_op_without_an_out_variant_is_recomputed_by_copy() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    func = aten._scaled_dot_product_flash_attention_for_cpu.default
    outs = func(q, k, v)
    recipe = Recipe(3, "sdpa", func, (q, k, v), {}, 0, (), outs)
    assert recipe.into is None
    assert _recomputed_bytes(recipe, outs[0]) == bytes(outs[0].untyped_storage())
