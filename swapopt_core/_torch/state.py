"""Swap slots: one swapped state tensor, its host copy and where it sits in optimizer.state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - builds without distributed support
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["Slot", "local_tensor", "wrap_like"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns storage on this rank: a DTensor's local shard, else itself."""
    if DTensor is not None and isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def wrap_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Give ``local`` the distributed layout of ``like`` (a no-op for plain tensors)."""
    if DTensor is not None and isinstance(like, DTensor):
        return DTensor.from_local(
            local,
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )
    return local


@dataclass(eq=False)
class Slot:
    """One swapped state entry ``optimizer.state[param][key]``.

    Between steps ``value`` is what the optimizer's state holds: ``host`` itself, or a
    DTensor whose local shard is ``host``. ``offset`` is the element offset in the packed
    host buffer of ``host``'s dtype, or ``-1`` when ``host`` owns its buffer.
    """

    param: torch.Tensor
    key: str
    host: torch.Tensor
    value: torch.Tensor
    device: torch.device
    offset: int = -1

    @property
    def dtype(self) -> torch.dtype:
        return self.host.dtype

    @property
    def numel(self) -> int:
        return self.host.numel()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.host.shape)

    @property
    def itemsize(self) -> int:
        return self.host.element_size()

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()
