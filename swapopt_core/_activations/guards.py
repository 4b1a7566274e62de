"""Misuse an ``OffloadSession`` cannot serve, found as early as it shows: compiled code.

A session sees a step through a ``TorchDispatchMode``. ``torch.compile`` runs any function
it meets while such a mode is active eagerly, and says so only in its debug log: the step
would be correct but silently lose its compilation. Dynamo records why it skipped a frame
in a thread-local list when one is there; ``CompileWatch`` gives it one for the length of
an entry and refuses at the first op of a function Dynamo skipped because of the mode.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["CompileWatch"]

#: The words Dynamo uses when it skips a frame because a dispatch mode is active.
_SKIPPED_FOR_MODE = "dispatch mode present"


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
            where = skipped.rsplit(": ", 1)[0]
            raise RuntimeError(
                f"A torch.compile'd function ({where}) ran inside an OffloadSession, which "
                "would run it eagerly and lose the compilation. Compiled code is not supported "
                "inside a session: call the compiled model outside the session, or use the "
                "eager model inside it."
            )

    def stop(self) -> None:
        """Hand Dynamo its list back (the entry ended)."""
        if self._state is not None:
            self._state.skip_reasons, self._state = self._prior, None
