"""An id kept by the torch engine never names a newer object that took a dead one's address.

CPython hands a freed object's address to the next object of its size, so each test lets a
parameter die and makes new ones until one lands where it was (while the engine keeps the
old one alive, as it must, none can: the test then goes on with a fresh one).
"""

from __future__ import annotations

import torch

from swapopt_core import swap_optimizer, unswap_optimizer
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._swap.engine import engine_of
from swapopt_core._swap.step import Interrupted
from swapopt_core._torch.bookkeeping import Unit
from swapopt_core._torch.prefetch import BackwardPrefetch
from tests.conftest import loopback

TRIES = 1000


def _new_param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(16))


def _spares() -> list[torch.Tensor]:
    """Data for the new parameters, made before the old one dies (so none lands there)."""
    return [torch.zeros(16) for _ in range(TRIES)]


def _at_address(address: int, spares: list[torch.Tensor]) -> torch.nn.Parameter:
    """A new parameter at ``address`` if one lands there, else the last one made."""
    tries = []
    for data in spares:
        tries.append(torch.nn.Parameter(data))
        if id(tries[-1]) == address:
            break
    return tries[-1]


def test_a_resident_parameter_that_died_does_not_keep_a_new_one_resident() -> None:
    old, kept = torch.nn.Parameter(torch.randn(16)), torch.nn.Parameter(torch.randn(16))
    opt = torch.optim.Adam([old, kept], lr=0.1)
    swap_optimizer(opt, loopback(min_numel=0, resident_state_fraction=1.0))
    try:
        engine = engine_of(opt)
        old.grad, kept.grad = torch.ones(16), torch.ones(16)
        opt.step()
        assert not engine.swappable(old, opt.state[old]["exp_avg"])  # resident
        # The script drops ``old`` from the optimizer, state and all: it dies.
        address, spares = id(old), _spares()
        opt.param_groups[0]["params"] = [kept]
        del opt.state[old], old
        new = _at_address(address, spares)
        # Until the next sync, the resident set still lists ``old``: never ``new``.
        assert engine.swappable(new, torch.zeros(16))
    finally:
        unswap_optimizer(opt)


def test_an_interrupted_unit_is_not_a_new_parameter_at_its_address() -> None:
    grad = torch.ones(16)
    old = _new_param()
    memory = Interrupted(None, None)
    unit = Unit(0, old, grad)
    memory.done[unit.key] = unit.token  # what a step that stopped after this unit keeps
    address, spares = id(old), _spares()
    del unit, old
    new = _at_address(address, spares)
    # Even with the very gradient the old parameter's update used, a retry updates ``new``.
    assert not memory.finished(Unit(0, new, grad))


def test_a_new_parameter_at_a_watched_one_s_address_is_watched() -> None:
    opened: list[object] = []

    def open_pipeline(plan: object) -> None:
        opened.append(plan)

    prefetch = BackwardPrefetch(LoopbackRuntime(), open_pipeline, ahead=2)
    old = _new_param()
    prefetch.watch([old])
    address, spares = id(old), _spares()
    del old
    new = _at_address(address, spares)
    prefetch.watch([new])
    prefetch.remember([[]])  # a plan: the first gradient of a backward asks for its pipeline
    (new * 2).sum().backward()
    assert len(opened) == 1
    prefetch.detach()
