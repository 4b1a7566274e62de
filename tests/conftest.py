"""Shared helpers for the fast CPU tests: a small deterministic model, a training loop and a
bitwise comparison of two optimizers."""

from __future__ import annotations

import contextvars
import copy
import os
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from swapopt_core import SwapOptimizerConfig, is_swap_optimizer, swap_optimizer, swap_stats
from swapopt_core._device.registry import forget_shared_runtimes

# MindFormers writes its logs under ./output at import; keep them out of the checkout.
os.environ.setdefault("LOCAL_DEFAULT_PATH", tempfile.mkdtemp(prefix="swapopt-mindformers-"))

_ENV_BEFORE_MINDSPORE = dict(os.environ)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Undo what importing MindSpore (at collection) did to the environment.

    It points ``LD_LIBRARY_PATH`` at its own bundled libraries; the torch worker processes
    that later tests spawn would inherit that and load them (a rank once aborted at exit).
    The variable only matters to processes started afterwards, so restoring it is safe.
    """
    for key in ("LD_LIBRARY_PATH", "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"):
        if key in _ENV_BEFORE_MINDSPORE:
            os.environ[key] = _ENV_BEFORE_MINDSPORE[key]
        else:
            os.environ.pop(key, None)


class SmallNet(nn.Module):
    """Linear layers of different sizes plus the awkward parameters an optimizer meets.

    ``tiny`` has 3 elements (below any sensible ``min_numel``), ``frozen`` has
    ``requires_grad=False``, ``unused`` never receives a gradient and ``odd`` is only used on
    odd steps, so it has a gradient in some steps and none (``None``) in others.
    """

    def __init__(self, *, frozen: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)  # weight: 1024 elements, exactly a default min_numel
        self.fc2 = nn.Linear(64, 48)
        self.fc3 = nn.Linear(48, 4)
        self.odd = nn.Linear(64, 48, bias=False)
        self.tiny = nn.Parameter(torch.randn(3))
        self.unused = nn.Parameter(torch.randn(40, 40))
        self.frozen = nn.Linear(16, 64) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.to(dtype)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        h = self.fc1(x)
        if self.frozen is not None:
            h = h + 0.5 * self.frozen(x)
        h = torch.tanh(h)
        z = self.fc2(h)
        if step % 2 == 1:
            z = z + self.odd(h)
        out = self.fc3(torch.tanh(z))
        return out + self.tiny.sum() * 0.1


def make_model(seed: int = 0, **kwargs) -> SmallNet:
    """A ``SmallNet`` whose initial weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return SmallNet(**kwargs)


def batch(step: int, micro: int = 0, dtype: torch.dtype = torch.float32):
    """Inputs and targets of one micro-batch, independent of the global RNG."""
    gen = torch.Generator().manual_seed(1000 + 17 * step + micro)
    x = torch.randn(8, 16, generator=gen).to(dtype)
    y = torch.randn(8, 4, generator=gen).to(dtype)
    return x, y


def loss_of(model: nn.Module, step: int, micro: int = 0) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x, y = batch(step, micro, dtype)
    return torch.nn.functional.mse_loss(model(x, step), y)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    start: int = 0,
    accumulate: int = 1,
    clip: float | None = None,
    closure: bool = False,
    scheduler=None,
    after_step: Callable[[int], None] | None = None,
) -> list[float | None]:
    """Run ``steps`` optimizer steps; return what each ``opt.step`` returned (as floats)."""
    returned: list[float | None] = []
    for step in range(start, start + steps):
        if closure:

            def fn(step=step):
                opt.zero_grad()
                loss = loss_of(model, step)
                loss.backward()
                return loss

            out = opt.step(fn)
        else:
            opt.zero_grad()
            for micro in range(accumulate):
                (loss_of(model, step, micro) / accumulate).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            out = opt.step()
        returned.append(None if out is None else float(out.detach()))
        if scheduler is not None:
            scheduler.step()
        if after_step is not None:
            after_step(step)
    return returned


def _same_value(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), f"{where}: values differ"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same(
    opt_a: torch.optim.Optimizer,
    opt_b: torch.optim.Optimizer,
    model_a: nn.Module,
    model_b: nn.Module,
) -> None:
    """Parameters, hyperparameters and every state entry are equal, bit for bit.

    A swapped optimizer's host state is read once ``swap_stats`` waited for its copies.
    """
    for opt in (opt_a, opt_b):
        if is_swap_optimizer(opt):
            swap_stats(opt)
    params_a = dict(model_a.named_parameters())
    params_b = dict(model_b.named_parameters())
    assert params_a.keys() == params_b.keys()
    for name, pa in params_a.items():
        _same_value(pa, params_b[name], f"parameter {name}")
    assert len(opt_a.param_groups) == len(opt_b.param_groups)
    for gi, (ga, gb) in enumerate(zip(opt_a.param_groups, opt_b.param_groups, strict=True)):
        assert ga.keys() == gb.keys(), f"param_groups[{gi}] keys"
        for key in ga:
            if key != "params":
                _same_value(ga[key], gb[key], f"param_groups[{gi}][{key!r}]")
        assert len(ga["params"]) == len(gb["params"])
        for pi, (pa, pb) in enumerate(zip(ga["params"], gb["params"], strict=True)):
            where = f"param_groups[{gi}]['params'][{pi}]"
            _same_value(pa, pb, where)
            sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
            assert sa.keys() == sb.keys(), f"{where}: state keys {set(sa)} != {set(sb)}"
            for key in sa:
                _same_value(sa[key], sb[key], f"state of {where}[{key!r}]")


@pytest.fixture(autouse=True)
def _own_runtime_instances() -> Iterator[None]:
    """Each test starts without shared runtime instances: a fault one test injects into its
    runtime (patching a method of the instance) cannot reach the next through sharing."""
    forget_shared_runtimes()
    yield
    forget_shared_runtimes()


#: The runtime ``loopback()`` configs name; the ``swap_runtime`` fixture switches it.
_RUNTIME: contextvars.ContextVar[str] = contextvars.ContextVar("runtime", default="loopback")

#: Jitter (microseconds) for suites run on ``loopback-async``: shakes out missing waits.
ASYNC_JITTER_US = "300"


def loopback(**kwargs) -> SwapOptimizerConfig:
    """A config on the CPU runtime of the test (``loopback`` unless ``swap_runtime`` says)."""
    return SwapOptimizerConfig(runtime=_RUNTIME.get(), **kwargs)


@pytest.fixture(params=["loopback", "loopback-async"])
def swap_runtime(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a test on the synchronous loopback and on ``loopback-async`` with jitter.

    Use it as ``pytestmark = pytest.mark.usefixtures("swap_runtime")``: every ``loopback()``
    config of the test then names that runtime.
    """
    if request.param == "loopback-async":
        monkeypatch.setenv("SWAPOPT_LOOPBACK_JITTER_US", ASYNC_JITTER_US)
    token = _RUNTIME.set(request.param)
    yield request.param
    _RUNTIME.reset(token)


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def assert_nothing_resident(opt: torch.optim.Optimizer) -> None:
    assert swap_stats(opt).resident_state_bytes == 0


@pytest.fixture
def make_pair():
    """``make_pair(make_opt, config, **model_kwargs)``: a plain and a swapped copy of one setup.

    ``make_opt(model)`` builds the optimizer; the second one is swapped with ``config``.
    Returns ``(plain_model, plain_opt, swap_model, swap_opt)``.
    """

    def build(make_opt, config: SwapOptimizerConfig, **model_kwargs):
        model_a = make_model(**model_kwargs)
        model_b = twin(model_a)
        opt_a = make_opt(model_a)
        opt_b = make_opt(model_b)
        assert swap_optimizer(opt_b, config) is opt_b
        return model_a, opt_a, model_b, opt_b

    return build
