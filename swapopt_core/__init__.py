"""swapopt core: optimizer state and activations in host memory, brought back just in time."""

from swapopt_core._activations.config import OffloadConfig
from swapopt_core._activations.session import OffloadSession, skip_offload
from swapopt_core._activations.session_stats import OffloadStats
from swapopt_core._api import (
    is_swap_optimizer,
    offload_optimizer_state,
    swap_optimizer,
    swap_stats,
    unswap_optimizer,
)
from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._device.interface import CopyPair, TransferRuntime
from swapopt_core._errors import SwapOptError, SwapOptWarning, UnsupportedOptimizerError
from swapopt_core._mindspore import MindSporeAdapter
from swapopt_core._planning.interface import ResidencyPlanner
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule
from swapopt_core._planning.step_types import BudgetTooSmall
from swapopt_core._plugins import get_plugin_manager, new_plugin_manager, runtime_names
from swapopt_core._stats import SwapStats
from swapopt_core._torch.adapter import OptimizerAdapter, StateFactory
from swapopt_core._torch.per_parameter import PerParameterAdapter
from swapopt_core.hookspecs import hookimpl

#: The interface of the activation runtimes, which is the one every runtime implements.
ActivationRuntime = TransferRuntime

__all__ = [
    "ActivationRuntime",
    "ActivationTrace",
    "BudgetTooSmall",
    "CopyPair",
    "MindSporeAdapter",
    "OffloadConfig",
    "OffloadSession",
    "OffloadStats",
    "OptimizerAdapter",
    "PerParameterAdapter",
    "ResidencyPlanner",
    "ResidencySchedule",
    "StateFactory",
    "SwapOptError",
    "SwapOptWarning",
    "UnsupportedOptimizerError",
    "SwapOptimizerConfig",
    "SwapStats",
    "TransferRuntime",
    "get_plugin_manager",
    "hookimpl",
    "is_swap_optimizer",
    "new_plugin_manager",
    "offload_optimizer_state",
    "runtime_names",
    "skip_offload",
    "swap_optimizer",
    "swap_stats",
    "unswap_optimizer",
]
