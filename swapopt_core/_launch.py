"""Process-wide facts ``swapopt run`` relies on: how many optimizers were swapped here (and
whether an integration found none to swap and said so), why a device budget was not applied
where a way in could not apply it, the record of their figures and of the offload sessions'
(``_record``), and the warning for a process that sets the offload flag without ``swapopt run``.

Framework-free and cheap. Importing swapopt reads no environment: the warning comes on first
use, when the first plugin manager is built (every swap and offload session asks for one).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from swapopt_core import _record
from swapopt_core._errors import SwapOptWarning

if TYPE_CHECKING:
    from swapopt_core._activations.session_stats import OffloadStats
    from swapopt_core._swap.engine import EngineBase

__all__ = [
    "BUDGET_ENV",
    "DEVICE_ENV",
    "RUN_ENV",
    "budget_not_applied",
    "note_budget_not_applied",
    "note_nothing_to_swap",
    "note_offload_session",
    "note_swapped",
    "nothing_to_swap_count",
    "offload_session_count",
    "offload_requested",
    "swap_flag",
    "started_by_cli",
    "swapped_count",
    "warn_without_run",
]

#: Set to ``1`` by ``swapopt run`` (and inherited by the processes the script starts).
RUN_ENV = "SWAPOPT_RUN"
#: The flag that asks for optimizer state in host memory.
DEVICE_ENV = "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE"
#: The whole step's device budget: it asks for the swap too (planned under the budget).
BUDGET_ENV = "SWAPOPT_DEVICE_BUDGET_MB"

_swapped = 0
_sessions = 0
_nothing_to_swap = 0
_budget_not_applied: list[str] = []
_warned = False


def note_swapped(engine: EngineBase) -> None:
    """Count one optimizer swapped in this process and record its figures (called by
    ``swap_optimizer`` once ``engine`` is installed)."""
    global _swapped
    _swapped += 1
    _record.record_swap(engine)


def swapped_count() -> int:
    """How many optimizers ``swap_optimizer`` installed on in this process so far."""
    return _swapped


def note_nothing_to_swap() -> None:
    """Count one integration that found no optimizer to swap (or one it cannot serve, left
    unswapped) and told the user so."""
    global _nothing_to_swap
    _nothing_to_swap += 1


def nothing_to_swap_count() -> int:
    """How many times an integration said it had no optimizer to swap in this process."""
    return _nothing_to_swap


def note_budget_not_applied(why: str) -> None:
    """Note that a way in could not apply the device budget, and why (said once per reason)."""
    if why not in _budget_not_applied:
        _budget_not_applied.append(why)


def budget_not_applied() -> list[str]:
    """Why the device budget was not applied, one reason per way in that could not (in order)."""
    return list(_budget_not_applied)


def note_offload_session(session: object, snapshot: Callable[[], OffloadStats]) -> None:
    """Count one ``OffloadSession`` created in this process and record it; ``snapshot``
    computes its figures without referring to the session (``_record.record_session``)."""
    global _sessions
    _sessions += 1
    _record.record_session(session, snapshot)


def offload_session_count() -> int:
    """How many ``OffloadSession`` objects were created in this process so far."""
    return _sessions


def offload_requested(environ: Mapping[str, str]) -> bool:
    """Whether ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE`` asks for host memory (``cpu``, any case)."""
    return environ.get(DEVICE_ENV, "").strip().lower() == "cpu"


def swap_flag(environ: Mapping[str, str]) -> str | None:
    """The variable that asks for the optimizer swap, as ``NAME=value``, or None: the
    offload flag at ``cpu``, else a device budget (neither empty nor ``none``)."""
    if offload_requested(environ):
        return f"{DEVICE_ENV}={environ[DEVICE_ENV]}"
    budget = environ.get(BUDGET_ENV, "").strip()
    if budget and budget.lower() not in ("none", "null"):
        return f"{BUDGET_ENV}={environ[BUDGET_ENV]}"
    return None


def started_by_cli(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (``sys.orig_argv``) starts the ``swapopt`` command line itself.

    True for ``.../bin/swapopt ...`` and ``python [options] -m swapopt_core ...``; that process
    imports swapopt before ``swapopt run`` can set ``SWAPOPT_RUN``.
    """
    words = iter(argv[1:])
    for word in words:
        if word in ("-X", "-W"):  # an interpreter option with a value
            next(words, None)
        elif word.startswith("-m"):
            return (word[2:] or next(words, "")) == "swapopt_core"
        elif word == "-c" or word == "-":
            return False
        elif not word.startswith("-"):  # the script the interpreter runs
            return os.path.basename(word) in ("swapopt", "swapopt.exe", "swapopt-script.py")
    return False


def warn_without_run(
    environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
) -> bool:
    """Warn once when the offload flag (or a device budget) is set in a process not started
    by ``swapopt run``.

    Only the local rank 0 warns, so a launch with many processes prints it once per machine.

    Returns:
        Whether the warning was issued now.
    """
    global _warned
    environ = os.environ if environ is None else environ
    argv = getattr(sys, "orig_argv", sys.argv) if argv is None else argv
    flag = swap_flag(environ)
    if _warned or flag is None or environ.get(RUN_ENV, "").strip():
        return False
    if environ.get("LOCAL_RANK", "0") != "0" or started_by_cli(argv):
        return False
    _warned = True
    warnings.warn(
        f"{flag} is set but this process was not started through `swapopt run`, so "
        "only the optimizers the script hands to swapopt itself (SwapAccelerator, "
        "SwapOptimizerCallback, swap_optimizer, or an integration's install_globally() "
        "called by the script) are swapped; otherwise a plain Accelerator, "
        "transformers.Trainer or Lightning Trainer keeps its state on the device. Run "
        "`swapopt run train.py`, `accelerate launch --no_python swapopt run train.py` or "
        "`torchrun --no-python ... swapopt run train.py` instead (silence this with "
        f"-W 'ignore:{flag.split('=')[0]}').",
        SwapOptWarning,
        stacklevel=2,
    )
    return True
