"""Record one training step on fake tensors: every op, its storages, FLOPs and bytes.

The step (forward, loss, backward) runs under ``FakeTensorMode``, so no tensor holds memory and
an 8B model traces on a laptop. A dispatch mode inside the fake mode sees every aten op and
records what a session's warmup records (``swapopt_core._activations.warmup``), with the
op's cost in place of a measured duration:

- the storages it reads and writes; a storage is tracked by identity (a fake tensor has an
  untyped storage, shared by its views) from the op that creates it, and the op after which
  it dies is noted by a finaliser;
- its FLOPs, from ``torch.utils.flop_counter``'s per-op formulas (matmuls, convolutions,
  attention; the CPU flash-attention kernels are counted like the CUDA ones), else 0;
- the bytes of its tensor inputs and outputs (views count as the bytes they span, not their
  storage's).

Ops that only make a view (their schema returns an alias of an input and writes nothing) are
not recorded: they launch no kernel and touch no memory, and every later use of the view is
an access to the same storage; so are ops whose every output is in an input's storage and
that write nothing (``_unsafe_view``). Neither are ``prim`` queries (``prim.device``, which fake
tensors dispatch for every ``.device`` read: four in five dispatched ops of a Llama step).

Parameters, buffers and the inputs are not activations: they are left out of the storages,
and so are the gradients (``OffloadStats`` counts them apart, as the session does).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from swapopt_core._activations.calls import written_tensors
from swapopt_core._activations.recording import op_kind
from swapopt_core._planning.ir import Access, AccessKind

__all__ = ["FakeOp", "FakeStep", "StepRecorder"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FakeOp:
    """One recorded op.

    Attributes:
        name: The aten overload (``mm.default``).
        flops: Its FLOPs (0 where no formula counts them).
        nbytes: Bytes of its tensor inputs and outputs.
        low_precision: It computes in bf16/fp16 (priced at that rate).
        accesses: The activation storages it touches.
        recompute: Running it again gives the same bits where it would run.
    """

    name: str
    flops: int
    nbytes: int
    low_precision: bool
    accesses: tuple[Access, ...]
    recompute: bool


@dataclass
class FakeStep:
    """What one recorded step holds (see :class:`StepRecorder`).

    Attributes:
        ops: The recorded ops in order.
        storage_sizes: Bytes of every activation storage, by sid.
        retained: Activation storages alive at the end of the step.
        freed_after: Storages that died after their last access: the op after which.
        backward_start: Index of backward's first op.
        gradients: ``(op, bytes)`` of every gradient storage: the op that made it.
    """

    ops: list[FakeOp] = field(default_factory=list)
    storage_sizes: dict[int, int] = field(default_factory=dict)
    retained: frozenset[int] = frozenset()
    freed_after: dict[int, int] = field(default_factory=dict)
    backward_start: int = 0
    gradients: list[tuple[int, int]] = field(default_factory=list)


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


class StepRecorder(TorchDispatchMode):
    """A dispatch mode that records ops into a :class:`FakeStep`; push it inside the fake mode.

    Args:
        known: Tensors whose storages are not activations (parameters, buffers, inputs).
        on_cpu: The priced device is the CPU: ops whose bits may differ between runs only on
            accelerators count as recomputable.
    """

    def __init__(self, known: Iterable[torch.Tensor], on_cpu: bool) -> None:
        super().__init__()
        self.step = FakeStep()
        self.on_cpu = on_cpu
        self._outside = {id(t.untyped_storage()) for t in known}
        self._keep_alive = [t.untyped_storage() for t in known]  # the ids above stay theirs
        self._sids: dict[int, int] = {}  # id(storage) -> sid, for live storages
        self._died: dict[int, int] = {}  # sid -> op after which it died
        self._alive: set[int] = set()
        self.closed = False

    # ---- the op path -------------------------------------------------------------------

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _only_views(func) or func.namespace == "prim":  # views; queries (prim.device)
            return out
        written = {id(t) for t in written_tensors(func, args, kwargs)}
        tensors = [v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        results = [v for v in tree_leaves(out) if isinstance(v, torch.Tensor)]
        inputs = {id(v.untyped_storage()) for v in tensors}
        if not written and results and all(id(v.untyped_storage()) in inputs for v in results):
            return out  # a view the schema does not call one (_unsafe_view): no kernel
        accesses: dict[int, AccessKind] = {}
        nbytes = 0
        low = False
        for value in tensors:
            nbytes += _nbytes(value)
            low = low or value.dtype in _LOW_PRECISION
            sid = self._sids.get(id(value.untyped_storage()))
            if sid is None:
                continue
            if id(value) in written:
                accesses[sid] = AccessKind.WRITE
            else:
                accesses.setdefault(sid, AccessKind.READ)
        outputs: dict[int, int] = {}
        fresh = True
        for position, value in enumerate(tree_leaves(out)):
            if not isinstance(value, torch.Tensor):
                continue  # positions count every leaf, as a session's replay finds them
            nbytes += _nbytes(value)
            low = low or value.dtype in _LOW_PRECISION
            storage = value.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._outside:
                fresh = False
                continue
            sid = self._sids.get(key)
            if sid is not None:
                fresh = False
                accesses[sid] = AccessKind.WRITE
                continue
            if storage.nbytes() == 0:
                continue
            sid = self._track(storage)
            accesses[sid] = AccessKind.WRITE
            outputs[sid] = position
        kind = op_kind(func).name
        self.step.ops.append(
            FakeOp(
                func.__name__,
                self._flops(func, args, kwargs, out),
                nbytes,
                low,
                tuple(Access(sid, kind_, outputs.get(sid)) for sid, kind_ in accesses.items()),
                fresh and (kind == "ALWAYS" or (kind == "CPU" and self.on_cpu)),
            )
        )
        return out

    @staticmethod
    def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
        packet = func.overloadpacket
        formula = flop_registry.get(packet)
        if formula is not None:
            return int(formula(*args, **kwargs, out_val=out))
        extra = _EXTRA.get(packet)
        return extra(*args, **kwargs) if extra is not None else 0

    def _track(self, storage: torch.UntypedStorage) -> int:
        sid = len(self.step.storage_sizes)
        self.step.storage_sizes[sid] = storage.nbytes()
        key = id(storage)
        self._sids[key] = sid
        self._alive.add(sid)
        weakref.finalize(storage, self._death, key, sid)
        return sid

    def _death(self, key: int, sid: int) -> None:
        self._sids.pop(key, None)  # the id may be reused by a storage made later
        self._alive.discard(sid)
        if not self.closed:
            self._died[sid] = len(self.step.ops) - 1

    # ---- marks and the result ----------------------------------------------------------

    def mark_backward(self) -> None:
        """The next recorded op is backward's first."""
        self.step.backward_start = len(self.step.ops)

    def finish(self, gradients: Iterable[torch.Tensor]) -> FakeStep:
        """Close the recording: the storages of ``gradients`` are not activations; those
        still alive are retained; the others died after their last access or later."""
        self.closed = True
        step = self.step
        made: dict[int, int] = {}
        last: dict[int, int] = {}
        for index, op in enumerate(step.ops):
            for access in op.accesses:
                last[access.storage_id] = index
                made.setdefault(access.storage_id, index)
        for grad in gradients:
            storage = grad.untyped_storage()
            sid = self._sids.get(id(storage))
            if sid is not None and sid in step.storage_sizes:
                step.gradients.append((made[sid], step.storage_sizes.pop(sid)))
            elif sid is None:
                step.gradients.append((step.backward_start, storage.nbytes()))
        sizes = step.storage_sizes
        step.retained = frozenset(sid for sid in self._alive if sid in sizes)
        step.freed_after = {
            sid: op
            for sid, op in self._died.items()
            if sid in sizes and sid not in step.retained and op > last.get(sid, op)
        }
        self._keep_alive.clear()
        return step
