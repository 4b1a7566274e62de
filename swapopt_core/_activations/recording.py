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
- every tensor it reads or makes is strided, and it moves nothing to another device type.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["call_devices", "fresh_outputs", "op_kind"]


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

_CACHE: dict[Any, _Kind] = {}


def _classify(func: Any) -> _Kind:
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        return _Kind.NEVER
    schema = func._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return _Kind.NEVER
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return _Kind.NEVER
    if any("Generator" in str(argument.type) for argument in schema.arguments):
        return _Kind.NEVER
    packet = schema.name.split("::", 1)[-1]
    if packet.startswith(_HIDDEN_STATE):
        return _Kind.NEVER
    if torch.Tag.nondeterministic_bitwise in tags or packet.startswith(_DEVICE_NONDETERMINISTIC):
        return _Kind.CPU
    return _Kind.ALWAYS


def op_kind(func: Any) -> _Kind:
    """What the schema of ``func`` allows (cached per ``OpOverload``)."""
    kind = _CACHE.get(func)
    if kind is None:
        kind = _CACHE[func] = _classify(func)
    return kind


def call_devices(func: Any, args: tuple, kwargs: dict) -> frozenset[str] | None:
    """Before ``func`` runs: the device types of its tensor inputs if this call may be
    recomputed as far as its schema and inputs tell, else ``None``."""
    kind = op_kind(func)
    if kind is _Kind.NEVER:
        return None
    devices = set()
    for value in tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                return None
            devices.add(value.device.type)
    if kind is _Kind.CPU and devices - {"cpu"} and not torch.are_deterministic_algorithms_enabled():
        return None
    return frozenset(devices)


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
    for value in tree_leaves(out):
        if not isinstance(value, torch.Tensor):
            continue
        if value.layout != torch.strided:
            return False
        if devices and value.device.type not in devices:
            return False
        storage = value.untyped_storage()
        if storage in inputs:
            return False
        entry = tracked.get(storage)
        if entry is not None and entry.sid not in made:
            return False
    return True
