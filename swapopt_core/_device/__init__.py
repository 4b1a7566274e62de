"""Device runtimes: the one interface both halves drive, and the built-in runtimes.

``interface`` holds ``TransferRuntime`` (generic in the tensor library; ``TorchRuntime`` is
its torch form) and the ``Ticket`` protocol; ``loopback``, ``loopback_async`` (on the copy
lanes of ``lanes``) and ``accelerator`` (``torch.Stream``/``torch.Event``, exact-size pinned
host memory from ``pinned``) implement it; ``registry`` chooses a runtime by name or device
and shares one instance per device; ``plugin`` registers the built-ins.
"""

from swapopt_core._device.interface import (
    CopyPair,
    Ticket,
    TorchRuntime,
    TransferRuntime,
    byte_view,
)
from swapopt_core._device.registry import shared_runtime

__all__ = ["CopyPair", "Ticket", "TorchRuntime", "TransferRuntime", "byte_view", "shared_runtime"]
