"""How many bytes of new storage an op is about to allocate, known before it runs.

A warmup (and any entry that runs without a plan) keeps the budget before an op allocates
its outputs, not after: it asks ``fresh_bytes`` and makes that much room first. The answer
comes from shape propagation: the op runs once on meta tensors of the same sizes, strides
and dtypes (no data, no kernel, no device memory), with every dispatch mode switched off,
and the outputs whose storage is none of its inputs' are the ones the real op will create.

The prediction is best effort and never changes what the op computes: only aten ops are
asked (a custom op's meta kernel may hide a side effect), an op without a meta kernel or
whose output sizes depend on the data (``nonzero``, ``.item()``) predicts nothing and is
remembered as such, and so does an op that reads tensors of a layout or type other than
plain strided ones. Meta kernels draw no random numbers, so the step's random stream is
untouched. What is not predicted is evicted after the op, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

logger = logging.getLogger(__name__)

__all__ = ["fresh_bytes"]

#: Ops whose outputs are all views or the inputs themselves (schema alias annotations on
#: every return), or that return no tensor: nothing fresh, no need to run them on meta.
_NOTHING_FRESH: set[Any] = set()
#: Ops that failed on meta once (no meta kernel, data-dependent sizes): not asked again.
_UNPREDICTABLE: set[Any] = set()
#: Ops known to be worth running on meta.
_PREDICTABLE: set[Any] = set()

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _classify(func: Any) -> bool:
    """Whether ``func`` may make a fresh storage and is an aten op (cached)."""
    if func in _PREDICTABLE:
        return True
    if func in _NOTHING_FRESH or func in _UNPREDICTABLE:
        return False
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        _UNPREDICTABLE.add(func)
        return False
    returns = func._schema.returns
    fresh = any(r.alias_info is None and ("Tensor" in str(r.type)) for r in returns)
    (_PREDICTABLE if fresh else _NOTHING_FRESH).add(func)
    return fresh


class _Unsupported(Exception):
    """An argument has no meta form (a tensor subclass, another layout)."""


#: Answers by call: the op, and each argument's sizes, strides and dtype or value. Meta
#: kernels are functions of exactly these, and a step repeats its layers' calls.
_ANSWERS: dict[tuple, int] = {}
_ANSWERS_KEPT = 8192


def _key(value: Any) -> Hashable:
    """What ``value`` contributes to an op's output sizes."""
    if isinstance(value, torch.Tensor):
        if type(value) not in _PLAIN or value.layout != torch.strided:
            raise _Unsupported
        return (value.shape, value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    return (type(value), value)  # 1 and 1.0 promote differently


def _meta(value: Any, inputs: set[int]) -> Any:
    """``value`` with every tensor replaced by a meta tensor of the same layout (their
    storages noted in ``inputs``) and every device by the meta device."""
    if isinstance(value, torch.Tensor):
        meta = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
        inputs.add(meta.untyped_storage()._cdata)
        return meta
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v, inputs) for v in value)
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


def fresh_bytes(func: Any, args: tuple, kwargs: dict) -> int:
    """Bytes of the storages ``func(*args, **kwargs)`` will create, 0 when unknown.

    Counts each new storage once, at its full size; outputs that share an input's storage
    (views, in-place results, ``out=`` arguments) are not new.
    """
    if not _classify(func):
        return 0
    try:
        key = (func, tuple(_key(v) for v in args), tuple((k, _key(v)) for k, v in kwargs.items()))
        known = _ANSWERS.get(key)
    except (_Unsupported, TypeError):  # a subclass, or an argument that cannot be hashed
        return 0
    if known is not None:
        return known
    inputs: set[int] = set()
    meta_args = tuple(_meta(v, inputs) for v in args)
    meta_kwargs = {k: _meta(v, inputs) for k, v in kwargs.items()}
    if meta_kwargs.get("device") is not None or _factory(func):
        meta_kwargs["device"] = torch.device("meta")  # a factory: make it on meta too
    try:
        with _disable_current_modes():
            out = func(*meta_args, **meta_kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel, data-dependent sizes: predict nothing
        _PREDICTABLE.discard(func)
        _UNPREDICTABLE.add(func)
        logger.debug("%s cannot be run on meta tensors: its outputs are not predicted", func)
        return 0
    seen: set[int] = set()
    total = 0
    for value in tree_leaves(out):
        if not isinstance(value, torch.Tensor):
            continue
        storage = value.untyped_storage()
        ident = storage._cdata
        if ident in inputs or ident in seen:
            continue
        seen.add(ident)
        total += storage.nbytes()
    if len(_ANSWERS) >= _ANSWERS_KEPT:
        _ANSWERS.clear()
    _ANSWERS[key] = total
    return total


def _factory(func: Any) -> bool:
    """Whether ``func`` takes a ``device`` argument (a factory: ``zeros``, ``arange``)."""
    return any(argument.name == "device" for argument in func._schema.arguments)
