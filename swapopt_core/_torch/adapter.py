"""The interface an optimizer family implements to be swapped."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from swapopt_core._swap.adapter import SwapAdapter

__all__ = ["OptimizerAdapter", "StateFactory", "TorchAdapterProtocol"]

#: ``make(key, like)`` returns a zero tensor shaped like ``like`` for state entry ``key``:
#: in host memory when the engine will swap it, on ``like``'s device otherwise.
StateFactory = Callable[[str, torch.Tensor], torch.Tensor]


@runtime_checkable
class TorchAdapterProtocol(SwapAdapter, Protocol):
    """What the torch engine asks of an optimizer family's adapter.

    Any object with these members serves (the registration checks it); ``OptimizerAdapter``
    subclasses it and inherits the defaults below. The engine owns all movement of state.
    An adapter only declares the state keys, creates state the way the family would, and
    runs the family's own numerics on tensors that the engine has placed on the device.
    """

    @abstractmethod
    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this adapter serves ``optimizer``."""

    @abstractmethod
    def keeps_masters(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` has master weights ``include_master_params`` could swap."""

    def silence(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Make ``optimizer``'s own ``step()`` update nothing; return the undo.

        The swap runs in a step post-hook, after the optimizer's own ``step`` has run the
        closure; that ``step`` must find no parameter to update. The default serves every
        torch optimizer whose ``step`` gathers its parameters through ``_init_group``
        (Adam, AdamW, SGD, ...): an instance attribute shadows it with one that gathers
        nothing, so the functional update is called with empty lists.
        """

        def gather_nothing(*args: Any, **kwargs: Any) -> bool:
            return False  # no complex / sparse parameters among none

        optimizer._init_group = gather_nothing  # type: ignore[attr-defined]

        def undo() -> None:
            del optimizer._init_group  # type: ignore[attr-defined]

        return undo

    def validate(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise for flags of ``optimizer``'s groups that the swap cannot honour.

        Called at install and again at every step, so groups added later are checked too.
        """

    @abstractmethod
    def state_keys(self, group: MutableMapping[str, Any]) -> tuple[str, ...] | None:
        """The swappable state entries for parameters of ``group``, in layout order.

        ``None``: whatever tensor entries the family keeps (the generic per-parameter path);
        each entry of at least one dimension is swapped if it is large enough.
        """

    def init_state(
        self,
        group: MutableMapping[str, Any],
        param: torch.Tensor,
        state: MutableMapping[str, Any],
        make: StateFactory,
    ) -> None:
        """Create the state of ``param`` before its first update, as the family would.

        Called only while ``state`` is empty. Use ``make(key, like)`` for every tensor that
        could be swapped so it starts in host memory. Families that create state inside
        their update (SGD's momentum) leave this alone; the engine adopts what the update
        creates.
        """

    @abstractmethod
    def update(
        self,
        optimizer: torch.optim.Optimizer,
        group: MutableMapping[str, Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        states: Sequence[MutableMapping[str, Any]],
    ) -> None:
        """Update ``params`` of one group in place from ``grads``.

        ``states[i]`` is a working copy of ``optimizer.state[params[i]]`` whose swapped
        entries are device tensors. Update them in place; entries the update creates or
        replaces are written into the working copy and the engine stores them.
        """


class OptimizerAdapter(TorchAdapterProtocol, ABC):
    """Base class of the built-in torch adapters: the protocol with its defaults.

    Subclasses set ``family`` and ``state_key_names`` and implement ``matches``,
    ``state_keys`` and ``update``.
    """

    #: Human-readable family name, used in error messages (e.g. ``"torch.optim.Adam"``).
    family: str
    #: The tensor library of the family (``"torch"``; MindSpore adapters say ``"mindspore"``).
    framework: str = "torch"
    #: Every state key the family can own; ``SwapOptimizerConfig.state_keys`` must be a subset.
    state_key_names: tuple[str, ...]
    #: Whether the family keeps master weights that ``include_master_params`` could swap.
    has_master_params: ClassVar[bool] = False

    def keeps_masters(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.has_master_params
