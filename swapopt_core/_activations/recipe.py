"""Recipes: how a replay makes a released storage's bytes again by re-running its producer.

A ``Recipe`` is taken when the producer runs (``keep_recipes``, the plan's ``recipes``
table): the op, its arguments (references to its input tensors, which keeps them alive while
the recipe lasts: ``_planning/recipes.py`` says how long), where the storage is among its
outputs, the layout of every output, and the version counter of each input tensor, so a
storage is released without a host copy only while its inputs are unchanged, and a recompute
from changed inputs fails instead of giving other bits.

A recompute writes straight into the storage through the op's ``out=`` variant when it has
one whose arguments match and that gave the same bits as the op itself on the same kind of
call (checked once per op, argument layout and scalar arguments, on the live output);
otherwise the op runs again and its output is copied into the storage.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from swapopt_core._activations.recording import live_refusal
from swapopt_core._activations.residency import Tracked
from swapopt_core._device.interface import byte_view

logger = logging.getLogger(__name__)

__all__ = ["Recipe", "drop_recipes", "keep_recipes"]

_Layout = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype]


class Recipe:
    """How to make one storage's bytes again: re-run the op that made it.

    Args:
        sid: The storage.
        name: The op's name (for messages).
        func: The op (an ``OpOverload``).
        args: Its positional arguments, as it ran.
        kwargs: Its keyword arguments.
        position: Where the storage is among the op's outputs (pytree leaf order).
        inputs: The registered storages it reads (made ready before it re-runs).
        out: What the op returned, when the recipe is taken right after it ran: with it,
            a recompute may write into the storage through the op's ``out=`` variant.
    """

    __slots__ = (
        "sid",
        "name",
        "func",
        "args",
        "kwargs",
        "position",
        "inputs",
        "versions",
        "into",
        "layouts",
    )

    def __init__(
        self,
        sid: int,
        name: str,
        func: Any,
        args: tuple,
        kwargs: dict,
        position: int,
        inputs: tuple[Tracked, ...],
        out: Any = None,
    ) -> None:
        self.sid, self.name, self.func = sid, name, func
        self.args, self.kwargs, self.position, self.inputs = args, kwargs, position, inputs
        # A tensor made under inference mode has no version counter: it can change only by
        # an in-place write inside inference mode, which the warmup saw (recording.py).
        self.versions = tuple(
            (t, t._version)
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not t.is_inference()
        )
        self.into: tuple[Any, tuple[str, ...]] | None = None  # the out= variant, its names
        self.layouts: tuple[_Layout, ...] = ()
        if out is not None:
            leaves = tree_leaves(out)
            if all(isinstance(v, torch.Tensor) for v in leaves):
                self.layouts = tuple(
                    (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype) for v in leaves
                )
                self.into = _out_variant(func, args, kwargs, leaves)

    def intact(self) -> bool:
        """Whether no input tensor was modified since the op ran."""
        return all(t._version == version for t, version in self.versions)

    def run_into(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Re-run the op and put the storage's bytes into ``storage`` (re-allocated here).

        Raises:
            RuntimeError: An input was modified in place since the op ran, or the op made
                an output of another size: the bytes would not be the ones it made.
        """
        changed = next(((t, v) for t, v in self.versions if t._version != v), None)
        if changed is not None:
            raise RuntimeError(
                f"Cannot recompute activation storage {self.sid} (made by {self.name}): an "
                f"input of {self.name} was modified in place since it ran (tensor version "
                f"{changed[1]} -> {changed[0]._version}), so the recomputed bits would differ. "
                "Mark that op recompute=false in the trace, or plan this storage as an "
                "offload."
            )
        # No autograd graph: the bytes are all that is wanted (and close() runs outside
        # the dispatch mode, where autograd would record the op).
        with torch.no_grad():
            if self.into is not None:
                self._run_in_place(storage, nbytes)
                return
            out = self.func(*self.args, **self.kwargs)
        leaves = tree_leaves(out)
        value = leaves[self.position] if self.position < len(leaves) else None
        if not isinstance(value, torch.Tensor) or value.untyped_storage().nbytes() != nbytes:
            raise RuntimeError(
                f"Cannot recompute activation storage {self.sid}: {self.name} re-ran but its "
                f"output {self.position} is not a {nbytes}-byte tensor as recorded. Mark that "
                "op recompute=false in the trace."
            )
        storage.resize_(nbytes)
        byte_view(storage).copy_(byte_view(value.untyped_storage()))

    def _run_in_place(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """The ``out=`` variant writes the storage's output where the op left it; the other
        outputs go to scratch tensors of their recorded layout."""
        func, names = self.into  # type: ignore[misc]
        storage.resize_(nbytes)
        outs = {}
        for k, (name, (size, stride, offset, dtype)) in enumerate(
            zip(names, self.layouts, strict=True)
        ):
            if k == self.position:
                view = torch.empty(0, dtype=dtype, device=storage.device)
                outs[name] = view.set_(storage, offset, size, stride)
            else:
                outs[name] = torch.empty_strided(size, stride, dtype=dtype, device=storage.device)
        func(*self.args, **self.kwargs, **outs)


#: Per op and kind of call: its ``out=`` variant and that variant's output names, or None
#: when it has none or it gave other bits.
_VARIANTS: dict[tuple, tuple[Any, tuple[str, ...]] | None] = {}
_MAX_VARIANTS = 4096


def _out_variant(
    func: Any, args: tuple, kwargs: dict, outputs: list[torch.Tensor]
) -> tuple[Any, tuple[str, ...]] | None:
    """``func``'s ``out=`` variant if it gives the same bits as ``outputs`` (checked once per
    op, input layouts and scalar arguments), else ``None``."""
    key = _variant_key(func, args, kwargs)
    if key in _VARIANTS:
        return _VARIANTS[key]
    if len(_VARIANTS) >= _MAX_VARIANTS:  # many shapes (dynamic padding): start over
        _VARIANTS.clear()
    found = _find_variant(func, len(outputs))
    if found is not None:
        variant, names = found
        scratch = {
            name: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            for name, v in zip(names, outputs, strict=True)
        }
        with torch.no_grad():
            variant(*args, **kwargs, **scratch)
        same = all(
            scratch[name].stride() == v.stride() and _same_bits(scratch[name], v)
            for name, v in zip(names, outputs, strict=True)
        )
        if not same:
            logger.info("%s: its out= variant gives other bits; recomputed by copy", func)
            found = None
    _VARIANTS[key] = found
    return found


def _variant_key(func: Any, args: tuple, kwargs: dict) -> tuple:
    return (
        func,
        tuple(
            (tuple(v.shape), v.stride(), v.dtype, v.device.type)
            if isinstance(v, torch.Tensor)
            else repr(v)
            for v in tree_leaves((args, kwargs))
        ),
    )


def check_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Device bytes a recipe taken now for op ``func`` (which returned ``out``) allocates at
    once to check its ``out=`` variant: a scratch copy of the outputs, the first time an op
    with these inputs is met in the process; 0 after, or where it has no such variant. The
    replay makes room for them first, so the check stays within the plan's peak."""
    if _variant_key(func, args, kwargs) in _VARIANTS:
        return 0
    leaves = tree_leaves(out)
    if not leaves or not all(isinstance(v, torch.Tensor) for v in leaves):
        return 0
    if _find_variant(func, len(leaves)) is None:
        return 0
    return sum(v.numel() * v.element_size() for v in leaves)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (``torch.equal`` takes -0.0 for 0.0 and NaN for unequal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _find_variant(func: Any, count: int) -> tuple[Any, tuple[str, ...]] | None:
    """The overload of ``func``'s packet that takes the same arguments and ``count`` output
    tensors to write (``add.Tensor`` -> ``add.out``, ``pow.Tensor_Scalar`` ->
    ``pow.Tensor_Scalar_out``)."""
    packet = getattr(func, "overloadpacket", None)
    if packet is None:
        return None
    wanted = [a.name for a in func._schema.arguments]
    name = func._overloadname
    for candidate in (f"{name}_out", "out"):
        if candidate not in packet.overloads():
            continue
        variant = getattr(packet, candidate)
        arguments = variant._schema.arguments
        writes = [a for a in arguments if a.alias_info is not None and a.alias_info.is_write]
        reads = [a.name for a in arguments if a not in writes]
        if reads == wanted and len(writes) == count and all(a.kwarg_only for a in writes):
            return variant, tuple(a.name for a in writes)
    return None


def keep_recipes(
    specs: tuple[Any, ...],
    by_sid: dict[int, Tracked],
    name: str,
    func: Any,
    args: tuple,
    kwargs: dict,
    out: Any,
) -> None:
    """Attach a recipe to each storage in ``specs`` that op ``func`` just made (it returned
    ``out``), once the live call passes the tracer's rules (``recording.live_refusal``): a
    trace read back from JSON may mark an op that cannot repeat its bits. A storage refused
    a recipe is never released without a host copy: it stays, or is copied out."""
    why = live_refusal(func, args, kwargs, out)
    if why:
        _refuse(name, func, why)
        return
    for spec in specs:
        entry = by_sid.get(spec.sid)
        if entry is None or not entry.alive:
            continue
        inputs = tuple(e for sid in spec.inputs if (e := by_sid.get(sid)) is not None)
        entry.recipe = Recipe(spec.sid, name, func, args, kwargs, spec.position, inputs, out)


_REFUSED: set[tuple[str, str]] = set()  # (op, why) already reported


def _refuse(name: str, func: Any, why: str) -> None:
    level = logging.DEBUG if (name, why) in _REFUSED else logging.WARNING
    _REFUSED.add((name, why))
    logger.log(
        level,
        "the trace marks %s recompute, but the op that ran (%s) %s: its outputs are kept or "
        "copied instead of recomputed (same bits, more memory or link time). Record the "
        'trace again, or set that op\'s "recompute" to false.',
        name,
        func,
        why,
    )


def drop_recipes(sids: tuple[int, ...], by_sid: dict[int, Tracked]) -> None:
    """Let go of the recipes of ``sids`` (and the inputs they hold), unless one is off the
    device without a host copy and still needs it."""
    for sid in sids:
        entry = by_sid.get(sid)
        if entry is not None and (entry.resident or entry.host_valid):
            entry.recipe = None
