"""Every family of PyTorch's optimizer database, every CPU configuration it is tested with,
swapped bit for bit: parameters and every state entry equal the unswapped optimizer's.

The configurations are the ones ``optim_db`` gives (``optim_inputs_func(device="cpu")``),
each in both staging modes and on both loopback runtimes (``loopback-async`` with jitter);
Adam and AdamW go through their dedicated adapter, the rest through ``PerParameterAdapter``.
LBFGS is refused (see ``test_per_parameter.py``).
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from swapopt_core import swap_stats
from tests.conftest import loopback
from tests.torch_backend.per_parameter_cases import MIN_NUMEL, lockstep, make_opt, pair

#: Each test runs on the synchronous loopback and on loopback-async with jitter.
pytestmark = pytest.mark.usefixtures("swap_runtime", "single_thread")

#: Families whose update reads across parameters: refused, not compared.
REFUSED = {"LBFGS"}

# Read in a child process: importing PyTorch's test utilities calls
# torch.backends.disable_global_flags() for the whole process, after which Lightning's
# Trainer (later in the same pytest run) cannot set its backend flags.
_READ_OPTIM_DB = """
import pickle, sys
from torch.testing._internal.common_optimizers import optim_db
found = {
    info.optim_cls.__name__: (
        tuple(info.supported_impls),
        tuple(info.supports_fused_on),
        [(i.desc, dict(i.kwargs), i.params is None) for i in info.optim_inputs_func(device="cpu")],
    )
    for info in optim_db
}
with open(sys.argv[1], "wb") as out:
    pickle.dump(found, out)
"""


@dataclass(frozen=True)
class _Info:
    """What the tests take of one ``OptimizerInfo``."""

    optim_cls: type
    supported_impls: tuple[str, ...]
    supports_fused_on: tuple[str, ...]
    inputs: list[tuple[str, dict[str, Any], bool]]


def _read_optim_db() -> dict[str, _Info]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "optim_db.pickle"
        done = subprocess.run(
            [sys.executable, "-c", _READ_OPTIM_DB, str(path)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"torch's optim_db cannot be read here: {done.stderr[-500:]}")
        found = pickle.loads(path.read_bytes())
    return {
        name: _Info(getattr(torch.optim, name), impls, fused_on, inputs)
        for name, (impls, fused_on, inputs) in found.items()
    }


INFOS = _read_optim_db()


def _slug(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_")


def _cases() -> list[Any]:
    cases = []
    for name, info in INFOS.items():
        if name in REFUSED:
            continue
        for desc, kwargs, no_params in info.inputs:
            assert no_params, f"{name} {desc}: explicit params are not handled"
            cases.append(pytest.param(name, kwargs, id=f"{name}-{_slug(desc)}"))
    return cases


CASES = _cases()
#: The same configurations with ``foreach=True`` where the family has a foreach path.
FOREACH = [
    pytest.param(c.values[0], {**c.values[1], "foreach": True}, id=f"{c.id}-foreach")
    for c in CASES
    if "foreach" in INFOS[c.values[0]].supported_impls
]
#: And with ``fused=True`` where the family has a fused CPU kernel.
FUSED = [
    pytest.param(c.values[0], {**c.values[1], "fused": True}, id=f"{c.id}-fused")
    for c in CASES
    if "fused" in INFOS[c.values[0]].supported_impls
    and "cpu" in INFOS[c.values[0]].supports_fused_on
]

STEPS = 4  # ``odd`` gets its first gradient (and state) at step 1, a second at step 3
PACKED = pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])


def _run(name: str, kwargs: dict[str, Any], packed: bool, *, odd_parity: int = 1) -> None:
    cls = INFOS[name].optim_cls
    config = loopback(swap_times=3, min_numel=MIN_NUMEL, packed_swap=packed)
    plain_model, plain, model, opt = pair(cls, kwargs, config, odd_parity=odd_parity)
    lockstep(plain_model, plain, model, opt, STEPS)
    stats = swap_stats(opt)
    assert stats.batches > 1 and stats.steps == STEPS
    stateless = name == "SGD" and not kwargs.get("momentum")
    assert stateless or stats.swapped_tensors >= 3  # fc1.weight, fc2.weight and odd's state


@PACKED
@pytest.mark.parametrize(("name", "kwargs"), CASES)
def test_optim_db(name: str, kwargs: dict[str, Any], packed: bool) -> None:
    _run(name, kwargs, packed)


@PACKED
@pytest.mark.parametrize(("name", "kwargs"), FOREACH)
def test_optim_db_foreach(name: str, kwargs: dict[str, Any], packed: bool) -> None:
    _run(name, kwargs, packed)


@PACKED
@pytest.mark.parametrize(("name", "kwargs"), FUSED)
def test_optim_db_fused(name: str, kwargs: dict[str, Any], packed: bool) -> None:
    # torch's fused SGD cannot start momentum for one parameter when others have theirs
    # (unswapped too): ``odd`` takes its first gradient in the first step here.
    _run(name, kwargs, packed, odd_parity=0)


def test_the_cases_cover_optim_db() -> None:
    """91 CPU configurations in all: LBFGS's 5 are refused, the other 86 compared."""
    total = sum(len(info.inputs) for info in INFOS.values())
    lbfgs = len(INFOS["LBFGS"].inputs)
    assert len(CASES) == total - lbfgs
    assert {c.values[0] for c in CASES} == set(INFOS) - REFUSED


@pytest.mark.parametrize("name", sorted(set(INFOS) - REFUSED - {"SparseAdam"}))
def test_family_with_scheduler_groups_and_clipping(name: str) -> None:
    """A learning rate scheduler and gradient clipping, around the swapped step."""
    cls = INFOS[name].optim_cls
    config = loopback(swap_times=4, min_numel=MIN_NUMEL)
    plain_model, plain, model, opt = pair(cls, {}, config)
    scheds = tuple(torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (plain, opt))
    lockstep(plain_model, plain, model, opt, 5, clip=0.05, schedulers=scheds)
    assert (
        opt.param_groups[1]["lr"]
        == plain.param_groups[1]["lr"]
        != make_opt(cls, model, {}).param_groups[1]["lr"]
    )
