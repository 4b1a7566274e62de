"""One rank of the two-process FSDP2 (``fully_shard``) run over gloo on CPU.

Launched by ``test_fsdp2_gloo.py`` with torchrun-style environment variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Every case trains a sharded model twice,
once with a plain optimizer and once with the optimizer swapped (loopback runtime), and
compares the local shards bit for bit. The outcome of each case is written to
``<out_dir>/rank<r>.json`` after every case, so the test can show which assertion failed on
which rank even if a later case hangs.

Usage: ``python _fsdp2_worker.py OUT_DIR``
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from swapopt_core import (
    SwapOptimizerConfig,
    is_swap_optimizer,
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)

STEPS = 10
RESUME_AT = 5
SWAP_TIMES = 3
# Local shards on 2 ranks: weights 32x16, 32x64, 3x64 / 2x64 (uneven), 1x5 / 0x5 (empty on
# rank 1); biases 32, 32, 3 / 2, 1 / 0. With 100 the three big weights are swapped and the
# small last weight and all biases stay as they are.
MIN_NUMEL = 100
SEED = 1234


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.hidden = nn.Linear(64, 64)
        self.out = nn.Linear(64, 5)  # 5 rows: uneven shards
        self.head = nn.Linear(5, 1)  # 1 row: rank 1 holds an empty shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        x = torch.relu(self.hidden(x))
        return self.head(torch.tanh(self.out(x)))


def build_model(mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(SEED)  # identical full weights on every rank and in every build
    model = Net()
    for layer in (model.inp, model.hidden, model.out, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [
        {"params": weights, "weight_decay": weight_decay},
        {"params": biases, "weight_decay": 0.0, "lr": 5e-3},
    ]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ---- checks ------------------------------------------------------------------------------


def assert_same(
    model_a: nn.Module,
    opt_a: torch.optim.Optimizer,
    model_b: nn.Module,
    opt_b: torch.optim.Optimizer,
    what: str,
) -> int:
    """Local shards of params and of every state entry equal bit for bit; returns #entries."""
    names = [n for n, _ in model_a.named_parameters()]
    params_a = list(model_a.parameters())
    params_b = list(model_b.parameters())
    assert len(params_a) == len(params_b)
    compared = 0
    for name, pa, pb in zip(names, params_a, params_b, strict=True):
        assert isinstance(pa, DTensor) and isinstance(pb, DTensor), name
        assert pa.placements == pb.placements, name
        assert torch.equal(local(pa), local(pb)), (
            f"{what}: parameter {name} differs; max abs diff "
            f"{(local(pa) - local(pb)).abs().max().item() if local(pa).numel() else 0}"
        )
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sa.keys() == sb.keys(), f"{what}: {name} state keys {sorted(sa)} vs {sorted(sb)}"
        for key in sa:
            va, vb = sa[key], sb[key]
            if not isinstance(va, torch.Tensor):
                assert va == vb, f"{what}: state[{name}][{key}] {va!r} vs {vb!r}"
                continue
            assert type(va) is type(vb), (
                f"{what}: state[{name}][{key}] is {type(va).__name__} vs {type(vb).__name__}"
            )
            la, lb = local(va), local(vb)
            assert la.shape == lb.shape and la.dtype == lb.dtype, (
                f"{what}: state[{name}][{key}] {la.shape}/{la.dtype} vs {lb.shape}/{lb.dtype}"
            )
            assert torch.equal(la, lb), (
                f"{what}: state[{name}][{key}] differs; max abs diff "
                f"{(la.double() - lb.double()).abs().max().item() if la.numel() else 0}"
            )
            compared += 1
    return compared


def assert_swapped_layout(
    model: nn.Module, opt: torch.optim.Optimizer, *, packed: bool, steps: int, what: str
) -> dict:
    """Swapped entries are DTensors over CPU host tensors; nothing resident between steps."""
    assert is_swap_optimizer(opt), f"{what}: swap not installed"
    stats = swap_stats(opt)
    assert stats.resident_state_bytes == 0, f"{what}: resident {stats.resident_state_bytes} B"
    assert stats.runtime == "loopback" and stats.packed is packed, f"{what}: {stats}"
    assert stats.steps == steps, f"{what}: stats.steps {stats.steps} != {steps}"
    names = dict(zip(model.parameters(), (n for n, _ in model.named_parameters()), strict=True))
    keys_of = {}
    for group in opt.param_groups:
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        for p in group["params"]:
            keys_of[p] = keys
    expected, storages, nbytes = 0, set(), 0
    for p, keys in keys_of.items():
        state = opt.state[p]
        for key in keys:
            value = state[key]
            assert isinstance(value, DTensor), (
                f"{what}: state[{names[p]}][{key}] is {type(value).__name__}, not a DTensor"
            )
            assert value.placements == p.placements and value.shape == p.shape, (
                f"{what}: state[{names[p]}][{key}] layout {value.placements}/{value.shape} "
                f"vs param {p.placements}/{p.shape}"
            )
            shard = value.to_local()
            assert shard.device.type == "cpu", f"{what}: {names[p]}.{key} on {shard.device}"
            if shard.numel() < MIN_NUMEL:
                continue
            expected += 1
            nbytes += shard.numel() * shard.element_size()
            # A released device tensor would have an empty storage: the host copy must not.
            assert shard.untyped_storage().nbytes() >= shard.numel() * shard.element_size(), (
                f"{what}: state[{names[p]}][{key}] has a released storage between steps"
            )
            start = shard.untyped_storage().data_ptr()
            storages.add((start, start + shard.untyped_storage().nbytes()))
    assert expected > 0, f"{what}: nothing was large enough to swap"
    assert stats.swapped_tensors == expected, (
        f"{what}: swapped_tensors {stats.swapped_tensors}, expected {expected}"
    )
    assert stats.total_state_bytes == nbytes, (
        f"{what}: total_state_bytes {stats.total_state_bytes}, expected {nbytes}"
    )
    if packed:
        # Packed entries are pieces of one host buffer per dtype (all fp32 here): the
        # byte ranges they cover must follow each other with no gap.
        spans = sorted(storages)
        gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False) if b[0] != a[1]]
        assert not gaps, f"{what}: packed entries are not one contiguous buffer: {spans}"
    else:
        assert len(storages) == expected, (
            f"{what}: per-tensor entries share storage ({len(storages)} for {expected})"
        )
    assert stats.h2d_bytes > 0 and stats.d2h_bytes > 0, f"{what}: no traffic: {stats}"
    return {
        "swapped_tensors": expected,
        "state_bytes": nbytes,
        "peak_resident": stats.peak_resident_state_bytes,
        "batches": stats.batches,
    }


# ---- cases -------------------------------------------------------------------------------

OptFactory = Callable[[nn.Module], torch.optim.Optimizer]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.8, 0.95))


def adamw_foreach(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, foreach=True)


def adam_amsgrad(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(param_groups(model, 0.01), lr=1e-2, amsgrad=True)


def config(packed: bool) -> SwapOptimizerConfig:
    return SwapOptimizerConfig(
        runtime="loopback", packed_swap=packed, swap_times=SWAP_TIMES, min_numel=MIN_NUMEL
    )


def case_equivalence(mesh: DeviceMesh, rank: int, make: OptFactory, packed: bool) -> dict:
    plain_model = build_model(mesh)
    plain_opt = make(plain_model)
    train(plain_model, plain_opt, rank, range(STEPS))

    model = build_model(mesh)
    opt = make(model)
    assert swap_optimizer(opt, config(packed)) is opt
    train(model, opt, rank, range(STEPS))

    info = assert_swapped_layout(model, opt, packed=packed, steps=STEPS, what="swapped run")
    info["compared_state_entries"] = assert_same(
        plain_model, plain_opt, model, opt, "swapped vs plain FSDP2"
    )
    return info


def case_install_midway(mesh: DeviceMesh, rank: int, make: OptFactory, packed: bool) -> dict:
    """Swap state that exists already (DTensors on the device), then unswap and go on."""
    install_at, remove_at = 3, 7
    plain_model = build_model(mesh)
    plain_opt = make(plain_model)
    model = build_model(mesh)
    opt = make(model)
    for first, last in ((0, install_at), (install_at, remove_at), (remove_at, STEPS)):
        if first == install_at:
            assert swap_optimizer(opt, config(packed)) is opt
            assert swap_stats(opt).resident_state_bytes == 0, "resident right after install"
        if first == remove_at:
            info = assert_swapped_layout(
                model, opt, packed=packed, steps=remove_at - install_at, what="installed mid-run"
            )
            unswap_optimizer(opt)
            assert not is_swap_optimizer(opt)
            for p in model.parameters():
                for key, value in opt.state[p].items():
                    if key != "step":
                        assert isinstance(value, DTensor), (
                            f"unswapped {key} is {type(value).__name__}"
                        )
                        assert value.placements == p.placements and value.shape == p.shape
        train(plain_model, plain_opt, rank, range(first, last))
        train(model, opt, rank, range(first, last))
        assert_same(
            plain_model,
            plain_opt,
            model,
            opt,
            f"swap installed at step {install_at}, removed at {remove_at}: after step {last - 1}",
        )
    info["compared_state_entries"] = assert_same(plain_model, plain_opt, model, opt, "end")
    return info


class Checkpoint:
    """A per-rank checkpoint of ``obj``, taken now and handed out as a fresh copy each time.

    ``via="torch.save"`` goes through ``torch.save``/``torch.load`` like a checkpoint file;
    ``via="clone"`` copies every tensor (DTensors shard by shard) in memory. Every resume
    gets its own copy: torch's ``load_state_dict`` keeps loaded tensors that are already on
    the right device (and always ``step``), so training would mutate a shared copy.
    """

    def __init__(self, obj: object, via: str) -> None:
        self.via = via
        if via == "torch.save":
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            self.blob = buffer.getvalue()
        else:
            self.obj = clone_tree(obj)

    def get(self) -> object:
        if self.via == "torch.save":
            return torch.load(io.BytesIO(self.blob), weights_only=False)
        return clone_tree(self.obj)


def clone_tree(obj: object) -> object:
    if isinstance(obj, DTensor):
        return DTensor.from_local(
            obj.to_local().clone(),
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.shape,
            stride=obj.stride(),
        )
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return type(obj)((k, clone_tree(v)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def case_resume(mesh: DeviceMesh, rank: int, make: OptFactory, packed: bool, via: str) -> dict:
    # Uninterrupted references: plain and swapped, STEPS steps each.
    plain_model = build_model(mesh)
    plain_opt = make(plain_model)
    train(plain_model, plain_opt, rank, range(STEPS))
    full_model = build_model(mesh)
    full_opt = swap_optimizer(make(full_model), config(packed))
    train(full_model, full_opt, rank, range(STEPS))

    # Interrupted: RESUME_AT steps, checkpoint mid-run.
    first_model = build_model(mesh)
    first_opt = swap_optimizer(make(first_model), config(packed))
    train(first_model, first_opt, rank, range(RESUME_AT))
    sd = first_opt.state_dict()
    swapped_entries = 0
    for pid, entry in sd["state"].items():
        for key, value in entry.items():
            if key == "step":
                continue
            assert isinstance(value, DTensor), f"state_dict {pid}.{key}: {type(value).__name__}"
            assert value.to_local().device.type == "cpu", f"state_dict {pid}.{key} not on host"
            swapped_entries += value.to_local().numel() >= MIN_NUMEL
    assert swap_stats(first_opt).resident_state_bytes == 0, "resident at save"
    saved_model = Checkpoint(first_model.state_dict(), via)
    saved_opt = Checkpoint(sd, via)
    del first_model, first_opt, sd

    # Resume into a fresh sharded model with a swapped optimizer (installed before load).
    model = build_model(mesh)
    model.load_state_dict(saved_model.get())
    opt = swap_optimizer(make(model), config(packed))
    opt.load_state_dict(saved_opt.get())
    assert swap_stats(opt).resident_state_bytes == 0, "resident right after load_state_dict"
    for p in model.parameters():
        for key, value in opt.state[p].items():
            if key != "step":
                assert isinstance(value, DTensor), f"loaded {key} is {type(value).__name__}"
                assert value.to_local().device.type == "cpu", f"loaded {key} not on host"
    train(model, opt, rank, range(RESUME_AT, STEPS))
    info = assert_swapped_layout(
        model, opt, packed=packed, steps=STEPS - RESUME_AT, what="resumed swapped run"
    )
    n = assert_same(full_model, full_opt, model, opt, "resumed vs uninterrupted swapped")
    assert_same(plain_model, plain_opt, model, opt, "resumed swapped vs plain FSDP2")

    # The swapped checkpoint also loads into a plain optimizer without swapopt.
    plain_resumed = build_model(mesh)
    plain_resumed.load_state_dict(saved_model.get())
    plain_resumed_opt = make(plain_resumed)
    plain_resumed_opt.load_state_dict(saved_opt.get())
    train(plain_resumed, plain_resumed_opt, rank, range(RESUME_AT, STEPS))
    assert_same(
        plain_model,
        plain_opt,
        plain_resumed,
        plain_resumed_opt,
        "plain optimizer resumed from swapped checkpoint vs plain FSDP2",
    )
    info["compared_state_entries"] = n
    info["swapped_entries_in_checkpoint"] = swapped_entries
    return info


CASES: list[tuple[str, Callable[[DeviceMesh, int], dict]]] = [
    ("adamw-packed", lambda m, r: case_equivalence(m, r, adamw, True)),
    ("adamw-per_tensor", lambda m, r: case_equivalence(m, r, adamw, False)),
    ("adamw_foreach-packed", lambda m, r: case_equivalence(m, r, adamw_foreach, True)),
    ("adam_amsgrad-packed", lambda m, r: case_equivalence(m, r, adam_amsgrad, True)),
    ("adam_amsgrad-per_tensor", lambda m, r: case_equivalence(m, r, adam_amsgrad, False)),
    ("install_midway-adamw-packed", lambda m, r: case_install_midway(m, r, adamw, True)),
    (
        "install_midway-adam_amsgrad-per_tensor",
        lambda m, r: case_install_midway(m, r, adam_amsgrad, False),
    ),
    ("resume-adamw-packed", lambda m, r: case_resume(m, r, adamw, True, "clone")),
    (
        "resume-adam_amsgrad-per_tensor",
        lambda m, r: case_resume(m, r, adam_amsgrad, False, "clone"),
    ),
    (
        "torch_save-resume-adamw-per_tensor",
        lambda m, r: case_resume(m, r, adamw, False, "torch.save"),
    ),
    ("torch_save-resume-adamw-packed", lambda m, r: case_resume(m, r, adamw, True, "torch.save")),
]


def main(
    out_dir: str, cases: list[tuple[str, Callable[[DeviceMesh, int], dict]]] | None = None
) -> int:
    """Run ``cases`` (default: ``CASES``) on this rank, writing ``<out_dir>/rank<r>.json``."""
    cases = CASES if cases is None else cases
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    result_file = Path(out_dir) / f"rank{rank}.json"
    results: dict = {"rank": rank, "world_size": world, "torch": torch.__version__, "cases": {}}

    def flush() -> None:
        tmp = result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(result_file)

    start = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        results["init_s"] = round(time.perf_counter() - start, 3)
        flush()
        for name, run in cases:
            t0 = time.perf_counter()
            try:
                info = run(mesh, rank)
                results["cases"][name] = {"ok": True, "info": info}
            except Exception as exc:  # reported to the test, which fails with the message
                results["cases"][name] = {
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                }
            results["cases"][name]["seconds"] = round(time.perf_counter() - t0, 3)
            flush()
            # Keep the ranks in step between cases even if one of them failed an assertion.
            dist.barrier()
    finally:
        dist.destroy_process_group()
    results["total_s"] = round(time.perf_counter() - start, 3)
    results["done"] = True
    flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
