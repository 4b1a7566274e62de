"""Lightning's callback hooks mapped onto ``SwapCallbackCore``, written once for both packages.

``swapopt_plugins.lightning`` declares one class per Lightning package, each deriving from
``SwapCallbackHooks`` and that package's ``Callback`` (in that order, so these hooks win).
Lightning calls hooks by name and passes its own trainer and module, so nothing here
imports Lightning: the only thing that differs between the packages is the exception
raised for a strategy the callback cannot serve.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from swapopt_core import OffloadConfig, OffloadSession, SwapOptimizerConfig
from swapopt_plugins._lightning_core import SwapCallbackCore
from swapopt_plugins._options import auto_enabled, read_settings

__all__ = ["SwapCallbackHooks", "auto_callbacks", "refusal"]

_C = TypeVar("_C", bound="SwapCallbackHooks")


def refusal(strategy: object) -> str | None:
    """Why ``strategy`` cannot be served, or None when it can."""
    names = {cls.__name__ for cls in type(strategy).__mro__}
    if "DeepSpeedStrategy" in names:
        zero = (getattr(strategy, "config", None) or {}).get("zero_optimization", {})
        offloads = [
            key
            for key in ("offload_optimizer", "offload_param")
            if isinstance(zero.get(key), dict) and zero[key].get("device", "none") != "none"
        ]
        already = f" and already offloads it ({', '.join(offloads)})" if offloads else ""
        return (
            f"SwapOptimizerCallback cannot run with {type(strategy).__name__}: DeepSpeed "
            f"keeps the optimizer state inside its own ZeRO optimizer{already}. Use "
            "DeepSpeedStrategy(offload_optimizer=True) without this callback, or keep the "
            "callback and train with strategy='ddp' or FSDP without cpu_offload."
        )
    cpu_offload = getattr(strategy, "cpu_offload", None)
    if "FSDPStrategy" in names and (
        cpu_offload is True or getattr(cpu_offload, "offload_params", False)
    ):
        return (
            f"SwapOptimizerCallback cannot run with {type(strategy).__name__}(cpu_offload="
            f"{cpu_offload!r}): FSDP already keeps parameters, gradients and optimizer state "
            "in host memory and steps there, so nothing is left on the device to swap. "
            "Remove the callback, or set cpu_offload=False so the callback swaps only the "
            "optimizer state."
        )
    return None


#: Lightning's stand-in optimizers (``configure_optimizers`` returned None), by name, as this
#: module imports no Lightning: a callback of one package may serve the other's Trainer.
_PLACEHOLDERS = frozenset(
    f"{package}.core.optimizer._MockOptimizer"
    for package in ("pytorch_lightning", "lightning.pytorch")
)


def _is_placeholder(optimizer: object) -> bool:
    """Whether ``optimizer`` is Lightning's stand-in for a module without an optimizer."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}" in _PLACEHOLDERS


def _window_done(trainer: Any, batch_idx: int) -> bool:
    """Whether this batch ends an accumulation window (so its optimizer step has run)."""
    accumulate = trainer.accumulate_grad_batches
    return (batch_idx + 1) % accumulate == 0 or batch_idx + 1 >= trainer.num_training_batches


class SwapCallbackHooks:
    """The hooks of ``SwapOptimizerCallback``; see ``swapopt_plugins.lightning``.

    Args:
        config: How optimizer state is swapped. Default: ``SwapOptimizerConfig()``.
        activation_offload: Activation budget and runtime. Default: None (no offload).

    Raises:
        TypeError: An argument has the wrong type.
    """

    #: What ``setup`` raises for a strategy it cannot serve (the package's own exception).
    _misconfiguration: ClassVar[type[Exception]] = ValueError

    if TYPE_CHECKING:  # given by Lightning's Callback, which the concrete classes derive from

        def _generate_state_key(self, **kwargs: Any) -> str: ...

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
        """How optimizer state is swapped."""
        return self._core.config

    @property
    def activation_offload(self) -> OffloadConfig | None:
        """The activation-offload config, or None when activations stay on the device."""
        return self._core.activation_offload

    @property
    def offload_sessions(self) -> dict[int, OffloadSession]:
        """The sessions of the last fit, keyed by the optimizer stepped before each."""
        return dict(self._core.offload_sessions)

    @property
    def state_key(self) -> str:
        extra = {"auto": True} if self._core.auto else {}
        return self._generate_state_key(
            config=self.config, activation_offload=self.activation_offload, **extra
        )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        core = self._core
        core.rank_zero = trainer.is_global_zero
        if stage != "fit":
            return
        # Either package's class counts: Lightning runs both kinds of callback.
        others = [
            c for c in trainer.callbacks if isinstance(c, SwapCallbackHooks) and c is not self
        ]
        core.active = not (core.auto and others)
        if not core.active:
            name = type(others[0]).__name__
            core._say("swapopt: %s set explicitly; the auto-registered one stays idle", name)
            return
        reason = refusal(trainer.strategy)
        if reason is not None:
            raise self._misconfiguration(reason)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._core.active:
            return
        optimizers = list(trainer.strategy.optimizers)
        real = [opt for opt in optimizers if not _is_placeholder(opt)]
        self._core.rank_zero = trainer.is_global_zero
        if len(real) < len(optimizers):
            # NOTE: Lightning trains such a module with a stand-in that has no state.
            self._core.nothing_to_swap("configure_optimizers returned None (no optimizer)")
        self._core.install(
            real, automatic=pl_module.automatic_optimization, rank_zero=trainer.is_global_zero
        )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning restored the checkpoint after on_fit_start and moved the state to the
        # device (_optimizer_to_device): take it back before the first forward.
        self._core.reoffload()

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._core.batch_start()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._core.before_optimizer_step()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._core.batch_end(window_done=_window_done(trainer, batch_idx))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._core.close_window()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._core.close_window()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._core.remove(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._core.remove()

    def state_dict(self) -> dict[str, Any]:
        return self._core.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._core.load_state_dict(state_dict)


def auto_callbacks(cls: type[_C]) -> list[_C]:
    """The callback an entry-point factory adds: ``[cls(...)]`` configured from the
    ``SWAPOPT_*`` variables when ``SWAPOPT_LIGHTNING_AUTO`` is a yes word, else ``[]``.

    Raises:
        ValueError: A variable holds a value that is not accepted; the message names it.
    """
    if not auto_enabled(os.environ):
        return []
    settings = read_settings({}, owner=cls.__name__)
    callback = cls(settings.swap, activation_offload=settings.activations)
    callback._core.auto = True
    return [callback]
