"""Tiny models, data and a runner shared by the Lightning integration tests.

Each model is written once as a mixin and declared for both Lightning packages
(``pytorch_lightning`` and ``lightning.pytorch``); ``PACKAGES`` holds what a test needs of
each. Importable by name (``ddp_spawn`` pickles the model into fresh processes) and runnable
as a script: ``python _lightning_models.py OUT_DIR`` is one rank of a two-process DDP run
started with torchrun-style environment variables (see ``test_lightning.py``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as lp
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from swapopt_core import SwapOptimizerConfig
from swapopt_plugins.lightning import LightningSwapOptimizerCallback, SwapOptimizerCallback

LOOPBACK = SwapOptimizerConfig(runtime="loopback", min_numel=16, swap_times=3)


def loader(n: int = 24, batch_size: int = 4) -> DataLoader:
    """A fixed regression data set, the same in every process."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 32, generator=gen)
    y = torch.randn(n, 4, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class NetLogic:
    """An MLP trained with AdamW and a step- or epoch-interval scheduler (mixin)."""

    def __init__(self, interval: str = "step", width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.interval = interval
        layers: list[nn.Module] = [nn.Linear(32, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        if self.interval == "step":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        else:
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


class TwoOptimizerLogic(NetLogic):
    """Manual optimization with two optimizers stepped in turn (GAN-style) (mixin)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.head = nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        x, y = batch
        loss_a = nn.functional.mse_loss(self.net(x), y)
        opt_a.zero_grad()
        self.manual_backward(loss_a)
        opt_a.step()
        loss_b = nn.functional.mse_loss(self.head(self.net(x).detach()), y)
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        opt_b.step()
        self.lr_schedulers().step()

    def configure_optimizers(self) -> Any:
        opt_a = torch.optim.AdamW(self.net.parameters(), lr=1e-2)
        opt_b = torch.optim.Adam(self.head.parameters(), lr=1e-2, amsgrad=True)
        sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
        return [opt_a, opt_b], [sched]


class Net(NetLogic, pl.LightningModule):
    """``NetLogic`` as a ``pytorch_lightning`` module."""


class TwoOptimizerNet(TwoOptimizerLogic, pl.LightningModule):
    """``TwoOptimizerLogic`` as a ``pytorch_lightning`` module."""


class UnifiedNet(NetLogic, lp.LightningModule):
    """``NetLogic`` as a ``lightning.pytorch`` module."""


class UnifiedTwoOptimizerNet(TwoOptimizerLogic, lp.LightningModule):
    """``TwoOptimizerLogic`` as a ``lightning.pytorch`` module."""


@dataclass(frozen=True)
class Package:
    """One Lightning package as the tests use it.

    Attributes:
        name: ``"pytorch_lightning"`` or ``"lightning.pytorch"``.
        module: The package (``Trainer``, ``Callback``, ``callbacks``, ...).
        net: ``Net`` built on it; ``model(*mixins)`` adds test-local mixins in front.
        two_optimizer_net: ``TwoOptimizerNet`` built on it.
        callback: swapopt's callback class for this package.
    """

    name: str
    module: ModuleType
    net: type
    two_optimizer_net: type
    callback: type

    def model(self, *mixins: type, base: type | None = None) -> type:
        """``Net`` (or ``base``) with test-local ``mixins`` overriding its methods."""
        return _composed(mixins, base or self.net)


@functools.cache
def _composed(mixins: tuple[type, ...], base: type) -> type:
    if not mixins:
        return base
    return type("".join(m.__name__ for m in mixins) + base.__name__, (*mixins, base), {})


PL = Package("pytorch_lightning", pl, Net, TwoOptimizerNet, SwapOptimizerCallback)
LP = Package(
    "lightning.pytorch", lp, UnifiedNet, UnifiedTwoOptimizerNet, LightningSwapOptimizerCallback
)
PACKAGES = {package.name: package for package in (PL, LP)}


def trainer(
    root: Path | str, callbacks: list | None = None, package: Package = PL, **kwargs: Any
) -> Any:
    """A quiet CPU trainer of ``package``; ``kwargs`` override the defaults."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 6,
        "limit_val_batches": 0,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": str(root),
        "deterministic": True,
    }
    options.update(kwargs)
    return package.module.Trainer(callbacks=callbacks or [], **options)


def fit(
    root: Path | str,
    callbacks: list | None = None,
    make: Callable[[], Any] | None = None,
    ckpt_path: str | None = None,
    package: Package = PL,
    **kwargs: Any,
) -> Any:
    """Seeded ``Trainer.fit`` of a module built by ``make`` (default: the package's ``Net``);
    returns the trained module."""
    package.module.seed_everything(0, verbose=False)
    model = (make or package.net)()
    trainer(root, callbacks, package, **kwargs).fit(model, loader(), ckpt_path=ckpt_path)
    return model


def _ddp_rank(out_dir: Path) -> None:
    """One rank of a torchrun-style launch: plain DDP, then DDP with the callback."""
    torch.set_num_threads(1)
    for name, callbacks in (("plain", []), ("swap", [SwapOptimizerCallback(LOOPBACK)])):
        pl.seed_everything(0, verbose=False)
        model = Net()
        trainer(out_dir / name, callbacks, strategy="ddp", devices=2).fit(model, loader())
        if torch.distributed.get_rank() == 0:
            torch.save(model.state_dict(), out_dir / f"{name}.pt")


def _ddp_figures(out_dir: Path) -> None:
    """One rank of a DDP fit with a ``CSVLogger``: what the callback logged and kept, as
    ``figures-RANK.json`` (the summary lines Lightning's rank_zero_info logger saw)."""
    import json
    import logging

    from lightning_utilities.core import rank_zero

    torch.set_num_threads(1)
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    rank_zero.log.addHandler(handler)
    callback = SwapOptimizerCallback(LOOPBACK)
    logger = pl.loggers.CSVLogger(out_dir / "logs")
    trainer(out_dir, [callback], strategy="ddp", devices=2, logger=logger, log_every_n_steps=2).fit(
        Net(), loader()
    )
    rank = torch.distributed.get_rank()
    (stats,) = callback.swap_stats
    record = {
        "summary": [line for line in lines if line.startswith("swapopt:")],
        "steps": stats.steps,
        "host_state_bytes": stats.host_state_bytes,
    }
    (out_dir / f"figures-{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    if sys.argv[2:] == ["figures"]:
        _ddp_figures(Path(sys.argv[1]))
    else:
        _ddp_rank(Path(sys.argv[1]))
