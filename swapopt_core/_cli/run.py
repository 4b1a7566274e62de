"""``swapopt run [--] SCRIPT [ARGS...]`` and ``swapopt run -m MODULE [ARGS...]``.

Switches on every installed integration (through the ``swapopt_install_integrations`` hook,
so this module imports no training framework), then runs the script as ``__main__`` the way
``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would: same ``sys.argv``, the script's
directory (or, with ``-m``, the working directory) first on ``sys.path``, the same exit code,
and an uncaught exception printed through ``sys.excepthook`` with exit code 1.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from swapopt_core._launch import (
    DEVICE_ENV,
    RUN_ENV,
    offload_requested,
    offload_session_count,
    swapped_count,
)

logger = logging.getLogger(__name__)

__all__ = ["RunTarget", "UsageError", "install_integrations", "parse_target", "run"]

USAGE = "swapopt run [-h] [--] SCRIPT [ARGS ...] | swapopt run -m MODULE [ARGS ...]"
_BUDGET_ENV = "SWAPOPT_ACTIVATION_BUDGET_MB"


class UsageError(ValueError):
    """The words after ``swapopt run`` name no script or module."""


@dataclass(frozen=True)
class RunTarget:
    """What to run.

    Attributes:
        target: The script's path, or the module's dotted name.
        is_module: ``-m MODULE`` rather than a script.
        args: The arguments after it (``sys.argv[1:]`` of the script).
    """

    target: str
    is_module: bool
    args: tuple[str, ...]


def parse_target(words: Sequence[str]) -> RunTarget:
    """Read ``[--] SCRIPT ARGS...`` or ``-m MODULE ARGS...``; everything after the script or
    module belongs to it, options included.

    Raises:
        UsageError: No script or module is given, or an option other than ``-m`` comes first.
    """
    words = list(words)
    if not words:
        raise UsageError("name the script to run: swapopt run train.py [ARGS ...]")
    first = words[0]
    if first == "-m" or (first.startswith("-m") and not first.startswith("--")):
        module = first[2:] or (words[1] if len(words) > 1 else "")
        rest = words[1:] if first[2:] else words[2:]
        if not module:
            raise UsageError("-m needs a module name: swapopt run -m package.train [ARGS ...]")
        return RunTarget(module, True, tuple(rest))
    if first == "--":
        if len(words) < 2:
            raise UsageError("name the script after --: swapopt run -- train.py [ARGS ...]")
        return RunTarget(words[1], False, tuple(words[2:]))
    if first.startswith("-"):
        raise UsageError(
            f"unknown option {first!r}; swapopt run takes only -m MODULE. Options of the "
            "script go after it; write `swapopt run -- SCRIPT` for a script named like an option."
        )
    return RunTarget(first, False, tuple(words[1:]))


def install_integrations() -> list[str]:
    """Set ``SWAPOPT_RUN=1`` and switch on every integration the registered plugins offer.

    Returns:
        The names of the integrations switched on, sorted.

    Raises:
        ValueError: A ``SWAPOPT_*`` variable is invalid (an integration's message names it).
    """
    from swapopt_core._plugins import get_plugin_manager

    os.environ[RUN_ENV] = "1"
    names = get_plugin_manager().hook.swapopt_install_integrations()
    return sorted({name for name in names if name})


def _main_rank() -> bool:
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK"))


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the first frame outside this module and ``runpy`` (like Python's)."""
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    return tb


def _exit_status(code: object) -> int:
    """The process status Python gives ``sys.exit(code)``; a message is printed, status 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _warn_if_nothing_swapped() -> None:
    """Say once, at exit, that the flags were set but nothing was swapped here.

    With ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu``: no optimizer was swapped. With only an
    activation budget: no optimizer was swapped and no ``OffloadSession`` was created.
    """
    environ = os.environ
    if not _main_rank() or swapped_count():
        return
    if offload_requested(environ):
        asked, what = f"{DEVICE_ENV}={environ[DEVICE_ENV]}", "no optimizer was swapped"
    elif environ.get(_BUDGET_ENV, "").strip() and not offload_session_count():
        asked = f"{_BUDGET_ENV}={environ[_BUDGET_ENV]}"
        what = "no optimizer was swapped and no activations were offloaded"
    else:
        return
    # logging, not warnings: a filter the script installed must not turn this into an error;
    # without any handler configured, logging's last resort prints it to stderr.
    logger.warning(
        "swapopt run: %s was set, but %s in this process. The script probably builds its "
        "optimizer outside a supported framework (an Accelerator's prepare(), a "
        "transformers.Trainer, a Lightning Trainer); call swapopt_core.swap_optimizer("
        "optimizer) on it yourself, or check that the parameters are on an accelerator (on "
        "the CPU set SWAPOPT_RUNTIME=loopback).",
        asked,
        what,
    )


def run(target: RunTarget) -> int:
    """Switch the integrations on and run ``target`` as ``__main__``.

    Returns:
        The exit status ``python SCRIPT`` would have: 0, the ``sys.exit`` code, or 1 after an
        uncaught exception (printed through ``sys.excepthook``). 2 when a ``SWAPOPT_*``
        variable is invalid or the script does not exist; the script does not start then.
    """
    if not target.is_module and not os.path.exists(target.target):
        print(f"swapopt run: error: no such script: {target.target!r}", file=sys.stderr)
        return 2  # what `python missing.py` returns
    try:
        names = install_integrations()
    except ValueError as error:
        print(f"swapopt run: error: {error}", file=sys.stderr)
        return 2
    if _main_rank():
        on = ", ".join(names) if names else "none (no SWAPOPT_* flag set, or no framework)"
        print(f"swapopt run: integrations on: {on}", file=sys.stderr)
    logger.info("swapopt run: %s %s with integrations %s", target.target, target.args, names)
    sys.argv = [target.target, *target.args]
    if target.is_module:
        sys.path[0:1] = [os.getcwd()]  # python -m puts the working directory first
    else:
        sys.path[0:1] = [os.path.dirname(os.path.abspath(target.target))]
    try:
        if target.is_module:
            if importlib.util.find_spec(target.target) is None:
                print(f"swapopt run: error: no module named {target.target!r}", file=sys.stderr)
                return 1  # what `python -m missing` returns
            runpy.run_module(target.target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target.target, run_name="__main__")
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except KeyboardInterrupt:
        raise  # Python's own handling: the traceback and the SIGINT status
    except BaseException as exc:  # noqa: BLE001 - printed like Python prints it
        # The default hook prints the exception's own traceback: trim that one.
        exc.with_traceback(_script_frames(exc.__traceback__))
        try:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        except Exception:  # a broken excepthook: fall back to the plain traceback
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        status = 1
    sys.stdout.flush()
    if status == 0:
        _warn_if_nothing_swapped()
    return status
