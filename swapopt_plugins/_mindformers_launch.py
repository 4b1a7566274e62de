"""The launcher behind ``python -m swapopt_plugins.mindformers --config train.yaml``.

It imports the modules named by ``--register``, reads the YAML, turns its
``swap_optimizer:`` section into a ``SwapOptimizerCallback`` entry
(``build_trainer_config``), sets PyNative mode and the device, and runs MindFormers'
pynative ``Trainer``. The callback itself is in ``swapopt_plugins.mindformers``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import mindspore as ms

from swapopt_plugins._mindformers_config import (
    GRAPH_HINT,
    SECTION,
    build_trainer_config,
    read_context,
)

logger = logging.getLogger(__name__)

__all__ = ["main"]


def _apply_context(config: Mapping[str, Any]) -> None:
    """PyNative mode, and the device named by ``context.device_target`` if the YAML has one."""
    context = read_context(config)
    mode = context.get("mode", ms.PYNATIVE_MODE)
    if mode != ms.PYNATIVE_MODE:
        raise ValueError(
            f"context.mode={mode!r}: this launcher starts MindFormers' pynative Trainer, which "
            f"needs context.mode: {ms.PYNATIVE_MODE} (PyNative). {GRAPH_HINT}"
        )
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if context.get("device_target"):
        ms.set_device(context["device_target"])


def _log_to_stderr() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
    for name in ("swapopt_core", "swapopt_plugins"):
        named = logging.getLogger(name)
        if not named.handlers:
            named.addHandler(handler)
            named.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Run MindFormers' pynative Trainer on a YAML, with the ``swap_optimizer:`` section.

    Returns:
        0 after training; 2 when the YAML or an option is invalid (the reason goes to stderr).
    """
    parser = argparse.ArgumentParser(
        prog="python -m swapopt_plugins.mindformers",
        description="Train with MindFormers' pynative Trainer; a 'swap_optimizer:' section of "
        "the YAML keeps the optimizer state in host memory.",
    )
    parser.add_argument("--config", required=True, help="training YAML")
    parser.add_argument(
        "--register",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, so it registers models or configs (repeatable)",
    )
    parser.add_argument("--checkpoint", default=None, help="resume from this checkpoint folder")
    parser.add_argument(
        "--mode",
        default="pretrain",
        choices=["pretrain", "finetune"],
        help="passed to Trainer.train(mode=...)",
    )
    args = parser.parse_args(argv)

    import yaml
    from mindformers.pynative.trainer import Trainer

    import swapopt_plugins.mindformers  # noqa: F401 - registers SwapOptimizerCallback

    for module in args.register:  # first: they may register models, configs or runtimes
        importlib.import_module(module)
    try:
        with open(args.config, encoding="utf-8") as file:
            loaded = yaml.safe_load(file)
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config} must hold a mapping of sections, got {loaded!r}.")
        config = build_trainer_config(loaded)
        _apply_context(config)
    except (OSError, ValueError, yaml.YAMLError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except RecursionError:
        print(
            f"{parser.prog}: error: {args.config} nests lists or mappings too deeply to be a "
            "training YAML.",
            file=sys.stderr,
        )
        return 2
    _log_to_stderr()
    if SECTION in loaded:
        logger.info("swapopt: %s section read; callbacks: %s", SECTION, config.get("callbacks"))
    Trainer(config=config).train(checkpoint_path=args.checkpoint, mode=args.mode)
    return 0
