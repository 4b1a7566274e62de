"""The OffloadSession part of the fault matrix: nothing is lost when a step is interrupted.

An exception or a ``KeyboardInterrupt`` is raised at the k-th hit of a fault site: in
forward, in backward (a tensor hook), in a copy of a real loopback runtime (its ``copy_out``
and ``copy_in`` wrapped), at the host pool (its ``acquire`` wrapped, under a host cap that
binds), and in a copy in that brings a storage back as the entry ends (``restore``: a
forward-only step leaves saved activations offloaded). Afterwards the tensors the failed
step made before the fault hold the reference's bits, and the next steps give gradients and
parameters ``torch.equal`` to a model trained without the session. Each fault fires in a
warmup and in a replay.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._device.loopback import LoopbackRuntime
from tests.activations.test_session import Net, _batch, _opaque_block

SITES = ("forward", "backward", "copy_out", "copy_in", "host_cap", "restore")
ERRORS = (ValueError, KeyboardInterrupt)
PHASES = ("warmup", "replay")
HITS = (1, 3)  # the k-th hit of the site in the failing step


class Faults:
    """Raises ``error`` at the ``k``-th hit of ``site`` once armed; every site calls ``hit``."""

    def __init__(self) -> None:
        self.site: str | None = None
        self.k = 0
        self.calls = 0
        self.error: type[BaseException] = ValueError
        self.fired = False

    def arm(self, site: str, k: int, error: type[BaseException]) -> None:
        self.site, self.k, self.error, self.calls, self.fired = site, k, error, 0, False

    def disarm(self) -> None:
        self.site = None

    def hit(self, site: str) -> None:
        if self.site != site:
            return
        self.calls += 1
        if self.calls == self.k:
            self.fired = True
            self.site = None  # one fault per case: the session's own recovery may retry
            raise self.error(f"injected at {site} #{self.k}")

    def wrap(self, site: str, fn):  # noqa: ANN001, ANN201
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.hit(site)
            return fn(*args, **kwargs)

        return wrapped


class FaultyNet(Net):
    """``Net`` with fault sites after each block (forward) and on each block's output
    gradient (backward); it keeps the blocks' outputs of its last forward."""

    def __init__(self, faults: Faults) -> None:
        super().__init__()
        self.faults = faults
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept = []
        h = self.inp(x)
        for index, block in enumerate(self.blocks):
            h = h + (_opaque_block(block, h) if index == 1 else block(h))
            h.mul_(0.5)
            self.kept.append(h)
            h.register_hook(self._backward_hit)
            self.faults.hit("forward")
        return self.out(h)

    def _backward_hit(self, grad: torch.Tensor) -> None:
        self.faults.hit("backward")


def _run(model: FaultyNet, step: int) -> torch.Tensor:
    torch.manual_seed(step)  # dropout masks
    logits = model(_batch(step))
    logits.square().mean().backward()
    return logits


def _session(manager, faults: Faults, site: str, planner: str = "every-gap") -> OffloadSession:
    config = OffloadConfig(
        max_resident_activation_mb=0.1,
        max_offload_activation_mb=0.05 if site == "host_cap" else 64,
        runtime="loopback",
        planner=planner,
        min_offload_kib=0,
    )
    session = OffloadSession(config, plugin_manager=manager)
    runtime = LoopbackRuntime()  # a real loopback runtime, its copies wrapped
    runtime.copy_out = faults.wrap("copy_out", runtime.copy_out)
    copy_in = faults.wrap("copy_in", runtime.copy_in)
    restore = faults.wrap("restore", runtime.copy_in)

    def either(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        closing = session._executor.entry is None  # the entry is being closed
        return (restore if closing else copy_in)(*args, **kwargs)

    runtime.copy_in = either
    session._executor._use(runtime)
    pool = session._executor.pool
    pool.acquire = faults.wrap("host_cap", pool.acquire)
    return session


def _clean_step(reference, model, optimizers, session, step: int) -> None:
    for m in (reference, model):
        m.zero_grad()
    ref_logits = _run(reference, step)
    with session:
        logits = _run(model, step)
    assert torch.equal(logits, ref_logits)
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    for optimizer in optimizers:
        optimizer.step()


def _case(
    manager,
    site: str,
    error: type[BaseException],
    phase: str,
    k: int,
    planner: str = "every-gap",
) -> OffloadSession:
    faults = Faults()
    reference, model = FaultyNet(Faults()), FaultyNet(faults)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, model)]
    session = _session(manager, faults, site, planner)
    first = 0
    if phase == "replay":
        _clean_step(reference, model, optimizers, session, 0)
        first = 1
    model.zero_grad()
    model.kept = []
    faults.arm(site, k, error)
    logits = None
    try:
        with session:
            torch.manual_seed(first)
            logits = model(_batch(first))
            if site != "restore":
                logits.square().mean().backward()
    except error:
        pass
    faults.disarm()
    assert faults.fired, f"{site} was hit {faults.calls} times, never {k}"
    kept = list(model.kept)
    reference.zero_grad()
    ref_logits = _run(reference, first)
    for mine, theirs in zip(kept, reference.kept, strict=False):
        assert torch.equal(mine, theirs)  # made before the fault, intact after it
    if logits is not None:
        assert torch.equal(logits, ref_logits)
    # The failed step is retried, then training goes on: the same bits as without a session.
    model.zero_grad()
    with session:
        _run(model, first)
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    for optimizer in optimizers:
        optimizer.step()
    for step in (first + 1, first + 2):
        _clean_step(reference, model, optimizers, session, step)
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    if site not in ("forward", "restore") or phase == "replay":
        assert session.stats().replays >= 1  # the plan still replays after the fault
    return session


MATRIX = list(itertools.product(SITES, ERRORS, PHASES, HITS))


@pytest.mark.parametrize(
    ("site", "error", "phase", "k"),
    MATRIX,
    ids=[f"{s}-{e.__name__}-{p}-{k}" for s, e, p, k in MATRIX],
)
def test_a_fault_loses_nothing(manager, site, error, phase, k) -> None:
    _case(manager, site, error, phase, k)


@pytest.mark.parametrize("error", ERRORS, ids=[e.__name__ for e in ERRORS])
@pytest.mark.parametrize("site", [s for s in SITES if s != "host_cap"])
def test_a_fault_in_a_replay_that_recomputes_loses_nothing(manager, site, error) -> None:
    """Storages released without a host copy are made again when a fault ends the step."""
    session = _case(manager, site, error, "replay", 1, planner="recompute-every-gap")
    assert session.stats().recomputes > 0


def test_host_memory_exhaustion_keeps_activations_on_the_device(manager) -> None:
    """``MemoryError`` from a host allocation is a refusal, as the host cap is: no failure."""
    reference, model = Net(), Net()
    session = OffloadSession(
        OffloadConfig(
            max_resident_activation_mb=0.1,
            runtime="loopback",
            planner="every-gap",
            min_offload_kib=0,
        ),
        plugin_manager=manager,
    )
    runtime = LoopbackRuntime()
    calls = itertools.count()

    def alloc_host(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        if nbytes < 2**20 and next(calls) % 2:  # not the bandwidth probe at the warmup
            raise MemoryError("injected")
        return torch.empty(nbytes, dtype=torch.uint8)

    runtime.alloc_host = alloc_host
    session._executor._use(runtime)
    for step in range(3):
        for m in (reference, model):
            m.zero_grad()
        torch.manual_seed(step)
        reference(_batch(step)).square().mean().backward()
        with session:
            torch.manual_seed(step)
            model(_batch(step)).square().mean().backward()
        for a, b in zip(reference.parameters(), model.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
    assert session.stats().host_cap_refusals > 0
    pool = session._executor.pool  # a refused allocation is not counted: all are back
    assert pool.allocated == sum(h.numel() for kept in pool._free.values() for h, _ in kept)
    assert 0 < pool.allocated <= session.stats().host_peak_bytes
