"""Lightning integration: ``Trainer(callbacks=[SwapOptimizerCallback(...)])``.

One callback class per Lightning package, both written out here and both with the hooks of
``swapopt_plugins._lightning_hooks.SwapCallbackHooks``:

- ``SwapOptimizerCallback`` derives from ``pytorch_lightning.Callback``;
- ``LightningSwapOptimizerCallback`` derives from ``lightning.pytorch.Callback``.

Lightning calls a callback's hooks without checking which package it derives from, so
either class serves either ``Trainer``; pick the one matching your imports so that
``isinstance`` checks and type checkers agree. With only the unified ``lightning`` package
installed, ``SwapOptimizerCallback`` names ``LightningSwapOptimizerCallback``.
"""

from __future__ import annotations

from typing import Any

from swapopt_plugins._integrations import enable_lightning_auto
from swapopt_plugins._lightning_hooks import SwapCallbackHooks, auto_callbacks

try:
    import pytorch_lightning as _pl
    from pytorch_lightning.utilities.exceptions import MisconfigurationException as _PLError
except ImportError:  # pragma: no cover - only the unified `lightning` package installed
    _pl = None
try:
    import lightning.pytorch as _lp
    from lightning.pytorch.utilities.exceptions import MisconfigurationException as _LPError
except ImportError:  # pragma: no cover - only `pytorch_lightning` installed
    _lp = None
if _pl is None and _lp is None:  # pragma: no cover
    raise ImportError(
        "swapopt_plugins.lightning needs pytorch_lightning>=2.4 or lightning>=2.4: "
        "pip install 'swapopt[lightning]'."
    )

__all__ = [
    "LightningSwapOptimizerCallback",
    "SwapOptimizerCallback",
    "callbacks_factory",
    "install_globally",
    "lightning_callbacks_factory",
]

if _lp is not None:

    class LightningSwapOptimizerCallback(SwapCallbackHooks, _lp.Callback):
        """``SwapOptimizerCallback`` deriving from ``lightning.pytorch.Callback``.

        Same arguments and behaviour as ``SwapOptimizerCallback``; ``setup`` raises
        ``lightning.pytorch``'s ``MisconfigurationException``. This is the class the
        ``lightning.pytorch.callbacks_factory`` entry point adds.
        """

        _misconfiguration = _LPError

else:  # pragma: no cover - only `pytorch_lightning` installed
    LightningSwapOptimizerCallback = None  # type: ignore[assignment, misc]

if _pl is not None:

    class SwapOptimizerCallback(SwapCallbackHooks, _pl.Callback):
        """Keep optimizer state (and optionally activations) in host memory during ``fit``.

        Swaps every optimizer in place at fit start (schedulers, ``LightningOptimizer``,
        scalers and ``LearningRateMonitor`` keep the same object), takes state a checkpoint
        restore put on the device back to host memory, and unswaps at teardown or on an
        error. With ``activation_offload`` each optimizer step's forward and backward (a
        whole accumulation window; in manual optimization, up to each ``step()``) run in one
        ``OffloadSession``.

        Args:
            config: How optimizer state is swapped. Default: ``SwapOptimizerConfig()``.
            activation_offload: Activation budget and runtime. Default: None (no offload).

        Raises:
            TypeError: An argument has the wrong type.
            MisconfigurationException: At setup, for a strategy that manages the same
                state itself (DeepSpeed, FSDP with ``cpu_offload``).

        Example:
            >>> swap = SwapOptimizerCallback(SwapOptimizerConfig(swap_times=8))
            >>> trainer = Trainer(callbacks=[swap])
        """

        _misconfiguration = _PLError

else:  # pragma: no cover - only the unified `lightning` package installed
    SwapOptimizerCallback = LightningSwapOptimizerCallback  # type: ignore[assignment, misc]


def callbacks_factory() -> list[Any]:
    """Entry point of ``pytorch_lightning.callbacks_factory``: the callback when
    ``SWAPOPT_LIGHTNING_AUTO=1``, configured from ``SWAPOPT_*`` variables; else ``[]``."""
    return auto_callbacks(SwapOptimizerCallback) if _pl is not None else []


def lightning_callbacks_factory() -> list[Any]:
    """Entry point of ``lightning.pytorch.callbacks_factory`` (see ``callbacks_factory``)."""
    return auto_callbacks(LightningSwapOptimizerCallback) if _lp is not None else []


def install_globally() -> bool:
    """Add the callback to every ``Trainer`` from now on (what ``swapopt run`` calls).

    Sets ``SWAPOPT_LIGHTNING_AUTO=1`` when ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu`` or an
    activation budget is set (a ``SWAPOPT_LIGHTNING_AUTO`` set by the user decides instead);
    the callback reads its configuration from the same variables. Idempotent.

    Returns:
        Whether every Trainer now gets the callback.

    Raises:
        ValueError: A ``SWAPOPT_*`` variable is invalid; the message names it.
    """
    return enable_lightning_auto()
