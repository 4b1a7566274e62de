"""What an OffloadSession refuses, or serves safely: threads, NumPy views, compiled code,
``skip_offload`` under a binding budget, CUDA graphs and side streams (checked on CPU)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from swapopt_core import OffloadConfig, OffloadSession, skip_offload
from swapopt_core._device import accelerator as runtime_module
from swapopt_core._device.accelerator import AcceleratorRuntime
from swapopt_core._device.interface import byte_view
from swapopt_core._device.loopback import LoopbackRuntime
from tests.activations.test_session import Net, Wide, _batch, _grads, _step
from tests.fake_accelerator import CurrentDevice

ROOT = Path(__file__).resolve().parents[2]
EVERY_GAP = OffloadConfig(
    max_resident_activation_mb=0.1, runtime="loopback", planner="every-gap", min_offload_kib=0
)


def _every_gap(runtime: str) -> OffloadConfig:
    return OffloadConfig(
        max_resident_activation_mb=0.1, runtime=runtime, planner="every-gap", min_offload_kib=0
    )


# ---- threads ---------------------------------------------------------------------------

_TWO_THREADS = textwrap.dedent(
    """
    import threading, torch
    from swapopt_core import OffloadConfig, OffloadSession
    from tests.activations.test_session import Net, _batch, _step
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.1, runtime="loopback",
                                           min_offload_kib=0))
    inside, tried = threading.Event(), threading.Event()
    errors = []
    model, reference = Net(), Net()
    def first():
        with session:
            torch.manual_seed(0)
            logits = model(_batch(0))
            inside.set()
            tried.wait(60)
            logits.square().mean().backward()
    def second():
        inside.wait(60)
        try:
            with session:
                Net()(_batch(1)).sum().backward()
        except RuntimeError as error:
            errors.append(str(error))
        tried.set()
    threads = [threading.Thread(target=first, name="A"), threading.Thread(target=second, name="B")]
    for t in threads: t.start()
    for t in threads: t.join(120)
    print("ERROR:", errors[0] if errors else None)
    assert errors, "the second thread entered the active session"
    _step(reference, _batch(0), seed=0)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert b.grad.untyped_storage().nbytes() == b.grad.numel() * b.grad.element_size()
        assert torch.equal(a.grad, b.grad)
    with session:  # free again once the first thread left
        model(_batch(2)).sum().backward()
    print("INTACT")
    """
)


def test_a_second_thread_is_refused_and_the_first_step_finishes_intact() -> None:
    # In a subprocess: before the fix the first thread's gradients were zero-byte storages,
    # and reading them could crash the interpreter.
    done = subprocess.run(
        [sys.executable, "-c", _TWO_THREADS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "already active in thread 'A'" in done.stdout
    assert "Give each thread its own OffloadSession" in done.stdout
    assert "INTACT" in done.stdout


def test_one_session_per_thread_runs_concurrently(manager, runtime_name: str) -> None:
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    reference = Wide()
    reference(x).backward()
    results: dict[str, list[torch.Tensor]] = {}
    # Made here: Wide() seeds and draws from the global generator, which threads share.
    models = {name: Wide() for name in "AB"}

    def train(name: str) -> None:
        model = models[name]
        session = OffloadSession(_every_gap(runtime_name), plugin_manager=manager)
        for _ in range(3):  # a warmup and two replays
            model.zero_grad()
            with session:
                model(x).backward()
        assert session.stats().replays == 2
        results[name] = _grads(model)

    threads = [threading.Thread(target=train, args=(name,)) for name in "AB"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(results) == {"A", "B"}
    for grads in results.values():
        for a, b in zip(_grads(reference), grads, strict=True):
            assert torch.equal(a, b)


# ---- storages shared with NumPy --------------------------------------------------------


class NumpyNet(Wide):
    """Reads an activation through NumPy in the middle of forward."""

    def __init__(self, region: bool) -> None:
        super().__init__()
        self.region = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = []
        for index, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if index == 2:
                read = _to_numpy_in_a_region if self.region else _to_numpy
                self.seen.append(read(x))
        return x.sum()


def _to_numpy(x: torch.Tensor) -> object:
    return x.detach().numpy()  # shares x's storage with NumPy


_to_numpy_in_a_region = skip_offload(_to_numpy)


@pytest.mark.parametrize("region", [False, True], ids=["plain", "skip_offload"])
def test_a_storage_shared_with_numpy_stays_on_the_device(
    manager, runtime_name: str, region: bool
) -> None:
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    reference, model = NumpyNet(region), NumpyNet(region)
    session = OffloadSession(_every_gap(runtime_name), plugin_manager=manager)
    for step in range(3):
        for m in (reference, model):
            m.zero_grad()
        reference(x * (step + 1)).backward()
        with session:
            model(x * (step + 1)).backward()
        for a, b in zip(reference.parameters(), model.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
        assert (model.seen[0] == reference.seen[0]).all()  # the NumPy view saw it all along
    stats = session.stats()
    assert (stats.warmups, stats.replays) == (1, 2) and stats.d2h_bytes > 0


# ---- torch.compile ---------------------------------------------------------------------


def test_compiled_code_inside_a_session_is_refused_clearly(manager) -> None:
    # aot_eager: Dynamo decides to skip a frame before any backend runs, so the refusal does
    # not depend on the backend, and the test needs no C compiler (inductor would take ~30 s).
    model = Wide()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    compiled(x).backward()  # compiled and cached outside a session
    session = OffloadSession(EVERY_GAP, plugin_manager=manager)
    for _ in range(2):  # a cached frame, and again after the refusal
        refused = pytest.raises(RuntimeError, match=r"torch\.compile'd function .* not supported")
        with refused, session:
            compiled(x).backward()
    reference = Wide()
    for m in (reference, model):
        m.zero_grad()
    reference(x).backward()
    with session:  # the eager model is served as before
        model(x).backward()
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    compiled(x)  # and the compiled one outside the session


def test_compiled_code_is_refused_where_dynamo_does_not_ask_the_mode(manager) -> None:
    import torch._dynamo.config

    weight = torch.randn(64, 64, requires_grad=True)

    def layer(a: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a @ weight).sum()

    # A function of its own: Dynamo now marks its code to run eagerly for good, and a
    # compiled module would share that mark with every other compiled module.
    compiled = torch.compile(layer, backend="aot_eager")
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    session = OffloadSession(EVERY_GAP, plugin_manager=manager)
    refused = pytest.raises(RuntimeError, match=r"torch\.compile'd function \(layer .*\) was")
    asks_no_mode = torch._dynamo.config.patch(inline_torch_dispatch_torch_compile=False)
    with asks_no_mode, refused, session:
        compiled(x).backward()


@pytest.mark.slow  # inductor compiles C++ with gcc: about 25 s on a 2-core machine
@pytest.mark.skipif(shutil.which("gcc") is None, reason="inductor on CPU needs a C compiler")
def test_an_inductor_compiled_model_is_refused_and_stays_compiled_outside(manager) -> None:
    model = Wide()
    compiled = torch.compile(model)  # the default backend, inductor
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    before = compiled(x)
    session = OffloadSession(EVERY_GAP, plugin_manager=manager)
    refused = pytest.raises(RuntimeError, match=r"torch\.compile'd function .* not supported")
    with refused, session:
        compiled(x).backward()
    assert torch.equal(compiled(x), before)  # still the compiled run, not an eager one


# ---- skip_offload under a binding budget -----------------------------------------------


@skip_offload
def _region(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(layer(x))


class RegionNet(Wide):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = _region(layer, x) if index == 3 else torch.tanh(layer(x))
        return x.sum()


@pytest.mark.parametrize("planner", ["auto", "every-gap", "recompute-every-gap"])
def test_skip_offload_regions_replay_under_a_binding_budget(
    manager, runtime_name: str, planner: str
) -> None:
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    reference, model = RegionNet(), RegionNet()
    config = OffloadConfig(
        max_resident_activation_mb=0.5, runtime=runtime_name, planner=planner, min_offload_kib=0
    )
    session = OffloadSession(config, plugin_manager=manager)
    for step in range(3):
        for m in (reference, model):
            m.zero_grad()
        reference(x * (step + 1)).backward()
        with session:
            model(x * (step + 1)).backward()
        for a, b in zip(reference.parameters(), model.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
    stats = session.stats()
    assert (stats.warmups, stats.replays, stats.retraces) == (1, 2, 0)
    assert stats.d2h_bytes > 0
    names = [op.name for op in session.trace.ops]
    assert "_region.forward" in names and not any(n.startswith("empty") for n in names)


# ---- CUDA graphs and side streams (torch.cuda faked) -----------------------------------


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Streams are plain objects; which one is current and whether it captures is ours."""
    state = {"current": "main", "capturing": False}
    ids: dict[object, int] = {}
    monkeypatch.setattr(torch, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    # The bindings behind them, which the per-op check calls: (stream id, device, type).
    monkeypatch.setattr(
        torch._C,
        "_cuda_getCurrentStream",
        lambda index: (ids.setdefault(state["current"], len(ids)), index, 1),
        raising=False,
    )
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: state["capturing"])
    CurrentDevice(0).install(monkeypatch)
    return state


def test_cuda_ops_on_a_side_stream_or_in_a_capture_are_refused(fake_cuda: dict) -> None:
    runtime = AcceleratorRuntime(torch.device("cuda", 0))
    check = runtime.begin_entry(torch.device("cuda", 0))
    check()  # the entry's own stream: fine
    fake_cuda["current"] = "side"
    with pytest.raises(RuntimeError, match="on CUDA stream side, but the session's entry"):
        check()
    fake_cuda["current"] = "main"
    fake_cuda["capturing"] = True
    with pytest.raises(RuntimeError, match="CUDA graph was being captured"):
        check()
    with pytest.raises(RuntimeError, match="CUDA graph was being captured"):
        runtime.begin_entry(torch.device("cuda", 0))  # an entry that starts inside a capture


class _Ordered(LoopbackRuntime):
    """Loopback copies with the CUDA runtime's ordering check, on a fake stream."""

    def __init__(self, state: dict) -> None:
        super().__init__()
        self.state = state

    def begin_entry(self, device):  # noqa: ANN001, ANN201
        start = self.state["current"]

        def check() -> None:
            if self.state["current"] != start:
                raise RuntimeError("side stream")

        return check


def test_a_refused_op_leaves_the_session_usable(manager) -> None:
    state = {"current": "main"}
    session = OffloadSession(EVERY_GAP, plugin_manager=manager)
    session._executor._use(_Ordered(state))
    model, reference = Net(), Net()
    with pytest.raises(RuntimeError, match="side stream"), session:
        torch.manual_seed(0)  # dropout masks
        kept = model(_batch(0))
        state["current"] = "side"
        model(_batch(1))
    state["current"] = "main"
    torch.manual_seed(0)
    assert torch.equal(kept, reference(_batch(0)))
    with session:
        loss, _ = _step(model, _batch(2), seed=2)
    assert torch.equal(loss, _step(reference, _batch(2), seed=2)[0])


# ---- the CUDA runtime's host buffers and copies (torch.cuda faked) ---------------------


def test_page_locking_is_tried_per_buffer_and_warned_once(
    fake_cuda: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def failing(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        calls.append(numel)
        return torch.empty(numel, dtype=dtype), 712  # cudaErrorHostMemoryAlreadyRegistered

    monkeypatch.setattr(runtime_module, "alloc_pinned", failing)
    runtime = AcceleratorRuntime(torch.device("cuda", 0))
    with caplog.at_level(logging.WARNING, logger=runtime_module.__name__):
        buffers = [runtime.alloc_host(n, torch.uint8) for n in (16, 32, 64)]
    assert [b.numel() for b in buffers] == [16, 32, 64]
    assert calls == [16, 32, 64]  # one failure does not make every later buffer pageable
    assert sum("cudaHostRegister failed" in r.message for r in caplog.records) == 1
    assert runtime.pageable_buffers(buffers) == 3


def test_cuda_copies_keep_blocks_by_events_not_record_stream(
    fake_cuda: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Event:
        def query(self) -> bool:
            return True

    class Stream:
        def wait_stream(self, other: object) -> None:
            pass

        def record_event(self) -> Event:
            return Event()

        def synchronize(self) -> None:
            pass

    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: recorded.append(s))
    monkeypatch.setattr(torch, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.accelerator, "set_stream", lambda stream: None)
    runtime = AcceleratorRuntime(torch.device("cuda", 0))
    storage = torch.arange(8, dtype=torch.float32).untyped_storage()
    host = torch.empty(storage.nbytes(), dtype=torch.uint8)
    assert isinstance(runtime.copy_out([(byte_view(storage), host)]).marks[0][1], Event)
    assert isinstance(runtime.copy_in([(byte_view(storage), host)]).marks[0][1], Event)
    assert recorded == []
