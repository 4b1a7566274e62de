"""The interface a MindSpore optimizer family implements to be swapped.

A MindSpore optimizer is a Cell whose ``construct(gradients)`` runs a once-per-step
preamble (learning rate, weight decay, global step, bias-correction powers) and then one
update primitive per parameter. The engine replaces ``construct``: it asks the adapter for
the preamble once, then runs the family's own update batch by batch (``update_batch``: one
``update`` per parameter, or one compiled graph per batch), with the swapped state
Parameters replaced by device views. Nothing here imports MindSpore at module import time,
so the plugin costs nothing where MindSpore is absent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from swapopt_core._errors import UnsupportedOptimizerError
from swapopt_core._swap.adapter import SwapAdapter

__all__ = ["GraphCache", "MindSporeAdapter", "MindSporeAdapterProtocol", "qualified_names"]

#: One parameter's work in a batch: its index and its states by key (see ``update``).
Work = tuple[int, Mapping[str, Any]]


def qualified_names(obj: object) -> set[str]:
    """``module.QualName`` of ``obj``'s class and every base class."""
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in type(obj).__mro__}


class GraphCache:
    """The compiled batch updates of one swapped optimizer, by what each depends on.

    A graph holds the Parameters of its batch, so the cache lives with the engine. After
    each complete step the graphs that step did not use are dropped (``prune``): a new
    batch split compiles anew instead of growing the cache.
    """

    def __init__(self) -> None:
        self._graphs: dict[Hashable, Any] = {}
        self._used: set[Hashable] = set()

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The graph cached under ``key``, built by ``build`` the first time."""
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = build()
        self._used.add(key)
        return graph

    def prune(self) -> None:
        """Drop the graphs unused since the last ``prune``."""
        self._graphs = {k: g for k, g in self._graphs.items() if k in self._used}
        self._used = set()

    def clear(self) -> None:
        """Drop every graph (and the Parameters it holds)."""
        self._graphs.clear()
        self._used.clear()


class MindSporeAdapter(ABC):
    """Knows one MindSpore optimizer family: its state Parameters, preamble and update."""

    #: Human-readable family name, used in error messages.
    family: ClassVar[str]
    framework: ClassVar[str] = "mindspore"
    #: Every state key the family can own; ``SwapOptimizerConfig.state_keys`` must be a subset.
    state_key_names: ClassVar[tuple[str, ...]]
    #: ``module.QualName`` of the classes served; subclasses are served too.
    classes: ClassVar[tuple[str, ...]]

    def matches(self, optimizer: Any) -> bool:
        """Whether this adapter serves ``optimizer``."""
        return bool(qualified_names(optimizer) & set(self.classes))

    def validate(self, optimizer: Any) -> None:
        """Refuse ``optimizer`` if one of its flags needs its state resident.

        Raises:
            UnsupportedOptimizerError: Such a flag is set (``use_parallel=True`` here).
        """
        if getattr(optimizer, "use_parallel", False):
            raise UnsupportedOptimizerError(
                f"{self.family} was built with the parallel optimizer (use_parallel=True), "
                "which shards and broadcasts state itself; swapopt cannot swap it. Turn the "
                "parallel optimizer off or leave this optimizer unswapped."
            )

    @abstractmethod
    def state(self, optimizer: Any) -> dict[str, Sequence[Any]]:
        """Per state key, the optimizer-owned Parameters in ``optimizer._parameters`` order."""

    def masters(self, optimizer: Any) -> Sequence[Any] | None:
        """The fp32 master weights the update runs on, if the optimizer keeps any."""
        return None

    def keeps_masters(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` has master weights ``include_master_params`` could swap."""
        return self.masters(optimizer) is not None

    @abstractmethod
    def prepare(self, optimizer: Any, gradients: tuple[Any, ...]) -> Any:
        """Run the once-per-step preamble exactly as ``construct`` would; return its values.

        Advances the optimizer's global step (and whatever else the family advances once
        per step). The engine calls it once per step, also when the step is resumed.
        """

    def steps(self, optimizer: Any, index: int) -> bool:
        """Whether parameter ``index`` is updated at all (``optim_filter``)."""
        return bool(optimizer.optim_filter[index])

    @abstractmethod
    def update(self, optimizer: Any, prepared: Any, index: int, states: Mapping[str, Any]) -> Any:
        """Update parameter ``index`` with the family's own primitive.

        ``states`` maps every state key to the tensor to update in place: a device view
        for swapped keys, the optimizer's own Parameter otherwise.

        Returns:
            What the family's ``construct`` returns for this parameter.
        """

    def update_batch(
        self, optimizer: Any, prepared: Any, work: Sequence[Work], graphs: GraphCache
    ) -> list[Any]:
        """Update every parameter of a batch; by default one ``update`` call each.

        Families whose plain ``construct`` is compiled override this to run the batch as one
        compiled graph with the same kernels (cached in ``graphs``).

        Returns:
            What ``update`` returns, per parameter of ``work``.
        """
        return [self.update(optimizer, prepared, index, states) for index, states in work]

    @staticmethod
    def per_parameter(values: Any, grouped: bool, index: int) -> Any:
        """``values[index]`` for per-group values (learning rate, weight decay), else ``values``."""
        return values[index] if grouped else values


@runtime_checkable
class MindSporeAdapterProtocol(SwapAdapter, Protocol):
    """What the MindSpore engine asks of an adapter; ``MindSporeAdapter`` implements it."""

    def validate(self, optimizer: Any) -> None: ...
    def state(self, optimizer: Any) -> dict[str, Sequence[Any]]: ...
    def masters(self, optimizer: Any) -> Sequence[Any] | None: ...
    def keeps_masters(self, optimizer: Any) -> bool: ...
    def prepare(self, optimizer: Any, gradients: tuple[Any, ...]) -> Any: ...
    def steps(self, optimizer: Any, index: int) -> bool: ...
    def update_batch(
        self, optimizer: Any, prepared: Any, work: Sequence[Work], graphs: GraphCache
    ) -> list[Any]: ...
