"""Lightning integration: ``Trainer(callbacks=[SwapOptimizerCallback(...)])``.

The callback is a ``swapopt_core.callbacks.SwapCallbackCore``, which decides what is swapped
and when an activation session opens and closes; this module only maps Lightning's hooks
onto it. ``SwapOptimizerCallback`` derives from ``pytorch_lightning.Callback`` and
``LightningSwapOptimizerCallback`` from ``lightning.pytorch.Callback``; Lightning does not
check which, so either serves either ``Trainer``: pick the one matching your imports so that
``isinstance`` checks and type checkers agree. With only the unified ``lightning`` package
installed, ``SwapOptimizerCallback`` names ``LightningSwapOptimizerCallback``.

The callback logs the ``swapopt/...`` figures (``docs/figures.md``) to the Trainer's loggers
every ``log_every_n_steps`` on rank zero, keeps ``swap_stats`` and ``offload_stats`` after
``fit``, and ends the fit with one summary line through Lightning's ``rank_zero_info``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from swapopt_core.callbacks import SwapCallbackCore, deepspeed_offloads, engine_refusal

# install_globally() (swapopt run) sets SWAPOPT_LIGHTNING_AUTO=1 when SWAPOPT_* ask for a swap.
from swapopt_core.options import enable_lightning_auto as install_globally

try:
    import pytorch_lightning as _pl
except ImportError:  # pragma: no cover - only the unified `lightning` package installed
    _pl = None
try:
    import lightning.pytorch as _lp
except ImportError:  # pragma: no cover - only `pytorch_lightning` installed
    _lp = None
if _pl is None and _lp is None:  # pragma: no cover
    raise ImportError(
        "swapopt_plugins.lightning needs pytorch_lightning>=2.4 or lightning>=2.4: "
        "pip install 'swapopt[lightning]'."
    )
# Both packages' rank_zero_info write to one logger that Lightning shows at INFO by default.
_rank_zero_info = (_lp or _pl).utilities.rank_zero.rank_zero_info

__all__ = [
    "LightningSwapOptimizerCallback",
    "SwapOptimizerCallback",
    "callbacks_factory",
    "install_globally",
    "lightning_callbacks_factory",
]

#: Both packages' stand-in optimizers (``configure_optimizers`` returned None), by name.
_PACKAGES = ("pytorch_lightning", "lightning.pytorch")
_PLACEHOLDERS = frozenset(f"{package}.core.optimizer._MockOptimizer" for package in _PACKAGES)


def _refusal(strategy: object) -> str | None:
    """Why ``strategy`` cannot be served, or None when it can."""
    names = {cls.__name__ for cls in type(strategy).__mro__}
    kind, offload = type(strategy).__name__, getattr(strategy, "cpu_offload", None)
    if "DeepSpeedStrategy" in names:
        return engine_refusal(
            kind,
            "deepspeed",
            offloads=deepspeed_offloads(getattr(strategy, "config", None)),
            own_offload="DeepSpeedStrategy(offload_optimizer=True)",
            instead="train with strategy='ddp' or FSDP without cpu_offload",
        )
    if "FSDPStrategy" in names and (offload is True or getattr(offload, "offload_params", 0)):
        return engine_refusal(
            f"{kind}(cpu_offload={offload!r})",
            "fsdp-offload",
            own_offload="FSDP's cpu_offload",
            instead="set cpu_offload=False so that only the optimizer state is swapped",
        )
    return None


class _SwapHooks(SwapCallbackCore):
    """The hooks of ``SwapOptimizerCallback`` (both packages), each a call into the core."""

    #: What ``setup`` raises for a strategy it cannot serve (the package's own exception).
    _misconfiguration: ClassVar[type[Exception]] = ValueError
    _generate_state_key: Callable[..., str]  # from Lightning's Callback, a base of both classes

    @property
    def state_key(self) -> str:
        return self._generate_state_key(**self.identity())

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.rank_zero = trainer.is_global_zero
        # Either package's class counts: Lightning runs both kinds of callback.
        others = [c for c in trainer.callbacks if isinstance(c, _SwapHooks) and c is not self]
        if stage != "fit" or self.stand_by(others):
            return
        if (reason := _refusal(trainer.strategy)) is not None:
            raise self._misconfiguration(reason)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.active:
            return
        optimizers = list(trainer.strategy.optimizers)
        names = [f"{type(o).__module__}.{type(o).__qualname__}" for o in optimizers]
        real = [o for o, name in zip(optimizers, names, strict=True) if name not in _PLACEHOLDERS]
        self.rank_zero = trainer.is_global_zero
        if len(real) < len(optimizers):
            # NOTE: Lightning trains such a module with a stand-in that has no state.
            self.nothing_to_swap("configure_optimizers returned None (no optimizer)")
        automatic = pl_module.automatic_optimization
        # The parameters set the activations' share of a device budget when there is no
        # optimizer (the arithmetic is the core's).
        self.install(
            real, automatic=automatic, rank_zero=self.rank_zero, parameters=pl_module.parameters()
        )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning restored the checkpoint after on_fit_start and moved the state to the
        # device (_optimizer_to_device): take it back before the first forward.
        self.reoffload()

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batch_start()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.before_optimizer_step()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Whether this batch ends an accumulation window (so its optimizer step has run).
        done = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        done = done or batch_idx + 1 >= trainer.num_training_batches
        self.batch_end(window_done=done)
        if (done or not pl_module.automatic_optimization) and self.active and self.rank_zero:
            self._log_figures(trainer)

    def _log_figures(self, trainer: Any) -> None:
        # As LearningRateMonitor: Lightning's log_every_n_steps test and step, straight to the
        # loggers (pl_module.log would add tensor ops that land in the next window's session).
        if not trainer.loggers or not trainer._logger_connector.should_update_logs:
            return
        if figures := self.figures():
            for each in trainer.loggers:
                each.log_metrics(figures, step=trainer.fit_loop.epoch_loop._batches_that_stepped)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.close_window()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.close_window()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.remove(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.remove()
        if stage == "fit" and self.active and self.rank_zero and (line := self.summary()):
            _rank_zero_info(line)


if _lp is not None:

    class LightningSwapOptimizerCallback(_SwapHooks, _lp.Callback):
        """``SwapOptimizerCallback`` deriving from ``lightning.pytorch.Callback`` (same
        arguments and behaviour; ``setup`` raises ``lightning.pytorch``'s
        ``MisconfigurationException``): the class ``lightning_callbacks_factory`` adds."""

        _misconfiguration = _lp.utilities.exceptions.MisconfigurationException

else:  # pragma: no cover - only `pytorch_lightning` installed
    LightningSwapOptimizerCallback = None  # type: ignore[assignment, misc]

if _pl is not None:

    class SwapOptimizerCallback(_SwapHooks, _pl.Callback):
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
            device_budget_mb: The most device memory, in MiB, one training step may hold (one
                optimizer): the session is then ``OffloadSession(config, optimizer=opt)`` and
                plans the whole step under it; with no optimizer (``configure_optimizers``
                returned None) the budget minus the parameters and their gradients is the
                activation budget. Exclusive with an activation budget in
                ``activation_offload``, whose runtime it keeps. Default: None.

        Raises:
            TypeError: An argument has the wrong type.
            ValueError: ``device_budget_mb`` with an activation budget; at fit start, a
                device budget with several optimizers, or with none and below the
                parameters and their gradients.
            MisconfigurationException: At setup, for a strategy that manages the same
                state itself (DeepSpeed, FSDP with ``cpu_offload``).

        Example:
            >>> swap = SwapOptimizerCallback(SwapOptimizerConfig(swap_times=8))
            >>> trainer = Trainer(callbacks=[swap])
            >>> trainer = Trainer(callbacks=[SwapOptimizerCallback(device_budget_mb=40_000)])
        """

        _misconfiguration = _pl.utilities.exceptions.MisconfigurationException

else:  # pragma: no cover - only the unified `lightning` package installed
    SwapOptimizerCallback = LightningSwapOptimizerCallback  # type: ignore[assignment, misc]


def callbacks_factory() -> list[Any]:
    """Entry point of ``pytorch_lightning.callbacks_factory``: the callback when
    ``SWAPOPT_LIGHTNING_AUTO=1``, configured from ``SWAPOPT_*`` variables; else ``[]``."""
    return SwapOptimizerCallback.auto_callbacks() if _pl is not None else []


def lightning_callbacks_factory() -> list[Any]:
    """Entry point of ``lightning.pytorch.callbacks_factory`` (see ``callbacks_factory``)."""
    return LightningSwapOptimizerCallback.auto_callbacks() if _lp is not None else []
