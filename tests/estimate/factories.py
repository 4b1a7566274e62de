"""Factories that ``swapopt estimate --model tests.estimate.factories:NAME`` builds."""

from __future__ import annotations

import torch
from torch import nn


class _Net(nn.Module):
    """A small CNN that returns its own loss."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 16 * 16, 10)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.conv(images))
        return nn.functional.cross_entropy(self.head(hidden.flatten(1)), labels)


def cnn() -> tuple[nn.Module, object]:
    """A model and its example batch (a tuple: ``model(images, labels)``)."""

    def example(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))

    return _Net(), example


def mlp_output() -> tuple[nn.Module, object]:
    """A model whose output is not a scalar: the estimate sums it."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), (
        lambda batch, seq: torch.randn(batch, 32)
    )


def no_loss() -> tuple[nn.Module, object]:
    """A model that returns a dict without a loss."""

    class Out(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": x * 2}

    return Out(), (lambda batch, seq: {"x": torch.randn(batch, 4)})


def not_a_model() -> str:
    """Returns something that is not a model."""
    return "a string"


def bare_linear() -> nn.Module:
    """A model without example_batch or config.vocab_size."""
    return nn.Linear(4, 4)


NOT_CALLABLE = 3
