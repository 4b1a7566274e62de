"""How a torch engine keeps ``optimizer.state`` and its host-memory slots in line.

``StateBook`` is the half of ``SwapEngine`` that decides which state entries are swapped,
takes them into host memory (``_adopt``, lazily created state through ``_make_state``) and
lists the parameters a step updates (``sync_state``). The step itself, install and
uninstall are in ``swapopt_core._torch.engine``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._device.interface import TransferRuntime
from swapopt_core._torch.adapter import OptimizerAdapter
from swapopt_core._torch.staging import PackedStaging, PerTensorStaging
from swapopt_core._torch.state import Slot, local_tensor, wrap_like

if TYPE_CHECKING:
    from swapopt_core._torch.prefetch import BackwardPrefetch

__all__ = ["StateBook", "Unit"]


@dataclass(eq=False)
class Unit:
    """One parameter taking part in a step, with its swapped slots."""

    group: int
    param: torch.Tensor
    grad: torch.Tensor
    slots: list[Slot] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots)


class StateBook:
    """State bookkeeping of a ``SwapEngine`` (a mixin: the engine provides the attributes)."""

    optimizer: torch.optim.Optimizer
    config: SwapOptimizerConfig
    adapter: OptimizerAdapter
    runtime: TransferRuntime
    staging: PackedStaging | PerTensorStaging
    slots: dict[tuple[int, str], Slot]
    prefetch: BackwardPrefetch
    settle: Callable[[], None]  # EngineBase's
    quiesce: Callable[[], None]  # EngineBase's

    def keys(self, group: MutableMapping[str, Any]) -> tuple[str, ...]:
        """The state keys swapped for parameters of ``group``: the adapter's, as configured."""
        keys = self.adapter.state_keys(group)
        wanted = self.config.state_keys
        return keys if wanted is None else tuple(k for k in keys if k in wanted)

    def swappable(self, param: torch.Tensor, value: object) -> bool:
        """Whether state entry ``value`` of ``param`` can live in host memory."""
        if not isinstance(value, torch.Tensor):
            return False
        local = local_tensor(value)
        return self._eligible(param, local.dtype, local.numel()) and (
            local.layout == torch.strided and local.is_contiguous()
        )

    def _eligible(self, param: torch.Tensor, dtype: torch.dtype, numel: int) -> bool:
        return (
            dtype.is_floating_point
            and numel >= self.config.min_numel
            and self.runtime.serves(local_tensor(param).device)
        )

    def host_copy(self, local: torch.Tensor, *, settled: bool = False) -> torch.Tensor:
        """Host memory holding ``local``'s values for a new slot.

        In packed mode the slot is about to be copied into the packed buffer by the layout
        that ends ``sync_state``, so unless ``settled`` is asked for (state created inside a
        step, which must leave the device now) the source itself stands in until then.
        """
        if self.staging.packed:
            return local.to("cpu", copy=True) if settled else local
        host = self.runtime.alloc_host(local.numel(), local.dtype).view(local.shape)
        return host.copy_(local)

    def _adopt(
        self, param: torch.Tensor, key: str, value: torch.Tensor, *, settled: bool = False
    ) -> Slot:
        """Take ``value`` into host memory and make it the state entry."""
        host = self.host_copy(local_tensor(value), settled=settled)
        slot = Slot(param, key, host, wrap_like(host, value), local_tensor(param).device)
        self.optimizer.state[param][key] = slot.value
        self.slots[(id(param), key)] = slot
        return slot

    def _slot(self, param: torch.Tensor, key: str, state: MutableMapping[str, Any]) -> Slot | None:
        value = state.get(key)
        slot = self.slots.get((id(param), key))
        if slot is not None and slot.value is value:
            return slot
        if not self.swappable(param, value):
            self.slots.pop((id(param), key), None)
            return None
        return self._adopt(param, key, value)

    def _make_state(self, keys: tuple[str, ...], key: str, like: torch.Tensor) -> torch.Tensor:
        """The ``make`` callback adapters create lazy state with (see ``StateFactory``)."""
        local = local_tensor(like)
        if (
            key in keys
            and local.is_contiguous()
            and self._eligible(like, local.dtype, local.numel())
        ):
            # Zeros straight into host memory: nothing is allocated on the device. Packed
            # mode needs no memory at all until the layout writes the zeros in place.
            zero = torch.zeros((), dtype=local.dtype)
            host = (
                zero.expand(local.shape)
                if self.staging.packed
                else self.host_copy(zero.expand(local.shape))
            )
            slot = Slot(like, key, host, wrap_like(host, like), local.device)
            self.slots[(id(like), key)] = slot
            return slot.value
        return torch.zeros_like(like, memory_format=torch.preserve_format)

    def offload(self) -> int:
        """Take swappable entries that are not our host tensors into host memory now."""
        opt = self.optimizer
        self.prefetch.drop()  # the layout may change below
        self.quiesce()  # host state final: a batch whose copy out failed is written back
        ours = {id(slot.value) for slot in self.slots.values()}  # alive: ids are unique
        moved = 0
        for group in opt.param_groups:
            keys = self.keys(group)
            for param in group["params"]:
                state = opt.state.get(param, {})
                moved += sum(
                    1
                    for key in keys
                    if key in state
                    and id(state[key]) not in ours
                    and self.swappable(param, state[key])
                )
        with torch.no_grad():
            self.sync_state()
        return moved

    def sync_state(self, *, stepping: bool = False) -> list[Unit]:
        """Bring ``optimizer.state`` in line with the slots; return the units to step.

        Any swappable entry that is not one of our host tensors (state created before
        install, loaded by a framework, or moved back to the device) is taken into host
        memory here. With ``stepping``, lazily initialises the state of parameters about to
        be stepped.
        """
        opt = self.optimizer
        units: list[Unit] = []
        ordered: list[Slot] = []
        live: set[tuple[int, str]] = set()
        for index, group in enumerate(opt.param_groups):
            keys = self.keys(group)
            for param in group["params"]:
                grad = param.grad if stepping else None
                state = opt.state.get(param)
                if grad is not None and not state:
                    state = self._init_state(group, param, keys)
                slots = []
                for key in keys if state else ():
                    slot = self._slot(param, key, state)
                    if slot is not None:
                        slots.append(slot)
                        live.add((id(param), key))
                ordered.extend(slots)
                if grad is not None:
                    units.append(Unit(index, param, grad, slots))
        stale = self.slots.keys() - live
        if stale:
            # Their host memory is freed below: no copy of the last step may still use it.
            self.runtime.synchronize()
        for key in stale:
            del self.slots[key]
        if isinstance(self.staging, PackedStaging):
            # The old buffers must be final, a failed copy out written back into them.
            self.staging.layout(ordered, self._publish, self.quiesce)
        return units

    def _init_state(
        self, group: MutableMapping[str, Any], param: torch.Tensor, keys: tuple[str, ...]
    ) -> MutableMapping[str, Any]:
        """Create ``param``'s state all at once: after a failure (host memory) it has none."""
        fresh: dict[str, Any] = {}
        try:
            self.adapter.init_state(group, param, fresh, functools.partial(self._make_state, keys))
        except BaseException:
            for key in keys:
                self.slots.pop((id(param), key), None)
            raise
        state = self.optimizer.state[param]
        state.update(fresh)
        return state

    def _publish(self, slot: Slot) -> None:
        self.optimizer.state[slot.param][slot.key] = slot.value
