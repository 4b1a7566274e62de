"""Fixtures of the torch backend's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread: the tiny models these tests train run ten times faster on a
    busy machine than with threads that wait for each other. Results do not depend on it
    (both optimizers of a comparison run under the same setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
