"""The CPU switch of the doc tests: every example swaps and offloads on the CPU for real.

Two documented mechanisms, no mock:

- In process, a plugin registered through the ``swapopt_register_runtimes`` hook on the
  process-wide plugin manager (``get_plugin_manager().register``, docs/plugins.md) adds
  ``LoopbackCpuRuntime``: the loopback runtime under another name, declaring the device type
  ``"cpu"``, so ``runtime="auto"`` (the default of ``SwapOptimizerConfig`` and
  ``OffloadConfig``) picks it for CPU tensors, as it picks ``cuda`` for CUDA tensors. The
  page's examples therefore run as a reader with a GPU runs them. The plugin is registered
  only while a page runs, so the rest of the suite keeps the built-in behaviour (``"auto"``
  swaps nothing on the CPU).
- In shell blocks (a new process: the plugin is not there), ``SWAPOPT_RUNTIME=loopback`` and
  ``SWAPOPT_ACTIVATION_RUNTIME=loopback``, the variables every integration and ``swapopt run``
  read (docs/accelerate.md, docs/lightning.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from swapopt_core import hookimpl
from swapopt_core._device.loopback import LoopbackRuntime
from swapopt_core._plugins import get_plugin_manager

__all__ = ["PLUGIN_NAME", "SHELL_ENV", "LoopbackCpuRuntime", "cpu_switch"]

PLUGIN_NAME = "swapopt-doc-tests-cpu"
#: What shell blocks get in their environment.
SHELL_ENV = {"SWAPOPT_RUNTIME": "loopback", "SWAPOPT_ACTIVATION_RUNTIME": "loopback"}


class LoopbackCpuRuntime(LoopbackRuntime):
    """The loopback runtime, chosen by ``runtime="auto"`` for CPU tensors."""

    name = "loopback-cpu"
    device_types = ("cpu",)


class _Plugin:
    @hookimpl
    def swapopt_register_runtimes(self) -> Iterable[type[Any]]:
        return [LoopbackCpuRuntime]


@contextmanager
def cpu_switch() -> Iterator[None]:
    """Register the CPU runtime on the process-wide plugin manager for the duration."""
    manager = get_plugin_manager()
    manager.register(_Plugin(), name=PLUGIN_NAME)
    try:
        yield
    finally:
        manager.unregister(name=PLUGIN_NAME)
