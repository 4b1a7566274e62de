"""The torch engine around ``state_dict()`` and ``load_state_dict()``.

Swapped entries never pass through torch's loader, which would put them on the parameters'
device: a load pre-hook takes them out of the dict being loaded, and a load post-hook
copies them straight into host memory. ``state_dict()`` hands out the host tensors
themselves, once no copy is writing them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from swapopt_core._torch.engine import SwapEngine

__all__ = ["CheckpointHooks"]


class CheckpointHooks:
    """The checkpoint hooks one ``SwapEngine`` registers on its optimizer.

    They ask the engine (``quiesce``, ``before_host_rewrite``, ``swapped_keys``,
    ``swappable``, ``load_swapped``) and keep nothing of it but the loaded entries in between.
    """

    def __init__(self, engine: SwapEngine) -> None:
        self.engine = engine
        self._pending_load: dict[tuple[int, str], torch.Tensor] = {}

    # ---- registration --------------------------------------------------------------------

    def attach(self) -> list[Any]:
        """Register the hooks on the engine's optimizer; return their handles."""
        opt = self.engine.optimizer
        load_pre = opt.register_load_state_dict_pre_hook(self.before_load)
        handles = [
            load_pre,
            opt.register_state_dict_pre_hook(self.before_state_dict),
            # First, so the user's load post-hooks find the swapped entries in place.
            opt.register_load_state_dict_post_hook(self.after_load, prepend=True),
        ]
        self._keep_load_pre_hook_last(load_pre.id)
        return handles

    def _keep_load_pre_hook_last(self, hook_id: int) -> None:
        """Keep our load pre-hook after any the user adds later.

        It takes the swapped entries out of the dict torch is about to load; a user's own
        pre-hook must still see (and may edit) the whole checkpoint first.
        """
        opt = self.engine.optimizer
        register = type(opt).register_load_state_dict_pre_hook.__get__(opt)

        def register_before_swap(hook: Callable[..., Any], prepend: bool = False) -> Any:
            handle = register(hook, prepend=prepend)
            opt._optimizer_load_state_dict_pre_hooks.move_to_end(hook_id)
            return handle

        opt.register_load_state_dict_pre_hook = register_before_swap  # type: ignore[method-assign]

    def detach(self) -> None:
        """Undo what ``attach`` did besides the handles (which the engine removes)."""
        del self.engine.optimizer.register_load_state_dict_pre_hook

    # ---- the hooks -----------------------------------------------------------------------

    def before_state_dict(self, opt: torch.optim.Optimizer) -> None:
        # state_dict() hands out the host tensors: kept batches written back, no copy
        # still writing them.
        self.engine.quiesce()

    def before_load(self, opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        """Keep swapped entries away from torch's loader, which would put them on the device."""
        engine = self.engine
        # The loaded values replace the host tensors: a prefetch of the old values is
        # given back, a kept batch must not land on top of them later, and no copy may
        # still be writing them.
        engine.before_host_rewrite()
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        stripped = dict(saved_state)
        self._pending_load = {}
        if len(saved_groups) != len(opt.param_groups):
            return state_dict  # torch's loader reports the mismatch
        for saved, group in zip(saved_groups, opt.param_groups, strict=True):
            for saved_id, param in zip(saved["params"], group["params"], strict=False):
                entry = saved_state.get(saved_id)
                if not isinstance(entry, dict):
                    continue
                keys = engine.swapped_keys(saved, entry)
                moved = {k: v for k, v in entry.items() if k in keys and engine.swappable(param, v)}
                if moved:
                    stripped[saved_id] = {k: v for k, v in entry.items() if k not in moved}
                    for key, value in moved.items():
                        self._pending_load[(id(param), key)] = value
        return {**state_dict, "state": stripped}

    def after_load(self, opt: torch.optim.Optimizer) -> None:
        """Put the entries ``before_load`` kept back into host memory, as new slots."""
        pending, self._pending_load = self._pending_load, {}
        self.engine.load_swapped(pending)
