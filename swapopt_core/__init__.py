"""swapopt core: optimizer state in host memory, streamed through the step bit for bit."""

from swapopt_core._adapter import OptimizerAdapter, StateFactory
from swapopt_core._api import is_swap_optimizer, swap_optimizer, swap_stats, unswap_optimizer
from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._errors import SwapOptError, SwapOptWarning
from swapopt_core._plugins import get_plugin_manager, new_plugin_manager
from swapopt_core._runtime import CopyPair, TransferRuntime
from swapopt_core._stats import SwapStats
from swapopt_core.hookspecs import hookimpl

__all__ = [
    "CopyPair",
    "OptimizerAdapter",
    "StateFactory",
    "SwapOptError",
    "SwapOptWarning",
    "SwapOptimizerConfig",
    "SwapStats",
    "TransferRuntime",
    "get_plugin_manager",
    "hookimpl",
    "is_swap_optimizer",
    "new_plugin_manager",
    "swap_optimizer",
    "swap_stats",
    "unswap_optimizer",
]
