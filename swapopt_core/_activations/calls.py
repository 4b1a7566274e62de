"""What one call dispatched inside a session entry touches: the storage of each argument, the
tensors it writes in place, and the device its activations go to."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["device_of", "storage_of", "written_tensors"]


def storage_of(value: object) -> torch.UntypedStorage | None:
    """The storage of a strided tensor, else ``None`` (not a tensor, sparse, no storage)."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    try:
        return value.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors ``func`` writes in place, matched by schema argument (position or name)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    written: list[torch.Tensor] = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


def device_of(inputs: object) -> torch.device:
    """Where an op's activations go: the first accelerator (not CPU or meta) among its
    tensors and its ``device`` argument (``x.to("cuda")`` reads a CPU tensor), else CPU."""
    leaves = tree_leaves(inputs)
    kwargs = inputs[-1] if isinstance(inputs, tuple) and inputs else None
    wanted = kwargs.get("device") if isinstance(kwargs, dict) else None
    devices = [v.device for v in leaves if isinstance(v, torch.Tensor)]
    if wanted is not None:
        devices.insert(0, torch.device(wanted))
    return next((d for d in devices if d.type not in ("cpu", "meta")), torch.device("cpu"))
