"""An unmodified training script: a plain ``Accelerator()``, no swapopt API.

Run by ``test_accelerate_run.py`` as ``python script.py OUT``, ``swapopt run script.py OUT``
and under ``accelerate launch``; with ``--install`` it calls
``swapopt_plugins.accelerate.install_globally()`` first (what ``swapopt run`` does for it).
It trains 12 micro-batches (accumulation 2, clipping, AdamW, a scheduler), saving a
checkpoint after 6; then frees the accelerator, prepares fresh objects, loads the checkpoint
and trains the last 6 again. Each rank saves to ``OUT/rank<N>.pt`` what both runs ended with,
and prints the ``swap_stats`` line of its optimizer when it was swapped.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

BATCHES, HALF = 12, 6


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(8 * BATCHES, 8, generator=gen), torch.randn(8 * BATCHES, 4, generator=gen)
    )
    return model, optimizer, torch.utils.data.DataLoader(data, batch_size=4), scheduler


def _train(accelerator, model, optimizer, loader, scheduler, start: int, stop: int) -> None:
    for index, (x, y) in enumerate(loader):
        if not start <= index < stop:
            continue
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def _ending(model, optimizer) -> dict:
    from swapopt_core import is_swap_optimizer, swap_stats

    swapped = is_swap_optimizer(optimizer.optimizer)
    # swap_stats waits for the last step's copies, so the state read below is final.
    stats = dataclasses.asdict(swap_stats(optimizer.optimizer)) if swapped else None
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optimizer": optimizer.state_dict(),
        "stats": stats,
    }


def main(out_dir: Path) -> None:
    accelerator = Accelerator(gradient_accumulation_steps=2)
    rank = accelerator.process_index
    objects = accelerator.prepare(*_objects())
    _train(accelerator, *objects, 0, HALF)
    accelerator.save_state(str(out_dir / "ckpt"))
    accelerator.wait_for_everyone()
    _train(accelerator, *objects, HALF, BATCHES)
    first = _ending(objects[0], objects[1])

    accelerator.free_memory()
    objects = accelerator.prepare(*_objects())
    accelerator.load_state(str(out_dir / "ckpt"))
    after_load = _ending(objects[0], objects[1])["stats"]
    _train(accelerator, *objects, HALF, BATCHES)
    resumed = _ending(objects[0], objects[1])
    if first["stats"] is not None:
        print(f"rank{rank} swap_stats: {first['stats']}", flush=True)
    torch.save(
        {
            "first": first,
            "resumed": resumed,
            "after_load": after_load,
            "num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type.value),
        },
        out_dir / f"rank{rank}.pt",
    )
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--install":
        from swapopt_plugins.accelerate import install_globally

        print(f"install_globally: {install_globally()}", flush=True)
        args = args[1:]
    main(Path(args[0]))
    # Gloo's worker threads can abort the interpreter's finalisation (see
    # _accelerate_launch_script.py); the results are on disk, leave without finalising.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
