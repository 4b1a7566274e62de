"""Choosing runtimes by name or device, and sharing one instance per device between halves.

``shared_runtime(cls, device)`` is the only way swapopt makes a runtime: it returns the live
instance of ``cls`` for ``cls.shared_key(device)`` if there is one, else makes it with
``cls.create(device)``. Instances are held weakly, so an optimizer swap and an
``OffloadSession`` on one device share one runtime (one copy queue per direction, one
link) while both live, and a process that builds many optimizers one after another does
not keep old runtimes (or the copy lanes' threads) alive. Each half keeps its own counts.

``resolve_runtime`` turns ``OffloadConfig.runtime`` into a ``RuntimeChoice`` when a session
is created; the session makes (or shares) its runtime at the first entry.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from swapopt_core._device.interface import TorchRuntime, TransferRuntime

logger = logging.getLogger(__name__)

__all__ = [
    "AUTO_RUNTIME",
    "FALLBACK_RUNTIME",
    "RuntimeChoice",
    "choose_runtime",
    "forget_shared_runtimes",
    "resolve_runtime",
    "shared_runtime",
]

#: The name that lets the tensors' device choose the runtime.
AUTO_RUNTIME = "auto"
#: What ``"auto"`` uses for activations on a device type no registered runtime declares.
FALLBACK_RUNTIME = "loopback"
#: The plugin module that registers the built-in runtimes.
BUILTIN_PLUGIN = "swapopt_core._device.plugin"
#: The hook runtimes are registered through (named in errors).
HOOK = "swapopt_register_runtimes"

_LIVE: weakref.WeakValueDictionary[tuple[type, object], TransferRuntime[Any, Any, Any]] = (
    weakref.WeakValueDictionary()
)
_LIVE_LOCK = threading.RLock()  # a create may ask for another runtime


def shared_runtime(
    cls: type[TransferRuntime[Any, Any, Any]], device: Any = None
) -> TransferRuntime[Any, Any, Any]:
    """The live instance of ``cls`` serving ``device``, made by ``cls.create`` if none is.

    Args:
        cls: A registered runtime class.
        device: Where the tensors are (``None``: the runtime picks, e.g. the current
            accelerator device). ``cls.shared_key(device)`` says which requests share.

    Raises:
        TypeError: ``cls.create`` did not return an instance of the interface.
        RuntimeError: The runtime cannot run here (from ``create``).
    """
    if cls.framework != "torch":
        # Only torch runtimes serve two halves; the others stay one per owner, so an
        # instance's whole pinned count (``pinned_nbytes``' default) stays its owner's.
        return cls.create(device)
    key = (cls, cls.shared_key(device))
    with _LIVE_LOCK:
        runtime = _LIVE.get(key)
        if runtime is not None:
            return runtime
        made = cls.create(device)
        if not isinstance(made, TransferRuntime):
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__}.create returned {made!r}; an activation "
                "runtime's create (any runtime's) must return a swapopt_core.TransferRuntime "
                "instance."
            )
        _LIVE[key] = made
    logger.debug("made the %s runtime for %s", cls.name, device)
    return made


def forget_shared_runtimes() -> None:
    """Forget the live instances: later requests make new ones (their owners keep theirs).

    Tests call it between cases, so a fault one case injects into its runtime instance never
    reaches the next case through a shared instance that is not yet collected.
    """
    with _LIVE_LOCK:
        _LIVE.clear()


def choose_runtime(
    wanted: str,
    device: torch.device | None = None,
    runtimes: Mapping[str, type[TorchRuntime]] | None = None,
) -> TorchRuntime:
    """The runtime that ``OffloadConfig.runtime`` names, for ``device``.

    A shortcut for ``resolve_runtime(wanted, runtimes).make(device)``.

    Args:
        wanted: A registered runtime name, or ``"auto"`` (see :class:`RuntimeChoice`).
        device: Where the activations are, as an entry's first op shows it; what
            ``"auto"`` follows.
        runtimes: The registered torch runtime classes by name. Default: those of
            ``get_plugin_manager()``.

    Raises:
        ValueError: ``wanted`` is not registered (the message lists what is).
        RuntimeError: An accelerator runtime is asked for and none is available.
    """
    if runtimes is None:
        # Imported here: the plugin manager imports the built-in plugin, which imports this.
        from swapopt_core._plugins import get_plugin_manager, runtime_classes

        runtimes = runtime_classes(get_plugin_manager(), "torch")
    return resolve_runtime(wanted, runtimes).make(device)


def resolve_runtime(
    name: str,
    runtimes: Mapping[str, type[TorchRuntime]],
    *,
    label: str = "OffloadConfig.runtime",
) -> RuntimeChoice:
    """How a session makes the runtime ``name`` selects, checked against ``runtimes``.

    Args:
        name: A registered runtime name, or ``"auto"``.
        runtimes: The registered torch runtime classes by name
            (``swapopt_core._plugins.runtime_classes``).
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
                f"{known}, or install or register the plugin that provides it ({HOOK})."
            )
        return RuntimeChoice(name, chosen, {}, None)
    by_type: dict[str, type[TorchRuntime]] = {}
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
    """How a session gets its runtime: one named class, or ``"auto"``'s pick per device.

    ``"auto"`` follows the activations: at an entry's first op, the runtime whose
    ``device_types`` holds the type of the device that op's tensors are on, else
    :data:`FALLBACK_RUNTIME` (loopback: CPU tensors are the "device" and their copies go
    to other CPU buffers; storages on other devices are left alone).

    Attributes:
        wanted: The configured name.
        named: The class a named runtime is made from (``None`` for ``"auto"``).
        by_type: For ``"auto"``: the class declaring each device type.
        fallback: For ``"auto"``: the class for every other device type.
    """

    wanted: str
    named: type[TorchRuntime] | None
    by_type: Mapping[str, type[TorchRuntime]]
    fallback: type[TorchRuntime] | None

    def class_for(self, device: torch.device | None) -> type[TorchRuntime]:
        """The class that serves activations on ``device`` (``None``: not known yet)."""
        if self.named is not None:
            return self.named
        assert self.fallback is not None
        if device is None:
            return self.fallback
        return self.by_type.get(device.type, self.fallback)

    def make(self, device: torch.device | None = None) -> TorchRuntime:
        """The (shared) runtime for activations on ``device`` (``None``: a named runtime,
        asked for before any op shows where the activations are).

        Raises:
            TypeError: The class's ``create`` did not return a runtime instance.
        """
        return shared_runtime(self.class_for(device), device)

    def keeps(self, runtime: TorchRuntime, device: torch.device) -> bool:
        """Whether ``runtime`` goes on serving an entry whose activations are on ``device``.

        A named runtime serves every entry. With ``"auto"`` the runtime is kept when it
        serves ``device``, or when a new one would be the same fallback class (it would
        serve that device no better).
        """
        if self.named is not None or runtime.serves(device):
            return True
        cls = self.class_for(device)
        return type(runtime) is cls and device.type not in cls.device_types
