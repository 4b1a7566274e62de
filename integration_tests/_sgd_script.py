"""An unmodified training script with ``torch.optim.SGD`` (momentum, nesterov): no swapopt API.

Run by ``test_optimizer_families_run.py`` as ``python _sgd_script.py KIND OUT`` and as
``swapopt run _sgd_script.py KIND OUT``. ``KIND`` is ``lightning`` (``Trainer.fit`` with a
step scheduler, accumulation 2 and gradient clipping) or ``accelerate`` (a plain
``Accelerator()`` with accumulation 2 and clipping). It saves the trained parameters and the
optimizer's state dict to ``OUT`` and prints one line ``REPORT {json}``: whether the
optimizer was swapped while it trained and, if so, its ``swap_stats`` after the last step
(taken by a step post-hook, which needs no framework callback).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

STEPS = 6  # optimizer steps: 12 micro-batches, accumulation 2


def _data() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(24, 32, generator=gen), torch.randn(24, 4, generator=gen)
    )
    return torch.utils.data.DataLoader(data, batch_size=2)


def _network() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _sgd(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _watch(optimizer: torch.optim.Optimizer, seen: dict) -> None:
    """Record after every step whether ``optimizer`` is swapped, and its stats if so."""

    def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            from swapopt_core import is_swap_optimizer, swap_stats
        except ImportError:  # not installed: certainly not swapped
            seen["swapped"].append(False)
            return
        seen["swapped"].append(is_swap_optimizer(opt))
        if is_swap_optimizer(opt):
            stats = swap_stats(opt)
            seen["stats"] = {
                "steps": stats.steps,
                "swapped_tensors": stats.swapped_tensors,
                "host_state_bytes": stats.host_state_bytes,
                "resident_state_bytes": stats.resident_state_bytes,
            }

    optimizer.register_step_post_hook(after_step)


def lightning(seen: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import pytorch_lightning as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _network()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = _sgd(self.parameters())
            _watch(opt, seen)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    pl.seed_everything(0, verbose=False)
    model = Net()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, _data())
    return model.net, trainer.optimizers[0]


def accelerate(seen: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _network()
    optimizer = _sgd(model.parameters())
    _watch(optimizer, seen)
    model, prepared, loader = accelerator.prepare(model, optimizer, _data())
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            prepared.step()
            prepared.zero_grad()
    return model, optimizer


def main(kind: str, out: Path) -> None:
    seen: dict = {"swapped": [], "stats": None}
    model, optimizer = {"lightning": lightning, "accelerate": accelerate}[kind](seen)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"params": params, "optimizer": optimizer.state_dict()}, out)
    print("REPORT " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
