"""The framework pages' verifiers fail where a page's claim does not hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from swapopt_core import OffloadConfig, OffloadSession, OffloadStats
from tests.docs.registry import CHECKS
from tests.docs.setups_frameworks import (
    assert_budget_binds,
    assert_nothing_unswapped,
    launcher_stats,
)


def _stats(budget_mb: float) -> OffloadStats:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_mb))
    for _ in range(2):
        with session:
            model(torch.randn(1024, 32)).square().mean().backward()
    return session.stats()


def test_a_budget_that_binds_passes() -> None:
    assert_budget_binds(_stats(4), 4)


def test_a_loose_budget_fails() -> None:
    with pytest.raises(AssertionError, match="did not bind"):
        assert_budget_binds(_stats(64), 64)


def test_another_budget_than_the_page_says_fails() -> None:
    with pytest.raises(AssertionError):
        assert_budget_binds(_stats(4), 3)


def test_the_mindformers_yaml_check_rejects_a_bad_section(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("swap_optimizer: {swap_times: 8}\n", encoding="utf-8")
    bad.write_text("swap_optimizer: {swap_times: 0}\n", encoding="utf-8")
    CHECKS["mindformers_yaml"](good)
    with pytest.raises(ValueError, match="swap_optimizer.swap_times=0"):
        CHECKS["mindformers_yaml"](bad)


def test_a_run_that_swapped_nothing_fails() -> None:
    said = "swapopt run: SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu was set, but no optimizer was swapped"
    assert_nothing_unswapped({"doc_outputs": {12: "1 process(es), last loss 0.5\n"}})
    assert_nothing_unswapped({})  # a harness that keeps no outputs: nothing to read
    with pytest.raises(AssertionError, match="line 12"):
        assert_nothing_unswapped({"doc_outputs": {12: said}})


def test_the_launchers_stats_line_is_read() -> None:
    line = '... - INFO - swapopt stats at train end: {"steps": 4, "total_state_bytes": 67328}\n'
    assert launcher_stats({"doc_outputs": {3: "other\n" + line}}) == {
        "steps": 4,
        "total_state_bytes": 67328,
    }
    assert launcher_stats({"doc_outputs": {3: "other\n"}}) is None
