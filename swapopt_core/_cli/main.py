"""The ``swapopt`` command line (also ``python -m swapopt_core``): the parser and its front.

Builds one subparser per command registered in ``swapopt_core._cli.commands`` (``swapopt
--help`` lists them all), parses, sets up logging and runs the chosen command's handler. The
``demo`` and ``run`` commands are declared here; ``plan`` and ``plot`` in
``swapopt_core._cli.trace_commands``; ``estimate`` in ``swapopt_core._cli.estimate_command``.
The words after ``run`` go to the script untouched.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from swapopt_core._cli import (  # noqa: F401  (their imports register their commands)
    estimate_command,
    trace_commands,
)
from swapopt_core._cli.commands import COMMANDS, Handler, command, positive_int, user_error

logger = logging.getLogger(__name__)


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


@command("demo", "train a tiny GPT with plain and with swapped AdamW and compare them")
def _demo_command(parser: argparse.ArgumentParser) -> Handler:
    """Declares ``swapopt demo``: two identical training runs, one with the swap installed."""

    from swapopt_core._cli.demo import QUICK, DemoOptions, render_report, run_demo

    defaults = DemoOptions()
    parser.description = (
        "Train a small GPT-style decoder on synthetic tokens twice from the same weights and "
        "data: once with plain torch.optim.AdamW, once with the same AdamW under "
        "swap_optimizer. Prints losses, optimizer-state memory, bytes moved and step times. "
        "Exits 0 when the final parameters of both runs are bit-identical, 1 otherwise. "
        "On a terminal a live bar shows the progress; in a log or a pipe, plain lines do."
    )
    add = parser.add_argument

    def dflt(name: str) -> str:
        """The help's default: the full demo's, and the quick one's where it differs."""
        full, quick = getattr(defaults, name), getattr(QUICK, name)
        return f" (default: {full}{f'; --quick: {quick}' if quick != full else ''})"

    add(
        "--quick",
        action="store_true",
        help=f"a smaller model and a shorter run, seconds on a CPU: {QUICK.layers} blocks of "
        f"width {QUICK.width}, {QUICK.steps} steps, sequences of {QUICK.seq_len} tokens, "
        f"{QUICK.threads} CPU thread; flags given as well override these",
    )
    # default None: a flag not given takes the full or the quick demo's value.
    add("--steps", type=positive_int, help="steps per run" + dflt("steps"))
    add(
        "--swap-times",
        type=positive_int,
        help="batches the swapped step is pipelined over" + dflt("swap_times"),
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--packed",
        dest="packed",
        action="store_const",
        const=True,
        default=defaults.packed,
        help="one host buffer per dtype; each batch moves in one copy per dtype into its own "
        "device buffer, at most three batches on the device at once (one coming in, one "
        "updating, one going out) (default: the runtime's choice)",
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
        help="torch device (default: cuda if available, else cpu; cpu uses the loopback runtime)",
    )
    add("--seed", type=int, help="seed of the weights and the data" + dflt("seed"))
    add("--layers", type=positive_int, help="transformer blocks" + dflt("layers"))
    add(
        "--width",
        type=positive_int,
        help=f"embedding width, a multiple of {defaults.heads} heads" + dflt("width"),
    )
    add(
        "--threads",
        type=positive_int,
        help="torch CPU threads during the runs (default: torch's setting; --quick: "
        f"{QUICK.threads})",
    )

    def run(args: argparse.Namespace) -> int:
        base = QUICK if args.quick else defaults
        # Each flag's dest is the DemoOptions field it sets; a flag not given keeps base's.
        flags = ("steps", "swap_times", "device", "seed", "layers", "width", "threads")
        given = {name: getattr(args, name) for name in flags if getattr(args, name) is not None}
        options = dataclasses.replace(base, packed=args.packed, **given)
        heads = options.heads
        if options.width % heads:
            parser.error(
                f"--width {options.width}: must be a multiple of the {heads} heads. "
                f"Pass for example --width {heads * max(1, options.width // heads)}."
            )
        console, progress = Console(), Console(stderr=True)
        # A live bar only when both streams are terminals: a redirected report is a log too.
        plain = not (console.is_terminal and progress.is_terminal)
        report = run_demo(options, console=progress, plain_progress=plain)
        console.print(render_report(report))
        if report.identical:
            console.print("[green]OK[/]: swapped AdamW ended bit-identical to plain AdamW.")
            return 0
        console.print("[red]FAIL[/]: swapped AdamW did not end bit-identical to plain AdamW.")
        return 1

    return run


@command("run", "run a training script with every installed integration switched on")
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
            return user_error(parser, str(error))
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


def version_line() -> str:
    """``swapopt X.Y.Z (torch A.B.C)``: the installed distributions' versions, from their metadata.

    A source tree that was never installed has no metadata; the line says so and how to fix it.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("swapopt")
    except PackageNotFoundError:
        ours = "(version unknown: the package is not installed; pip install -e . records it)"
    try:
        torch = f"torch {version('torch')}"
    except PackageNotFoundError:
        torch = "torch not installed"
    return f"swapopt {ours} ({torch})"


def build_parser() -> argparse.ArgumentParser:
    """Builds the ``swapopt`` parser with one subparser per registered command."""
    parser = argparse.ArgumentParser(
        prog="swapopt",
        description="Keep optimizer state and activations in host memory, bit for bit.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v: info, -vv: debug)"
    )
    parser.add_argument(
        "--version",
        action="version",
        version=version_line(),
        help="print swapopt's version (and torch's) and exit",
    )
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    commands.required = True
    for entry in sorted(COMMANDS, key=lambda entry: entry.name):
        sub = commands.add_parser(entry.name, help=entry.summary, description=entry.summary)
        sub.set_defaults(handler=entry.configure(sub))
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
