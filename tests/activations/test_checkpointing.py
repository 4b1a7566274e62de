"""Activation checkpointing inside an OffloadSession: the recomputed forward runs during
backward, between the session's copies, and the gradients stay the same bits."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from swapopt_core import OffloadConfig, OffloadSession
from tests.activations.test_session import _batch, _grads


class CheckpointedNet(torch.nn.Module):
    """Blocks whose insides are recomputed in backward; dropout checks the replayed RNG."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(64, 256)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(256),
                torch.nn.Linear(256, 256),
                torch.nn.GELU(),
                torch.nn.Dropout(0.1),
            )
            for _ in range(4)
        )
        self.out = torch.nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for index, block in enumerate(self.blocks):
            if index % 2:  # every other block keeps its activations: both kinds in one step
                h = h + block(h)
            else:
                h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("planner", ["every-gap", "recompute-every-gap", "auto"])
def test_checkpointed_blocks_match_bit_for_bit(
    manager, runtime_name: str, planner: str, reentrant: bool
) -> None:
    reference, offloaded = CheckpointedNet(reentrant), CheckpointedNet(reentrant)
    config = OffloadConfig(
        max_resident_activation_mb=0.1, runtime=runtime_name, planner=planner, min_offload_kib=0
    )
    session = OffloadSession(config, plugin_manager=manager)
    for step in range(3):  # a warmup and two replays
        x = _batch(step).requires_grad_(reentrant)  # the reentrant variant needs a grad input
        for model in (reference, offloaded):
            model.zero_grad()
        torch.manual_seed(step)
        ref_loss = reference(x).square().mean()
        ref_loss.backward()
        with session:
            torch.manual_seed(step)
            loss = offloaded(x).square().mean()
            loss.backward()
        assert torch.equal(loss, ref_loss)
        for a, b in zip(_grads(reference), _grads(offloaded), strict=True):
            assert torch.equal(a, b)
    stats = session.stats()
    assert (stats.warmups, stats.replays, stats.retraces) == (1, 2, 0)
    assert stats.d2h_bytes > 0 and stats.h2d_bytes > 0
    if planner == "recompute-every-gap":  # checkpointed blocks rerun, and recompute too
        assert stats.recomputes > 0
