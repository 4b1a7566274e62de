"""The generic torch path: an optimizer's own ``step``, on one batch of parameters at a time.

Every torch.optim family but LBFGS updates each parameter from its own gradient and its own
state, so running the family's ``step`` on a batch of parameters gives the same bits as
running it on all of them. ``PerParameterAdapter.update`` does exactly that: for the length of
one call, the optimizer sees a single group holding the batch's parameters, and a state whose
swapped entries are the device copies the engine brought in. Every flag (``foreach``,
``fused``, ``maximize``, ``nesterov``, Muon's ``adjust_lr_fn``, ...) keeps its meaning because
the family's own code reads it; state of any name is swapped (``StateBook`` decides by what
the entry is: a tensor of at least one dimension, floating point, ``min_numel`` or larger),
step counters and other scalars stay where the family put them.

The optimizer's own ``step()`` must still run the closure and return its loss, yet update
nothing: ``silence`` hides the groups once the closure has run, and shows them again before
the engine's step post-hook runs the batches.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import Any

import torch

from swapopt_core._errors import SwapOptError, UnsupportedOptimizerError
from swapopt_core._step.hooks import StepHooks
from swapopt_core._torch.adapter import OptimizerAdapter, StateFactory

logger = logging.getLogger(__name__)

__all__ = ["PER_PARAMETER_ATTR", "PerParameterAdapter", "refusal"]

#: A class (or instance) attribute by which a ``torch.optim.Optimizer`` subclass says whether
#: its ``step`` updates each parameter from that parameter's gradient and state only.
PER_PARAMETER_ATTR = "swapopt_per_parameter"


def _torch_families() -> tuple[type, ...]:
    """The torch.optim classes whose ``step`` is per parameter (Adam and AdamW have a
    dedicated adapter; it is asked first)."""
    optim = torch.optim
    names: tuple[str, ...] = ("SGD", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam")
    names += ("RAdam", "RMSprop", "Rprop", "SparseAdam", "Adafactor", "Muon")
    return tuple(getattr(optim, name) for name in names if hasattr(optim, name))


#: Classes outside torch known to be per parameter, by ``module.qualname`` (not imported).
_KNOWN_ELSEWHERE = ("transformers.optimization.Adafactor",)

#: Optimizers whose update cannot run one batch at a time, and why.
_CROSS_PARAMETER = {
    "torch.optim.lbfgs.LBFGS": (
        "its step re-evaluates the closure over all parameters at once (line search, one "
        "flat history of every parameter's change), so it cannot run one batch at a time"
    ),
}


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _unhooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` without the hook wrapper torch puts around each optimizer class's step."""
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def _step_owner(cls: type) -> type:
    """The class in ``cls``'s MRO that defines the ``step`` the optimizer runs.

    The first instance of a subclass that only inherits ``step`` gets torch's hook wrapper
    of the inherited step in the subclass's own namespace: that does not make it the owner.
    """
    raw = _unhooked(cls.step)  # type: ignore[attr-defined]
    return [k for k in cls.__mro__ if "step" in vars(k) and _unhooked(vars(k)["step"]) is raw][-1]


def refusal(optimizer: object) -> str | None:
    """Why ``optimizer`` cannot be swapped by running its step per batch, if it is known not
    to be (LBFGS, or a class that declares ``swapopt_per_parameter = False``)."""
    declared = getattr(optimizer, PER_PARAMETER_ATTR, None)
    if declared is False:
        return f"it declares {PER_PARAMETER_ATTR} = False (its update reads across parameters)"
    for cls in type(optimizer).__mro__:
        reason = _CROSS_PARAMETER.get(_name(cls))
        if reason is not None:
            return reason
    return None


def own_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """``optimizer``'s class ``step`` without torch's hook wrapper.

    torch wraps each optimizer class's ``step`` once, in a function that runs the step pre-
    and post-hooks (ours among them); a batch's update must not run them again.
    """
    return _unhooked(type(optimizer).step)


class _Hiding:
    """Hides an optimizer's groups from its own ``step`` between its closure and the engine.

    While hidden, ``optimizer.param_groups`` is an empty list: a step that has already run
    its closure loops over no group and returns the closure's loss.

    A subclass's ``step`` that calls ``super().step()`` runs torch's hook wrapper twice, one
    call inside the other: the inner call is recognised by the closure it is handed (ours),
    and only the outermost call's post-hooks show the groups and let the engine step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.groups: list[dict[str, Any]] | None = None
        #: Hook-wrapped ``step`` calls under way (more than one: a nested ``super().step()``).
        self.depth = 0

    @property
    def inside(self) -> bool:
        """Whether the post-hooks now running belong to a nested ``step`` call."""
        return self.depth > 0

    def hide(self) -> None:
        if self.groups is None:
            self.groups = self.optimizer.param_groups
            self.optimizer.param_groups = []

    def show(self) -> bool:
        """Put the groups back; whether they were hidden."""
        if self.groups is None:
            return False
        self.optimizer.param_groups = self.groups
        self.groups = None
        return True

    def before_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Step pre-hook: hand the step a closure that hides the groups once it returned."""
        # ``args`` starts with the optimizer itself; the closure follows, or is a keyword.
        positional = len(args) > 1
        closure = args[1] if positional else kwargs.get("closure")
        if getattr(closure, "hiding", None) is self:
            self.depth += 1  # a nested call: the outer one wrapped the closure already
            return None
        self.show()  # a step that raised after hiding left them hidden
        self.depth = 1

        def closure_then_hide() -> Any:
            loss = closure() if closure is not None else None
            self.hide()
            return loss

        # Keeps the marks other step hooks put on the closure (the budget's): a nested
        # call is handed this wrapper and must be known to them too.
        closure_then_hide.__dict__.update(getattr(closure, "__dict__", {}))
        closure_then_hide.hiding = self  # type: ignore[attr-defined]
        if positional:
            return (args[0], closure_then_hide, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_hide}

    def after_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Step post-hook, ahead of the engine's: the groups are back for the batches."""
        self.depth = max(0, self.depth - 1)
        if self.inside:
            return
        if not self.show():
            raise SwapOptError(
                f"{type(optimizer).__name__}.step() returned without calling its closure, so "
                "it may have updated its parameters itself; swapopt needs a step that calls "
                "its closure before updating. Leave this optimizer unswapped."
            )


#: The attribute under which an optimizer keeps its ``_Hiding`` while swapped.
_HIDING_ATTR = "_swapopt_hiding"


class PerParameterAdapter(OptimizerAdapter):
    """Every optimizer whose update is per parameter, through its own ``step``.

    Serves the per-parameter torch.optim families (all but LBFGS; Adam and AdamW go to their
    dedicated adapter first), transformers' ``Adafactor``, any ``torch.optim.Optimizer``
    whose class sets ``swapopt_per_parameter = True``, and the ``classes`` given here (a
    plugin registers ``PerParameterAdapter(classes=(MyOptimizer,))`` through
    ``swapopt_register_optimizer_adapters``). A subclass of a served family that overrides
    ``step`` is served only if it declares itself.

    Args:
        classes: More optimizer classes to serve (with their subclasses that keep ``step``).
    """

    family = "per-parameter torch optimizers (their own step)"
    #: The state names the torch families keep; a declared class may keep others.
    state_key_names = (
        "momentum_buffer",
        "sum",
        "square_avg",
        "acc_delta",
        "exp_avg",
        "exp_avg_sq",
        "exp_inf",
        "ax",
        "grad_avg",
        "prev",
        "step_size",
        "row_var",
        "col_var",
        "variance",
        "exp_avg_sq_row",
        "exp_avg_sq_col",
    )
    whole_tensors = True

    def __init__(self, classes: Iterable[type] = ()) -> None:
        self.classes = tuple(classes)
        for cls in self.classes:
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
                raise TypeError(
                    f"PerParameterAdapter(classes=...) takes torch.optim.Optimizer subclasses, "
                    f"got {cls!r}."
                )

    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        if not isinstance(optimizer, torch.optim.Optimizer) or refusal(optimizer) is not None:
            return False
        if getattr(optimizer, PER_PARAMETER_ATTR, None) is True:
            return True
        # Served when the step that runs is the served class's own or one it inherits:
        # a subclass that overrides ``step`` has numerics nobody vouched for.
        owner = _step_owner(type(optimizer))
        if any(isinstance(optimizer, cls) and issubclass(cls, owner) for cls in self.classes):
            return True
        return owner in _torch_families() or _name(owner) in _KNOWN_ELSEWHERE

    def validate(self, optimizer: torch.optim.Optimizer) -> None:
        name = type(optimizer).__name__
        for index, group in enumerate(optimizer.param_groups):
            if group.get("differentiable"):
                raise UnsupportedOptimizerError(
                    f"{name} param_groups[{index}] has differentiable=True, which swapopt "
                    "does not support (differentiating through the step needs the state "
                    "resident). Create the optimizer with differentiable=False to swap it."
                )

    def state_keys(self, group: MutableMapping[str, Any]) -> None:
        return None  # whatever the family keeps: StateBook decides entry by entry

    def init_state(
        self,
        group: MutableMapping[str, Any],
        param: torch.Tensor,
        state: MutableMapping[str, Any],
        make: StateFactory,
    ) -> None:
        """Nothing: the family creates its state in its own step, and the engine takes what
        it created into host memory right after the batch."""

    def silence(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Hide the groups from the optimizer's own update (see ``_Hiding``).

        Its hooks are the ``"hiding"`` part of the optimizer's ``StepHooks``: the pre-hook
        runs after the user's, the post-hook first of swapopt's, ahead of the engine's.
        """
        hiding = _Hiding(optimizer)
        leave = StepHooks.of(optimizer).join(
            "hiding", pre=hiding.before_step, post=hiding.after_step
        )
        setattr(optimizer, _HIDING_ATTR, hiding)

        def undo() -> None:
            hiding.show()
            leave()
            delattr(optimizer, _HIDING_ATTR)

        return undo

    def inside_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the step post-hooks now running belong to a nested ``step`` call (a
        subclass's ``super().step()``): the engine steps only after the outermost one."""
        hiding = getattr(optimizer, _HIDING_ATTR, None)
        return hiding is not None and hiding.inside

    def update(
        self,
        optimizer: torch.optim.Optimizer,
        group: MutableMapping[str, Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        states: Sequence[MutableMapping[str, Any]],
    ) -> None:
        """Run the family's own step with ``group`` holding ``params`` only and ``states``
        as their state; the group's other settings are read as they are."""
        groups, state, members = optimizer.param_groups, optimizer.state, group["params"]
        hooks = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
        group["params"] = list(params)
        optimizer.param_groups = [group]  # type: ignore[list-item]
        optimizer.state = defaultdict(dict, zip(params, states, strict=True))
        # A parent's hook-wrapped step reached through ``super().step()`` runs no hook
        # inside a batch: ours would hide the batch and step the engine again.
        optimizer._optimizer_step_pre_hooks = OrderedDict()
        optimizer._optimizer_step_post_hooks = OrderedDict()
        try:
            own_step(optimizer)(optimizer)
        finally:
            group["params"] = members
            optimizer.param_groups = groups
            optimizer.state = state
            (
                optimizer._optimizer_step_pre_hooks,
                optimizer._optimizer_step_post_hooks,
            ) = hooks
