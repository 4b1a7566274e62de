"""``swapopt plan`` and ``swapopt plot``: an activation trace in, a schedule or a picture out.

Both read a trace, take a budget and a planner and write one file; :class:`_TraceCommand` words
their common options once, each command its own way. The work itself (reading and checking
files, planning, the summary) is in ``swapopt_core._cli.support``; the drawing in
``swapopt_core._cli.plot``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from rich.console import Console

from swapopt_core._cli.commands import Handler, command, user_error
from swapopt_core._planning.interface import AUTO, DEFAULT_PLANNER

__all__: list[str] = []


_PLANNER_HELP = (
    f"registered planner to use; {AUTO} = the default, {DEFAULT_PLANNER} (default: %(default)s)"
)


@dataclasses.dataclass(frozen=True)
class _TraceCommand:
    """What ``plan`` and ``plot`` declare alike (a trace in, a budget, a planner, a file out),
    as one command words it."""

    description: str
    trace: str
    budget: str
    budget_required: bool
    out_metavar: str
    out: str
    planner: str

    def declare(self, parser: argparse.ArgumentParser) -> None:
        """Describe the command; declare ``--trace``, ``--budget-mb``, ``--out``, ``--planner``."""
        parser.description = self.description
        add = parser.add_argument
        add("--trace", required=True, metavar="T.json", help=self.trace)
        add("--budget-mb", required=self.budget_required, metavar="MB", help=self.budget)
        add("--out", required=True, metavar=self.out_metavar, help=self.out)
        add("--planner", default=AUTO, help=self.planner)


_PLAN = _TraceCommand(
    description=(
        "Read an activation trace (ActivationTrace.to_json(), e.g. OffloadSession.trace), plan "
        "it under an activation budget with a registered planner, write the residency "
        "schedule as JSON and print what the plan does in a simulated step. When no plan "
        "keeps the budget (it is below the floor, the least any plan needs), say so and exit "
        "1 without writing, unless --allow-over. The formats are described in docs/formats.md."
    ),
    trace="the activation trace to plan",
    budget="activation budget on the device, in MiB",
    budget_required=True,
    out_metavar="P.json",
    out="where to write the schedule",
    planner=_PLANNER_HELP,
)
_PLOT = _TraceCommand(
    description=(
        "Simulate one step of an activation trace with no plan and with a plan (read from "
        "--schedule, or made now under --budget-mb), and draw resident activation memory over "
        "time, the budget, one lane of bars per copy direction, and a compute lane with the "
        "ops and the recomputes. Needs matplotlib (pip install 'swapopt[plot]')."
    ),
    trace="the activation trace",
    budget="activation budget in MiB: without --schedule, plan the trace under it now; "
    "with --schedule, only draw it (default: the trace's own budget)",
    budget_required=False,
    out_metavar="timeline.png",
    out="the image to write",
    planner=_PLANNER_HELP + "; with --budget-mb only",
)


@command("plan", "plan a recorded activation trace under a memory budget")
def _plan_command(parser: argparse.ArgumentParser) -> Handler:
    """Declares ``swapopt plan``: trace JSON in, residency schedule JSON out, plus a summary."""
    from swapopt_core._cli import support as cli
    from swapopt_core._planning.simulate import simulate

    _PLAN.declare(parser)
    parser.add_argument(
        "--allow-over",
        action="store_true",
        help="when no plan keeps the budget, write the best plan over it and exit 0 "
        "(without it: an error naming the budget and the floor, exit 1, nothing written)",
    )

    def run(args: argparse.Namespace) -> int:
        from swapopt_core._plugins import get_plugin_manager

        try:
            cli.writable_target(args.out, inputs={"--trace": args.trace})
            trace = cli.read_trace(args.trace).with_limit(cli.budget_bytes(args.budget_mb))
            planner = cli.choose_planner(get_plugin_manager(), args.planner)
            problem = cli.floor_problem(trace)  # known before planning: fail fast
            if problem is None or args.allow_over:
                schedule = planner.plan(trace)
                result = simulate(trace, schedule)
                problem = cli.budget_problem(trace, result, f"the plan by {planner.name}")
            if problem is not None and not args.allow_over:
                print(
                    f"{parser.prog}: error: --budget-mb {args.budget_mb}: {problem}, or "
                    "--allow-over to write the best plan over the budget.",
                    file=sys.stderr,
                )
                return 1
            cli.write_text(args.out, schedule.to_json())
        except cli.CommandError as error:
            return user_error(parser, str(error))
        console = Console()
        console.print(cli.summary(trace, schedule, planner.name, result))
        over = f", over the budget (--allow-over): it peaks at {cli.mib(result.peak_bytes)}"
        console.print(f"Schedule written to {args.out}{over if problem else ''}.")
        return 0

    return run


@command("plot", "draw the activation memory timeline of a trace with and without a plan")
def _plot_command(parser: argparse.ArgumentParser) -> Handler:
    """Declares ``swapopt plot``: a PNG of resident activation memory and copies over time."""
    from swapopt_core._cli import support as cli

    _PLOT.declare(parser)
    parser.add_argument(
        "--schedule", metavar="P.json", help="a schedule written by `swapopt plan` for this trace"
    )

    def run(args: argparse.Namespace) -> int:
        from swapopt_core._cli.plot import plot_timeline

        if args.schedule is None and args.budget_mb is None:
            parser.error("give --schedule P.json (a plan to draw) or --budget-mb MB (plan now).")
        if args.schedule is not None and args.planner != AUTO:
            parser.error(
                f"--planner {args.planner}: applies only with --budget-mb; "
                f"--schedule {args.schedule} is already planned. Drop one of them."
            )
        try:
            cli.image_target(args.out, inputs={"--trace": args.trace, "--schedule": args.schedule})
            if args.schedule is not None:
                trace = cli.read_trace(args.trace)
                if args.budget_mb is not None:
                    trace = trace.with_limit(cli.budget_bytes(args.budget_mb))
                schedule = cli.read_schedule(args.schedule)
                cli.simulate_checked(trace, schedule, args.schedule)
                plan = f"the plan in {args.schedule}"
            else:
                trace, schedule, planner = cli.plan_file(args.trace, args.budget_mb, args.planner)
                plan = f"the plan by {planner}"
            result = cli.atomic_write(
                args.out, lambda temporary: plot_timeline(trace, schedule, temporary)
            )
        except (cli.CommandError, ModuleNotFoundError) as error:  # matplotlib is optional
            return user_error(parser, str(error))
        recomputed = result.recomputes + result.demand_recomputes
        console = Console()
        console.print(
            f"Memory timeline written to {args.out} (peak "
            f"{result.peak_bytes / cli.MIB:,.1f} MiB, overhead "
            f"{100 * result.overhead:.1f} %"
            + (f", {recomputed} recompute{'' if recomputed == 1 else 's'}" if recomputed else "")
            + ")."
        )
        problem = cli.budget_problem(trace, result, plan)
        if problem is not None:  # drawn, and marked on the plot
            console.print(f"[yellow]Over budget, marked on the plot: {problem}.[/]")
        return 0

    return run
