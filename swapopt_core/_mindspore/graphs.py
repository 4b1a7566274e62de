"""A batch's update compiled into one graph, as the plain optimizer's ``construct`` is.

``nn.Adam`` and ``nn.AdamWeightDecay`` compile their whole ``construct`` with ``@jit``; the
swapped step cannot, because it updates the parameters batch by batch between copies. Called
one parameter at a time in PyNative, the same update primitives cost more than inside the
plain graph (MindSpore 2.9 on CPU: about 2 ms of dispatch per ``Adam`` call, and slower
kernels). So each batch gets a small Cell whose jit-compiled ``construct`` maps the very
function the plain ``construct`` maps (``_adam_opt`` with ``Adam`` or
``ApplyAdamWithAmsgradV2``, ``_fused_adam_weight_decay`` with ``AdamWeightDecay``, or the
unfused ``_adam_opt``) over the batch's parameters: the same kernels in the same order, so
the result is the plain optimizer's, bit for bit.

A batch's inputs come in three kinds (``Columns``): the optimizer's own Parameters (the
model parameters, resident state, a static learning rate) are free variables of the graph,
as in the plain ``construct``; tensors that change from step to step (gradients, device
views of swapped state, learning rates of a schedule, bias-correction powers) are its
arguments, one ``mutable`` tuple so that a new step does not recompile; Python numbers and
flags (a static weight decay, ``decay_flags``, ``optim_filter``) are constants. Parameters
are never passed as arguments: MindSpore 2.9 copies them (and fails on tuples of them).

This module imports MindSpore; the families import it only when they update a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn
from mindspore.nn.optim.adam import _adam_opt, _fused_adam_weight_decay
from mindspore.ops import composite as C
from mindspore.ops import functional as F

__all__ = ["AdamBatch", "AdamWeightDecayBatch", "Columns", "Preamble", "save"]

_ARG, _OWNED, _CONST = 0, 1, 2


class Columns:
    """The inputs of one batch's graph, sorted into arguments, free Parameters, constants.

    Each column is one input of the mapped function: a value per parameter of the batch
    (or a single value). ``key`` names the graph these inputs need: the same key means
    the same free Parameters and constants, so a graph built for it can be called again.
    """

    def __init__(self) -> None:
        self.args: list[Any] = []
        self.owned: list[Any] = []
        self.columns: list[tuple[tuple[int, Any], ...]] = []
        self._owned_at: dict[int, int] = {}

    def add(self, values: Sequence[Any]) -> None:
        """Append a column holding ``values``."""
        entries = []
        for value in values:
            if isinstance(value, Parameter):
                at = self._owned_at.get(id(value))
                if at is None:
                    at = self._owned_at[id(value)] = len(self.owned)
                    self.owned.append(value)
                entries.append((_OWNED, at))
            elif isinstance(value, Tensor):
                entries.append((_ARG, len(self.args)))
                self.args.append(value)
            else:
                entries.append((_CONST, value))
        self.columns.append(tuple(entries))

    @property
    def key(self) -> tuple[Any, ...]:
        """What the graph depends on: the layout, the constants and the free Parameters.

        A compiled graph keeps using the memory its free Parameters had when it was built:
        after ``set_data`` (``load_param_into_net``, for one) it would update the old memory.
        The data pointers are part of the key, so a replaced Parameter gets a new graph.
        """
        return (tuple(self.columns), tuple((id(p), p.data_ptr()) for p in self.owned))

    def call(self, graph: nn.Cell) -> Any:
        """Run ``graph`` (built from these columns, or from equal ones) on the arguments."""
        return graph(ms.mutable(tuple(self.args)))


#: Dtypes whose ``asnumpy`` is a view of the tensor's own memory (no conversion).
_NUMPY_NATIVE = frozenset({"Float16", "Float32", "Float64"})


def save(sources: Sequence[Any], copies: Sequence[Any]) -> None:
    """Copy each of ``sources`` into the same position of ``copies`` (the undo copy).

    Where every tensor is in CPU memory (the loopback runtimes), a memcpy through numpy
    views: MindSpore's CPU ``Assign`` copies at a few GB/s, a memcpy several times faster,
    and no launch is handed to PyNative's worker thread. Elsewhere one compiled launch per
    batch (``_save_graph``).
    """
    if all(_plain_cpu(t) for t in (*sources, *copies)):
        import numpy

        from swapopt_core._mindspore.runtime import drain_compute

        # Updates queued before may still write the sources (or read the copies).
        drain_compute()
        for source, copy in zip(sources, copies, strict=True):
            numpy.copyto(copy.asnumpy(), source.asnumpy())
        return
    _save_graph(ms.mutable(tuple(sources)), ms.mutable(tuple(copies)))


def _plain_cpu(tensor: Any) -> bool:
    """Whether ``tensor`` lives in CPU memory that ``asnumpy`` views without conversion."""
    return str(tensor.dtype) in _NUMPY_NATIVE and str(tensor.device).upper().startswith("CPU")


@ms.jit
def _save_graph(sources: Any, copies: Any) -> Any:
    """``save`` as one compiled launch per batch instead of one ``assign`` each: PyNative
    queues every op to a worker thread, and on a busy host each hand-over costs
    milliseconds. The sources are only read, so Parameters may be arguments here, and
    batches with the same shapes share the compiled graph."""
    done = ()
    for k in range(len(sources)):
        done = done + (F.assign(copies[k], sources[k]),)
    return done


class Preamble(nn.Cell):
    """The once-per-step counters of ``construct`` in one graph.

    Advances ``global_step`` and, for ``nn.Adam``, the bias-correction powers
    (``beta1_power * beta1``, ``beta2_power * beta2``), which it returns. One launch
    instead of five queued PyNative ops. Build a new one when a counter's data was
    replaced (see ``Columns.key``).
    """

    def __init__(self, optimizer: Any, powers: bool) -> None:
        super().__init__(auto_prefix=False)
        counters = [optimizer.global_step]
        if powers:
            counters += [optimizer.beta1_power, optimizer.beta2_power]
            self.beta1 = optimizer.beta1
            self.beta2 = optimizer.beta2
        self.counters = ParameterTuple(counters)
        self.increase = optimizer.global_step_increase_tensor
        self.powers = powers

    @ms.jit
    def construct(self) -> Any:
        stepped = F.assign_add(self.counters[0], self.increase)
        if self.powers:
            beta1_power = self.counters[1] * self.beta1
            F.assign(self.counters[1], beta1_power)
            beta2_power = self.counters[2] * self.beta2
            F.assign(self.counters[2], beta2_power)
            return beta1_power, beta2_power
        return stepped


class _Batch(nn.Cell):
    """Holds a batch's free Parameters and column layout; ``column`` reads one back."""

    def __init__(self, columns: Columns) -> None:
        # auto_prefix=False: the Parameters are the optimizer's and keep their names.
        super().__init__(auto_prefix=False)
        self.layout = tuple(columns.columns)
        self.owned = ParameterTuple(columns.owned)

    def column(self, index: int, args: Any) -> Any:
        out = ()
        for kind, payload in self.layout[index]:
            if kind == 0:
                out = out + (args[payload],)
            elif kind == 1:
                out = out + (self.owned[payload],)
            else:
                out = out + (payload,)
        return out


class AdamBatch(_Batch):
    """``nn.Adam``'s map over one batch (dense gradients, with or without amsgrad).

    Columns: gradients, parameters, ``moment1``, ``moment2``, [``vhat``,] learning rate
    (one per parameter with group learning rates, else one), ``beta1_power``,
    ``beta2_power``.
    """

    def __init__(self, optimizer: Any, columns: Columns) -> None:
        super().__init__(columns)
        self.opt = optimizer.opt
        self.sparse_opt = optimizer.sparse_opt
        self.use_locking = optimizer.use_locking
        self.use_nesterov = optimizer.use_nesterov
        self.is_device = optimizer._is_device
        self.beta1 = optimizer.beta1
        self.beta2 = optimizer.beta2
        self.eps = optimizer.eps
        self.amsgrad = optimizer.use_amsgrad
        self.group_lr = optimizer.is_group_lr
        self.map_ = C.Map()

    @ms.jit
    def construct(self, args: Any) -> Any:
        grads = self.column(0, args)
        params = self.column(1, args)
        moment1 = self.column(2, args)
        moment2 = self.column(3, args)
        tail = 4
        if self.amsgrad:
            tail = 5
        lr = self.column(tail, args)
        beta1_power = self.column(tail + 1, args)[0]
        beta2_power = self.column(tail + 2, args)[0]
        if self.group_lr:
            fn = F.partial(
                _adam_opt, self.opt, self.sparse_opt, self.use_locking, self.use_nesterov,
                self.is_device, beta1_power, beta2_power, self.beta1, self.beta2, self.eps,
            )  # fmt: skip
            if self.amsgrad:
                return self.map_(fn, lr, grads, params, moment1, moment2, self.column(4, args))
            return self.map_(fn, lr, grads, params, moment1, moment2)
        fn = F.partial(
            _adam_opt, self.opt, self.sparse_opt, self.use_locking, self.use_nesterov,
            self.is_device, beta1_power, beta2_power, self.beta1, self.beta2, self.eps, lr[0],
        )  # fmt: skip
        if self.amsgrad:
            return self.map_(fn, grads, params, moment1, moment2, self.column(4, args))
        return self.map_(fn, grads, params, moment1, moment2)


class AdamWeightDecayBatch(_Batch):
    """``nn.AdamWeightDecay``'s hyper-map over one batch, fused or not.

    Columns: parameters, ``moments1``, ``moments2``, gradients, ``decay_flags``,
    ``optim_filter``, learning rate, weight decay (each one per parameter when the
    optimizer maps it, else one).
    """

    def __init__(self, optimizer: Any, columns: Columns) -> None:
        super().__init__(columns)
        self.fused = optimizer.use_fused_opt
        self.fused_opt = optimizer.fused_opt
        self.beta1 = optimizer.beta1
        self.beta2 = optimizer.beta2
        self.eps = optimizer.eps
        self.group = optimizer.is_group
        self.group_lr = optimizer.is_group_lr
        self.hyper_map = C.HyperMap()

    @ms.jit(backend="ms_backend")
    def construct(self, args: Any) -> Any:
        params = self.column(0, args)
        moments1 = self.column(1, args)
        moments2 = self.column(2, args)
        grads = self.column(3, args)
        decay_flags = self.column(4, args)
        optim_filter = self.column(5, args)
        lr = self.column(6, args)
        weight_decay = self.column(7, args)
        if self.fused:
            if self.group:
                if self.group_lr:
                    fn = F.partial(
                        _fused_adam_weight_decay, self.fused_opt, self.beta1, self.beta2,
                        self.eps,
                    )  # fmt: skip
                    return self.hyper_map(
                        fn, lr, weight_decay, params, moments1, moments2, grads, decay_flags,
                        optim_filter,
                    )  # fmt: skip
                fn = F.partial(
                    _fused_adam_weight_decay, self.fused_opt, self.beta1, self.beta2, self.eps,
                    lr[0],
                )  # fmt: skip
                return self.hyper_map(
                    fn, weight_decay, params, moments1, moments2, grads, decay_flags,
                    optim_filter,
                )  # fmt: skip
            fn = F.partial(
                _fused_adam_weight_decay, self.fused_opt, self.beta1, self.beta2, self.eps,
                lr[0], weight_decay[0],
            )  # fmt: skip
            return self.hyper_map(
                fn, params, moments1, moments2, grads, decay_flags, optim_filter
            )  # fmt: skip
        if self.group:
            if self.group_lr:
                fn = F.partial(_adam_opt, self.beta1, self.beta2, self.eps)
                return self.hyper_map(
                    fn, lr, weight_decay, params, moments1, moments2, grads, decay_flags,
                    optim_filter,
                )  # fmt: skip
            fn = F.partial(_adam_opt, self.beta1, self.beta2, self.eps, lr[0])
            return self.hyper_map(
                fn, weight_decay, params, moments1, moments2, grads, decay_flags, optim_filter
            )  # fmt: skip
        fn = F.partial(_adam_opt, self.beta1, self.beta2, self.eps, lr[0], weight_decay[0])
        return self.hyper_map(fn, params, moments1, moments2, grads, decay_flags, optim_filter)
