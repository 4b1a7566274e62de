"""Built-in MindSpore families: ``nn.Adam``, ``nn.AdamWeightDecay``, MindFormers ``AdamW``.

Each replays its optimizer's ``construct`` preamble and calls the very primitive (or
per-parameter function) that ``construct`` maps over the parameters, so the swapped update
is the unswapped one, bit for bit. ``nn.Adam`` and ``nn.AdamWeightDecay``, whose plain
``construct`` is jit-compiled, map it over each batch in a compiled graph
(``swapopt_core._mindspore.graphs``); MindFormers' AdamW, whose plain ``construct`` runs op
by op, updates one parameter at a time the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from swapopt_core._errors import SwapOptError, UnsupportedOptimizerError
from swapopt_core._mindspore.adapter import GraphCache, MindSporeAdapter, Work
from swapopt_core._swap.engine import ENGINE_ATTR

__all__ = [
    "MindFormersAdamWAdapter",
    "NnAdamAdapter",
    "NnAdamWeightDecayAdapter",
    "advance_counters",
    "require_dense",
]


def _graphs(optimizer: Any) -> GraphCache:
    """The compiled graphs of ``optimizer``'s engine (a throwaway cache without one)."""
    graphs = getattr(getattr(optimizer, ENGINE_ATTR, None), "graphs", None)
    return graphs if isinstance(graphs, GraphCache) else GraphCache()


def advance_counters(optimizer: Any, powers: bool) -> Any:
    """Advance the global step (and nn.Adam's powers) in one compiled launch."""
    from swapopt_core._mindspore.graphs import Preamble

    counters = [optimizer.global_step]
    if powers:
        counters += [optimizer.beta1_power, optimizer.beta2_power]
    # a counter whose data was replaced (a checkpoint load) needs a new graph
    key = ("preamble", powers, tuple((id(c), c.data_ptr()) for c in counters))
    return _graphs(optimizer).get(key, lambda: Preamble(optimizer, powers))()


def require_dense(gradients: tuple[Any, ...], family: str) -> None:
    """Raise ``SwapOptError`` (an error of the step) for a gradient that is not a dense Tensor."""
    from mindspore import Tensor

    for position, grad in enumerate(gradients):
        if not isinstance(grad, Tensor):
            raise SwapOptError(
                f"gradients[{position}] is a {type(grad).__name__}; {family} under swapopt "
                "needs dense Tensor gradients. Use dense gradients or leave it unswapped."
            )


class NnAdamAdapter(MindSporeAdapter):
    """``mindspore.nn.Adam`` (with or without amsgrad)."""

    family = "mindspore.nn.Adam"
    classes = ("mindspore.nn.optim.adam.Adam",)
    state_key_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def validate(self, optimizer: Any) -> None:
        super().validate(optimizer)
        if optimizer.use_lazy:
            raise UnsupportedOptimizerError(
                "mindspore.nn.Adam(use_lazy=True) updates only the rows of sparse gradients, "
                "on the host; swapopt cannot swap it. Build it with use_lazy=False."
            )
        if optimizer.use_offload:
            raise UnsupportedOptimizerError(
                "mindspore.nn.Adam(use_offload=True) already keeps its state and update on "
                "the host; swapping on top would only add copies. Use one of the two: "
                "use_offload=False with swapopt, or use_offload=True alone."
            )

    def state(self, optimizer: Any) -> dict[str, Sequence[Any]]:
        found = {"exp_avg": optimizer.moment1, "exp_avg_sq": optimizer.moment2}
        if optimizer.use_amsgrad:
            found["max_exp_avg_sq"] = optimizer.vhat
        return found

    def prepare(self, optimizer: Any, gradients: tuple[Any, ...]) -> Any:

        gradients = optimizer.decay_weight(gradients)
        gradients = optimizer.gradients_centralization(gradients)
        gradients = optimizer.scale_grad(gradients)
        gradients = optimizer._grad_sparse_indices_deduplicate(gradients)
        require_dense(gradients, self.family)
        lr = optimizer.get_lr()
        beta1_power, beta2_power = advance_counters(optimizer, powers=True)
        return gradients, lr, beta1_power, beta2_power

    def steps(self, optimizer: Any, index: int) -> bool:
        return True  # construct maps the update over every parameter

    def update(self, optimizer: Any, prepared: Any, index: int, states: Mapping[str, Any]) -> Any:
        gradients, lr, beta1_power, beta2_power = prepared
        lr = self.per_parameter(lr, optimizer.is_group_lr, index)
        param = optimizer._parameters[index]
        tail = (
            beta1_power,
            beta2_power,
            lr,
            optimizer.beta1,
            optimizer.beta2,
            optimizer.eps,
            gradients[index],
        )
        if optimizer.use_amsgrad:
            return optimizer.opt(
                param, states["exp_avg"], states["exp_avg_sq"], states["max_exp_avg_sq"], *tail
            )
        return optimizer.opt(param, states["exp_avg"], states["exp_avg_sq"], *tail)

    def update_batch(
        self, optimizer: Any, prepared: Any, work: Sequence[Work], graphs: GraphCache
    ) -> list[Any]:
        from swapopt_core._mindspore.graphs import AdamBatch, Columns

        gradients, lr, beta1_power, beta2_power = prepared
        indices = [index for index, _ in work]
        columns = Columns()
        columns.add([gradients[i] for i in indices])
        columns.add([optimizer._parameters[i] for i in indices])
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if optimizer.use_amsgrad else [])
        for key in keys:
            columns.add([states[key] for _, states in work])
        if optimizer.is_group_lr:
            columns.add([lr[i] for i in indices])
        else:
            columns.add([lr])
        columns.add([beta1_power])
        columns.add([beta2_power])
        graph = graphs.get(columns.key, lambda: AdamBatch(optimizer, columns))
        return list(columns.call(graph))


class _DecoupledDecay(MindSporeAdapter):
    """Families whose preamble is weight decay, learning rate and the global step."""

    state_key_names = ("exp_avg", "exp_avg_sq")

    def prepare(self, optimizer: Any, gradients: tuple[Any, ...]) -> Any:
        require_dense(gradients, self.family)
        weight_decay = optimizer.get_weight_decay()
        lr = optimizer.get_lr()
        advance_counters(optimizer, powers=False)
        return gradients, lr, weight_decay

    def hyper(self, optimizer: Any, prepared: Any, index: int) -> tuple[Any, Any, Any]:
        """Gradient, learning rate and weight decay of parameter ``index``."""
        gradients, lr, weight_decay = prepared
        return (
            gradients[index],
            self.per_parameter(lr, optimizer.is_group_lr, index),
            self.per_parameter(weight_decay, optimizer.is_group, index),
        )


class NnAdamWeightDecayAdapter(_DecoupledDecay):
    """``mindspore.nn.AdamWeightDecay`` (fused or not) and its subclasses (AdamW aliases)."""

    family = "mindspore.nn.AdamWeightDecay"
    classes = ("mindspore.nn.optim.adam.AdamWeightDecay",)

    def state(self, optimizer: Any) -> dict[str, Sequence[Any]]:
        return {"exp_avg": optimizer.moments1, "exp_avg_sq": optimizer.moments2}

    def update_batch(
        self, optimizer: Any, prepared: Any, work: Sequence[Work], graphs: GraphCache
    ) -> list[Any]:
        from swapopt_core._mindspore.graphs import AdamWeightDecayBatch, Columns

        gradients, lr, weight_decay = prepared
        indices = [index for index, _ in work]
        columns = Columns()
        columns.add([optimizer._parameters[i] for i in indices])
        columns.add([states["exp_avg"] for _, states in work])
        columns.add([states["exp_avg_sq"] for _, states in work])
        columns.add([gradients[i] for i in indices])
        columns.add([bool(optimizer.decay_flags[i]) for i in indices])
        columns.add([bool(optimizer.optim_filter[i]) for i in indices])
        columns.add([lr[i] for i in indices] if optimizer.is_group_lr else [lr])
        columns.add([weight_decay[i] for i in indices] if optimizer.is_group else [weight_decay])
        graph = graphs.get(columns.key, lambda: AdamWeightDecayBatch(optimizer, columns))
        return list(columns.call(graph))

    def update(self, optimizer: Any, prepared: Any, index: int, states: Mapping[str, Any]) -> Any:
        from mindspore.nn.optim.adam import _adam_opt
        from mindspore.ops import functional as F
        from mindspore.ops import operations as P

        grad, lr, weight_decay = self.hyper(optimizer, prepared, index)
        param, decay = optimizer._parameters[index], optimizer.decay_flags[index]
        m, v = states["exp_avg"], states["exp_avg_sq"]
        if optimizer.use_fused_opt:
            optimizer.fused_opt(
                param,
                m,
                v,
                lr,
                optimizer.beta1,
                optimizer.beta2,
                optimizer.eps,
                weight_decay if decay else 0.0,
                P.Cast()(grad, F.dtype(param)),
            )
            return True
        return _adam_opt(
            optimizer.beta1,
            optimizer.beta2,
            optimizer.eps,
            lr,
            weight_decay,
            param,
            m,
            v,
            grad,
            decay,
            optimizer.optim_filter[index],
        )


class MindFormersAdamWAdapter(_DecoupledDecay):
    """MindFormers' AdamW (``mindformers.core.optim.adamw.AdamW``, mindformers 1.9).

    Optimizers of this family that keep fp32 master weights in ``fp32_params`` (the
    layout of MindFormers' later mixed-precision AdamW) run the update on the master and
    cast it into the model parameter; ``include_master_params`` swaps those masters too.
    """

    family = "mindformers AdamW"
    classes = ("mindformers.core.optim.adamw.AdamW",)

    def validate(self, optimizer: Any) -> None:
        super().validate(optimizer)
        if getattr(optimizer, "swap", False):
            raise UnsupportedOptimizerError(
                "This MindFormers AdamW was built with swap=True, so MindFormers already keeps "
                "its state on the CPU (graph mode). Use one of the two: drop `swap: True` from "
                "the optimizer config to use swapopt, or leave it unswapped."
            )

    def state(self, optimizer: Any) -> dict[str, Sequence[Any]]:
        return {"exp_avg": optimizer.exp_avg, "exp_avg_sq": optimizer.exp_avg_sq}

    def masters(self, optimizer: Any) -> Sequence[Any] | None:
        masters = getattr(optimizer, "fp32_params", None)
        if masters is None:
            return None
        params = optimizer._parameters
        if all(m is p for m, p in zip(masters, params, strict=True)):
            return None
        return cast("Sequence[Any]", masters)

    def update(self, optimizer: Any, prepared: Any, index: int, states: Mapping[str, Any]) -> Any:
        from mindformers.core.optim.adamw import _adamw_opt
        from mindspore.ops import functional as F

        grad, lr, weight_decay = self.hyper(optimizer, prepared, index)
        param = optimizer._parameters[index]
        target = states.get("master_param", param)
        result = _adamw_opt(
            optimizer.beta1,
            optimizer.beta2,
            optimizer.eps,
            optimizer.global_step,
            lr,
            weight_decay,
            target,
            grad,
            states["exp_avg"],
            states["exp_avg_sq"],
            optimizer.optim_filter[index],
        )
        if target is not param:
            F.assign(param, F.cast(target, F.dtype(param)))
        return result
