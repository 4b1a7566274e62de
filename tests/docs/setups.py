"""Setups and checkers of the core pages (README.md and docs/ but the framework pages).

Each gives a page's namespace what its text assumes, small enough that the page runs in
seconds on two CPU cores; see ``tests/docs/registry.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tests.docs.registry import check, setup, verify  # noqa: F401


class MyModel(nn.Module):
    """What the pages call ``MyModel``: a small regression MLP whose output has ``.loss``.

    Its batches are ``(inputs, targets)`` pairs; it moves them to its own device, so the
    examples' ``model(batch)`` works whatever device the reader picked.
    """

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 1)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> SimpleNamespace:
        device = self.head.weight.device
        inputs, targets = (t.to(device) for t in batch)
        prediction = self.head(self.body(inputs))
        return SimpleNamespace(loss=nn.functional.mse_loss(prediction, targets))


def make_loader(steps: int = 4, batch: int = 8, width: int = 64) -> list[Any]:
    """A list of ``steps`` random ``(inputs, targets)`` batches (seeded)."""
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, width, generator=generator), torch.randn(batch, 1, generator=generator))
        for _ in range(steps)
    ]


@setup("model_and_loader")
def model_and_loader(ns: dict[str, Any], folder: Path) -> None:
    """``MyModel`` and a ``loader`` of four batches."""
    torch.manual_seed(0)
    ns["MyModel"] = MyModel
    ns["loader"] = make_loader()


@verify("README.md")
def readme_swapped(ns: dict[str, Any]) -> None:
    """The quick start's optimizer really was swapped and its state moved."""
    stats = ns["swap_stats"](ns["opt"])
    assert stats.swapped_tensors > 0 and stats.h2d_bytes > 0, stats
