"""Setups, checkers and verifiers for the framework pages (lightning, accelerate,
transformers, mindspore); see ``tests/docs/registry.py`` for how to add one.

``PAGES`` lists the framework pages whose blocks are all marked: the doc tests run them and
fail on any unmarked block in them (the core pages are listed in ``tests/docs/pages.py``).
The pages build their own tiny models in the blocks a reader sees; what is here asserts,
after a page ran, what its text claims happened: the optimizer state moved, and each
activation budget bound (something went to host memory and the peak kept under it).
"""

from __future__ import annotations

import json
import re
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import yaml

from swapopt_core import OffloadStats, swap_stats
from swapopt_core.mindformers_yaml import build_trainer_config
from tests.docs.registry import check, setup, verify  # noqa: F401  (what this module uses)

#: Framework pages (paths relative to the repository root) the doc tests cover.
PAGES: tuple[str, ...] = (
    "docs/lightning.md",
    "docs/accelerate.md",
    "docs/transformers.md",
    "docs/mindspore.md",
)


def assert_budget_binds(stats: OffloadStats, budget_mb: float) -> None:
    """The session offloaded (its budget is below the unbudgeted peak) and kept under it."""
    budget = int(budget_mb * 2**20)
    assert stats.activation_budget_bytes == budget, stats
    assert stats.d2h_bytes > 0 and stats.h2d_bytes > 0, f"the budget did not bind: {stats}"
    assert 0 < stats.peak_resident_activation_bytes <= budget, stats


def assert_nothing_unswapped(ns: MutableMapping[str, Any]) -> None:
    """No block printed that its run swapped nothing (``swapopt run``'s warning at exit).

    Reads ``ns["doc_outputs"]`` (what each block printed, by line) where the harness gives it.
    """
    for line, text in ns.get("doc_outputs", {}).items():
        assert "no optimizer was swapped" not in text, f"the block at line {line}:\n{text}"


def launcher_stats(ns: MutableMapping[str, Any]) -> dict[str, Any] | None:
    """The counters the MindFormers callback logged at train end, if a block printed them."""
    for text in ns.get("doc_outputs", {}).values():
        found = re.search(r"swapopt stats at train end: (\{.*\})", text)
        if found:
            return dict(json.loads(found.group(1)))
    return None


@verify("docs/lightning.md")
def lightning_offloaded(ns: MutableMapping[str, Any]) -> None:
    """The activation example's 4 MiB budget bound in every session of its fit."""
    assert_nothing_unswapped(ns)
    sessions = list(ns["swap"].offload_sessions.values())
    assert sessions, "the activation example opened no session"
    for session in sessions:
        assert_budget_binds(session.stats(), 4)


@verify("docs/accelerate.md")
def accelerate_offloaded(ns: MutableMapping[str, Any]) -> None:
    """The activation example swapped its optimizer and its 4 MiB budget bound."""
    assert_nothing_unswapped(ns)
    stats = swap_stats(ns["optimizer"].optimizer)
    assert stats.steps == 3 and stats.d2h_bytes > 0, stats
    assert_budget_binds(ns["accelerator"].offload_session().stats(), 4)


@verify("docs/transformers.md")
def transformers_offloaded(ns: MutableMapping[str, Any]) -> None:
    """The Trainer's optimizer was swapped for its 4 steps and the 1 MiB budget bound."""
    assert_nothing_unswapped(ns)
    callback = ns["swap"]
    assert callback.stats and callback.stats[0].steps == 4, callback.stats
    assert callback.stats[0].d2h_bytes > 0, callback.stats
    assert_budget_binds(callback.offload_session.stats(), 1)


@check("mindformers_yaml")
def mindformers_yaml(path: Path) -> None:
    """A training YAML (or part of one) the MindFormers launcher accepts as written."""
    build_trainer_config(yaml.safe_load(path.read_text(encoding="utf-8")))


@verify("docs/mindspore.md")
def mindspore_saved(ns: MutableMapping[str, Any]) -> None:
    """Both examples kept most of the state off the device: about 3 / swap_times of it."""
    cells = ns["stats"]  # the optimizer Cell example, swap_times=8: the printed 0.38
    assert cells.swapped_tensors == 18 and cells.steps == 10, cells
    assert round(cells.peak_resident_state_bytes / cells.total_state_bytes, 2) == 0.38, cells
    trained = swap_stats(ns["trainer"].optimizer)  # the MindFormers run, swap_times: 8
    assert trained.swapped_tensors == 30 and trained.steps == 4, trained
    # The figures the page quotes from the launcher's log line (the same YAML, the same model).
    assert (trained.total_state_bytes, trained.peak_resident_state_bytes) == (67328, 26368), trained
    logged = launcher_stats(ns)  # the launcher's own run, where the harness keeps its output
    if logged is not None:
        quoted = {"total_state_bytes": 67328, "peak_resident_state_bytes": 26368, "steps": 4}
        assert {key: logged[key] for key in quoted} == quoted, logged
