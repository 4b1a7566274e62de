"""Fakes of the parts of ``torch.accelerator`` that track the current device, for CPU tests.

Each follows what torch does: ``device_index(i)`` makes ``i`` current for its block and
restores the previous index on exit (``None``: no switch), and ``current_device_index``
reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch


class CurrentDevice:
    """The process's current accelerator device index, as ``torch.accelerator`` keeps it.

    Args:
        index: The current device at the start (the default device of a process: 0).
    """

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.switches: list[int] = []  # indices ``device_index`` switched to, in order

    @contextlib.contextmanager
    def device_index(self, device: int | None, /) -> Iterator[None]:
        previous = self.index
        if device is not None:
            self.switches.append(device)
            self.index = device
        try:
            yield
        finally:
            if device is not None:
                self.index = previous

    def install(self, monkeypatch: pytest.MonkeyPatch) -> CurrentDevice:
        """Make ``torch.accelerator`` use this current device; returns it."""
        monkeypatch.setattr(torch.accelerator, "device_index", self.device_index)
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: self.index)
        return self
