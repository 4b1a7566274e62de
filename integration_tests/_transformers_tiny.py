"""A tiny GPT-2 trained by a real ``transformers.Trainer`` on CPU, shared by the tests and
run as a script by ``swapopt run`` (``python _transformers_tiny.py OUT_DIR``).

No downloads: the model is built from a config and the data are random tokens. Run as a
script (no callback) it trains once, trains the same Trainer again from the mid-run
checkpoint, then resumes a fresh Trainer from it, and saves the three runs' final parameters
and optimizer state, with ``swap_stats`` of the optimizer when swapped and whether it was
still swapped after ``train()``, to ``OUT_DIR/result.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

SEQ = 16
VOCAB = 64


class Tokens(torch.utils.data.Dataset):
    """Random token sequences; the labels are the inputs (causal LM)."""

    def __init__(self, n: int = 24) -> None:
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model() -> GPT2LMHeadModel:
    """The tiny GPT-2, seeded."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32)
    return GPT2LMHeadModel(config)


def arguments(out: Path, **overrides: Any) -> TrainingArguments:
    """CPU, no reporting, fixed seed; 6 optimizer steps with accumulation 2 by default."""
    fields: dict[str, Any] = dict(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=1.0,
        logging_steps=3,
        save_strategy="no",
        disable_tqdm=True,
    )
    fields.update(overrides)
    return TrainingArguments(**fields)


def trainer(out: Path, callbacks: list | None = None, **overrides: Any) -> Trainer:
    """A fresh Trainer on the tiny model and the random tokens."""
    return Trainer(
        model=model(), args=arguments(out, **overrides), train_dataset=Tokens(), callbacks=callbacks
    )


def _probe(seen: dict[str, Any]) -> Any:
    from swapopt_core import is_swap_optimizer, swap_stats

    def probe(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        seen["swapped"] = is_swap_optimizer(opt)
        if seen["swapped"]:
            seen["stats"] = swap_stats(opt)

    return probe


def _run(
    out: Path, resume: Path | None = None, run: Trainer | None = None, **overrides: Any
) -> dict[str, Any]:
    """Train ``run`` (default: a fresh Trainer), from ``resume`` if given."""
    # NOTE: a swap may be removed at the end of train(), so the stats are taken after each
    # step by a callback-free probe (the optimizer's step hook) that works on any script.
    seen: dict[str, Any] = {}
    if run is None:
        run = trainer(out, **overrides)
        run.create_optimizer()
    inner = getattr(run.optimizer, "optimizer", run.optimizer)  # prepared by a first train()
    handle = inner.register_step_post_hook(_probe(seen))
    run.train(resume_from_checkpoint=None if resume is None else str(resume))
    handle.remove()
    from swapopt_core import is_swap_optimizer

    return {
        "params": {k: v.detach().clone() for k, v in run.model.named_parameters()},
        "optimizer": run.optimizer.state_dict(),
        "swapped": seen.get("swapped", False),
        "stats": vars(seen["stats"]) if "stats" in seen else None,
        "swapped_after": is_swap_optimizer(inner),
        "trainer": run,
    }


def main(out: str) -> None:
    """Train once saving a checkpoint at step 3, train the same Trainer again from it (a
    second ``train()``), then resume a fresh Trainer from it."""
    root = Path(out)
    whole = _run(root, save_strategy="steps", save_steps=3)
    again = _run(root, resume=root / "checkpoint-3", run=whole.pop("trainer"))
    again.pop("trainer")
    resumed = _run(root / "resumed", resume=root / "checkpoint-3")
    resumed.pop("trainer")
    torch.save({"whole": whole, "again": again, "resumed": resumed}, root / "result.pt")


if __name__ == "__main__":
    main(sys.argv[1])
