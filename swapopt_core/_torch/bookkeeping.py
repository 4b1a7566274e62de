"""How a torch engine keeps ``optimizer.state`` and its host-memory slots in line.

``StateBook`` owns the slots of one swapped torch optimizer: it decides which state entries
are swapped, takes them into host memory (``adopt``, lazily created state through
``make_state``, entries a checkpoint load set aside through ``adopt_loaded``) and lists the
parameters a step updates (``sync``). The engine asks it; it calls back into the engine
only through ``before_bring_in``.

Under ``resident_state_fraction`` the leading parameters (``param_groups`` order, every
parameter that has state, with a gradient this step or not) whose swappable state fits that
share of the total keep it on the device for good: those entries are plain device tensors,
not slots, and ``sync`` moves an entry in or out when the share (or the state) changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._device.interface import TorchRuntime
from swapopt_core._planning.resident import resident_count
from swapopt_core._torch.adapter import OptimizerAdapter
from swapopt_core._torch.state import Slot, local_tensor, wrap_like

__all__ = ["SlotKey", "StateBook", "Unit"]

#: A slot's key: the id of its parameter and its state key.
SlotKey = tuple[int, str]


@dataclass(eq=False)
class Unit:
    """One parameter taking part in a step, with its swapped slots."""

    group: int
    param: torch.Tensor
    grad: torch.Tensor
    slots: list[Slot] = field(default_factory=list)
    #: Bytes of its swappable state kept on the device for good (0: the state is swapped).
    resident_bytes: int = 0

    @property
    def resident(self) -> bool:
        """Whether its state stays on the device (``resident_state_fraction``)."""
        return self.resident_bytes > 0

    @property
    def key(self) -> int:
        return id(self.param)

    @property
    def token(self) -> tuple[Any, ...]:
        """The parameter, the gradient the update used and its version: a retry with them
        skips the unit. The parameter itself is in it: ``key`` is its id, which a new
        parameter could take once it died, and a token kept under that key keeps it alive."""
        return (self.param, self.grad, self.grad._version)

    @property
    def nbytes(self) -> int:
        """Bytes of its swappable state: on the device for good, or in its slots."""
        return self.resident_bytes or sum(slot.nbytes for slot in self.slots)


@dataclass(eq=False)
class StateBook:
    """The swapped state entries of one torch optimizer and their host memory.

    Attributes:
        optimizer: Whose ``state`` the book keeps in line.
        config: ``state_keys`` and ``min_numel`` say what is swapped.
        adapter: The family's state keys and state creation.
        runtime: Host memory and the devices it accepts.
        packed: Whether host memory is packed (the layout fills it in after ``sync``).
        before_bring_in: Called before swapped entries become resident: the host copies
            are read next, so the engine makes them final.
        slots: The swapped entries by ``(id(param), key)`` (each slot holds its parameter,
            so an id in a key stays its own).
        resident: The parameters whose swappable state stays on the device, by id, with
            the bytes of it; each entry holds its parameter, so that an id read between two
            ``sync`` calls (``offload``, a checkpoint load) names no newer parameter.
        unit_bytes: Swappable state bytes of every parameter in ``param_groups`` order,
            resident ones included, as of the last ``sync``.
    """

    optimizer: torch.optim.Optimizer
    config: SwapOptimizerConfig
    adapter: OptimizerAdapter
    runtime: TorchRuntime
    packed: bool
    before_bring_in: Callable[[], None] = lambda: None
    slots: dict[SlotKey, Slot] = field(default_factory=dict)
    resident: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    unit_bytes: list[int] = field(default_factory=list)

    # ---- what is swapped -----------------------------------------------------------------

    def keys(
        self, group: MutableMapping[str, Any], state: MutableMapping[str, Any] | None = None
    ) -> tuple[str, ...]:
        """The state keys swapped for a parameter of ``group`` whose state is ``state``: the
        adapter's, as configured. A family that names none (``state_keys`` is ``None``)
        swaps its tensor entries of at least one dimension: scalars (step counters) stay."""
        keys = self.adapter.state_keys(group)
        if keys is None:
            keys = tuple(
                k
                for k, v in (state or {}).items()
                if isinstance(v, torch.Tensor) and v.dim() > 0  # a DTensor has its shard's dims
            )
        wanted = self.config.state_keys
        return keys if wanted is None else tuple(k for k in keys if k in wanted)

    def swappable(self, param: torch.Tensor, value: object) -> bool:
        """Whether state entry ``value`` of ``param`` lives in host memory between steps."""
        return not self.resident_bytes_of(param) and self.storable(param, value)

    def resident_bytes_of(self, param: torch.Tensor) -> int:
        """Bytes of ``param``'s swappable state kept on the device for good (0: none)."""
        entry = self.resident.get(id(param))
        return entry[1] if entry is not None and entry[0] is param else 0

    def storable(self, param: torch.Tensor, value: object) -> bool:
        """Whether state entry ``value`` of ``param`` could live in host memory (it does
        unless ``param`` is resident)."""
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

    def unswapped(self) -> int:
        """How many swappable entries are not our host tensors now."""
        opt = self.optimizer
        ours = {id(slot.value) for slot in self.slots.values()}  # alive: ids are unique
        count = 0
        for group in opt.param_groups:
            for param in group["params"]:
                state = opt.state.get(param, {})
                keys = self.keys(group, state)
                count += sum(
                    1
                    for key in keys
                    if key in state
                    and id(state[key]) not in ours
                    and self.swappable(param, state[key])
                )
        return count

    # ---- taking state into host memory ---------------------------------------------------

    def _host_copy(self, local: torch.Tensor, *, settled: bool = False) -> torch.Tensor:
        """Host memory holding ``local``'s values for a new slot.

        In packed mode the slot is about to be copied into the packed buffer by the layout
        that follows ``sync``, so unless ``settled`` is asked for (state created inside a
        step, which must leave the device now) the source itself stands in until then.
        """
        if self.packed:
            return local.to("cpu", copy=True) if settled else local
        host = self.runtime.alloc_host(local.numel(), local.dtype).view(local.shape)
        return host.copy_(local)

    def _add(self, param: torch.Tensor, key: str, host: torch.Tensor, like: torch.Tensor) -> Slot:
        slot = Slot(param, key, host, wrap_like(host, like), local_tensor(param).device)
        self.optimizer.state[param][key] = slot.value
        self.slots[(id(param), key)] = slot
        return slot

    def adopt(
        self, param: torch.Tensor, key: str, value: torch.Tensor, *, settled: bool = False
    ) -> Slot:
        """Take ``value`` into host memory and make it the state entry ``key`` of ``param``."""
        return self._add(param, key, self._host_copy(local_tensor(value), settled=settled), value)

    def adopt_loaded(self, pending: dict[SlotKey, torch.Tensor]) -> None:
        """Replace every slot by the entries a checkpoint load set aside (``pending``)."""
        self.slots.clear()
        loaded: dict[int, dict[str, torch.Tensor]] = {}
        for (owner, key), value in pending.items():
            loaded.setdefault(owner, {})[key] = value
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                for key in self.keys(group, loaded.get(id(param))):
                    entry = pending.get((id(param), key))
                    if entry is None:
                        continue
                    value = entry
                    local = local_tensor(value)
                    if local_tensor(param).is_floating_point():
                        # Cast like torch's loader does, but into host memory, not the device.
                        local = local.to(device="cpu", dtype=param.dtype)
                    self._add(param, key, self._host_copy(local), _layout_source(value, param))

    def forget(self, param: torch.Tensor, key: str) -> None:
        """Drop the slot of entry ``key`` of ``param`` (an undone update created it)."""
        self.slots.pop((id(param), key), None)

    def publish(self, slot: Slot) -> None:
        """Make ``slot``'s state entry hold its ``host`` (which the layout just moved)."""
        slot.value = wrap_like(slot.host, slot.value)
        self.optimizer.state[slot.param][slot.key] = slot.value

    def _slot(self, param: torch.Tensor, key: str, state: MutableMapping[str, Any]) -> Slot | None:
        value = state.get(key)
        slot = self.slots.get((id(param), key))
        if slot is not None and slot.value is value:
            return slot
        if not self.swappable(param, value):
            self.slots.pop((id(param), key), None)
            return None
        assert isinstance(value, torch.Tensor)
        return self.adopt(param, key, value)

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
            zero = torch.zeros((), dtype=local.dtype).expand(local.shape)
            host = zero if self.packed else self._host_copy(zero)
            slot = Slot(like, key, host, wrap_like(host, like), local.device)
            self.slots[(id(like), key)] = slot
            return slot.value
        return torch.zeros_like(like, memory_format=torch.preserve_format)

    # ---- the state a step updates ----------------------------------------------------------

    def sync(self, *, stepping: bool = False) -> tuple[list[Unit], list[Slot]]:
        """Bring ``optimizer.state`` in line with the slots.

        Any swappable entry that is not one of our host tensors (state created before
        install, loaded by a framework, or moved back to the device) is taken into host
        memory here. With ``stepping``, lazily initialises the state of parameters about to
        be stepped.

        Returns:
            The units to step, and every slot in layout order (for the packed layout).
        """
        opt = self.optimizer
        if stepping:
            for group in opt.param_groups:
                for param in group["params"]:
                    if param.grad is not None and not opt.state.get(param):
                        self._init_state(group, param, self.keys(group, {}))
        self._place_resident()
        units: list[Unit] = []
        ordered: list[Slot] = []
        live: set[SlotKey] = set()
        for index, group in enumerate(opt.param_groups):
            for param in group["params"]:
                grad = param.grad if stepping else None
                state = opt.state.get(param)
                slots = []
                for key in self.keys(group, state) if state else ():
                    assert state is not None
                    slot = self._slot(param, key, state)
                    if slot is not None:
                        slots.append(slot)
                        live.add((id(param), key))
                ordered.extend(slots)
                if grad is not None:
                    units.append(Unit(index, param, grad, slots, self.resident_bytes_of(param)))
        stale = self.slots.keys() - live
        if stale:
            # Their host memory is freed below: no copy of the last step may still use it.
            self.runtime.synchronize()
        for gone in stale:
            del self.slots[gone]
        return units, ordered

    def _place_resident(self) -> None:
        """Choose the resident parameters from the state as it is, and bring the swapped
        entries of those that just became resident onto the device.

        Entries of parameters that stop being resident are taken into host memory by the
        ``sync`` that follows (they are device tensors no slot holds).
        """
        opt = self.optimizer
        params: list[torch.Tensor] = []
        costs: list[int] = []
        for group in opt.param_groups:
            for param in group["params"]:
                state = opt.state.get(param) or {}
                keys = self.keys(group, state)
                costs.append(
                    sum(_nbytes(state[k]) for k in keys if self._counted(param, k, state.get(k)))
                )
                params.append(param)
        self.unit_bytes = costs
        fraction = self.config.resident_state_fraction
        count = resident_count(costs, fraction) if fraction > 0 else 0
        # A parameter without state yet is not resident: its state (created or loaded later)
        # starts in host memory, and comes in at the sync that finds it in the prefix.
        self.resident = {
            id(p): (p, c) for p, c in zip(params, costs[:count], strict=False) if c > 0
        }
        # Slots of resident parameters, and those ``min_numel`` no longer swaps, come in.
        leaving = [
            key
            for key, slot in self.slots.items()
            if key[0] in self.resident or not self._eligible(slot.param, slot.dtype, slot.numel)
        ]
        incoming = [
            self.slots[key]
            for key in leaving
            if opt.state.get(self.slots[key].param, {}).get(key[1]) is self.slots[key].value
        ]
        if incoming:
            self.before_bring_in()
            for slot in incoming:
                local = torch.empty(slot.shape, dtype=slot.dtype, device=slot.device)
                local.copy_(slot.host)
                opt.state[slot.param][slot.key] = wrap_like(local, slot.value)
        for key in leaving:
            del self.slots[key]

    def _counted(self, param: torch.Tensor, key: str, value: object) -> bool:
        """Whether entry ``key`` is swappable state: a slot's (fresh packed zeros are not
        contiguous) or one that could be."""
        slot = self.slots.get((id(param), key))
        return (slot is not None and slot.value is value) or self.storable(param, value)

    def fixed_bytes(self) -> int:
        """Bytes of tensor state that is never swapped (too small, keys not swapped, step
        counters), on the device of a parameter the runtime serves."""
        total = 0
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state.get(param) or {}
                keys = self.keys(group, state)
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor) or (
                        key in keys and self._counted(param, key, value)
                    ):
                        continue
                    local = local_tensor(value)
                    if self.runtime.serves(local.device):
                        total += _nbytes(local)
        return total

    @property
    def resident_bytes(self) -> int:
        """Device bytes of the state kept resident for good."""
        return sum(nbytes for _, nbytes in self.resident.values())

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
        if not fresh:  # the family creates its state in its own step, if any
            return {}
        state: MutableMapping[str, Any] = self.optimizer.state[param]
        state.update(fresh)
        return state

    def restore_all(self) -> None:
        """Put every swapped entry back on its parameter's device and forget the slots.

        The caller makes the host state final first.
        """
        for slot in self.slots.values():
            local = torch.empty_like(slot.host, device=slot.device)
            local.copy_(slot.host)
            self.optimizer.state[slot.param][slot.key] = wrap_like(local, slot.value)
        self.slots.clear()


def _nbytes(value: torch.Tensor) -> int:
    local = local_tensor(value)
    return local.numel() * local.element_size()


def _layout_source(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Whose distributed layout a loaded state entry takes: its own, else its parameter's."""
    if local_tensor(value) is not value:
        return value
    if local_tensor(param).shape == value.shape:
        return param
    return value
