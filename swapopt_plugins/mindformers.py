"""MindFormers integration: a registered trainer callback and a launcher that reads the YAML.

Importing this module registers ``SwapOptimizerCallback`` in MindFormers' registry, so a
training YAML can name it: ``callbacks: [{type: SwapOptimizerCallback, swap_times: 8}]``.
The launcher ``python -m swapopt_plugins.mindformers --config train.yaml`` also reads a
top-level ``swap_optimizer:`` section, turns it into that callback entry and starts
MindFormers' pynative ``Trainer``. Only PyNative mode is served; in graph mode MindFormers
has its own host-side optimizer state (``optimizer: {type: AdamW, swap: True}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from swapopt_core import (
    SwapOptError,
    SwapOptimizerConfig,
    is_swap_optimizer,
    swap_optimizer,
    swap_stats,
)
from swapopt_plugins._mindformers_config import (
    SECTION,
    SwapOptimizerSection,
    build_trainer_config,
    check_options,
)

try:
    import mindspore as ms
    from mindformers.pynative.callback import TrainerCallback
    from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
except ImportError as _error:  # pragma: no cover - exercised without mindformers only
    raise ImportError(
        f"swapopt_plugins.mindformers needs mindformers 1.9 with mindspore 2.9 ({_error}): "
        "pip install 'swapopt[mindformers]'."
    ) from _error

logger = logging.getLogger(__name__)

__all__ = ["SwapOptimizerCallback", "SwapOptimizerSection", "build_trainer_config", "main"]

_GRAPH_HINT = (
    "In graph mode use MindFormers' own host-side optimizer state instead: "
    "'optimizer: {type: AdamW, swap: True}'."
)


@MindFormerRegister.register(MindFormerModuleType.CALLBACK)
class SwapOptimizerCallback(TrainerCallback):
    """Keep the optimizer state in host memory while MindFormers' pynative Trainer trains.

    At ``on_train_begin`` the Trainer's optimizer is swapped in place; the Trainer has
    already loaded any checkpoint by then, so the loaded state moves to host memory too.
    The swap stays installed after training (bringing the whole state back to the device
    at the end would undo the saving); ``unswap_optimizer(trainer.optimizer)`` removes it.
    At ``on_train_end`` the callback logs ``swap_stats`` as one JSON line.

    Args:
        swap_times: Pipeline batches per step (an integer >= 1).
        state_keys: State entries to swap, from ``exp_avg``, ``exp_avg_sq`` and
            ``max_exp_avg_sq``; None swaps all that the optimizer keeps.
        min_numel: State tensors with fewer elements stay on the device (>= 0).
        include_master_params: Also swap fp32 master weights, where the optimizer keeps them.
        packed_swap: True, False, or None for the runtime's default.
        runtime: ``"auto"``, ``"loopback"`` or another registered runtime name.

    Defaults are ``SwapOptimizerConfig``'s.

    Raises:
        ValueError: At construction, an unknown keyword or a bad value; the message names
            it, shows the value and lists what is accepted.
        SwapOptError: At train begin, without an optimizer or outside PyNative mode.

    Example:
        >>> Trainer(config=config_dict, callbacks=[SwapOptimizerCallback(swap_times=8)])
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self._config = SwapOptimizerConfig(**check_options(options, owner=type(self).__name__))

    @property
    def config(self) -> SwapOptimizerConfig:
        """The swap configuration this callback installs."""
        return self._config

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        """Swap the optimizer that ``CallbackHandler`` passes as ``optimizer=``."""
        optimizer = kwargs.get("optimizer")
        if optimizer is None:
            raise SwapOptError(
                "SwapOptimizerCallback got no optimizer at train begin: give the Trainer an "
                "'optimizer:' section (or an optimizer and lr_scheduler) so there is state "
                "to swap, or remove the callback."
            )
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise SwapOptError(
                "SwapOptimizerCallback runs only in PyNative mode (ms.PYNATIVE_MODE); the "
                f"context is in mode {ms.get_context('mode')}. {_GRAPH_HINT}"
            )
        swap_optimizer(optimizer, self._config)
        if is_swap_optimizer(optimizer):
            logger.info("swapopt: %s swapped with %s", type(optimizer).__name__, self._config)

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        """Log what the swap held and moved, as ``swapopt stats at train end: {json}``."""
        optimizer = kwargs.get("optimizer")
        if optimizer is None or not is_swap_optimizer(optimizer):
            logger.info("swapopt: nothing was swapped in this run")
            return
        stats = dataclasses.asdict(swap_stats(optimizer))
        logger.info("swapopt stats at train end: %s", json.dumps(stats, sort_keys=True))


# ---- launcher ------------------------------------------------------------------------------


def _apply_context(config: Mapping[str, Any]) -> None:
    """PyNative mode, and the device named by ``context.device_target`` if the YAML has one."""
    context = config.get("context") or {}
    mode = context.get("mode", ms.PYNATIVE_MODE)
    if mode != ms.PYNATIVE_MODE:
        raise ValueError(
            f"context.mode={mode!r}: this launcher starts MindFormers' pynative Trainer, which "
            f"needs context.mode: {ms.PYNATIVE_MODE} (PyNative). {_GRAPH_HINT}"
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
    _log_to_stderr()
    if SECTION in loaded:
        logger.info("swapopt: %s section read; callbacks: %s", SECTION, config.get("callbacks"))
    Trainer(config=config).train(checkpoint_path=args.checkpoint, mode=args.mode)
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so the class registered last is the importable one.
    from swapopt_plugins.mindformers import main as _main

    sys.exit(_main())
