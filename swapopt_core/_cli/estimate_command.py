"""``swapopt estimate``: the memory and time of one training step, plain and planned.

The work is in ``swapopt_core._estimate``; this module declares the options, turns every
wrong input into one line naming the flag and the fix (exit code 2), and a budget below the
floor into the planner's message naming the budget and the floor (exit code 1, as ``swapopt
plan`` without ``--allow-over``).
"""

from __future__ import annotations

import argparse
import math
import sys

from rich.console import Console

from swapopt_core._cli.commands import Handler, command, flag, positive_int, user_error
from swapopt_core._options import parse_int
from swapopt_core._planning.interface import AUTO, DEFAULT_PLANNER

__all__: list[str] = []

_MIB = 2**20


def _budget_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected the device budget in MiB, a number > 0 (e.g. 70000), got {text!r}"
        )
    return value


@command("estimate", "estimate a training step's memory and time, plain and under a budget")
def _estimate_command(parser: argparse.ArgumentParser) -> Handler:
    """Declares ``swapopt estimate``."""
    parser.description = (
        "Trace one training step (forward, loss, backward) of a model on fake tensors, without "
        "allocating it, price every op with a device profile and print the memory breakdown "
        "(parameters, gradients, optimizer state, activation peak) and step time of plain "
        "training and of the plan swapopt makes at --budget-mb. See docs/estimate.md."
    )
    add = parser.add_argument
    add(
        "--model",
        required=True,
        metavar="CONFIG.json|module:factory",
        help="a transformers config file (built with AutoModelForCausalLM.from_config, no "
        "weights), or module:factory returning a model or (model, example_batch)",
    )
    add("--batch", type=positive_int, required=True, help="batch size")
    add("--seq", type=positive_int, required=True, help="sequence length")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--device",
        default="h200",
        help="built-in device profile: h100, h200 or cpu (measured here) (default: %(default)s)",
    )
    where.add_argument("--profile", metavar="FILE", help="a device profile JSON file instead")
    add("--budget-mb", type=_budget_mb, metavar="MB", help="device budget of the plan, in MiB")
    add(
        "--optimizer",
        default="adamw",
        help="adamw, adam, sgd, adagrad, rmsprop or muon (default: %(default)s)",
    )
    add("--dtype", help="float32, bfloat16 or float16 (default: the config's torch_dtype)")
    add(
        "--min-numel",
        type=flag(parse_int(0), "an integer >= 0"),
        default=1024,
        help="parameters with fewer elements keep their optimizer state on the device "
        "(default: %(default)s)",
    )
    add(
        "--planner",
        default=AUTO,
        help=f"activation planner; {AUTO} = {DEFAULT_PLANNER} (default: %(default)s)",
    )
    add("--json", metavar="OUT", help="also write the estimate as JSON to OUT")
    add(
        "--trace-out",
        metavar="T.json",
        help="also write the priced activation trace (for swapopt plan and swapopt plot)",
    )

    def run(args: argparse.Namespace) -> int:
        from swapopt_core._cli.support import CommandError, choose_planner, write_text
        from swapopt_core._estimate import (
            estimate,
            estimate_json,
            load_profile,
            model_spec,
            profile_named,
            render_estimate,
        )
        from swapopt_core._planning.whole_step import BudgetTooSmall
        from swapopt_core._plugins import get_plugin_manager

        try:
            profile = load_profile(args.profile) if args.profile else profile_named(args.device)
            spec = model_spec(args.model, args.dtype)
            planner = choose_planner(get_plugin_manager(), args.planner)
            budget = None if args.budget_mb is None else int(args.budget_mb * _MIB)
            found = estimate(
                spec,
                args.batch,
                args.seq,
                profile,
                planner,
                optimizer=args.optimizer,
                budget_bytes=budget,
                min_numel=args.min_numel,
            )
        except BudgetTooSmall as error:
            # The planner words its fix for the Python option; here the flag is the fix.
            message = str(error).replace("device_budget_mb", "--budget-mb")
            if budget is not None and error.floor_bytes > budget:
                floor = f"{error.floor_bytes / _MIB:,.2f}".rstrip("0").rstrip(".")
                message += f" (floor: {floor} MiB)"
            print(
                f"{parser.prog}: error: --budget-mb {args.budget_mb:g}: {message}", file=sys.stderr
            )
            return 1
        except (CommandError, ValueError) as error:
            return user_error(parser, str(error))
        Console().print(render_estimate(found))
        try:
            if args.json:
                write_text(args.json, estimate_json(found), "--json")
            if args.trace_out and found.trace is not None:
                write_text(args.trace_out, found.trace.to_json(), "--trace-out")
        except CommandError as error:
            return user_error(parser, str(error))
        return 0

    return run
