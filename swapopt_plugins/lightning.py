"""Lightning integration: ``Trainer(callbacks=[SwapOptimizerCallback(...)])``.

``SwapOptimizerCallback`` derives from ``pytorch_lightning.Callback``. When the ``lightning``
package is installed, ``LightningSwapOptimizerCallback`` is the same callback for
``lightning.pytorch.Trainer`` (the two class hierarchies do not mix); with only ``lightning``
installed, ``SwapOptimizerCallback`` names that class. The logic lives in
``swapopt_plugins._lightning_core``; the classes here only map Lightning hooks onto it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from swapopt_core import OffloadConfig, OffloadSession, SwapOptimizerConfig
from swapopt_plugins._lightning_core import SwapCallbackCore, auto_enabled, config_from_env

if TYPE_CHECKING:
    import pytorch_lightning as pl

try:
    import pytorch_lightning as _pl
    from pytorch_lightning.utilities.exceptions import MisconfigurationException as _PLError
except ImportError:  # pragma: no cover - only `lightning` installed
    _pl = None
try:
    import lightning.pytorch as _lp
    from lightning.fabric.utilities.exceptions import MisconfigurationException as _LPError
except ImportError:
    _lp = None
if _pl is None and _lp is None:  # pragma: no cover
    raise ImportError(
        "swapopt_plugins.lightning needs pytorch_lightning>=2.4 or lightning: "
        "pip install 'swapopt[lightning]'."
    )

__all__ = ["SwapOptimizerCallback", "callbacks_factory", "lightning_callbacks_factory"]

_DOC = """Keep optimizer state (and optionally activations) in host memory during ``fit``.

    Swaps every optimizer in place at fit start (schedulers, ``LightningOptimizer``, scalers
    and ``LearningRateMonitor`` keep the same object), takes state a checkpoint restore put
    on the device back to host memory, and unswaps at teardown or on an error. With
    ``activation_offload`` each optimizer step's forward and backward (a whole accumulation
    window; in manual optimization, up to each ``step()``) run in one ``OffloadSession``.

    Args:
        config: How optimizer state is swapped. Default: ``SwapOptimizerConfig()``.
        activation_offload: Activation budget and runtime. Default: None (no offload).

    Raises:
        TypeError: An argument has the wrong type.
        MisconfigurationException: At setup, for a strategy that manages the same state
            itself (DeepSpeed, FSDP with ``cpu_offload``).

    Example:
        >>> trainer = Trainer(callbacks=[SwapOptimizerCallback(SwapOptimizerConfig(swap_times=8))])
    """


def _window_done(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether this batch ends an accumulation window (so its optimizer step has run)."""
    accumulate = trainer.accumulate_grad_batches
    return (batch_idx + 1) % accumulate == 0 or batch_idx + 1 >= trainer.num_training_batches


def _build(base: type, error: type[Exception], name: str) -> type:
    class _Callback(base):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            config: SwapOptimizerConfig | None = None,
            *,
            activation_offload: OffloadConfig | None = None,
        ) -> None:
            super().__init__()
            self._core = SwapCallbackCore(config, activation_offload)

        @property
        def config(self) -> SwapOptimizerConfig:
            return self._core.config

        @property
        def activation_offload(self) -> OffloadConfig | None:
            return self._core.activation_offload

        @property
        def offload_sessions(self) -> dict[int, OffloadSession]:
            """The sessions of the last fit, keyed by the optimizer stepped before each."""
            return dict(self._core.offload_sessions)

        @property
        @override
        def state_key(self) -> str:
            extra = {"auto": True} if self._core.auto else {}
            return self._generate_state_key(
                config=self.config, activation_offload=self.activation_offload, **extra
            )

        @override
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            core = self._core
            core.rank_zero = trainer.is_global_zero
            if stage != "fit":
                return
            others = [c for c in trainer.callbacks if isinstance(c, _Callback) and c is not self]
            core.active = not (core.auto and others)
            if not core.active:
                core._say("swapopt: %s set explicitly; the auto-registered one stays idle", name)
                return
            reason = core.refusal(trainer.strategy)
            if reason is not None:
                raise error(reason)

        @override
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if self._core.active:
                self._core.install(
                    trainer.strategy.optimizers,
                    automatic=pl_module.automatic_optimization,
                    rank_zero=trainer.is_global_zero,
                )

        @override
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            # Lightning restored the checkpoint after on_fit_start and moved the state to
            # the device (_optimizer_to_device): take it back before the first forward.
            self._core.reoffload()

        @override
        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
        ) -> None:
            self._core.batch_start()

        @override
        def on_before_optimizer_step(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
        ) -> None:
            self._core.before_optimizer_step()

        @override
        def on_train_batch_end(
            self,
            trainer: pl.Trainer,
            pl_module: pl.LightningModule,
            outputs: Any,
            batch: Any,
            batch_idx: int,
        ) -> None:
            self._core.batch_end(window_done=_window_done(trainer, batch_idx))

        @override
        def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._core.close_window()

        @override
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._core.close_window()

        @override
        def on_exception(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
        ) -> None:
            self._core.remove(exception)

        @override
        def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            self._core.remove()

        @override
        def state_dict(self) -> dict[str, Any]:
            return self._core.state_dict()

        @override
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self._core.load_state_dict(state_dict)

    # Importable under its public name, so ddp_spawn can pickle instances.
    _Callback.__name__ = _Callback.__qualname__ = name
    _Callback.__module__ = __name__
    _Callback.__doc__ = _DOC
    return _Callback


def _auto_callbacks(cls: type | None) -> list[Any]:
    if cls is None or not auto_enabled(os.environ):
        return []
    config, activation_offload = config_from_env(os.environ)
    callback = cls(config, activation_offload=activation_offload)
    callback._core.auto = True
    return [callback]


_PLCallback = _build(_pl.Callback, _PLError, "SwapOptimizerCallback") if _pl else None
LightningSwapOptimizerCallback = (
    _build(_lp.Callback, _LPError, "LightningSwapOptimizerCallback") if _lp else None
)
SwapOptimizerCallback: type = _PLCallback or LightningSwapOptimizerCallback  # type: ignore[assignment]
if _lp is not None:
    __all__ += ["LightningSwapOptimizerCallback"]


def callbacks_factory() -> list[Any]:
    """Entry point of ``pytorch_lightning.callbacks_factory``: the callback when
    ``SWAPOPT_LIGHTNING_AUTO=1``, configured from ``SWAPOPT_*`` variables; else ``[]``."""
    return _auto_callbacks(_PLCallback)


def lightning_callbacks_factory() -> list[Any]:
    """Entry point of ``lightning.pytorch.callbacks_factory`` (see ``callbacks_factory``)."""
    return _auto_callbacks(LightningSwapOptimizerCallback)
