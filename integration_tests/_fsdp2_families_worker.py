"""One rank of the two-process FSDP2 run with optimizers of the generic path.

Launched by ``test_optimizer_families_gloo.py`` like ``_fsdp2_worker.py``, whose model, data,
training loop, comparison and case runner it reuses. Each case trains the sharded model with
a plain optimizer and with the same optimizer swapped (loopback runtime), whose update runs
the optimizer's own ``step`` on one batch of parameters at a time over DTensor parameters and
state, and compares the local shards bit for bit: SGD, Adagrad, and the families whose step
creates its ``step`` counter lazily (RMSprop, Adadelta, Adamax, ASGD, NAdam, RAdam). Two cases
also checkpoint through ``torch.distributed.checkpoint`` mid-run and resume, swapped and plain.
(Rprop, Muon and torch's Adafactor do not run on sharded DTensor parameters even unswapped in
torch 2.13: in-place ops that change placement.)

Usage: ``python _fsdp2_families_worker.py OUT_DIR``
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import _fsdp2_dcp_worker as dcp_worker
import _fsdp2_worker as base
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from swapopt_core import is_swap_optimizer, swap_optimizer, swap_stats


def sgd_nesterov(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(base.param_groups(model, 0.01), lr=1e-2, momentum=0.9, nesterov=True)


def sgd_dampening_foreach(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        base.param_groups(model, 0.0), lr=1e-2, momentum=0.8, dampening=0.1, foreach=True
    )


def adagrad(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(base.param_groups(model, 0.01), lr=1e-2, lr_decay=0.01)


def _family(cls: type, **options: object) -> base.OptFactory:
    """A factory of ``cls`` over the weight and bias groups, with ``options``."""

    def make(model: nn.Module) -> torch.optim.Optimizer:
        return cls(base.param_groups(model, 0.01), lr=1e-2, **options)

    return make


#: Families whose step creates a plain 0-dim ``step`` counter (or ``eta``/``mu``) beside
#: DTensor state the first time it runs: the counters stay plain tensors, as unswapped.
LAZY_COUNTERS: dict[str, tuple[base.OptFactory, bool]] = {
    "rmsprop_centered": (_family(torch.optim.RMSprop, momentum=0.5, centered=True), True),
    "adadelta": (_family(torch.optim.Adadelta), False),
    "adamax": (_family(torch.optim.Adamax), True),
    "asgd": (_family(torch.optim.ASGD), False),
    "nadam_decoupled": (_family(torch.optim.NAdam, decoupled_weight_decay=True), True),
    "radam": (_family(torch.optim.RAdam), False),
}


def swapped_layout(opt: torch.optim.Optimizer, *, packed: bool, steps: int, what: str) -> dict:
    """Large state entries are DTensors over host (CPU) shards with their storage in place;
    nothing swapped is resident between steps."""
    assert is_swap_optimizer(opt), f"{what}: swap not installed"
    stats = swap_stats(opt)
    assert stats.resident_state_bytes == 0, f"{what}: resident {stats.resident_state_bytes} B"
    assert stats.packed is packed and stats.steps == steps, f"{what}: {stats}"
    expected = 0
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state[p].items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    continue  # step counters stay where the family put them
                assert isinstance(value, DTensor), f"{what}: {key} is {type(value).__name__}"
                assert value.placements == p.placements and value.shape == p.shape, what
                shard = value.to_local()
                assert shard.device.type == "cpu", f"{what}: {key} on {shard.device}"
                if shard.numel() >= base.MIN_NUMEL:
                    expected += 1
                    size = shard.numel() * shard.element_size()
                    assert shard.untyped_storage().nbytes() >= size, f"{what}: {key} released"
    assert expected > 0 and stats.swapped_tensors == expected, (
        f"{what}: swapped_tensors {stats.swapped_tensors}, expected {expected}"
    )
    assert stats.h2d_bytes > 0 and stats.d2h_bytes > 0, f"{what}: no traffic: {stats}"
    return {"swapped_tensors": expected, "batches": stats.batches}


def case_equivalence(mesh: DeviceMesh, rank: int, make: base.OptFactory, packed: bool) -> dict:
    plain_model = base.build_model(mesh)
    plain_opt = make(plain_model)
    base.train(plain_model, plain_opt, rank, range(base.STEPS))
    model = base.build_model(mesh)
    opt = make(model)
    assert swap_optimizer(opt, base.config(packed)) is opt
    base.train(model, opt, rank, range(base.STEPS))
    info = swapped_layout(opt, packed=packed, steps=base.STEPS, what="swapped run")
    info["compared_state_entries"] = base.assert_same(
        plain_model, plain_opt, model, opt, "swapped vs plain FSDP2"
    )
    return info


def case_dcp_resume(
    mesh: DeviceMesh, rank: int, make: base.OptFactory, packed: bool, root: Path
) -> dict:
    """Save through DCP after ``RESUME_AT`` steps, resume a fresh sharded model, go on: the
    swapped run equals the plain run doing the same, and an uninterrupted plain run."""
    whole = base.build_model(mesh)
    whole_opt = make(whole)
    base.train(whole, whole_opt, rank, range(base.STEPS))
    runs = {}
    for name, swap in (("plain", False), ("swapped", True)):
        model = base.build_model(mesh)
        opt = make(model)
        if swap:
            swap_optimizer(opt, base.config(packed))
        base.train(model, opt, rank, range(base.RESUME_AT))
        dcp_worker.save(model, opt, root / name)
        del model, opt
        model = base.build_model(mesh)
        opt = make(model)
        if swap:
            swap_optimizer(opt, base.config(packed))
        dcp_worker.load(model, opt, root / name)
        loaded = swap_stats(opt).steps if swap else 0  # DCP may step once to create state
        if swap:
            dcp_worker._host_state(opt, "swapped optimizer loaded by DCP")
        base.train(model, opt, rank, range(base.RESUME_AT, base.STEPS))
        runs[name] = (model, opt, loaded)
    plain, plain_opt, _ = runs["plain"]
    model, opt, loaded = runs["swapped"]
    base.assert_same(whole, whole_opt, plain, plain_opt, "plain DCP resume vs uninterrupted")
    steps = loaded + base.STEPS - base.RESUME_AT
    info = swapped_layout(opt, packed=packed, steps=steps, what="swapped DCP resume")
    info["compared_state_entries"] = base.assert_same(
        plain, plain_opt, model, opt, "swapped DCP resume vs plain DCP resume"
    )
    # The swapped run's checkpoint is an ordinary one: a plain optimizer resumes from it.
    other = base.build_model(mesh)
    other_opt = make(other)
    dcp_worker.load(other, other_opt, root / "swapped")
    base.train(other, other_opt, rank, range(base.RESUME_AT, base.STEPS))
    base.assert_same(plain, plain_opt, other, other_opt, "plain resumed from swapped checkpoint")
    return info


Case = Callable[[DeviceMesh, int], dict]


def cases(root: Path) -> list[tuple[str, Case]]:
    """The cases, the DCP one checkpointing under ``root``."""
    return [
        ("sgd_nesterov-packed", lambda m, r: case_equivalence(m, r, sgd_nesterov, True)),
        ("sgd_nesterov-per_tensor", lambda m, r: case_equivalence(m, r, sgd_nesterov, False)),
        (
            "sgd_dampening_foreach-packed",
            lambda m, r: case_equivalence(m, r, sgd_dampening_foreach, True),
        ),
        ("adagrad-packed", lambda m, r: case_equivalence(m, r, adagrad, True)),
        ("adagrad-per_tensor", lambda m, r: case_equivalence(m, r, adagrad, False)),
        *(
            (
                f"{name}-{'packed' if packed else 'per_tensor'}",
                functools.partial(case_equivalence, make=make, packed=packed),
            )
            for name, (make, packed) in LAZY_COUNTERS.items()
        ),
        (
            "dcp-resume-sgd_nesterov-packed",
            functools.partial(case_dcp_resume, make=sgd_nesterov, packed=True, root=root / "sgd"),
        ),
        (
            "dcp-resume-adagrad-per_tensor",
            functools.partial(case_dcp_resume, make=adagrad, packed=False, root=root / "adagrad"),
        ),
    ]


CASES = cases(Path("."))  # the names, for the test's parametrisation


def main(out_dir: str) -> int:
    return base.main(out_dir, cases(Path(out_dir) / "dcp"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
