"""Record one training step on fake tensors with the session's own recorder, and its costs.

The step (forward, loss, backward) runs under ``FakeTensorMode``, so no tensor holds memory and
an 8B model traces on a laptop. A dispatch mode inside the fake mode hands every op to the
recorder an ``OffloadSession`` runs at its first entry (``WarmupEntry``,
``swapopt_core._activations.warmup``), under a budget nothing reaches, so nothing is evicted.
What it records is what that warmup records of the same step on CPU, by the same code: every
op in order (views included), the activation storages each reads and writes and where each
it creates is among its outputs, which ops may be recomputed, the op after which a storage
the caller held died, and the parameter gradients, which it takes out of the storages (the
session counts them apart); the storages are numbered as a session numbers them
(``plans.canonical``). Parameters, buffers and the inputs, made before the step, are not
recorded as storages.

Beside each recorded op the mode notes its cost, which a warmup measures instead:

- its FLOPs, from ``torch.utils.flop_counter``'s per-op formulas (matmuls, convolutions,
  attention; the CPU flash-attention kernels are counted like the CUDA ones), else 0;
- the bytes of its tensor inputs and outputs (views count as the bytes they span, not their
  storage's);
- whether it launches a kernel: an op that only makes a view (its schema returns an alias
  of an input and writes nothing, or every output is in an input's storage and nothing is
  written, as ``_unsafe_view``) does not, and costs nothing.

Two things differ from a warmup on real tensors, neither in what is recorded: fake tensors
dispatch ``prim`` queries (``prim.device``, for every ``.device`` read) that real tensors
answer without the dispatcher, and they are passed through; and fake storages are on the
meta device, which the recorder's runtime serves. The recompute marks are the CPU's (the
fake tensors are CPU tensors); on another device, ops whose bits may differ between two runs
on an accelerator are not marked (``recording.op_kind``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from swapopt_core._activations.calls import written_tensors
from swapopt_core._activations.plans import canonical
from swapopt_core._activations.recording import op_kind
from swapopt_core._activations.residency import HostPool
from swapopt_core._activations.scope import Scope
from swapopt_core._activations.warmup import WarmupEntry
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._planning.ir import Access, ActivationTrace

__all__ = ["FakeOp", "FakeStep", "StepRecorder"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
#: The recorder's activation budget: more than any step holds, so it never evicts.
_UNLIMITED = 2**62


@dataclass(frozen=True)
class FakeOp:
    """One recorded op.

    Attributes:
        name: The aten overload (``mm.default``).
        flops: Its FLOPs (0 where no formula counts them).
        nbytes: Bytes of its tensor inputs and outputs (0 for an op without a kernel).
        low_precision: It computes in bf16/fp16 (priced at that rate).
        accesses: The activation storages it touches.
        recompute: Running it again gives the same bits where it would run.
        kernel: It launches a kernel (an op that only makes a view does not).
    """

    name: str
    flops: int
    nbytes: int
    low_precision: bool
    accesses: tuple[Access, ...]
    recompute: bool
    kernel: bool = True


@dataclass
class FakeStep:
    """What one recorded step holds (see :class:`StepRecorder`).

    Attributes:
        ops: The recorded ops in order.
        storage_sizes: Bytes of every activation storage, by sid.
        retained: Activation storages alive at the end of the step.
        freed_after: Storages that died after their last access: the op after which.
        backward_start: Index of backward's first op.
        gradients: ``(op, bytes)`` of every gradient: the op after which autograd stored it
            (as a session's warmup reports it to the whole-step planner).
    """

    ops: list[FakeOp] = field(default_factory=list)
    storage_sizes: dict[int, int] = field(default_factory=dict)
    retained: frozenset[int] = frozenset()
    freed_after: dict[int, int] = field(default_factory=dict)
    backward_start: int = 0
    gradients: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class _Cost:
    flops: int
    nbytes: int
    low_precision: bool
    kernel: bool
    device_only: bool  # recomputable on CPU, on an accelerator only deterministically


def _cpu_flash_forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


def _cpu_flash_backward(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any
) -> int:
    return int(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    aten = torch.ops.aten
    found: dict[Any, Callable[..., int]] = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_forward),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_backward),
    ):
        packet = getattr(aten, name, None)
        if packet is not None:
            found[packet] = formula
    return found


_EXTRA = _extra_formulas()
_VIEW_CACHE: dict[Any, bool] = {}


def _only_views(func: Any) -> bool:
    """Whether ``func`` only makes views: every return aliases an input, nothing written."""
    found = _VIEW_CACHE.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = bool(
            schema is not None
            and schema.returns
            and not schema.is_mutable
            and all(r.alias_info is not None for r in schema.returns)
        )
        _VIEW_CACHE[func] = found
    return found


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    packet = func.overloadpacket
    formula = flop_registry.get(packet)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    extra = _EXTRA.get(packet)
    return extra(*args, **kwargs) if extra is not None else 0


def _cost(func: Any, args: tuple, kwargs: dict, out: Any) -> _Cost:
    """What the op ``func`` that returned ``out`` costs where it runs."""
    device_only = op_kind(func).name == "CPU"
    tensors = [v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    results = [v for v in tree_leaves(out) if isinstance(v, torch.Tensor)]
    if _only_views(func):
        return _Cost(0, 0, False, False, device_only)
    if results and not written_tensors(func, args, kwargs):
        inputs = {v.untyped_storage() for v in tensors}
        if all(v.untyped_storage() in inputs for v in results):
            return _Cost(0, 0, False, False, device_only)  # _unsafe_view: no kernel
    both = (*tensors, *results)
    return _Cost(
        _flops(func, args, kwargs, out),
        sum(_nbytes(v) for v in both),
        any(v.dtype in _LOW_PRECISION for v in both),
        True,
        device_only,
    )


class _FakeStorages(LoopbackRuntime):
    """The loopback runtime, serving the storages of fake tensors too (they are on the meta
    device): a warmup records the storages its runtime serves."""

    def serves(self, device: torch.device) -> bool:
        return device.type in ("cpu", "meta")


class StepRecorder(TorchDispatchMode):
    """A dispatch mode that records ops into a :class:`FakeStep` through a session warmup;
    push it inside the fake mode, around forward, loss and backward.

    Args:
        on_cpu: The priced device is the CPU: ops whose bits may differ between runs only on
            accelerators count as recomputable.
    """

    def __init__(self, on_cpu: bool) -> None:
        super().__init__()
        self.on_cpu = on_cpu
        runtime = _FakeStorages()
        self.scope = Scope(_UNLIMITED, 0, [])
        self.scope.start(runtime, HostPool(runtime, 0))
        self.warmup = WarmupEntry(self.scope)
        self.backward_start = 0
        self._costs: list[_Cost] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "prim":  # queries real tensors answer without the dispatcher
            return func(*args, **kwargs)
        recorded = len(self.warmup.ops)
        out = self.warmup.dispatch(func, args, kwargs)
        if len(self.warmup.ops) > recorded:
            self._costs.append(_cost(func, args, kwargs, out))
        return out

    # ---- marks and the result ----------------------------------------------------------

    def mark_backward(self) -> None:
        """The next recorded op is backward's first."""
        self.backward_start = len(self.warmup.ops)

    def finish(self, gradients: Iterable[torch.Tensor]) -> FakeStep:
        """Close the recording, as a session closes its warmup's entry: the storages alive
        now are retained. ``gradients``: the parameters' gradients; bytes of those the
        warmup did not see stored count from backward's first op on."""
        warmup, scope = self.warmup, self.scope
        recorded = ActivationTrace(
            tuple(warmup.trace_ops()),
            warmup.storage_sizes(),
            scope.retained(),
            freed_after=warmup.freed_after(),
        )
        warmup.close()
        scope.gradients.close()
        trace, _ = canonical(recorded)
        ready = list(scope.gradients.ready)
        storages = {g.untyped_storage(): g for g in gradients}
        missing = sum(s.nbytes() for s in storages) - sum(nbytes for _, nbytes in ready)
        if missing > 0:
            ready.append((self.backward_start, missing))
        ops = [
            FakeOp(
                op.name,
                cost.flops,
                cost.nbytes,
                cost.low_precision,
                op.accesses,
                op.recompute and (self.on_cpu or not cost.device_only),
                cost.kernel,
            )
            for op, cost in zip(trace.ops, self._costs, strict=True)
        ]
        return FakeStep(
            ops=ops,
            storage_sizes=dict(trace.storage_sizes),
            retained=trace.retained_sids,
            freed_after=dict(trace.freed_after),
            backward_start=self.backward_start,
            gradients=ready,
        )
