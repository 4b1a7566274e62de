"""Pieces the optimizer-swap benchmarks share: imports, sizes, the workload's gradients, the
emulated link of ``loopback-async``, medians and ratios, and the tables they print.

A benchmark script puts its own folder on ``sys.path`` and imports from here::

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import emulated_link, rich_table  # noqa: E402
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import platform
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.table import Table
from torch import nn

#: The variable ``loopback-async`` reads its emulated link from (GB/s per direction), when an
#: instance is made; the value is part of the runtime's sharing key, so a new value gets
#: new lanes.
LINK_ENV = "SWAPOPT_LOOPBACK_GBPS"
_SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}


def import_swapopt(name: str = "swapopt_core") -> ModuleType:
    """Import a swapopt module, falling back to the checkout the benchmarks live in."""
    try:
        return importlib.import_module(name)
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        return importlib.import_module(name)


def parse_size(text: str) -> int:
    """A positive parameter count such as ``10M``, ``1.5G`` or ``500000``."""
    text = text.strip().upper()
    scale = _SUFFIX.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _SUFFIX else text
    value = int(float(number) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"model size must be positive, got {text!r}")
    return value


def human(n: float) -> str:
    """``n`` with a G/M/K suffix and one decimal."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or ``None`` where either is missing (or ``den`` is zero)."""
    if num is None or not den:
        return None
    return num / den


def median(xs: list[float]) -> float | None:
    """The median, or ``None`` for no sample."""
    return statistics.median(xs) if xs else None


@contextlib.contextmanager
def emulated_link(gbps: float | None) -> Iterator[None]:
    """Pace ``loopback-async``'s copy lanes at ``gbps`` per direction inside the block.

    The runtime reads the setting when an instance is made (at install or a session's first
    entry), so make the optimizer swap or the session inside the block. ``None`` leaves the
    environment as it is. The previous value is restored on exit.
    """
    saved = os.environ.get(LINK_ENV)
    if gbps is not None:
        os.environ[LINK_ENV] = f"{gbps:.9f}"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(LINK_ENV, None)
        else:
            os.environ[LINK_ENV] = saved


def make_grads(model: nn.Module, seed: int) -> list[list[torch.Tensor]]:
    """Two gradient sets, used on alternate steps so the update is not a fixed point."""
    gen = torch.Generator().manual_seed(seed + 1)
    sets = []
    for _ in range(2):
        grads = []
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen, dtype=p.dtype).mul_(1e-2)
            grads.append(g.to(p.device))
        sets.append(grads)
    return sets


def set_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """Point each parameter's ``.grad`` at its tensor of ``grads``."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def rich_table(title: str, head: list[str], rows: list[list[str]], left: int = 3) -> Table:
    """A rich table whose first ``left`` columns are left-aligned, the others right-aligned."""
    table = Table(title=title)
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*row)
    return table


def machine_info(device: torch.device) -> dict[str, Any]:
    """Versions, cores, torch threads and load: what a reader needs to weigh the figures."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "loadavg_1_5_15": list(os.getloadavg()),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
