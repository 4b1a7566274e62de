"""``swapopt run [--] SCRIPT [ARGS...]`` and ``swapopt run -m MODULE [ARGS...]``.

Switches on every installed integration (through the ``swapopt_install_integrations`` hook,
so this module imports no training framework), then runs the script as ``__main__`` the way
``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would: same ``sys.argv``, an absolute
``__file__``, the script's directory (or, with ``-m``, the working directory) first on
``sys.path``, Python's one-line error for a module ``-m`` cannot run, the same exit code, and
an uncaught exception (``KeyboardInterrupt`` included) printed through ``sys.excepthook`` with
the script's frames only. An uncaught ``KeyboardInterrupt`` ends the process by ``SIGINT``
after the normal shutdown, as Python does.

On stderr, so the script's stdout stays its own: a line before the script on what the
settings ask for, and after it the summary of what was swapped and offloaded
(``run_summary``, from the process-wide record ``swapopt_core._record``) and of a device
budget that was not applied, on the first process of each machine only. A budget the step
cannot fit in stops the script with the planner's error, which then names
``SWAPOPT_DEVICE_BUDGET_MB`` when that variable set it.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import pkgutil
import runpy
import sys
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.machinery import SourceFileLoader, SourcelessFileLoader
from types import TracebackType
from typing import TYPE_CHECKING

from swapopt_core._cli.run_summary import integrations_line, summary_lines
from swapopt_core._launch import (
    BUDGET_ENV,
    RUN_ENV,
    budget_not_applied,
    nothing_to_swap_count,
    offload_session_count,
    swap_flag,
    swapped_count,
)
from swapopt_core._record import session_entries, swap_entries

if TYPE_CHECKING:
    from swapopt_core.options import Settings

logger = logging.getLogger(__name__)

__all__ = ["RunTarget", "UsageError", "install_integrations", "parse_target", "run"]

USAGE = "swapopt run [-h] [--] SCRIPT [ARGS ...] | swapopt run -m MODULE [ARGS ...]"
_BUDGET_ENV = "SWAPOPT_ACTIVATION_BUDGET_MB"
#: What ``sys.excepthook`` holds.
_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


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
    return _install()[1]


def _install() -> tuple[Settings, list[str]]:
    """``install_integrations``, with the settings read (what the run asks for)."""
    from swapopt_core._automatic import strict_mode
    from swapopt_core._plugins import get_plugin_manager
    from swapopt_core.options import read_settings

    # Checked here too, so a bad value (or both budgets) stops the run with no framework.
    settings = read_settings({}, owner="swapopt run")
    strict_mode()
    os.environ[RUN_ENV] = "1"
    names = get_plugin_manager().hook.swapopt_install_integrations()
    return settings, sorted({name for name in names if name})


def _main_rank() -> bool:
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK"))


def _local_main() -> bool:
    """Whether this is the first process on its machine (``LOCAL_RANK`` 0 or unset)."""
    return os.environ.get("LOCAL_RANK", "0").strip() in ("", "0")


def _budget_not_applied(sessions: int, *, succeeded: bool) -> list[str]:
    """Why ``SWAPOPT_DEVICE_BUDGET_MB`` was not applied here: what the ways in noted, else,
    after a script that ran to its end with no ``OffloadSession`` at all, that no step ran
    under it."""
    noted = budget_not_applied()
    budget = os.environ.get(BUDGET_ENV, "").strip()
    if noted or not succeeded or sessions or swap_flag({BUDGET_ENV: budget}) is None:
        return noted
    return [
        f"{BUDGET_ENV}={budget}: no step ran in a whole-step OffloadSession in this process "
        "(swapopt run applies it to a Lightning or transformers Trainer and to the loop over "
        "what a plain Accelerator's prepare() returned; elsewhere use OffloadSession(config, "
        "optimizer=opt) or accelerator.offload_session())"
    ]


def _print_summary(*, succeeded: bool = True) -> None:
    """Sum up what was swapped and offloaded in this process, on stderr (the script's
    stdout stays its own); only the first process on each machine prints."""
    if not _local_main():
        return
    try:
        sessions = session_entries()
        not_applied = _budget_not_applied(len(sessions), succeeded=succeeded)
        lines = summary_lines(swap_entries(), sessions, not_applied)
    except Exception as error:  # noqa: BLE001 - the script's result must not change for it
        logger.warning("swapopt run: no summary of this run (%s: %s)", type(error).__name__, error)
        return
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)


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

    With ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu`` or ``SWAPOPT_DEVICE_BUDGET_MB``: no
    optimizer was swapped. With only an activation budget: no optimizer was swapped and no
    ``OffloadSession`` was created. Quiet when an integration already said that it had no
    optimizer to swap (a Lightning module whose ``configure_optimizers`` returns None, an
    optimizer swapopt cannot serve).
    """
    environ = os.environ
    if not _main_rank() or swapped_count() or nothing_to_swap_count():
        return
    if (flag := swap_flag(environ)) is not None:
        asked, what = flag, "no optimizer was swapped"
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


class _NotRunnable(Exception):
    """``-m`` names a module Python cannot run; the message is the one Python prints."""


def _module_problem(name: str) -> str | None:
    """Why ``python -m name`` would refuse to start, in Python's words, or None.

    Asks runpy's own lookup, the one ``python -m`` runs before any code of the module, so
    the message (a missing module, a package without ``__main__``, a ``.py`` suffix) and
    the cases are Python's. An error raised while importing a parent package propagates.
    """
    lookup = getattr(runpy, "_get_module_details", None)
    if lookup is None:  # pragma: no cover - a Python without it: run_module reports instead
        return None
    try:
        lookup(name, _NotRunnable)
    except _NotRunnable as problem:
        return str(problem)
    return None


def _run_file(path: str) -> None:
    """Run the file ``path`` as ``__main__`` the way ``python path`` does.

    ``__file__`` and the code's file name are absolute (tracebacks show that path) while
    ``sys.argv[0]`` stays as the user wrote it; a compiled ``.pyc`` runs too. The module
    stands in for ``__main__`` while the script runs, as ``runpy.run_path`` does.
    """
    absolute = os.path.abspath(path)
    with io.open_code(absolute) as file:
        code = pkgutil.read_code(file)
    loader: SourceFileLoader | SourcelessFileLoader
    if code is None:
        with io.open_code(absolute) as file:
            code = compile(file.read(), absolute, "exec", dont_inherit=True)
        loader = SourceFileLoader("__main__", absolute)
    else:
        loader = SourcelessFileLoader("__main__", absolute)
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=absolute,
        __cached__=None,
        __loader__=loader,
        __spec__=None,
        __package__=None,
        __builtins__=builtins,
    )
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous


def _print_uncaught(exc: BaseException) -> None:
    """Print ``exc`` as Python prints an uncaught exception: the script's frames, through
    ``sys.excepthook`` (the plain traceback if that hook itself fails)."""
    # The default hook prints the exception's own traceback: trim that one.
    exc.with_traceback(_script_frames(exc.__traceback__))
    try:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    except Exception:  # a broken excepthook: fall back to the plain traceback
        traceback.print_exception(type(exc), exc, exc.__traceback__)


def _printed_already(hook: _ExceptHook) -> None:
    """Make the next ``sys.excepthook`` call print nothing, then put ``hook`` back.

    A ``KeyboardInterrupt`` is printed here with the script's frames and then re-raised,
    so that Python itself ends the process by ``SIGINT`` after its normal shutdown; the
    frames of the launcher it passes on the way out must not be printed again.
    """

    def printed(*args: object) -> None:
        sys.excepthook = hook

    sys.excepthook = printed


def run(target: RunTarget) -> int:
    """Switch the integrations on and run ``target`` as ``__main__``.

    Returns:
        The exit status ``python SCRIPT`` would have: 0, the ``sys.exit`` code, or 1 after an
        uncaught exception (printed through ``sys.excepthook``) or for a module ``-m``
        cannot run (Python's one-line message). 2 when a ``SWAPOPT_*`` variable is invalid
        or the script does not exist; the script does not start then.

    Raises:
        KeyboardInterrupt: Uncaught by the script; printed here already, it propagates so
            that the interpreter exits by ``SIGINT`` as ``python SCRIPT`` does.
    """
    if not target.is_module and not os.path.exists(target.target):
        print(f"swapopt run: error: no such script: {target.target!r}", file=sys.stderr)
        return 2  # what `python missing.py` returns
    try:
        settings, names = _install()
    except ValueError as error:
        print(f"swapopt run: error: {error}", file=sys.stderr)
        return 2
    if _main_rank():
        print(integrations_line(settings, names), file=sys.stderr)
    logger.info("swapopt run: %s %s with integrations %s", target.target, target.args, names)
    sys.argv = [target.target, *target.args]
    # A file runs as a script; a directory or zip file (a sys.path entry) by its __main__.py.
    is_file = not target.is_module and pkgutil.get_importer(target.target) is None
    if target.is_module:
        sys.path[0:1] = [os.getcwd()]  # python -m puts the working directory first
    elif is_file:
        sys.path[0:1] = [os.path.dirname(os.path.abspath(target.target))]
    else:
        del sys.path[0]  # run_path puts the directory or zip file itself first
    try:
        if target.is_module:
            problem = _module_problem(target.target)
            if problem is not None:
                print(f"{sys.executable}: {problem}", file=sys.stderr)
                return 1  # what `python -m missing` prints and returns
            runpy.run_module(target.target, run_name="__main__", alter_sys=True)
        elif is_file:
            _run_file(target.target)
        else:  # __file__ and sys.path[0] absolute as Python makes them (sys.argv[0] too)
            runpy.run_path(os.path.abspath(target.target), run_name="__main__")
    except SystemExit as exc:
        _end(succeeded=exc.code in (None, 0))
        return _exit_status(exc.code)
    except KeyboardInterrupt as exc:
        _print_uncaught(exc)
        _printed_already(sys.excepthook)
        raise
    except BaseException as exc:  # noqa: BLE001 - printed like Python prints it
        _name_budget_variable(exc)
        _end(succeeded=False)
        _print_uncaught(exc)
        return 1
    _end(succeeded=True)
    return 0


def _end(*, succeeded: bool) -> None:
    """After the script: the summary, and on success the nothing-swapped warning.

    A failed script gets its summary too (what was swapped until then), printed before
    the error Python prints for it, so that the error stays last on the screen.
    """
    sys.stdout.flush()
    _print_summary(succeeded=succeeded)
    if succeeded:
        _warn_if_nothing_swapped()


def _name_budget_variable(exc: BaseException) -> None:
    """A budget the planner found too small (``BudgetTooSmall``, raised by the step after
    the first one was measured) names ``SWAPOPT_DEVICE_BUDGET_MB`` when that variable is set."""
    from swapopt_core._budget import name_budget_variable
    from swapopt_core._planning.step_types import BudgetTooSmall

    if isinstance(exc, BudgetTooSmall):
        name_budget_variable(exc)
