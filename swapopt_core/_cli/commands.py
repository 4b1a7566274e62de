"""The registry of ``swapopt`` subcommands, and what their declarations share.

Every subcommand is one function decorated with :func:`command`. The function receives the
subcommand's argument parser, declares its options on it, and returns the handler that runs the
command with the parsed arguments. ``swapopt_core._cli.main`` builds one subparser per
registered command, so adding a command means adding one such function in a module that
``main`` imports.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

from swapopt_core._options import Invalid, parse_int

__all__ = [
    "COMMANDS",
    "Command",
    "Configure",
    "Handler",
    "command",
    "flag",
    "positive_int",
    "user_error",
]

Handler = Callable[[argparse.Namespace], int]
"""Runs one command with its parsed arguments; returns the process exit code."""

Configure = Callable[[argparse.ArgumentParser], Handler]
"""Declares a command's options on its parser and returns the command's handler."""


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its name, its line in ``--help`` and how it is declared."""

    name: str
    summary: str
    configure: Configure


COMMANDS: list[Command] = []
"""The registered subcommands (``swapopt --help`` lists them by name)."""


def command(name: str, summary: str) -> Callable[[Configure], Configure]:
    """Registers a subcommand under ``name`` with a one-line ``summary`` for ``--help``."""

    def register(configure: Configure) -> Configure:
        COMMANDS.append(Command(name, summary, configure))
        return configure

    return register


def flag(parse: Callable[[object], object], accepted: str) -> Callable[[str], object]:
    """An argparse ``type`` that reads a flag with the options parser of the configs."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except Invalid:
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None

    return convert


positive_int = flag(parse_int(1), "an integer >= 1")


def user_error(parser: argparse.ArgumentParser, message: str) -> int:
    """Report a wrong input in one line, without the usage text, and return exit code 2."""
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2
