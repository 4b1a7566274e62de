"""Setups, checkers and verifiers for the framework pages (lightning, accelerate,
transformers, mindspore); see ``tests/docs/registry.py`` for how to add one.

``PAGES`` lists the framework pages whose blocks are all marked: the doc tests run them and
fail on any unmarked block in them (the core pages are listed in ``tests/docs/pages.py``).
The pages build their own tiny models in the blocks a reader sees; what is here asserts,
after a page ran, what its text claims happened: the optimizer state moved, and each
activation budget bound (something went to host memory and the peak kept under it).
"""

from __future__ import annotations

from typing import Any

from swapopt_core import OffloadStats, swap_stats
from tests.docs.registry import check, setup, verify  # noqa: F401  (what this module uses)

#: Framework pages (paths relative to the repository root) the doc tests cover.
PAGES: tuple[str, ...] = (
    "docs/lightning.md",
    "docs/accelerate.md",
    "docs/transformers.md",
)


def assert_budget_binds(stats: OffloadStats, budget_mb: float) -> None:
    """The session offloaded (its budget is below the unbudgeted peak) and kept under it."""
    budget = int(budget_mb * 2**20)
    assert stats.activation_budget_bytes == budget, stats
    assert stats.d2h_bytes > 0 and stats.h2d_bytes > 0, f"the budget did not bind: {stats}"
    assert 0 < stats.peak_resident_activation_bytes <= budget, stats


@verify("docs/lightning.md")
def lightning_offloaded(ns: dict[str, Any]) -> None:
    """The activation example's 4 MiB budget bound in every session of its fit."""
    sessions = list(ns["swap"].offload_sessions.values())
    assert sessions, "the activation example opened no session"
    for session in sessions:
        assert_budget_binds(session.stats(), 4)


@verify("docs/accelerate.md")
def accelerate_offloaded(ns: dict[str, Any]) -> None:
    """The activation example swapped its optimizer and its 4 MiB budget bound."""
    stats = swap_stats(ns["optimizer"].optimizer)
    assert stats.steps == 3 and stats.d2h_bytes > 0, stats
    assert_budget_binds(ns["accelerator"].offload_session().stats(), 4)


@verify("docs/transformers.md")
def transformers_offloaded(ns: dict[str, Any]) -> None:
    """The Trainer's optimizer was swapped for its 4 steps and the 1 MiB budget bound."""
    callback = ns["swap"]
    assert callback.stats and callback.stats[0].steps == 4, callback.stats
    assert callback.stats[0].d2h_bytes > 0, callback.stats
    assert_budget_binds(callback.offload_session.stats(), 1)
