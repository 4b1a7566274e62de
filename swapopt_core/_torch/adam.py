"""Adapter for ``torch.optim.Adam`` and ``torch.optim.AdamW``.

The update is PyTorch's own functional ``adam`` with the group's flags, called on one batch
of parameters at a time, so the result equals the unwrapped optimizer bit for bit.
"""

from __future__ import annotations

import inspect
from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _device_dtype_check_for_fused, _get_scalar_dtype

from swapopt_core._errors import UnsupportedOptimizerError
from swapopt_core._torch.adapter import OptimizerAdapter, StateFactory


class TorchAdamAdapter(OptimizerAdapter):
    """``torch.optim.Adam`` and its subclass ``torch.optim.AdamW``."""

    family = "torch.optim.Adam / torch.optim.AdamW"
    state_key_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        # A subclass that overrides step() has numerics of its own; we would skip them.
        return isinstance(optimizer, torch.optim.Adam) and inspect.unwrap(
            type(optimizer).step
        ) is inspect.unwrap(torch.optim.Adam.step)

    def validate(self, optimizer: torch.optim.Optimizer) -> None:
        name = type(optimizer).__name__
        for index, group in enumerate(optimizer.param_groups):
            for flag, fix in (
                ("differentiable", "differentiation through the step needs the state resident"),
                ("capturable", "graph capture cannot include host copies"),
            ):
                if group.get(flag):
                    raise UnsupportedOptimizerError(
                        f"{name} param_groups[{index}] has {flag}=True, which swapopt does not "
                        f"support ({fix}). Create the optimizer with {flag}=False to swap it."
                    )

    def state_keys(self, group: MutableMapping[str, Any]) -> tuple[str, ...]:
        if group.get("amsgrad"):
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")

    def init_state(
        self,
        group: MutableMapping[str, Any],
        param: torch.Tensor,
        state: MutableMapping[str, Any],
        make: StateFactory,
    ) -> None:
        # Same placement as Adam._init_group: the step counter stays on the CPU unless the
        # group is fused or capturable.
        fused = bool(group.get("fused"))
        if fused:
            _device_dtype_check_for_fused(param)
        if fused or group.get("capturable"):
            state["step"] = torch.zeros(
                (), dtype=_get_scalar_dtype(is_fused=fused), device=param.device
            )
        else:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        for key in self.state_keys(group):
            state[key] = make(key, param)

    def update(
        self,
        optimizer: torch.optim.Optimizer,
        group: MutableMapping[str, Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        states: Sequence[MutableMapping[str, Any]],
    ) -> None:
        amsgrad = bool(group["amsgrad"])
        beta1, beta2 = group["betas"]
        adam(
            list(params),
            list(grads),
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
            [s["step"] for s in states],
            amsgrad=amsgrad,
            has_complex=any(torch.is_complex(p) for p in params),
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            # GradScaler hands fused optimizers these to skip steps with inf/NaN grads.
            grad_scale=getattr(optimizer, "grad_scale", None),
            found_inf=getattr(optimizer, "found_inf", None),
            decoupled_weight_decay=group.get("decoupled_weight_decay", False),
        )
