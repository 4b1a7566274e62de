"""What ``swapopt plan`` and ``swapopt plot`` share: reading files, choosing a planner, a summary.

Every user mistake (a missing file, a file that is not a trace, a negative budget, an unknown
planner) raises :class:`CommandError` with a message naming the flag, the value and the fix; the
command line turns it into exit code 2.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import pluggy
from rich.console import Group
from rich.table import Table

from swapopt_core._options import Invalid, parse_mib
from swapopt_core._planning.bounds import floor_reason, min_feasible_budget, overhead_lower_bound
from swapopt_core._planning.interface import DEFAULT_PLANNER, ResidencyPlanner, resolve_planner
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule
from swapopt_core._planning.simulate import SimulationResult, simulate

__all__ = [
    "DEFAULT_PLANNER",
    "IMAGE_SUFFIXES",
    "CommandError",
    "atomic_write",
    "budget_bytes",
    "budget_problem",
    "choose_planner",
    "floor_problem",
    "image_target",
    "least_budget_mb",
    "mib",
    "plan_file",
    "plan_trace",
    "read_schedule",
    "read_trace",
    "simulate_checked",
    "summary",
    "writable_target",
    "write_text",
]

T = TypeVar("T")

MIB = 1 << 20
_MIB = parse_mib(allow_none=False)


class CommandError(Exception):
    """A command-line input is wrong; the message says which flag and how to fix it."""


def _read(flag: str, path: str, what: str) -> str:
    file = Path(path)
    if not file.exists():
        raise CommandError(f"{flag} {path}: no such file. Pass the path of {what}.")
    if file.is_dir():
        raise CommandError(f"{flag} {path}: is a directory. Pass the path of a JSON file.")
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CommandError(
            f"{flag} {path}: cannot be read ({error}). Check its permissions and encoding."
        ) from None


@dataclass(frozen=True)
class _JsonFile(Generic[T]):
    """A kind of JSON file a command reads: what it holds, what writes it, how it is parsed."""

    what: str
    writer: str
    parse: Callable[[str], T]

    def read(self, path: str, flag: str) -> T:
        try:
            return self.parse(_read(flag, path, f"{self.what} written by {self.writer}"))
        except ValueError as error:
            raise CommandError(
                f"{flag} {path}: not {self.what} ({error}). Pass a file written by "
                f"{self.writer}; docs/formats.md has the schema."
            ) from None


_TRACE_FILE = _JsonFile(
    "an activation trace",
    "ActivationTrace.to_json() (OffloadSession.trace)",
    ActivationTrace.from_json,
)
_SCHEDULE_FILE = _JsonFile(
    "a residency schedule",
    "`swapopt plan` or ResidencySchedule.to_json()",
    ResidencySchedule.from_json,
)


def read_trace(path: str, flag: str = "--trace") -> ActivationTrace:
    """The trace in ``path``, as written by ``ActivationTrace.to_json()``."""
    return _TRACE_FILE.read(path, flag)


def read_schedule(path: str, flag: str = "--schedule") -> ResidencySchedule:
    """The schedule in ``path``, as written by ``ResidencySchedule.to_json()``."""
    return _SCHEDULE_FILE.read(path, flag)


def simulate_checked(
    trace: ActivationTrace, schedule: ResidencySchedule | None, path: str, flag: str = "--schedule"
) -> SimulationResult:
    """``simulate``, with a schedule that cannot run on ``trace`` reported against ``flag``."""
    try:
        return simulate(trace, schedule)
    except ValueError as error:
        raise CommandError(
            f"{flag} {path}: does not fit this trace ({error}). Pass the schedule planned "
            "for this trace (swapopt plan --trace ...), or --budget-mb to plan it now."
        ) from None


def budget_bytes(megabytes: str | float, flag: str = "--budget-mb") -> int:
    """``megabytes`` MiB (a number or its text) in bytes, rounded down.

    It is read like every size option (``swapopt_core._options.parse_mib``); negative, not
    finite or not a number is refused.
    """
    try:
        value = _MIB(megabytes)
        if value is None:  # a parser that refuses "none" never returns it; kept for the types
            raise Invalid
    except Invalid:
        raise CommandError(
            f"{flag} {megabytes}: the activation budget must be a finite number of MiB >= 0 "
            f"and below {2**43}. Pass for example {flag} 512."
        ) from None
    return int(value * MIB)


def choose_planner(
    manager: pluggy.PluginManager, name: str, flag: str = "--planner"
) -> ResidencyPlanner:
    """The registered planner called ``name`` (``auto``: the default planner)."""
    from swapopt_core._plugins import residency_planners

    try:
        return resolve_planner(name, residency_planners(manager), label="planner")
    except ValueError as error:
        raise CommandError(f"{flag} {name}: {error}") from None


def plan_trace(
    trace: ActivationTrace,
    limit_bytes: int,
    planner: ResidencyPlanner,
) -> tuple[ActivationTrace, ResidencySchedule]:
    """``trace`` under the budget ``limit_bytes`` and the schedule ``planner`` makes for it."""
    limited = trace.with_limit(limit_bytes)
    return limited, planner.plan(limited)


def plan_file(
    trace_path: str,
    budget_mb: str | float,
    planner_name: str,
) -> tuple[ActivationTrace, ResidencySchedule, str]:
    """The trace in ``trace_path`` under ``budget_mb`` MiB, the schedule the registered
    planner ``planner_name`` makes for it, and that planner's name (``auto`` resolved)."""
    from swapopt_core._plugins import get_plugin_manager

    trace = read_trace(trace_path)
    limit = budget_bytes(budget_mb)
    planner = choose_planner(get_plugin_manager(), planner_name)
    return (*plan_trace(trace, limit, planner), planner.name)


def atomic_write(path: str, write: Callable[[str], T], flag: str = "--out") -> T:
    """Have ``write`` fill a temporary file beside ``path``, then rename it onto ``path``.

    A write that fails (disk full, a size limit, an interrupt) leaves ``path`` as it was: the
    rename is atomic within one folder, and the temporary file is removed.

    Returns:
        What ``write`` returned.
    """
    target = Path(path)
    temporary = str(target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp{target.suffix}"))
    try:
        # Created like a plain open() would (mode 0o666 less the umask), unlike mkstemp's 0o600.
        os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except OSError as error:
        raise CommandError(f"{flag} {path}: cannot be written ({error}).") from None
    try:
        written = write(temporary)
        os.replace(temporary, target)
    except OSError as error:
        raise CommandError(f"{flag} {path}: cannot be written ({error}).") from None
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return written


def write_text(path: str, text: str, flag: str = "--out") -> None:
    """Write ``text`` to ``path`` atomically; a refused write is a ``CommandError``."""

    def write(temporary: str) -> None:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)

    atomic_write(path, write, flag)


def writable_target(
    path: str, flag: str = "--out", *, inputs: dict[str, str] | None = None
) -> None:
    """Refuse ``path`` early when its folder is missing, it names a folder, or it is one of
    the ``inputs`` (flag to path): writing there would overwrite what the command reads."""
    file = Path(path)
    if file.is_dir():
        raise CommandError(f"{flag} {path}: is a directory. Pass a file name.")
    if not file.parent.is_dir():
        raise CommandError(
            f"{flag} {path}: the folder {file.parent} does not exist. Create it first."
        )
    for other_flag, other in (inputs or {}).items():
        if other is not None and _same_file(file, Path(other)):
            raise CommandError(
                f"{flag} {path}: is the file given to {other_flag}, which would be overwritten. "
                f"Pass another file name to {flag}."
            )


def _same_file(one: Path, other: Path) -> bool:
    try:
        return one.resolve() == other.resolve() or (
            one.exists() and other.exists() and os.path.samefile(one, other)
        )
    except OSError:
        return False


#: Image formats ``swapopt plot`` writes, by file suffix.
IMAGE_SUFFIXES = (".png", ".svg", ".pdf")


def image_target(path: str, flag: str = "--out", *, inputs: dict[str, str] | None = None) -> None:
    """Refuse an image path whose folder is missing, that is one of the ``inputs``, or whose
    suffix names no known format."""
    writable_target(path, flag, inputs=inputs)
    if Path(path).suffix.lower() not in IMAGE_SUFFIXES:
        raise CommandError(
            f"{flag} {path}: the file name must end in {', '.join(IMAGE_SUFFIXES)} (the format "
            "is taken from it). Pass for example --out timeline.png."
        )


def mib(nbytes: float) -> str:
    """``nbytes`` in MiB with two decimals: ``4.00 MiB``."""
    return f"{nbytes / MIB:,.2f} MiB"


def least_budget_mb(floor: int) -> str:
    """The smallest ``--budget-mb`` text, to two decimals, that reads back as ``floor`` bytes or
    more (``budget_bytes`` rounds down)."""
    hundredths = -(-floor * 100 // MIB)
    while budget_bytes(f"{hundredths / 100:g}") < floor:  # guard against a float rounding down
        hundredths += 1
    return f"{hundredths / 100:g}"


def floor_problem(trace: ActivationTrace, flag: str = "--budget-mb") -> str | None:
    """Why no plan can keep ``trace``'s budget, naming the budget asked, the floor (the least
    any plan needs, and what sets it) and the fix; None when the budget is not below the floor.
    """
    budget = trace.memory_limit_bytes
    floor = min_feasible_budget(trace)
    if budget is None or budget >= floor:
        return None
    return (
        f"no plan fits under the {mib(budget)} asked: the floor, the least any plan needs, "
        f"is {mib(floor)} ({floor_reason(trace)}). Pass {flag} {least_budget_mb(floor)} or more"
    )


def budget_problem(
    trace: ActivationTrace,
    result: SimulationResult,
    plan: str,
    flag: str = "--budget-mb",
) -> str | None:
    """Why the plan simulated as ``result`` does not keep ``trace``'s budget, naming the budget
    asked, the floor and the fix; None when it keeps it. ``plan`` names the plan in the
    message ("the plan by timed", "the plan in plan.json").

    Either the budget is below the floor (:func:`floor_problem`: no plan can fit), or the
    planner's plan goes over a budget some plan could keep.
    """
    budget = trace.memory_limit_bytes
    if budget is None or result.peak_bytes <= budget:
        return None
    return floor_problem(trace, flag) or (
        f"{plan} peaks at {mib(result.peak_bytes)}, over the "
        f"{mib(budget)} asked (the floor, the least any plan needs, is "
        f"{mib(min_feasible_budget(trace))}). Pass another --planner or a larger {flag}"
    )


def summary(
    trace: ActivationTrace, schedule: ResidencySchedule, planner_name: str, result: SimulationResult
) -> Group:
    """What the plan does to one simulated step (memory, time, copies), with any warning."""
    budget = trace.memory_limit_bytes
    heading = (
        f"Plan by [bold]{planner_name}[/] for {len(trace.ops)} ops, "
        f"{len(trace.storage_sizes)} activation storages:"
    )
    table = Table(show_header=False)
    table.add_column(style="bold")
    table.add_column()
    notes: list[str] = []
    table.add_row("natural peak", mib(result.natural_peak_bytes))
    table.add_row("budget", "unlimited" if budget is None else mib(budget))
    peak = mib(result.peak_bytes)
    problem = budget_problem(trace, result, f"the plan by {planner_name}")
    if problem is not None:
        peak = f"[red]{peak}, over budget[/]"
        notes.append(f"[yellow]Over budget: {problem}.[/]")
    table.add_row("planned peak", peak)
    table.add_row("step time", f"{result.compute_ms:,.3f} ms -> {result.total_ms:,.3f} ms")
    overhead = f"{100 * result.overhead:.1f} %"
    bound = overhead_lower_bound(trace)
    if budget is not None and math.isfinite(bound) and result.peak_bytes <= budget:
        offload_only = overhead_lower_bound(trace, recompute=False)
        without = (
            f"; {100 * offload_only:.1f} % without recomputing" if offload_only > bound else ""
        )
        overhead += f" (no plan can go below {100 * bound:.1f} %{without})"
    table.add_row("overhead", overhead)
    table.add_row("actions", str(len(schedule)))
    table.add_row("moved D2H / H2D", f"{mib(result.d2h_bytes)} / {mib(result.h2d_bytes)}")
    table.add_row("host peak", mib(result.peak_host_bytes))
    if result.recomputes or result.demand_recomputes:
        on_demand = (
            f", [yellow]{result.demand_recomputes} on demand[/]" if result.demand_recomputes else ""
        )
        table.add_row(
            "recomputes",
            f"{result.recomputes} planned{on_demand}, {result.recompute_ms:,.3f} ms of compute",
        )
    if result.demand_fetches:
        table.add_row(
            "demand fetches",
            f"[yellow]{result.demand_fetches}, {result.demand_fetch_ms:,.3f} ms waited[/]",
        )
    return Group(heading, table, *notes)
