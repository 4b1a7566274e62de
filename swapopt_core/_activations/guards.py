"""Misuse an ``OffloadSession`` cannot serve, found as early as it shows: compiled code.

A session sees a step through a ``TorchDispatchMode``. ``torch.compile`` runs any function
it meets while such a mode is active eagerly, says so only in its debug log, and keeps
running that function eagerly from then on, outside the session too. Before it decides,
Dynamo asks each active mode's ``ignore_compile_internals()``; the session's mode answers
by raising ``compiled_refusal()``, so the call fails before Dynamo marks the function and
the compiled model stays compiled.

With ``torch._dynamo.config.inline_torch_dispatch_torch_compile`` off, Dynamo does not ask;
``CompileWatch`` then reads the reasons Dynamo records for skipped frames (in a
thread-local list it fills when one is there) and refuses at the function's first op.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["CompileWatch", "compiled_refusal"]

#: The words Dynamo uses when it skips a frame because a dispatch mode is active.
_SKIPPED_FOR_MODE = "dispatch mode present"


def compiled_refusal(where: str = "") -> RuntimeError:
    """The error for a ``torch.compile``d function called inside a session."""
    at = f" ({where})" if where else ""
    return RuntimeError(
        f"A torch.compile'd function{at} was called inside an OffloadSession, where "
        "torch.compile would run it eagerly and lose the compilation. Compiled code is not "
        "supported inside a session: call the compiled model outside the session, or the "
        "eager model inside it."
    )


def _dynamo_state() -> Any:
    """Dynamo's thread-local state when ``torch._dynamo`` is loaded, else ``None``."""
    module = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(module, "dynamo_tls", None)


class CompileWatch:
    """Refuses ``torch.compile``d code inside one session entry (see the module doc)."""

    def __init__(self) -> None:
        self._state: Any = None
        self._prior: Any = None
        self._seen = 0
        self.check()  # starts collecting when Dynamo is already loaded

    def check(self) -> None:
        """Raise if Dynamo skipped a compiled function because of the session's mode.

        Raises:
            RuntimeError: A ``torch.compile``d function started inside the session.
        """
        state = self._state
        if state is None:
            state = _dynamo_state()
            if state is None:
                return  # Dynamo is not loaded: nothing can have been compiled
            self._state, self._prior = state, state.skip_reasons
            state.skip_reasons, self._seen = [], 0
            return
        reasons = state.skip_reasons
        if reasons is None:  # Dynamo clears the list after a fullgraph call
            state.skip_reasons, self._seen = [], 0
            return
        if len(reasons) <= self._seen:
            return
        fresh, self._seen = reasons[self._seen :], len(reasons)
        skipped = next((r for r in fresh if _SKIPPED_FOR_MODE in r), None)
        if skipped is not None:
            raise compiled_refusal(skipped.rsplit(": ", 1)[0])

    def stop(self) -> None:
        """Hand Dynamo its list back (the entry ended)."""
        if self._state is not None:
            self._state.skip_reasons, self._state = self._prior, None
