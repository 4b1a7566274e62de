"""The compiled batch updates of ``nn.Momentum`` and ``nn.SGD``.

Like ``AdamBatch`` (``swapopt_core._mindspore.graphs``): a small Cell whose jit-compiled
``construct`` maps the function the plain ``construct`` maps (``_momentum_opt``,
``_sgd_opt``) over one batch, with the optimizer's own primitives, compiled as the plain
``construct`` is (``Momentum`` with ``backend="ms_backend"``). The inputs come sorted
by ``Columns``.

This module imports MindSpore; the families import it only when they update a batch.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
from mindspore.nn.optim.momentum import _momentum_opt
from mindspore.nn.optim.sgd import _sgd_opt
from mindspore.ops import composite as C
from mindspore.ops import functional as F

from swapopt_core._mindspore.graphs import Columns, _Batch

__all__ = ["MomentumBatch", "SGDBatch"]


class MomentumBatch(_Batch):
    """``nn.Momentum``'s reversed hyper-map over one batch.

    Columns: gradients, parameters, ``moments``, learning rate (one per parameter with
    group learning rates, else one), the ``momentum`` Parameter.
    """

    def __init__(self, optimizer: Any, columns: Columns) -> None:
        super().__init__(columns)
        self.opt = optimizer.opt
        self.group_lr = optimizer.is_group_lr
        self.hyper_map_reverse = C.HyperMap(None, True)

    @ms.jit(backend="ms_backend")
    def construct(self, args: Any) -> Any:
        grads = self.column(0, args)
        params = self.column(1, args)
        moments = self.column(2, args)
        lr = self.column(3, args)
        momentum = self.column(4, args)[0]
        if self.group_lr:
            fn = F.partial(_momentum_opt, self.opt, momentum)
            return self.hyper_map_reverse(fn, lr, grads, params, moments)
        fn = F.partial(_momentum_opt, self.opt, momentum, lr[0])
        return self.hyper_map_reverse(fn, grads, params, moments)


class SGDBatch(_Batch):
    """``nn.SGD``'s reversed hyper-map over one batch.

    Columns: gradients, parameters, ``accum``, ``stat``, learning rate (one per parameter
    with group learning rates, else one), the ``momentum`` Parameter. ``kernels`` are the
    optimizer's ``SGD`` primitives of the batch's parameters.
    """

    def __init__(self, optimizer: Any, columns: Columns, kernels: tuple[Any, ...]) -> None:
        super().__init__(columns)
        self.kernels = kernels
        self.group_lr = optimizer.is_group_lr
        self.hyper_map_reverse = C.HyperMap(None, True)

    @ms.jit
    def construct(self, args: Any) -> Any:
        grads = self.column(0, args)
        params = self.column(1, args)
        accum = self.column(2, args)
        stat = self.column(3, args)
        lr = self.column(4, args)
        momentum = self.column(5, args)[0]
        if self.group_lr:
            fn = F.partial(_sgd_opt, momentum)
            return self.hyper_map_reverse(fn, lr, grads, params, accum, stat, self.kernels)
        fn = F.partial(_sgd_opt, momentum, lr[0])
        return self.hyper_map_reverse(fn, grads, params, accum, stat, self.kernels)
