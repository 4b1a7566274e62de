"""Copies, waits and clocks for activation offload: one stream per copy direction.

Every copy is issued at a point of the compute stream and starts only after the compute
work queued before that point (the copy stream waits for it), which is the rule the
simulator and the planner assume. Device storage is allocated and freed on the compute
stream; a release waits for the copies still using the storage. The compute stream is the
one current when an entry's first op ran: ops on another stream, or inside a CUDA graph
capture, are refused, since the copies would not be ordered with them.

Runtimes are plugins (``swapopt_register_activation_runtimes``; the built-ins are registered
by ``_activations/plugin.py``): ``resolve_runtime`` turns ``OffloadConfig.runtime`` into a
``RuntimeChoice`` when a session is created, and that makes the runtime at the first entry.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "AUTO_RUNTIME",
    "FALLBACK_RUNTIME",
    "ActivationRuntime",
    "RuntimeChoice",
    "byte_view",
    "choose_runtime",
    "resolve_runtime",
]

#: The name that lets the activations' device choose the runtime (``OffloadConfig.runtime``).
AUTO_RUNTIME = "auto"
#: What ``"auto"`` uses for a device type no registered runtime declares.
FALLBACK_RUNTIME = "loopback"
#: The plugin module that registers the built-in activation runtimes.
BUILTIN_PLUGIN = "swapopt_core._activations.plugin"


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def choose_runtime(
    wanted: str,
    device: torch.device | None = None,
    runtimes: Mapping[str, type[ActivationRuntime]] | None = None,
) -> ActivationRuntime:
    """The runtime that ``OffloadConfig.runtime`` names, made for ``device``.

    A shortcut for ``resolve_runtime(wanted, runtimes).make(device)``.

    Args:
        wanted: A registered runtime name, or ``"auto"`` (see :class:`RuntimeChoice`).
        device: Where the activations are, as an entry's first op shows it; what
            ``"auto"`` follows.
        runtimes: The registered runtime classes by name. Default: those of
            ``get_plugin_manager()``.

    Raises:
        ValueError: ``wanted`` is not registered (the message lists what is).
        RuntimeError: ``"cuda"`` is asked for and CUDA is not available.
    """
    if runtimes is None:
        # Imported here: the plugin manager imports this module.
        from swapopt_core._plugins import activation_runtimes, get_plugin_manager

        runtimes = activation_runtimes(get_plugin_manager())
    return resolve_runtime(wanted, runtimes).make(device)


def resolve_runtime(
    name: str,
    runtimes: Mapping[str, type[ActivationRuntime]],
    *,
    label: str = "OffloadConfig.runtime",
) -> RuntimeChoice:
    """How a session makes the runtime ``name`` selects, checked against ``runtimes``.

    Args:
        name: A registered runtime name, or ``"auto"``.
        runtimes: The registered runtime classes by name (``swapopt_core._plugins.
            activation_runtimes``).
        label: How to name the setting in errors.

    Raises:
        ValueError: No runtime is registered under ``name``; or, for ``"auto"``, two
            runtimes declare the same device type, or ``"loopback"`` (what ``"auto"`` uses for
            the other device types) is not registered. The message says how to fix it.
    """
    known = sorted({AUTO_RUNTIME, *runtimes})
    if name != AUTO_RUNTIME:
        chosen = runtimes.get(name)
        if chosen is None:
            raise ValueError(
                f"{label}={name!r} is not a registered activation runtime. Choose one of "
                f"{known}, or install or register the plugin that provides it "
                "(swapopt_register_activation_runtimes)."
            )
        return RuntimeChoice(name, chosen, {}, None)
    by_type: dict[str, type[ActivationRuntime]] = {}
    for runtime_name, cls in sorted(runtimes.items()):
        for device_type in cls.device_types:
            other = by_type.setdefault(device_type, cls)
            if other is not cls:
                raise ValueError(
                    f"{label}='auto' is ambiguous for tensors on {device_type!r}: the "
                    f"activation runtimes {other.name!r} and {runtime_name!r} both declare it "
                    f"in device_types. Name one in {label} (one of {known}), or unregister "
                    "one of the plugins."
                )
    fallback = runtimes.get(FALLBACK_RUNTIME)
    if fallback is None:
        raise ValueError(
            f"{label}='auto' needs the activation runtime {FALLBACK_RUNTIME!r} for device "
            f"types no runtime declares, and no plugin registers it. Name a runtime in "
            f"{label} (one of {known}), or register the built-in plugin "
            f"{BUILTIN_PLUGIN!r}."
        )
    return RuntimeChoice(name, None, by_type, fallback)


@dataclass(frozen=True)
class RuntimeChoice:
    """How a session makes its runtime: one named class, or ``"auto"``'s pick per device.

    ``"auto"`` follows the activations: at an entry's first op, the runtime whose
    ``device_types`` holds the type of the device that op's tensors are on (CUDA for CUDA
    tensors), else :data:`FALLBACK_RUNTIME` (loopback: CPU tensors are the "device" and
    their copies go to other CPU buffers; storages on other devices are left alone).

    Attributes:
        wanted: The configured name.
        named: The class a named runtime is made from (``None`` for ``"auto"``).
        by_type: For ``"auto"``: the class declaring each device type.
        fallback: For ``"auto"``: the class for every other device type.
    """

    wanted: str
    named: type[ActivationRuntime] | None
    by_type: Mapping[str, type[ActivationRuntime]]
    fallback: type[ActivationRuntime] | None

    def class_for(self, device: torch.device | None) -> type[ActivationRuntime]:
        """The class that serves activations on ``device`` (``None``: not known yet)."""
        if self.named is not None:
            return self.named
        assert self.fallback is not None
        if device is None:
            return self.fallback
        return self.by_type.get(device.type, self.fallback)

    def make(self, device: torch.device | None = None) -> ActivationRuntime:
        """A new runtime for activations on ``device`` (``None``: a named runtime, made
        before any op shows where the activations are).

        Raises:
            TypeError: The class's ``create`` did not return an ``ActivationRuntime``.
        """
        cls = self.class_for(device)
        runtime = cls.create(device)
        if not isinstance(runtime, ActivationRuntime):
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__}.create returned {runtime!r}; an "
                "activation runtime's create must return an ActivationRuntime instance."
            )
        return runtime

    def keeps(self, runtime: ActivationRuntime, device: torch.device) -> bool:
        """Whether ``runtime`` goes on serving an entry whose activations are on ``device``.

        A named runtime serves every entry. With ``"auto"`` the runtime is kept when it
        serves ``device``, or when a new one would be the same fallback class (it would
        serve that device no better).
        """
        if self.named is not None or runtime.serves(device):
            return True
        cls = self.class_for(device)
        return type(runtime) is cls and device.type not in cls.device_types


class ActivationRuntime:
    """What moves activation storages between the device and host memory; this base class
    is the ``"loopback"`` runtime (CPU tensors play the device, copies run at once).

    A plugin runtime subclasses it, sets a unique ``name`` and, to be picked by
    ``OffloadConfig(runtime="auto")``, the ``device_types`` it serves, and returns the class
    from the ``swapopt_register_activation_runtimes`` hook. It overrides what differs from
    loopback: ``serves``, ``create`` when its constructor takes arguments, and for an
    asynchronous device the copies, waits and clocks below. A copy returns a *ticket*
    (``None`` when the copy is already done) that ``wait`` and ``host_wait`` take back.
    The session calls these methods from the thread that runs the step.
    """

    #: Name selected by ``OffloadConfig.runtime``; unique among the registered runtimes.
    name: ClassVar[str] = "loopback"
    #: Device types (``torch.device.type``) that ``runtime="auto"`` picks this runtime for;
    #: empty: only by name. ``"auto"`` uses ``"loopback"`` for types no runtime declares.
    device_types: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def create(cls, device: torch.device | None) -> ActivationRuntime:
        """Make a runtime for a session: once for a runtime selected by name; with
        ``"auto"``, whenever an entry's activations are on a device the session's current
        runtime does not serve.

        Args:
            device: With ``runtime="auto"``, where the entry's activations are; ``None``
                for a runtime selected by name, made at the session's first entry before
                any op ran.

        Raises:
            RuntimeError: The runtime cannot run here (its device is not available); the
                session's ``__enter__`` then fails with that error.
        """
        return cls()

    def serves(self, device: torch.device) -> bool:
        """Whether storages on ``device`` are the ones this runtime moves."""
        return device.type == "cpu"

    def begin_entry(self) -> Callable[[], None] | None:
        """Called at an entry's first op; returns a check to run before each op, if any."""
        return None

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host tensor of ``nbytes`` bytes to hold one offloaded storage."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_out(self, storage: torch.UntypedStorage, host: torch.Tensor) -> Any:
        """Copy all bytes of ``storage`` (on a served device) into ``host``; return a ticket.

        The copy must see every op the step issued before it (it may run asynchronously
        after that point, as on a CUDA stream that waits for the compute stream).
        """
        host.copy_(byte_view(storage))
        return None

    def copy_in(self, storage: torch.UntypedStorage, host: torch.Tensor) -> Any:
        """Copy ``host`` into ``storage`` (already resized back); return a ticket."""
        byte_view(storage).copy_(host)
        return None

    def wait(self, ticket: Any) -> None:
        """Order the step's next ops after the copy ``ticket`` stands for.

        Called before an op reads or writes a copied storage and before a storage is
        released; on a device with streams it need not block the host.
        """

    def host_wait(self, ticket: Any) -> None:
        """Block the host until the copy ``ticket`` stands for is done (before the host
        buffer it touches is reused or dropped)."""

    def done(self, ticket: Any) -> bool:
        """Whether the copy ``ticket`` stands for has finished, without blocking.

        The host pool asks before handing a buffer out again. This default treats every
        ticket but ``None`` as still running (the pool then host-waits on it): an
        asynchronous runtime overrides it.
        """
        return ticket is None

    def synchronize(self) -> None:
        """Block until every copy issued so far is done (when the entry ends)."""

    # ---- timing --------------------------------------------------------------------------

    def stamp(self) -> Any:
        """A point on the compute stream whose time ``elapsed_ms`` can read later."""
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two ``stamp`` results (read after the warmup ends)."""
        return (end - start) * 1e3

    def measure_bandwidth(self, nbytes: int = 32 * 2**20, repeats: int = 5) -> tuple[float, float]:
        """Median D2H and H2D bandwidth in GB/s over ``repeats`` warm copies."""
        device = torch.empty(nbytes, dtype=torch.uint8)
        host = self.alloc_host(nbytes)
        device.fill_(1)
        host.fill_(2)
        d2h, h2d = [], []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            host.copy_(device)
            middle = time.perf_counter()
            device.copy_(host)
            end = time.perf_counter()
            d2h.append(nbytes / max(middle - start, 1e-9) / 1e9)
            h2d.append(nbytes / max(end - middle, 1e-9) / 1e9)
        return statistics.median(d2h[1:]), statistics.median(h2d[1:])
