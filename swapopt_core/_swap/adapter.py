"""What every optimizer adapter is, whatever its framework (checked at registration)."""

from __future__ import annotations

from typing import Any, Generic, Protocol, runtime_checkable

__all__ = ["SwapAdapter", "missing_members"]


@runtime_checkable
class SwapAdapter(Protocol):
    """An optimizer family's adapter: its framework, its name, and which optimizers it serves.

    Each framework asks more (``swapopt_core._torch.adapter.TorchAdapterProtocol``,
    ``swapopt_core._mindspore.adapter.MindSporeAdapterProtocol``).
    """

    framework: str
    family: str
    state_key_names: tuple[str, ...]

    def matches(self, optimizer: Any) -> bool: ...


def missing_members(obj: object, protocol: type) -> list[str]:
    """The members (attributes and methods) of ``protocol`` that ``obj`` lacks, sorted."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (object, Protocol, Generic):
            continue
        names.update(vars(cls).get("__annotations__", {}))
        names.update(n for n, v in vars(cls).items() if callable(v) and not n.startswith("_"))
    return sorted(name for name in names if not hasattr(obj, name))
