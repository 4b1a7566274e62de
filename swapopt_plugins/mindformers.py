"""MindFormers integration: a trainer callback registered with MindFormers.

Importing this module registers ``SwapOptimizerCallback`` in MindFormers' registry, so a
training YAML can name it: ``callbacks: [{type: SwapOptimizerCallback, swap_times: 8}]``.
The launcher ``python -m swapopt_plugins.mindformers --config train.yaml`` (``main``) also
reads a top-level ``swap_optimizer:`` section, turns it into that callback entry
(``swapopt_core.mindformers_yaml``, which needs no MindFormers) and starts MindFormers'
pynative ``Trainer``. Only
PyNative mode is served; in graph mode MindFormers has its own host-side optimizer state
(``optimizer: {type: AdamW, swap: True}``).

The settings come from the callback's keys (or the ``swap_optimizer:`` section), not from
the ``SWAPOPT_*`` setting variables or the ``SWAPOPT_CONFIG`` file of the torch
integrations; of the variables, MindFormers runs read ``SWAPOPT_STRICT`` (and the loopback
runtimes' pacing). A ``SWAPOPT_*`` name swapopt does not read warns once at train begin.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from swapopt_core import SwapOptError, SwapOptimizerConfig, is_swap_optimizer, swap_stats
from swapopt_core._automatic import swap_automatically
from swapopt_core._variables import warn_unknown_variables
from swapopt_core.mindformers_yaml import (
    GRAPH_HINT,
    SwapOptimizerSection,
    build_trainer_config,
    fit_device_budget,
    read_callback_options,
    read_command_line,
    read_context,
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


@MindFormerRegister.register(MindFormerModuleType.CALLBACK)
class SwapOptimizerCallback(TrainerCallback):
    """Keep the optimizer state in host memory while MindFormers' pynative Trainer trains.

    At ``on_train_begin`` the Trainer's optimizer is swapped in place; the Trainer has
    already loaded any checkpoint by then, so the loaded state moves to host memory too.
    The swap stays installed after training (bringing the whole state back to the device
    at the end would undo the saving); ``unswap_optimizer(trainer.optimizer)`` removes it.
    At ``on_train_end`` the callback logs ``swap_stats`` as one JSON line. An optimizer
    swapopt cannot serve is left as it is with one ``SwapOptWarning`` (``SWAPOPT_STRICT=1``:
    ``UnsupportedOptimizerError`` instead).

    Args:
        swap_times: Pipeline batches per step (an integer >= 1).
        state_keys: State entries to swap, out of those the registered MindSpore optimizer
            families keep (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``,
            ``stat``); None swaps all that the optimizer keeps.
        min_numel: State tensors with fewer elements stay on the device (>= 0).
        include_master_params: Also swap fp32 master weights, where the optimizer keeps them.
        packed_swap: True, False, or None (or ``"auto"``) for the runtime's default.
        runtime: ``"auto"`` or a registered MindSpore runtime (``"ascend"``, ``"loopback"``).
        device_budget_mb: Device MiB the optimizer state may hold (its resident share plus
            the staging of the rest; optimizer state only): as much state as fits stays on
            the device for good (``resident_state_fraction``, chosen at train begin).
            Exclusive with ``resident_state_fraction``.

    Defaults are ``SwapOptimizerConfig``'s. The keys are read by
    ``SwapOptimizerConfig.from_options``, as the ``swap_optimizer:`` section is.

    Raises:
        ValueError: At construction, an unknown keyword or a bad value; the message names
            it, shows the value and lists what is accepted.
        SwapOptError: At train begin, without an optimizer or outside PyNative mode.
        ValueError: At train begin, a ``device_budget_mb`` below the staging floor.

    Example:
        >>> Trainer(config=config_dict, callbacks=[SwapOptimizerCallback(swap_times=8)])
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self._config, self._budget = read_callback_options(options, source=type(self).__name__)

    @property
    def config(self) -> SwapOptimizerConfig:
        """The swap configuration this callback installs."""
        return self._config

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        """Swap the optimizer that ``CallbackHandler`` passes as ``optimizer=``."""
        warn_unknown_variables(os.environ)  # a misspelt SWAPOPT_STRICT is not ignored silently
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
                f"context is in mode {ms.get_context('mode')}. {GRAPH_HINT}"
            )
        # An optimizer swapopt cannot serve trains unswapped, with one warning.
        if swap_automatically(optimizer, self._config):
            if self._budget is not None:  # all state in host memory now: keep what fits
                fit_device_budget(optimizer, self._budget)
            logger.info("swapopt: %s swapped with %s", type(optimizer).__name__, self._config)

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        """Log what the swap held and moved, as ``swapopt stats at train end: {json}``."""
        optimizer = kwargs.get("optimizer")
        if optimizer is None or not is_swap_optimizer(optimizer):
            logger.info("swapopt: nothing was swapped in this run")
            return
        stats = dataclasses.asdict(swap_stats(optimizer))
        logger.info("swapopt stats at train end: %s", json.dumps(stats, sort_keys=True))


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run MindFormers' pynative Trainer on a YAML, with the ``swap_optimizer:`` section.

    Returns:
        0 after training; 2 when the YAML or an option is invalid (the reason goes to stderr).
    """
    from mindformers.pynative.trainer import Trainer

    read = read_command_line(argv, _apply_context)
    if isinstance(read, int):
        return read
    args, config = read
    Trainer(config=config).train(checkpoint_path=args.checkpoint, mode=args.mode)
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so the class registered last is the importable one.
    from swapopt_plugins.mindformers import main as _main

    sys.exit(_main())
