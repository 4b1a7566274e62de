"""Device runtimes: the one interface both halves drive, and the built-in runtimes.

``interface`` holds ``TransferRuntime`` (generic in the tensor library; ``TorchRuntime`` is
its torch form) and the ``Ticket`` protocol; ``loopback``, ``loopback_async`` (on the copy
lanes of ``lanes``) and ``accelerator`` (``torch.Stream``/``torch.Event``, exact-size pinned
host memory from ``pinned``) implement it; ``registry`` chooses a runtime by name or device
and shares one instance per device; ``plugin`` registers the built-ins. ``meter`` holds the
whole-step meters (``StepMeter``: the allocator's counters on accelerators, a count of every
storage the step holds on the loopback runtimes), one per runtime instance
(``TransferRuntime.step_meter``).
"""

from swapopt_core._device.interface import (
    CopyPair,
    Ticket,
    TorchRuntime,
    TransferRuntime,
    byte_view,
)
from swapopt_core._device.meter import StepMeter
from swapopt_core._device.registry import shared_runtime

__all__ = [
    "CopyPair",
    "StepMeter",
    "Ticket",
    "TorchRuntime",
    "TransferRuntime",
    "byte_view",
    "shared_runtime",
]
