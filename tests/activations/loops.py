"""A small GPT and the training loops real runs use, for the activation tests: micro-batches
with gradient accumulation, and sequences whose length changes every step."""

from __future__ import annotations

import torch

from swapopt_core import OffloadConfig, OffloadSession
from swapopt_core._cli.demo import _TinyGPT
from swapopt_core._planning.simulate import simulate

VOCAB = 256
MAX_LEN = 96


def gpt() -> torch.nn.Module:
    """Two pre-norm blocks of width 64, four heads: about 0.1 M parameters."""
    torch.manual_seed(0)
    return _TinyGPT(vocab=VOCAB, width=64, layers=2, heads=4, max_len=MAX_LEN)


def tokens(seed: int, length: int = 64, batch: int = 4) -> torch.Tensor:
    """A batch of ``length + 1`` tokens per row (inputs and shifted targets)."""
    return torch.randint(
        0, VOCAB, (batch, length + 1), generator=torch.Generator().manual_seed(seed)
    )


def backward(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Forward and backward of the next-token loss; returns the loss."""
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def natural_peak(length: int = 64) -> int:
    """The activation peak of one step at ``length`` with no budget."""
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, runtime="loopback"))
    with probe:
        backward(gpt(), tokens(0, length))
    return simulate(probe.trace).natural_peak_bytes


def same_grads(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether both models hold the same gradients, bit for bit (``None`` alike)."""
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            if p.grad is not q.grad:
                return False
        elif not torch.equal(p.grad, q.grad):
            return False
    return True
