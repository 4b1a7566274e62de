"""Which recorded ops may be recomputed: running them again on the same inputs gives the same
output bits, so a storage they made can be released without a host copy and made again.

The warmup asks twice per op: ``call_devices`` before it runs (the op's schema, cached per
``OpOverload``, and its tensor inputs), ``fresh_outputs`` after (every tensor output is a new
storage the op made, on a device type among its inputs'). An op passes when:

- it is an aten ``OpOverload`` (custom ops may hide state or random numbers behind a clean
  schema), its schema writes nothing and returns no alias of an input (views);
- it draws no random numbers (no ``nondeterministic_seeded`` tag, no ``Generator``
  argument), does not read uninitialised memory (``empty`` and friends), and is not a batch
  norm (``native_batch_norm`` updates the running statistics behind a pure-looking schema);
- it is bitwise reproducible where it runs: ops tagged ``nondeterministic_bitwise``, and
  ops known to use atomics or data-dependent algorithms off the CPU (scatter and index
  accumulation, pooling and upsampling backwards, attention, matmuls and convolutions
  whose algorithm the backend picks), pass only on CPU or with
  ``torch.are_deterministic_algorithms_enabled()``;
- every tensor it reads or makes is strided, and it moves nothing to another device type;
- it reads no tensor made under ``torch.inference_mode()`` that a later op of the step writes
  in place (``InferenceWatch``: such tensors have no version counter to tell a replay).

The marks are a contract a trace carries, so a trace read back from JSON is checked again:
``check_marks`` applies the schema rules to each marked op's name when a session loads a plan,
and ``live_refusal`` applies them all to the live call when a replay keeps a recipe.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from swapopt_core._planning.ir import AccessKind, ActivationTrace

__all__ = [
    "InferenceWatch",
    "call_devices",
    "check_marks",
    "fresh_outputs",
    "live_refusal",
    "op_kind",
    "resolve_op",
]


class _Kind(enum.Enum):
    NEVER = 0  # not recomputable
    ALWAYS = 1  # recomputable wherever it runs
    CPU = 2  # recomputable on CPU, elsewhere only under deterministic algorithms


#: Packets whose schema looks pure but whose result is not reproducible: uninitialised
#: memory, and batch norm's hidden write to its running statistics.
_HIDDEN_STATE = (
    "empty",
    "new_empty",
    "_empty",
    "resize",
    "native_batch_norm",
    "cudnn_batch_norm",
    "miopen_batch_norm",
    "batch_norm",
    "_batch_norm",
    "_native_batch_norm",
)

#: Packets whose CUDA (or other accelerator) kernels may differ bitwise between two runs on
#: the same inputs (atomics, algorithm choice), unless deterministic algorithms are on.
_DEVICE_NONDETERMINISTIC = (
    "index_add",
    "index_copy",
    "index_put",
    "_index_put",
    "index_reduce",
    "scatter",
    "put",
    "embedding",
    "_embedding",
    "cumsum",
    "cumprod",
    "histc",
    "histogram",
    "bincount",
    "kthvalue",
    "median",
    "nanmedian",
    "nll_loss",
    "ctc_loss",
    "_ctc_loss",
    "grid_sampler",
    "_grid_sampler",
    "adaptive_",
    "_adaptive_",
    "avg_pool",
    "max_pool",
    "fractional_max_pool",
    "max_unpool",
    "upsample",
    "_upsample",
    "reflection_pad",
    "replication_pad",
    "_segment_reduce",
    "_scaled_dot_product",
    "_flash_attention",
    "_efficient_attention",
    "scaled_dot_product",
    "mm",
    "bmm",
    "addmm",
    "addbmm",
    "baddbmm",
    "addmv",
    "mv",
    "matmul",
    "linear",
    "_addmm",
    "_scaled_mm",
    "_int_mm",
    "convolution",
    "_convolution",
    "conv",
    "cudnn_",
    "miopen_",
    "mkldnn_",
)

_CACHE: dict[Any, tuple[_Kind, str]] = {}


def _classify(func: Any) -> tuple[_Kind, str]:
    """What the schema of ``func`` allows, and why not when it forbids it."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        namespace = getattr(func, "namespace", None)
        where = f"an op of the {namespace!r} namespace" if namespace else "not an aten op"
        return _Kind.NEVER, f"is {where} (only aten ops are recomputed)"
    schema = func._schema
    if schema.is_mutable:
        return _Kind.NEVER, "writes its arguments in place"
    if any(r.alias_info is not None for r in schema.returns):
        return _Kind.NEVER, "returns a view of an input"
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return _Kind.NEVER, "draws random numbers"
    if any("Generator" in str(argument.type) for argument in schema.arguments):
        return _Kind.NEVER, "takes a random number generator"
    packet = schema.name.split("::", 1)[-1]
    if packet.startswith(_HIDDEN_STATE):
        return _Kind.NEVER, "reads uninitialised memory or updates hidden state"
    if torch.Tag.nondeterministic_bitwise in tags or packet.startswith(_DEVICE_NONDETERMINISTIC):
        return _Kind.CPU, ""
    return _Kind.ALWAYS, ""


def _classified(func: Any) -> tuple[_Kind, str]:
    found = _CACHE.get(func)
    if found is None:
        found = _CACHE[func] = _classify(func)
    return found


def op_kind(func: Any) -> _Kind:
    """What the schema of ``func`` allows (cached per ``OpOverload``)."""
    return _classified(func)[0]


def _call_check(func: Any, args: tuple, kwargs: dict) -> tuple[frozenset[str] | None, str]:
    """``call_devices`` with the reason of a refusal."""
    kind, why = _classified(func)
    if kind is _Kind.NEVER:
        return None, why
    devices = set()
    for value in tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                return None, f"reads a {value.layout} tensor"
            devices.add(value.device.type)
    if kind is _Kind.CPU and devices - {"cpu"} and not torch.are_deterministic_algorithms_enabled():
        return None, (
            f"may give other bits on {', '.join(sorted(devices - {'cpu'}))} without "
            "torch.use_deterministic_algorithms(True)"
        )
    return frozenset(devices), ""


def call_devices(func: Any, args: tuple, kwargs: dict) -> frozenset[str] | None:
    """Before ``func`` runs: the device types of its tensor inputs if this call may be
    recomputed as far as its schema and inputs tell, else ``None``."""
    return _call_check(func, args, kwargs)[0]


def fresh_outputs(
    out: object,
    devices: frozenset[str],
    inputs: Collection[torch.UntypedStorage],
    tracked: Mapping[torch.UntypedStorage, Any],
    made: Collection[int],
) -> bool:
    """After the op ran: every tensor output is strided, on a device type among its inputs'
    (no transfer), and in a storage the op made (no input's, none tracked before).

    Args:
        out: What the op returned.
        devices: ``call_devices``'s answer for the call.
        inputs: The storages of its tensor inputs.
        tracked: The warmup's tracked storages, each with a ``sid``.
        made: The ids of the storages this op created.
    """

    def older(storage: torch.UntypedStorage) -> bool:
        entry = tracked.get(storage)
        return entry is not None and entry.sid not in made

    return not _stale_output(out, devices, inputs, older)


def _stale_output(
    out: object,
    devices: frozenset[str],
    inputs: Collection[torch.UntypedStorage],
    older: Callable[[torch.UntypedStorage], bool] | None = None,
) -> str:
    """Why an output breaks ``fresh_outputs``'s rule, or ``""``."""
    for value in tree_leaves(out):
        if not isinstance(value, torch.Tensor):
            continue
        if value.layout != torch.strided:
            return f"returns a {value.layout} tensor"
        if devices and value.device.type not in devices:
            return f"moves a tensor to {value.device.type}"
        storage = value.untyped_storage()
        if storage in inputs:
            return "returns a tensor in the storage of an input"
        if older is not None and older(storage):
            return "returns a tensor in a storage that existed before it ran"
    return ""


def live_refusal(func: Any, args: tuple, kwargs: dict, out: object) -> str:
    """Why this call of ``func`` (which returned ``out``) may not be recomputed, or ``""``:
    every rule of the module docstring, on the live op, as a replay keeps its recipe."""
    devices, why = _call_check(func, args, kwargs)
    if devices is None:
        return why
    inputs = [
        v.untyped_storage() for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)
    ]
    return _stale_output(out, devices, inputs)


def resolve_op(name: str) -> Any:
    """The aten ``OpOverload`` a recorded op name (``packet.overload``) stands for, or
    ``None`` when no aten op has that name."""
    packet, _, overload = name.rpartition(".")
    if not packet or not overload:
        return None
    try:
        return getattr(getattr(torch.ops.aten, packet), overload)
    except (AttributeError, RuntimeError):
        return None


def check_marks(trace: ActivationTrace) -> None:
    """Re-check every op a trace marks ``recompute`` against the rules the tracer applies
    from the op's name alone (the schema rules); the device and output rules are checked on
    the live op when a replay keeps its recipe (``live_refusal``).

    Raises:
        ValueError: A marked op is no aten op, its schema forbids recomputing it (in-place
            writes, views, random numbers, hidden state), or the trace says it writes in
            place a storage it did not create. The message names the op's index, its name
            and why.
    """
    for index, op in enumerate(trace.ops):
        if not op.recompute:
            continue
        func = resolve_op(op.name)
        if func is None:
            why = "is not an aten op (only aten ops are recomputed)"
        else:
            why = _classified(func)[1]
        if not why:
            rewritten = [
                a.storage_id for a in op.accesses if a.kind is AccessKind.WRITE and a.output is None
            ]
            if rewritten:
                why = f"writes storage {rewritten[0]} in place, which it did not create"
        if why:
            raise ValueError(
                f"The trace marks op {index} ({op.name}) recompute, but that op {why}: "
                'recomputing it would not give the same bits. Set its "recompute" to '
                "false (or record the trace again with an OffloadSession)."
            )


class InferenceWatch:
    """Tensors made under ``torch.inference_mode()`` have no version counter, so a recipe
    cannot see them change; they can change only by an in-place write inside inference
    mode. The warmup notes which marked ops read them and unmarks those whose inference
    input a later op of the step writes in place (the replay follows the same ops).
    """

    def __init__(self) -> None:
        # An inference tensor's storage -> the marked ops that read it. Keyed by the storage
        # itself, held weakly: a storage that dies is forgotten with its readers, and a new
        # one is never taken for it (an address or ``data_ptr`` is reused, and a released
        # storage has none).
        self.readers: weakref.WeakKeyDictionary[torch.UntypedStorage, list[int]] = (
            weakref.WeakKeyDictionary()
        )
        self.spoiled: set[int] = set()  # ops that may not be recomputed after all

    def note(self, index: int, inputs: object, written: list[torch.Tensor], marked: bool) -> None:
        """Op ``index`` read ``inputs`` and wrote ``written`` in place; ``marked``: it may be
        recomputed as far as its schema and inputs tell."""
        if marked:
            for value in tree_leaves(inputs):
                if isinstance(value, torch.Tensor) and value.is_inference():
                    self.readers.setdefault(value.untyped_storage(), []).append(index)
        for tensor in written:
            if self.readers and tensor.is_inference():
                self.spoiled.update(self.readers.pop(tensor.untyped_storage(), ()))
