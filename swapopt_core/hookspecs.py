"""Every hook swapopt calls, and the markers plugins use to implement them.

A plugin is any object (usually a module) with functions marked ``@swapopt_core.hookimpl``
whose names match the specs below. The built-in runtimes, optimizer adapters and planners
are registered the same way (``swapopt_core._plugins.DEFAULT_PLUGINS``), so a plugin can do
anything a built-in does. Third-party plugins are found through the ``swapopt`` entry-point
group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from swapopt_core._config import SwapOptimizerConfig
    from swapopt_core._device.interface import TransferRuntime
    from swapopt_core._mindspore.adapter import MindSporeAdapter
    from swapopt_core._planning.interface import ResidencyPlanner
    from swapopt_core._stats import SwapStats
    from swapopt_core._swap.engine import EngineBase
    from swapopt_core._torch.adapter import OptimizerAdapter

PROJECT = "swapopt"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["PROJECT", "SwapOptSpecs", "hookimpl", "hookspec"]


class SwapOptSpecs:
    """Hook specifications. Every hook takes keyword arguments only.

    The observers receive the optimizer exactly as it was given to ``swap_optimizer``: a
    ``torch.optim.Optimizer`` or a MindSpore optimizer Cell (``mindspore.nn.Optimizer``),
    hence ``Any``.
    """

    # ---- registration --------------------------------------------------------------------

    @hookspec
    def swapopt_register_runtimes(self) -> Iterable[type[TransferRuntime[Any, Any, Any]]]:
        """Contribute transfer runtimes, for the optimizer swap and the activation offload.

        Called at every ``swap_optimizer``, when an ``OffloadSession`` is created (it
        resolves ``OffloadConfig.runtime`` there, so an unknown name fails at once) and by
        ``runtime_names()`` (which config validation uses). Each class carries a ``name``,
        unique within its ``framework`` and never ``"auto"`` (what
        ``SwapOptimizerConfig.runtime`` and ``OffloadConfig.runtime`` select), and the
        ``device_types`` that ``runtime="auto"`` picks it for. Both halves share one instance
        per device (``shared_key``), made by the classmethod ``create(device)``.

        Returns:
            Runtime classes, subclasses of ``swapopt_core.TransferRuntime`` (the interface,
            with each method's contract, is in ``swapopt_core/_device/interface.py``); each
            serves the tensors of its ``framework`` (``"torch"`` or ``"mindspore"``).
        """

    @hookspec
    def swapopt_register_optimizer_adapters(
        self,
    ) -> Iterable[OptimizerAdapter | MindSporeAdapter]:
        """Contribute optimizer families that can be swapped.

        Called at every ``swap_optimizer`` (and when config validation lists the state
        keys); the first adapter of the optimizer's framework whose ``matches`` accepts it
        serves it. Adapters from plugins registered later are asked first, so a
        plugin can take over a family a built-in serves.

        Returns:
            Instances of ``swapopt_core.OptimizerAdapter`` subclasses (torch optimizers) or of
            ``swapopt_core.MindSporeAdapter`` subclasses (MindSpore optimizer Cells).
        """

    @hookspec
    def swapopt_register_planners(self) -> Iterable[ResidencyPlanner]:
        """Contribute activation residency planners.

        Called when an ``OffloadSession`` resolves ``OffloadConfig.planner`` and by
        ``swapopt plan``. Each planner carries a unique ``name``.

        Returns:
            Instances of ``swapopt_core.ResidencyPlanner`` subclasses.
        """

    @hookspec
    def swapopt_register_engines(self) -> Iterable[type[EngineBase]]:
        """Contribute swap engines: one per framework whose optimizers can be swapped.

        Called at every ``swap_optimizer``. Each engine class says with its classmethod
        ``serves(optimizer)`` whether an optimizer is of its framework (without importing
        that framework); the first engine that serves it is built, and the runtimes and
        adapters of its ``framework`` are offered to it. Engines from plugins registered
        later are asked first, so a plugin can take over a framework a built-in serves.

        Returns:
            Engine classes, subclasses of ``swapopt_core._swap.engine.EngineBase``.
        """

    # ---- integrations ----------------------------------------------------------------------

    @hookspec
    def swapopt_install_integrations(self) -> str | None:
        """Switch on, process-wide, the integration this plugin provides.

        Called once by ``swapopt run`` before the user's script starts (the core never
        imports a training framework itself). The plugin reads the ``SWAPOPT_*`` environment
        variables (``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE``, ``SWAPOPT_ACTIVATION_BUDGET_MB``, ...)
        and installs itself its own way, e.g. every Accelerate ``Accelerator`` swaps the
        optimizers it prepares, or every Lightning ``Trainer`` gets the callback. Calling it
        twice does no more than calling it once. A ``ValueError`` naming the variable stops
        ``swapopt run`` before the script starts.

        Returns:
            A short name of what was switched on (e.g. ``"accelerate"``), or None when the
            framework is not installed or the variables ask for nothing.
        """

    # ---- lifecycle observers ---------------------------------------------------------------

    @hookspec
    def swapopt_on_install(self, optimizer: Any, config: SwapOptimizerConfig) -> None:
        """Called after the swap was installed on ``optimizer`` and its state offloaded.

        Not called when ``swap_optimizer`` installs nothing (``runtime="auto"`` without an
        accelerator) or finds the same config installed already.

        Args:
            optimizer: The torch optimizer or MindSpore optimizer Cell now swapped.
            config: The config it was swapped with.
        """

    @hookspec
    def swapopt_after_step(self, optimizer: Any, stats: SwapStats) -> None:
        """Called after every swapped step, once its state is back in host memory.

        Args:
            optimizer: The torch optimizer or MindSpore optimizer Cell that stepped.
            stats: Its ``swap_stats`` snapshot after the step.
        """

    @hookspec
    def swapopt_on_uninstall(self, optimizer: Any) -> None:
        """Called after ``unswap_optimizer`` removed the swap and moved the state back.

        Args:
            optimizer: The torch optimizer or MindSpore optimizer Cell, a plain one again.
        """
