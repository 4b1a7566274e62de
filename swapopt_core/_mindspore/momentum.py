"""MindSpore's momentum families: ``nn.Momentum`` and ``nn.SGD``.

Both replay their optimizer's ``construct`` preamble (weight decay, gradient
centralization, loss scale, learning rate, global step) and map the very function their
``construct`` maps (``_momentum_opt`` with ``ApplyMomentum``, ``_sgd_opt`` with ``SGD``)
over each batch in one compiled graph (``swapopt_core._mindspore.momentum_graphs``), with
the optimizer's own primitives and its ``momentum`` Parameter: the swapped update is the
unswapped one, bit for bit.

``nn.SGD`` allocates ``accum`` and ``stat`` whatever its momentum; with ``momentum=0`` its
kernel reads neither, but they are still the optimizer's device memory and its kernel's
inputs, so they are swapped like any state (``state_keys`` keeps them resident).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from swapopt_core._mindspore.adapter import GraphCache, MindSporeAdapter, Work
from swapopt_core._mindspore.families import advance_counters, require_dense

__all__ = ["NnMomentumAdapter", "NnSGDAdapter"]


class _MomentumFamily(MindSporeAdapter):
    """Families whose ``construct`` is ``Optimizer``'s gradient preamble, the learning rate,
    the global step, then one update per parameter (all of them, in reverse)."""

    def prepare(self, optimizer: Any, gradients: tuple[Any, ...]) -> Any:
        gradients = optimizer.decay_weight(gradients)
        gradients = optimizer.gradients_centralization(gradients)
        gradients = optimizer.scale_grad(gradients)
        require_dense(gradients, self.family)
        lr = optimizer.get_lr()  # before the global step advances, as in ``construct``
        advance_counters(optimizer, powers=False)
        return gradients, lr

    def steps(self, optimizer: Any, index: int) -> bool:
        return True  # construct maps the update over every parameter

    def lr_of(self, optimizer: Any, prepared: Any, index: int) -> Any:
        """The learning rate of parameter ``index``."""
        return self.per_parameter(prepared[1], optimizer.is_group_lr, index)

    def columns(
        self, optimizer: Any, prepared: Any, work: Sequence[Work], keys: Sequence[str]
    ) -> Any:
        """A batch's graph inputs: gradients, parameters, the state ``keys`` in order, the
        learning rate (one per parameter with group rates) and ``momentum``."""
        from swapopt_core._mindspore.graphs import Columns

        gradients, lr = prepared
        indices = [index for index, _ in work]
        columns = Columns()
        columns.add([gradients[i] for i in indices])
        columns.add([optimizer._parameters[i] for i in indices])
        for key in keys:
            columns.add([states[key] for _, states in work])
        columns.add([lr[i] for i in indices] if optimizer.is_group_lr else [lr])
        columns.add([optimizer.momentum])
        return columns


class NnMomentumAdapter(_MomentumFamily):
    """``mindspore.nn.Momentum`` (with or without Nesterov), and its subclasses."""

    family = "mindspore.nn.Momentum"
    classes = ("mindspore.nn.optim.momentum.Momentum",)
    state_key_names = ("momentum_buffer",)

    def state(self, optimizer: Any) -> dict[str, Sequence[Any]]:
        return {"momentum_buffer": optimizer.moments}

    def update(self, optimizer: Any, prepared: Any, index: int, states: Mapping[str, Any]) -> Any:
        from mindspore.ops import functional as F

        lr = self.lr_of(optimizer, prepared, index)
        param, grad = optimizer._parameters[index], prepared[0][index]
        done = optimizer.opt(param, states["momentum_buffer"], lr, grad, optimizer.momentum)
        return F.depend(True, done)

    def update_batch(
        self, optimizer: Any, prepared: Any, work: Sequence[Work], graphs: GraphCache
    ) -> list[Any]:
        from swapopt_core._mindspore.momentum_graphs import MomentumBatch

        columns = self.columns(optimizer, prepared, work, ("momentum_buffer",))
        graph = graphs.get(columns.key, lambda: MomentumBatch(optimizer, columns))
        return list(columns.call(graph))


class NnSGDAdapter(_MomentumFamily):
    """``mindspore.nn.SGD`` (momentum, dampening, Nesterov, weight decay), and subclasses.

    ``accum`` is swapped as ``momentum_buffer``, ``stat`` (its first-step flags) as
    ``stat``.
    """

    family = "mindspore.nn.SGD"
    classes = ("mindspore.nn.optim.sgd.SGD",)
    state_key_names = ("momentum_buffer", "stat")

    def state(self, optimizer: Any) -> dict[str, Sequence[Any]]:
        return {"momentum_buffer": optimizer.accum, "stat": optimizer.stat}

    def update(self, optimizer: Any, prepared: Any, index: int, states: Mapping[str, Any]) -> Any:
        from mindspore.ops import functional as F

        lr = self.lr_of(optimizer, prepared, index)
        param, grad = optimizer._parameters[index], prepared[0][index]
        accum, stat = states["momentum_buffer"], states["stat"]
        done = optimizer.opt[index](param, grad, lr, accum, optimizer.momentum, stat)
        return F.depend(True, done)

    def update_batch(
        self, optimizer: Any, prepared: Any, work: Sequence[Work], graphs: GraphCache
    ) -> list[Any]:
        from swapopt_core._mindspore.momentum_graphs import SGDBatch

        columns = self.columns(optimizer, prepared, work, ("momentum_buffer", "stat"))
        kernels = tuple(optimizer.opt[index] for index, _ in work)
        graph = graphs.get(columns.key, lambda: SGDBatch(optimizer, columns, kernels))
        return list(columns.call(graph))
