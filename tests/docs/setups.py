"""Setups and checkers of the core pages (README.md and docs/ but the framework pages).

Each gives a page's namespace what its text assumes, small enough that the page runs in
seconds on two CPU cores; see ``tests/docs/registry.py``.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import MutableMapping
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
def readme_swapped(ns: MutableMapping[str, Any]) -> None:
    """The quick start's optimizer really was swapped and its state moved."""
    stats = ns["swap_stats"](ns["opt"])
    assert stats.swapped_tensors > 0 and stats.h2d_bytes > 0, stats


@setup("model")
def model(ns: dict[str, Any], folder: Path) -> None:
    """``torch`` and a ``model`` (a ``MyModel``), as a page's text assumes them."""
    torch.manual_seed(0)
    ns["torch"] = torch
    ns["model"] = MyModel()


@setup("activation_model")
def activation_model(ns: dict[str, Any], folder: Path) -> None:
    """``model``, ``optimizer`` and a ``loader`` whose step holds about 140 MiB of activations
    at its peak on the CPU (a long batch of narrow rows: much memory, little compute), so the
    page's 64 MiB budget binds."""
    torch.manual_seed(0)
    ns["model"] = model = MyModel(width=64, depth=4)
    ns["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ns["loader"] = make_loader(steps=2, batch=1 << 16)


@verify("docs/activation_offload.md")
def activation_budget_binds(ns: MutableMapping[str, Any]) -> None:
    """The example's budget binds: activations were moved, and replays kept the budget."""
    stats = ns["session"].stats()
    assert stats.d2h_bytes > 0 and stats.replays > 0, stats
    assert stats.last_peak_resident_activation_bytes <= stats.budget_bytes, stats


@check("mindformers_section")
def mindformers_section(path: Path) -> None:
    """A MindFormers YAML whose ``swap_optimizer:`` section swapopt reads without an error."""
    import yaml

    from swapopt_core.mindformers_yaml import SwapOptimizerSection

    section = SwapOptimizerSection.from_yaml(yaml.safe_load(path.read_text())["swap_optimizer"])
    section.to_config()


@verify("docs/device_budget.md")
def device_budget_binds(ns: MutableMapping[str, Any]) -> None:
    """Your own loop's and the Accelerate example's budgets bind (activations were moved), and
    `swapopt run` swapped the unchanged script's optimizer."""
    assert isinstance(ns, ChainMap)
    own_loop, accelerate = ns.maps[-2]["session"], ns.maps[0]["session"]  # [-1]: doc_outputs
    for session in (own_loop, accelerate):
        stats = session.stats()
        assert stats.d2h_bytes > 0 and stats.replays > 0, stats
    (run,) = [out for out in ns["doc_outputs"].values() if "integrations on: " in out]
    assert "lightning" in run and "no optimizer was swapped" not in run, run


@check("profile")
def profile(path: Path) -> None:
    """A device profile file ``swapopt estimate --profile`` accepts."""
    from swapopt_core._estimate.profiles import load_profile

    load_profile(str(path))


@check("estimate_json")
def estimate_json(path: Path) -> None:
    """The keys a page shows for ``--json`` are those of the ``estimate.json`` an earlier block
    of the page wrote into its folder (values shown as ``...`` are not compared)."""
    import json
    import re

    real = json.loads((path.parent / "estimate.json").read_text())
    keys = {*real, *real["plain"], *real["plan"]}
    shown = set(re.findall(r'"(\w+)":', path.read_text()))
    assert shown == keys, (
        f"shown but not written: {shown - keys}; written, not shown: {keys - shown}"
    )


@setup("recorded_session")
def recorded_session(ns: dict[str, Any], folder: Path) -> None:
    """A ``session`` that recorded and replayed two steps of ``activation_model``'s loop under
    a budget that binds (the page writes its ``trace``)."""
    from swapopt_core import OffloadConfig, OffloadSession

    activation_model(ns, folder)
    model, optimizer = ns["model"], ns["optimizer"]
    ns["session"] = session = OffloadSession(OffloadConfig(max_resident_activation_mb=64))
    for batch in ns["loader"][:2]:
        with session:
            model(batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert session.stats().d2h_bytes > 0


@check("trace")
def trace(path: Path) -> None:
    """An activation trace ``ActivationTrace.from_json`` reads."""
    from swapopt_core import ActivationTrace

    ActivationTrace.from_json(path.read_text())


def _simulate_worked(path: Path, *, recompute: bool) -> Any:
    import json

    from swapopt_core import ActivationTrace, ResidencySchedule
    from swapopt_core._planning.simulate import simulate

    doc = json.loads((path.parent / "worked_trace.json").read_text())
    if recompute:
        doc["ops"][0]["recompute"] = True
    return simulate(
        ActivationTrace.from_json(json.dumps(doc)), ResidencySchedule.from_json(path.read_text())
    )


@check("worked_plan")
def worked_plan(path: Path) -> None:
    """formats.md's worked schedule simulates as its text says: 1.27 ms against 0.75 ms of
    compute, the 8 MiB peak of the step without it."""
    result = _simulate_worked(path, recompute=False)
    assert round(result.total_ms, 2) == 1.27 and result.compute_ms == 0.75, result
    assert round(100 * result.overhead) == 70 and result.peak_bytes == 8 << 20, result


@check("worked_recompute")
def worked_recompute(path: Path) -> None:
    """The recompute variant: the ReLU ends at 1.25 ms and one recompute is counted."""
    result = _simulate_worked(path, recompute=True)
    assert round(result.total_ms, 2) == 1.25 and result.recomputes == 1, result


@check("toml")
def toml(path: Path) -> None:
    """A TOML file declaring at least one plugin in the ``swapopt`` entry-point group."""
    import tomllib

    group = tomllib.loads(path.read_text())["project"]["entry-points"]["swapopt"]
    assert group and all(":" not in value or value.count(":") == 1 for value in group.values())


@check("settings")
def settings(path: Path) -> None:
    """A ``SWAPOPT_CONFIG`` file ``read_settings`` accepts, which asks for the swap."""
    from swapopt_core.options import read_settings

    read = read_settings({}, owner="docs", environ={"SWAPOPT_CONFIG": str(path)})
    assert read.enabled and read.sources, read


@verify("docs/performance.md")
def benchmarks_passed(ns: MutableMapping[str, Any]) -> None:
    """The quick benchmark run reports bit-exact swapped runs; the GPU check's smoke is ok."""
    outputs = list(ns["doc_outputs"].values())
    assert any("wall time" in out for out in outputs), outputs
    assert any('"ok": true' in out for out in outputs), outputs
