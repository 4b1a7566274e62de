"""What a session keeps about storages across a step knows them by the object, never by an
address; and a session leaves torch's process-wide state as it found it.

A step frees and allocates all the time (the optimizer between entries too), so a freed
address, ``data_ptr`` or ``_cdata`` soon belongs to another storage; a released storage has
no data pointer at all, and one paged back in has a new one.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._activations.recording import InferenceWatch
from swapopt_core._activations.warmup import OutsideReads


def _moved(storage: torch.UntypedStorage) -> list[torch.UntypedStorage]:
    """Release ``storage`` and page it back in at another address (as an eviction does);
    returns what holds its old block so the address cannot come back."""
    nbytes, before = storage.nbytes(), storage.data_ptr()
    storage.resize_(0)
    holders = []
    while True:
        holders.append(torch.UntypedStorage(nbytes))  # type: ignore[no-untyped-call]
        storage.resize_(nbytes)
        if storage.data_ptr() != before:
            return holders
        storage.resize_(0)


def test_an_inference_input_written_after_a_page_in_spoils_its_reader() -> None:
    """The warmup noted that op 0 (marked recompute) read an inference tensor; the tensor
    was evicted and paged back in (a new address) before op 1 wrote it in place: op 0 may
    no longer be recomputed, or its recompute would read the new bytes."""
    with torch.inference_mode():
        table = torch.arange(64, dtype=torch.float32)
    watch = InferenceWatch()
    watch.note(0, ((table,), {}), [], marked=True)
    held = _moved(table.untyped_storage())
    watch.note(1, ((table, 1.0), {}), [table], marked=False)
    assert watch.spoiled == {0}
    del held


def test_an_inference_storage_freed_is_not_taken_for_the_next_at_its_address() -> None:
    """A storage read by a marked op dies; a new inference storage that a later op writes
    is another storage, whatever its address: op 0 stays recomputable."""
    with torch.inference_mode():
        first = torch.zeros(256)
    watch = InferenceWatch()
    watch.note(0, ((first,), {}), [], marked=True)
    address = first.untyped_storage().data_ptr()
    del first
    with torch.inference_mode():
        second = torch.zeros(256)
    watch.note(1, ((second, 1.0), {}), [second], marked=False)
    assert watch.spoiled == set(), f"same address: {second.data_ptr() == address}"


def test_outside_reads_count_a_dead_storage_apart_from_one_at_its_address() -> None:
    """The batch the step read dies before the plan is made, and the optimizer's new state
    lands where it was: the batch's bytes still count as an input the step read."""
    reads = OutsideReads()
    batch = torch.UntypedStorage(4096)  # type: ignore[no-untyped-call]
    reads.note(batch)
    reads.note(batch)  # read by a second op: noted once
    del batch
    state = [torch.UntypedStorage(4096) for _ in range(8)]  # type: ignore[no-untyped-call]
    assert reads.bytes_besides(state) == 4096
    param = torch.UntypedStorage(1024)  # type: ignore[no-untyped-call]
    reads.note(param)
    assert reads.bytes_besides([*state, param]) == 4096  # the held one is not an input


def _global_state() -> dict[str, object]:
    return {
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "function modes": torch._C._len_torch_function_stack(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "threads": torch.get_num_threads(),
        "interop threads": torch.get_num_interop_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default dtype": torch.get_default_dtype(),
        "anomaly": torch.is_anomaly_enabled(),
        "saved tensor hooks": torch._C._autograd._saved_tensors_hooks_is_enabled(),
    }


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
        torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 10),
    )


@pytest.mark.parametrize("runtime", ["loopback", "loopback-async"])
def test_a_session_leaves_torch_as_it_found_it(runtime: str) -> None:
    """Warmup, replays, a step that leaves its plan and one that raises: afterwards torch's
    modes, flags and threads are as before, no hook is left on a parameter, and no thread of
    the session runs on the synchronous runtime."""
    model = _mlp()
    before, threads = _global_state(), threading.active_count()
    config = OffloadConfig(max_resident_activation_mb=0.05, runtime=runtime, min_offload_kib=0)
    session = OffloadSession(config)
    for step in range(4):
        x = torch.randn(32 if step != 2 else 16, 64, generator=torch.Generator().manual_seed(step))
        with session:
            model(x).square().mean().backward()
        assert _global_state() == before, f"after entry {step}"
    with pytest.raises(ZeroDivisionError), session:
        model(torch.randn(32, 64)).square().mean().backward()
        raise ZeroDivisionError
    assert _global_state() == before
    for param in model.parameters():
        assert not param._post_accumulate_grad_hooks, "a hook was left on a parameter"
        assert not param._backward_hooks
    if runtime == "loopback":
        assert threading.active_count() == threads


def test_plain_steps_after_a_session_are_deterministic() -> None:
    """After session entries, the same plain AdamW step on copies of the same inputs gives
    one result, the one it gives in a model never stepped under a session."""
    model = _mlp()
    twin = copy.deepcopy(model)
    session = OffloadSession(
        OffloadConfig(max_resident_activation_mb=0.05, runtime="loopback", min_offload_kib=0)
    )
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        with session:
            model(x).square().mean().backward()
    twin(x).square().mean().backward()
    twin(x).square().mean().backward()
    results = set()
    for source in (model, twin, model, twin, model):
        params = [torch.nn.Parameter(p.detach().clone()) for p in source.parameters()]
        for param, original in zip(params, source.parameters(), strict=True):
            param.grad = original.grad.clone()
        opt = torch.optim.AdamW(params, lr=1e-2)
        for _ in range(3):
            opt.step()
        results.add(tuple(p.detach().numpy().tobytes() for p in params))
    assert len(results) == 1
