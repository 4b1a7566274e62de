"""The swap engine installed on one MindSpore optimizer Cell.

The Cell keeps its identity: an instance attribute shadows ``construct``, so ``opt(grads)``
(PyNative) runs the family's preamble once and then its per-parameter update through the
neutral step transaction (``swapopt_core._swap.engine``) over a ``MindSporeStep``. Between
steps every swapped state Parameter's data is a CPU tensor, so MindSpore's own
``save_checkpoint`` writes host copies and nothing is resident on the device, except the
state of the leading parameters that ``resident_state_fraction`` keeps there for good.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pluggy

from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._device.interface import TransferRuntime
from swapopt_core._errors import SwapOptError
from swapopt_core._mindspore import is_mindspore_optimizer
from swapopt_core._mindspore.adapter import GraphCache, MindSporeAdapter
from swapopt_core._mindspore.runtime import MindSporeRuntime
from swapopt_core._mindspore.state import MindSporeTensorOps, Slot
from swapopt_core._planning.resident import resident_count
from swapopt_core._swap.engine import ENGINE_ATTR, EngineBase
from swapopt_core._swap.ops import Target

logger = logging.getLogger(__name__)

MASTER_KEY = "master_param"
_FLOATS = ("Float16", "Float32", "Float64", "BFloat16")
#: The config fields ``reconfigure`` may change; the others fix the engine's layout.
_RECONFIGURABLE = ("resident_state_fraction", "swap_times", "prefetch_batches")


@dataclass(eq=False)
class Unit:
    """One parameter taking part in a step (its index in ``_parameters``), with its slots."""

    index: int
    slots: list[Slot]
    token = ()  # a retry resumes only the same call (``MindSporeStep.identity``)

    @property
    def key(self) -> int:
        return self.index

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots)


class SameCall:
    """Which call a step was: its gradients, compared by identity and held.

    A retry resumes an interrupted step only with the very gradients it failed with. Ids
    alone would also match new gradients that landed at the addresses of dead ones (and
    resume a step they never began), so the objects themselves are kept, for as long as the
    transaction remembers the interrupted call.

    Args:
        objects: The gradients of the call, in order.
    """

    __slots__ = ("objects",)

    def __init__(self, objects: Sequence[Any]) -> None:
        self.objects = tuple(objects)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SameCall)
            and len(self.objects) == len(other.objects)
            and all(a is b for a, b in zip(self.objects, other.objects, strict=True))
        )

    def __hash__(self) -> int:
        return hash(tuple(map(id, self.objects)))  # held: the ids stay these objects'


class MindSporeSwapEngine(EngineBase):
    """Keeps a MindSpore optimizer's swappable state in host memory; pipelines its update."""

    framework = "mindspore"
    # MindSpore saves checkpoints straight from the state Parameters, with no hook to wait
    # in: host state is final (failed copies written back) when a step returns.
    readers_hooked = False
    adapter: MindSporeAdapter
    runtime: MindSporeRuntime

    def __init__(
        self,
        optimizer: Any,
        config: SwapOptimizerConfig,
        adapter: MindSporeAdapter,
        runtime: MindSporeRuntime,
        plugin_manager: pluggy.PluginManager,
    ) -> None:
        self._slots: dict[tuple[str, int], Slot] = {}
        super().__init__(optimizer, config, adapter, runtime, plugin_manager)
        #: The compiled batch updates of this optimizer (see ``adapter.update_batch``).
        self.graphs = GraphCache()

    @staticmethod
    def tensor_ops(runtime: TransferRuntime) -> MindSporeTensorOps:
        assert isinstance(runtime, MindSporeRuntime)
        return MindSporeTensorOps(runtime)

    @property
    def slots(self) -> dict[tuple[str, int], Slot]:
        return self._slots

    # ---- install / uninstall -------------------------------------------------------------

    @classmethod
    def serves(cls, optimizer: object) -> bool:
        return is_mindspore_optimizer(optimizer)

    @classmethod
    def param_devices(cls, optimizer: Any) -> set[str]:
        return {str(p.device).split(":")[0] for p in optimizer._parameters}

    def install(self) -> None:
        self._check_mode()
        self.adapter.validate(self.optimizer)
        self.offload()
        object.__setattr__(self.optimizer, "construct", self.construct)
        object.__setattr__(self.optimizer, ENGINE_ATTR, self)

    def uninstall(self) -> None:
        """Put every swapped state back on its device and give ``construct`` back."""
        self.quiesce()  # the host tensors are read below
        for slot in self.slots.values():
            slot.state.set_data(self.runtime.to_device(slot.host, slot.device))
        self.slots.clear()
        for name in ("construct", ENGINE_ATTR):
            object.__delattr__(self.optimizer, name)

    # ---- state bookkeeping ---------------------------------------------------------------

    def keyed_states(self) -> dict[str, Sequence[Any]]:
        """The state Parameters per key that the config asks to swap."""
        found = self.adapter.state(self.optimizer)
        wanted = self.config.state_keys
        keyed = {k: v for k, v in found.items() if wanted is None or k in wanted}
        masters = self.adapter.masters(self.optimizer)
        if self.config.include_master_params and masters is not None:
            keyed[MASTER_KEY] = masters
        return keyed

    def _swappable(self, state: Any, param: Any) -> bool:
        return (
            str(state.dtype) in _FLOATS
            and int(state.size) >= self.config.min_numel
            and self.runtime.serves(param.device)
        )

    def _ours(self, slot: Slot) -> bool:
        """Whether the state Parameter still holds our host memory (a load replaces it)."""
        return bool(slot.state.data_ptr() == slot.host.data_ptr())

    def unit_state_bytes(self) -> list[tuple[int, int]]:
        """``(index, swappable state bytes)`` of each parameter the step updates, in step
        order (the units ``resident_state_fraction`` is measured against)."""
        opt, params = self.optimizer, self.optimizer._parameters
        sizes = dict.fromkeys((i for i in range(len(params)) if self.adapter.steps(opt, i)), 0)
        for states in self.keyed_states().values():
            for index, state in enumerate(states):
                if index in sizes and self._swappable(state, params[index]):
                    sizes[index] += int(state.size) * int(state.itemsize)
        return list(sizes.items())

    def resident_indices(self) -> set[int]:
        """The parameters whose state stays on the device for good: the longest prefix of
        the step order whose state bytes fit ``resident_state_fraction`` of the total."""
        if self.config.resident_state_fraction <= 0.0:
            return set()
        units = self.unit_state_bytes()
        count = resident_count([nbytes for _, nbytes in units], self.config.resident_state_fraction)
        return {index for index, _ in units[:count]}

    def reconfigure(self, config: SwapOptimizerConfig) -> None:
        """Change the resident share (and ``swap_times``) in place: state that becomes
        resident is copied onto the device, state that becomes swapped into host memory,
        one parameter at a time (never all of it on the device).

        Raises:
            SwapOptError: ``config`` changes a field other than those of ``_RECONFIGURABLE``.
        """
        changed = [
            f.name
            for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(self.config, f.name)
            and f.name not in _RECONFIGURABLE
        ]
        if changed:
            raise SwapOptError(
                f"An installed MindSpore swap can change only {list(_RECONFIGURABLE)}; the new "
                f"config changes {changed}. Unswap the optimizer and swap it again instead."
            )
        self.config = config
        self.offload()

    def offload(self) -> int:
        """Take every swappable state into host memory (except the resident share); return
        how many were moved."""
        self.settle()
        params = self.optimizer._parameters
        resident = self.resident_indices()
        ordered: list[Slot] = []
        moved = 0
        live: set[tuple[str, int]] = set()
        for key, states in self.keyed_states().items():
            for index, state in enumerate(states):
                if index in resident or not self._swappable(state, params[index]):
                    continue
                live.add((key, index))
                slot = self.slots.get((key, index))
                if slot is None or slot.state is not state or not self._ours(slot):
                    slot = self._adopt(key, index, state, str(params[index].device), slot)
                    moved += 1
                ordered.append(slot)
        stale = self.slots.keys() - live
        if stale:
            self.quiesce()  # the last step's copies out may still be writing the host copies
        for gone in stale:
            slot = self.slots.pop(gone)
            if self._ours(slot):  # now resident (or no longer swappable): back on its device
                slot.state.set_data(self.runtime.to_device(slot.host, slot.device))
        ordered.sort(key=lambda slot: (slot.index, slot.key))
        self.lay_out(ordered)
        return moved

    def _adopt(self, key: str, index: int, state: Any, device: str, old: Slot | None) -> Slot:
        """Make host memory hold ``state``'s values and ``state`` hold that host memory."""
        if getattr(state, "has_init", False):
            state.init_data()
        if old is not None and old.state is state and (old.offset >= 0 or not self.staging.packed):
            # Something (a checkpoint load) replaced the data: new values, same host place.
            old.host.copy_(state.data)
            self.publish(old)
            return old
        if self.staging.packed:
            # The layout copies the values into the packed buffer; the data stands in until then.
            slot = Slot(key, index, state, state.data, device)
        else:
            numel, shape = int(state.size), tuple(state.shape)
            host = self.runtime.view(self.runtime.alloc_host(numel, state.dtype), 0, numel, shape)
            host.copy_(state.data)
            slot = Slot(key, index, state, host, device)
            self.publish(slot)
        self.slots[(key, index)] = slot
        return slot

    def publish(self, slot: Slot) -> None:
        slot.state.set_data(slot.host)

    # ---- the step ------------------------------------------------------------------------

    def construct(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The swapped ``construct(gradients)``: preamble, then the update as a pipeline.

        If anything raises, each parameter was updated completely or not at all and the
        state is in host memory (or kept on the device until the next call); calling again
        with the same gradients finishes the step.
        """
        opt = self.optimizer
        if kwargs or len(args) != 1:
            raise TypeError(
                f"A swapped {self.adapter.family} takes exactly one argument, the gradients "
                f"tuple; got {len(args)} positional and {sorted(kwargs)} keyword arguments."
            )
        gradients = tuple(args[0])
        if len(gradients) != len(opt._parameters):
            raise ValueError(
                f"{self.adapter.family} has {len(opt._parameters)} parameters but got "
                f"{len(gradients)} gradients. Pass one gradient per parameter, in order."
            )
        results: list[Any] = [True] * len(gradients)
        self.run_step((gradients, results))
        return tuple(results)

    def open_step(self, call: Any) -> MindSporeStep:
        gradients, results = call
        opt = self.optimizer
        self._check_mode()
        self.adapter.validate(opt)
        self.offload()
        by_index: dict[int, list[Slot]] = {}
        for slot in self.slots.values():
            by_index.setdefault(slot.index, []).append(slot)
        units = [
            Unit(i, by_index.get(i, []))
            for i in range(len(gradients))
            if self.adapter.steps(opt, i)
        ]
        return MindSporeStep(self, gradients, results, units)

    def step_queued(self, plan: list[list[Any]], resumed: bool) -> None:
        if not resumed:
            self.graphs.prune()

    def resident_states(self) -> dict[str, Sequence[Any]]:
        """Every state the update reads, by key: the optimizer's own Parameters."""
        states = dict(self.adapter.state(self.optimizer))
        masters = self.adapter.masters(self.optimizer)
        if masters is not None:
            states[MASTER_KEY] = masters
        return states

    @staticmethod
    def _check_mode() -> None:
        import mindspore as ms

        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise SwapOptError(
                "swapopt runs MindSpore optimizers in PyNative mode only; the context is in "
                "GRAPH_MODE. Call mindspore.set_context(mode=mindspore.PYNATIVE_MODE), or use "
                "MindFormers' own `optimizer: {type: AdamW, swap: True}` for graph mode."
            )


class MindSporeStep:
    """One call of a MindSpore step: the preamble, and a batch's update with compiled graphs.

    Args:
        engine: Its optimizer, adapter and compiled graphs.
        gradients: The gradients of the call, one per parameter.
        results: Receives what the family returns per parameter.
        units: The parameters the step updates.
    """

    def __init__(
        self,
        engine: MindSporeSwapEngine,
        gradients: tuple[Any, ...],
        results: list[Any],
        units: list[Unit],
    ) -> None:
        self.optimizer = engine.optimizer
        self.adapter = engine.adapter
        self.graphs = engine.graphs
        self.gradients = gradients
        self.results = results
        self.units = units
        #: A retry with the same gradients resumes the step, without its preamble again.
        self.identity = SameCall(gradients)
        self.resident = engine.resident_states()
        self.devices = [str(p.device) for p in self.optimizer._parameters]  # waits once

    def prepare(self) -> Any:
        return self.adapter.prepare(self.optimizer, self.gradients)

    def changed(self, batch: Sequence[Unit]) -> list[Target]:
        """What the update of ``batch`` changes in place, with its device: the parameters
        and the state that is not swapped (the swapped state's host copy is only
        overwritten once the update succeeded)."""
        targets: list[Target] = []
        for unit in batch:
            index = unit.index
            swapped = {slot.key for slot in unit.slots}
            targets.append((self.optimizer._parameters[index], self.devices[index]))
            targets += [
                (values[index], self.devices[index])
                for key, values in self.resident.items()
                if key not in swapped and values[index] is not None
            ]
        return targets

    def update(self, batch: Sequence[Unit], views: dict[Any, Any], prepared: Any) -> None:
        work = []
        for unit in batch:
            states = {key: values[unit.index] for key, values in self.resident.items()}
            for slot in unit.slots:
                states[slot.key] = views[slot]
            work.append((unit.index, states))
        out = self.adapter.update_batch(self.optimizer, prepared, work, self.graphs)
        for unit, result in zip(batch, out, strict=True):
            self.results[unit.index] = result
