"""The swap engine installed on one MindSpore optimizer Cell.

The Cell keeps its identity: an instance attribute shadows ``construct``, so ``opt(grads)``
(PyNative) runs the family's preamble once and then its per-parameter update as the
pipeline of ``swapopt_core._pipeline``. Between steps every swapped state Parameter's data
is a CPU tensor, so MindSpore's own ``save_checkpoint`` writes host copies and nothing is
resident on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pluggy

from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._engine_base import ENGINE_ATTR, EngineBase
from swapopt_core._errors import SwapOptError
from swapopt_core._mindspore import is_mindspore_optimizer
from swapopt_core._mindspore.adapter import GraphCache, MindSporeAdapter
from swapopt_core._mindspore.runtime import MindSporeRuntime
from swapopt_core._mindspore.staging import PackedStaging, PerTensorStaging, Slot
from swapopt_core._mindspore.undo import UndoArena
from swapopt_core._partition import partition
from swapopt_core._pipeline import deferred_interrupt, run_pipeline

logger = logging.getLogger(__name__)

MASTER_KEY = "master_param"
_FLOATS = ("Float16", "Float32", "Float64", "BFloat16")


class MindSporeSwapEngine(EngineBase):
    """Keeps a MindSpore optimizer's swappable state in host memory; pipelines its update."""

    framework = "mindspore"
    packed_staging = PackedStaging
    per_tensor_staging = PerTensorStaging
    adapter: MindSporeAdapter
    runtime: MindSporeRuntime
    staging: PackedStaging | PerTensorStaging
    slots: dict[tuple[str, int], Slot]

    def __init__(
        self,
        optimizer: Any,
        config: SwapOptimizerConfig,
        adapter: MindSporeAdapter,
        runtime: MindSporeRuntime,
        plugin_manager: pluggy.PluginManager,
    ) -> None:
        super().__init__(optimizer, config, adapter, runtime, plugin_manager)
        # An interrupted step: (gradient ids, preamble values, indices already updated).
        self._interrupted: tuple[tuple[int, ...], Any, set[int]] | None = None
        #: The compiled batch updates of this optimizer (see ``adapter.update_batch``).
        self.graphs = GraphCache()

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
        self.settle()
        # The host tensors are read below: every copy into them must have landed.
        self.runtime.synchronize()
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
        return slot.state.data_ptr() == slot.host.data_ptr()

    def offload(self) -> int:
        """Take every swappable state into host memory; return how many were moved."""
        self.settle()
        params = self.optimizer._parameters
        ordered: list[Slot] = []
        moved = 0
        live: set[tuple[str, int]] = set()
        for key, states in self.keyed_states().items():
            for index, state in enumerate(states):
                if not self._swappable(state, params[index]):
                    continue
                live.add((key, index))
                slot = self.slots.get((key, index))
                if slot is None or slot.state is not state or not self._ours(slot):
                    slot = self._adopt(key, index, state, str(params[index].device), slot)
                    moved += 1
                ordered.append(slot)
        for stale in self.slots.keys() - live:
            del self.slots[stale]
        if isinstance(self.staging, PackedStaging):
            self.staging.layout(sorted(ordered, key=lambda s: (s.index, s.key)), self._publish)
        return moved

    def _adopt(self, key: str, index: int, state: Any, device: str, old: Slot | None) -> Slot:
        """Make host memory hold ``state``'s values and ``state`` hold that host memory."""
        if getattr(state, "has_init", False):
            state.init_data()
        if old is not None and old.state is state and (old.offset >= 0 or not self.staging.packed):
            # Something (a checkpoint load) replaced the data: new values, same host place.
            old.host.copy_(state.data)
            self._publish(old)
            return old
        if self.staging.packed:
            # The layout copies the values into the packed buffer; the data stands in until then.
            slot = Slot(key, index, state, state.data, device)
        else:
            numel, shape = int(state.size), tuple(state.shape)
            host = self.runtime.view(self.runtime.alloc_host(numel, state.dtype), 0, numel, shape)
            host.copy_(state.data)
            slot = Slot(key, index, state, host, device)
            self._publish(slot)
        self.slots[(key, index)] = slot
        return slot

    @staticmethod
    def _publish(slot: Slot) -> None:
        slot.state.set_data(slot.host)

    # ---- the step ------------------------------------------------------------------------

    def construct(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The swapped ``construct(gradients)``: preamble, then the update as a pipeline.

        If anything raises, each parameter was updated completely or not at all and the
        state is in host memory (or kept on the device until the next call); calling again
        with the same gradients finishes the step.
        """
        with deferred_interrupt():
            return self._construct(*args, **kwargs)

    def _construct(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
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
        self._check_mode()
        self.adapter.validate(opt)
        self.offload()
        identity = tuple(id(g) for g in gradients)
        resumed = self._interrupted is not None and self._interrupted[0] == identity
        if resumed:
            _, prepared, done = self._interrupted
        else:
            prepared, done = self.adapter.prepare(opt, gradients), set()
        # From here on a retry with the same gradients must not run the preamble again.
        self._interrupted = (identity, prepared, done)
        results: list[Any] = [True] * len(gradients)
        units = [i for i in range(len(gradients)) if i not in done and self.adapter.steps(opt, i)]
        by_index: dict[int, list[Slot]] = {}
        for slot in self.slots.values():
            by_index.setdefault(slot.index, []).append(slot)
        runs = partition(
            [sum(s.nbytes for s in by_index.get(i, ())) for i in units], self.config.swap_times
        )
        batches = [[units[k] for k in run] for run in runs]
        resident = self._resident_states()
        devices = [str(p.device) for p in opt._parameters]  # waits once, before the step
        arena = UndoArena(
            self.runtime, [self._changed(batch, by_index, resident, devices) for batch in batches]
        )

        def update(b: int, views: dict[Slot, Any]) -> None:
            work = []
            for index in batches[b]:
                states = {key: values[index] for key, values in resident.items()}
                for slot in by_index.get(index, ()):
                    states[slot.key] = views[slot]
                work.append((index, states))
            saved = arena.save(self._changed(batches[b], by_index, resident, devices))
            try:
                out = self.adapter.update_batch(opt, prepared, work, self.graphs)
            except BaseException:
                arena.restore(saved)
                raise
            for index, result in zip(batches[b], out, strict=True):
                results[index] = result
            done.update(batches[b])

        try:
            h2d, d2h = run_pipeline(
                [[s for i in batch for s in by_index.get(i, ())] for batch in batches],
                self.staging,
                self.runtime,
                update,
                self.kept,
            )
            # MindSpore saves checkpoints straight from the host Parameters, with no hook
            # to wait in: the host copies must be final when the step returns.
            self.runtime.synchronize()
        except BaseException:
            self._interrupted = (identity, prepared, done)
            raise
        finally:
            arena.release()
        if not resumed:
            self.graphs.prune()
        # Until the observers have seen the step, a call with the same gradients only
        # tells them again.
        self._interrupted = (identity, prepared, done)
        self.finish_step(h2d, d2h, len(batches), resumed=resumed)
        self._interrupted = None
        return tuple(results)

    def _changed(
        self,
        batch: Sequence[int],
        by_index: dict[int, list[Slot]],
        resident: dict[str, Any],
        devices: Sequence[str],
    ) -> list[tuple[Any, str]]:
        """What the update of ``batch`` changes in place, with its device: the parameters
        and the state that is not swapped (the swapped state's host copy is only
        overwritten once the update succeeded)."""
        targets = []
        for index in batch:
            swapped = {slot.key for slot in by_index.get(index, ())}
            targets.append((self.optimizer._parameters[index], devices[index]))
            targets += [
                (values[index], devices[index])
                for key, values in resident.items()
                if key not in swapped and values[index] is not None
            ]
        return targets

    def _resident_states(self) -> dict[str, Sequence[Any]]:
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
