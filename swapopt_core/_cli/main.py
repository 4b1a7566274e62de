"""The ``swapopt`` command line (also ``python -m swapopt_core``).

Every subcommand is one function decorated with :func:`_command`. The function receives the
subcommand's argument parser, declares its options on it, and returns the handler that runs the
command with the parsed arguments. Adding a command (``plan``, ``plot``) means adding one such
function; ``swapopt --help`` lists every registered command.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from swapopt_core._options import Invalid, parse_int
from swapopt_core._planning.interface import AUTO, DEFAULT_PLANNER

logger = logging.getLogger(__name__)

Handler = Callable[[argparse.Namespace], int]
"""Runs one command with its parsed arguments; returns the process exit code."""

Configure = Callable[[argparse.ArgumentParser], Handler]
"""Declares a command's options on its parser and returns the command's handler."""


@dataclasses.dataclass(frozen=True)
class _Command:
    name: str
    summary: str
    configure: Configure


_COMMANDS: list[_Command] = []


def _command(name: str, summary: str) -> Callable[[Configure], Configure]:
    """Registers a subcommand under ``name`` with a one-line ``summary`` for ``--help``."""

    def register(configure: Configure) -> Configure:
        _COMMANDS.append(_Command(name, summary, configure))
        return configure

    return register


def _flag(parse: Callable[[object], object], accepted: str) -> Callable[[str], object]:
    """An argparse ``type`` that reads a flag with the options parser of the configs."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except Invalid:
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None

    return convert


_positive_int = _flag(parse_int(1), "an integer >= 1")


def _user_error(parser: argparse.ArgumentParser, message: str) -> int:
    """Report a wrong input in one line, without the usage text, and return exit code 2."""
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2


def _demo_device(text: str | None) -> str | None:
    """The demo's ``--device``: ``cpu``, ``cuda`` or ``cuda:N``, checked before any work."""
    import torch

    if text is None:
        return None
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(
            f"expected cpu, cuda or cuda:N, got {text!r} (the demo runs on CPU or CUDA)"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return text


@_command("demo", "train a tiny GPT with plain and with swapped AdamW and compare them")
def _demo_command(parser: argparse.ArgumentParser) -> Handler:
    """Declares ``swapopt demo``: two identical training runs, one with the swap installed."""

    from swapopt_core._cli.demo import DemoOptions, render_report, run_demo

    defaults = DemoOptions()
    parser.description = (
        "Train a small GPT-style decoder on synthetic tokens twice from the same weights and "
        "data: once with plain torch.optim.AdamW, once with the same AdamW under "
        "swap_optimizer. Prints losses, optimizer-state memory, bytes moved and step times. "
        "Exits 0 when the final parameters of both runs are bit-identical, 1 otherwise."
    )
    dflt = " (default: %(default)s)"
    add = parser.add_argument
    add("--steps", type=_positive_int, default=defaults.steps, help="steps per run" + dflt)
    add(
        "--swap-times",
        type=_positive_int,
        default=defaults.swap_times,
        help="batches the swapped step is pipelined over" + dflt,
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--packed",
        dest="packed",
        action="store_const",
        const=True,
        default=defaults.packed,
        help="one host buffer per dtype, staged through two device arenas "
        "(default: the runtime's choice)",
    )
    mode.add_argument(
        "--per-tensor",
        dest="packed",
        action="store_const",
        const=False,
        help="one host mirror per state tensor",
    )
    add(
        "--device",
        type=_demo_device,
        default=defaults.device,
        help="torch device (default: cuda if available, else cpu; cpu uses the loopback runtime)",
    )
    add("--seed", type=int, default=defaults.seed, help="seed of the weights and the data" + dflt)
    add("--layers", type=_positive_int, default=defaults.layers, help="transformer blocks" + dflt)
    add(
        "--width",
        type=_positive_int,
        default=defaults.width,
        help=f"embedding width, a multiple of {defaults.heads} heads" + dflt,
    )

    def run(args: argparse.Namespace) -> int:
        if args.width % defaults.heads:
            parser.error(f"--width must be a multiple of {defaults.heads}")
        # Each flag's dest is the DemoOptions field it sets.
        flags = ("steps", "swap_times", "packed", "device", "seed", "layers", "width")
        options = dataclasses.replace(defaults, **{name: getattr(args, name) for name in flags})
        report = run_demo(options, console=Console(stderr=True))
        console = Console()
        console.print(render_report(report))
        if report.identical:
            console.print("[green]OK[/]: swapped AdamW ended bit-identical to plain AdamW.")
            return 0
        console.print("[red]FAIL[/]: swapped AdamW did not end bit-identical to plain AdamW.")
        return 1

    return run


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
        "schedule as JSON and print what the plan does in a simulated step. The formats are "
        "described in docs/formats.md."
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


@_command("plan", "plan a recorded activation trace under a memory budget")
def _plan_command(parser: argparse.ArgumentParser) -> Handler:
    """Declares ``swapopt plan``: trace JSON in, residency schedule JSON out, plus a summary."""
    from swapopt_core._cli import support as cli
    from swapopt_core._planning.simulate import simulate

    _PLAN.declare(parser)

    def run(args: argparse.Namespace) -> int:
        try:
            cli.writable_target(args.out, inputs={"--trace": args.trace})
            trace, schedule, planner = cli.plan_file(args.trace, args.budget_mb, args.planner)
            result = simulate(trace, schedule)
            cli.write_text(args.out, schedule.to_json())
        except cli.CommandError as error:
            return _user_error(parser, str(error))
        console = Console()
        console.print(cli.summary(trace, schedule, planner, result))
        console.print(f"Schedule written to {args.out}.")
        return 0

    return run


@_command("plot", "draw the activation memory timeline of a trace with and without a plan")
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
            else:
                trace, schedule, _ = cli.plan_file(args.trace, args.budget_mb, args.planner)
            result = cli.atomic_write(
                args.out, lambda temporary: plot_timeline(trace, schedule, temporary)
            )
        except (cli.CommandError, ModuleNotFoundError) as error:  # matplotlib is optional
            return _user_error(parser, str(error))
        recomputed = result.recomputes + result.demand_recomputes
        Console().print(
            f"Memory timeline written to {args.out} (peak "
            f"{result.peak_bytes / cli.MIB:,.1f} MiB, overhead "
            f"{100 * result.overhead:.1f} %"
            + (f", {recomputed} recompute{'' if recomputed == 1 else 's'}" if recomputed else "")
            + ")."
        )
        return 0

    return run


@_command("run", "run a training script with every installed integration switched on")
def _run_command(parser: argparse.ArgumentParser) -> Handler:
    """Declares ``swapopt run``; its words after ``run`` go to the script untouched."""
    from swapopt_core._cli.run import USAGE, UsageError, parse_target, run

    parser.usage = USAGE
    parser.description = (
        "Switch on, from the SWAPOPT_* environment variables, every swapopt integration whose "
        "framework is installed (a plain Accelerator, transformers.Trainer and Lightning "
        "Trainer swap their optimizers when SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu), then run "
        "SCRIPT (or -m MODULE) as __main__ with ARGS, as python would. Under a launcher: "
        "accelerate launch --no_python swapopt run train.py, or torchrun --no-python ... "
        "swapopt run train.py."
    )
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    parser.add_argument("script", nargs="?", metavar="SCRIPT", help="the script to run")
    parser.add_argument("args", nargs="*", metavar="ARGS", help="its arguments, passed as they are")

    def handle(args: argparse.Namespace) -> int:
        try:
            target = parse_target(args.run_words)
        except UsageError as error:
            return _user_error(parser, str(error))
        return run(target)

    return handle


def _split_run(argv: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """``(words up to "run", words after it)`` when the command is ``run``, else None.

    The words after ``run`` belong to the script (options included), so argparse must not
    see them; only a leading ``-h``/``--help`` is kept for ``swapopt run --help``.
    """
    for index, word in enumerate(argv):
        if word == "run":
            return list(argv[: index + 1]), list(argv[index + 1 :])
        if not word.startswith("-"):
            return None
    return None


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 2


def _log_swapopt_only(level: int) -> None:
    """With ``-v``, show swapopt's own records; the script's logging stays its own to set up."""
    if level >= logging.WARNING:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in ("swapopt_core", "swapopt_plugins"):
        logger_ = logging.getLogger(name)
        logger_.addHandler(handler)
        logger_.setLevel(level)
        logger_.propagate = False  # else a handler the script installs prints them twice


def build_parser() -> argparse.ArgumentParser:
    """Builds the ``swapopt`` parser with one subparser per registered command."""
    parser = argparse.ArgumentParser(
        prog="swapopt",
        description="Keep optimizer state and activations in host memory, bit for bit.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v: info, -vv: debug)"
    )
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    commands.required = True
    for command in _COMMANDS:
        sub = commands.add_parser(command.name, help=command.summary, description=command.summary)
        sub.set_defaults(handler=command.configure(sub))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``swapopt`` command line.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit code: the command's own, or 2 for a usage error (0 for ``--help``).
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    split = _split_run(argv)
    run_words: list[str] = []
    if split is not None:
        argv, run_words = split
        if run_words[:1] in (["-h"], ["--help"]):
            argv, run_words = [*argv, "-h"], []
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error: report the code instead of exiting
        return _exit_code(exc)
    args.run_words = run_words
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    if args.command == "run":
        _log_swapopt_only(level)
    else:
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logger.debug("running command %s", args.command)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except SystemExit as exc:  # parser.error() raised from inside a handler
        return _exit_code(exc)
