"""One rank of the two-process FSDP2 run that checkpoints through ``torch.distributed.checkpoint``.

Launched by ``test_fsdp2_gloo.py`` like ``_fsdp2_worker.py``, whose model, data, training loop,
checks and case runner it reuses. Each case trains a sharded model ``RESUME_AT`` steps, saves
model and optimizer with ``get_model_state_dict`` / ``get_optimizer_state_dict`` and
``dcp.save``, then builds a fresh sharded model and a fresh optimizer, loads them with
``dcp.load`` and ``set_model_state_dict`` / ``set_optimizer_state_dict``, and trains to
``STEPS``. The swapped run (swap installed before the load) must end with the local shards of
every parameter and state entry equal, bit for bit, to the plain run doing the same, which must
equal an uninterrupted plain run; the swapped checkpoint also resumes a plain optimizer.

Usage: ``python _fsdp2_dcp_worker.py OUT_DIR`` (checkpoints go to ``OUT_DIR/dcp/<case>``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import _fsdp2_worker as base
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from swapopt_core import swap_optimizer, swap_stats


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def save(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """Model and optimizer to ``path`` through DCP (every rank writes its shards)."""
    dcp.save(_state(model, opt), checkpoint_id=str(path))


def load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """Model and optimizer from ``path`` through DCP, as a resuming job does."""
    state = _state(model, opt)  # the layout to load into: this rank's shards
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _host_state(opt: torch.optim.Optimizer, what: str) -> None:
    """Swapped entries are host DTensors and nothing is resident right after the load."""
    assert swap_stats(opt).resident_state_bytes == 0, f"{what}: resident after load"
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step":
                assert isinstance(value, DTensor), f"{what}: {key} is {type(value).__name__}"
                assert value.to_local().device.type == "cpu", f"{what}: {key} not on host"


def case_dcp_resume(
    mesh: DeviceMesh, rank: int, make: base.OptFactory, packed: bool, root: Path
) -> dict:
    loaded_steps = {}  # swap_stats(opt).steps right after the load (DCP may step once)

    def resumed(checkpoint: Path, swap: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = base.build_model(mesh)
        opt = make(model)
        if swap:
            swap_optimizer(opt, base.config(packed))
        load(model, opt, checkpoint)
        if swap:
            _host_state(opt, "swapped optimizer loaded by DCP")
            loaded_steps[opt] = swap_stats(opt).steps
        base.train(model, opt, rank, range(base.RESUME_AT, base.STEPS))
        return model, opt

    whole = base.build_model(mesh)
    whole_opt = make(whole)
    base.train(whole, whole_opt, rank, range(base.STEPS))
    for name, swap in (("plain", False), ("swapped", True)):
        model = base.build_model(mesh)
        opt = make(model)
        if swap:
            swap_optimizer(opt, base.config(packed))
        base.train(model, opt, rank, range(base.RESUME_AT))
        save(model, opt, root / name)
        del model, opt
    plain, plain_opt = resumed(root / "plain", swap=False)
    base.assert_same(whole, whole_opt, plain, plain_opt, "plain DCP resume vs uninterrupted")
    model, opt = resumed(root / "swapped", swap=True)
    steps = loaded_steps[opt] + base.STEPS - base.RESUME_AT
    info = base.assert_swapped_layout(
        model, opt, packed=packed, steps=steps, what="swapped DCP resume"
    )
    info["compared_state_entries"] = base.assert_same(
        plain, plain_opt, model, opt, "swapped DCP resume vs plain DCP resume"
    )
    # The swapped run's checkpoint is an ordinary one: a plain optimizer resumes from it.
    other, other_opt = resumed(root / "swapped", swap=False)
    base.assert_same(plain, plain_opt, other, other_opt, "plain resumed from swapped checkpoint")
    return info


Case = Callable[[DeviceMesh, int, Path], dict]

CASES: list[tuple[str, Case]] = [
    (
        "dcp-resume-adamw-packed",
        lambda m, r, root: case_dcp_resume(m, r, base.adamw, True, root),
    ),
    (
        "dcp-resume-adam_amsgrad-per_tensor",
        lambda m, r, root: case_dcp_resume(m, r, base.adam_amsgrad, False, root),
    ),
]


def main(out_dir: str) -> int:
    """Run ``CASES`` through ``_fsdp2_worker.main``, each with its own checkpoint folder."""
    root = Path(out_dir) / "dcp"
    cases = [(name, functools.partial(run, root=root / name)) for name, run in CASES]
    return base.main(out_dir, cases)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
