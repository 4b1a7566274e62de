"""The integrations ``swapopt run`` switches on, as ``swapopt`` plugins.

Registered through the ``swapopt`` entry-point group (``pyproject.toml``), one plugin object
per framework, each implementing ``swapopt_install_integrations``. When its framework is
installed and the ``SWAPOPT_*`` variables ask for something, it calls its integration's
``install_globally()``: at once when the framework is imported already, else right after the
script imports it. So ``swapopt run`` imports no framework the script does not use, and a
plain ``swap_optimizer`` never imports Accelerate, Lightning or Transformers.

``ClassPatch`` is how an ``install_globally`` reaches objects an unmodified script creates:
it puts the integration's functions on the framework's class for the whole process.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from swapopt_core import hookimpl
from swapopt_core.options import enable_lightning_auto, read_settings

logger = logging.getLogger(__name__)

__all__ = ["ClassPatch", "Integration", "accelerate", "lightning", "transformers"]


def _module_install(dotted: str) -> Callable[[], bool]:
    """``install_globally`` of the integration module ``dotted``, imported when called."""

    def install() -> bool:
        try:
            module = importlib.import_module(dotted)
        except ModuleNotFoundError as error:
            if error.name != dotted:  # the integration itself is broken: say so
                raise
            return False
        function = getattr(module, "install_globally", None)
        return bool(function()) if function is not None else False

    return install


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls functions right after a top-level package finished importing (first time only).

    It finds nothing itself: it asks the finders after it for the spec and wraps that
    loader's ``exec_module`` on the loader instance, so the module keeps its own loader.
    """

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[], object]]] = {}

    def add(self, name: str, function: Callable[[], object]) -> None:
        self.pending.setdefault(name, []).append(function)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name not in self.pending:
            return None
        # NOTE: a spec may be only looked at (importlib.util.find_spec), never executed, so
        # the functions run, and leave the queue, only when the module itself is executed.
        spec = next(filter(None, (f.find_spec(name, path, target) for f in self._others())), None)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            del loader.exec_module  # back to the class's method
            execute(module)
            for function in self.pending.pop(name, []):
                function()
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)

        loader.exec_module = exec_module
        return spec

    def _others(self) -> list[Any]:
        return [f for f in sys.meta_path if f is not self and hasattr(f, "find_spec")]


_after_import = _AfterImport()


class Integration:
    """One framework's integration, as a plugin for ``swapopt_install_integrations``.

    Args:
        name: What ``swapopt run`` reports when it is on, e.g. ``"accelerate"``.
        frameworks: Top-level packages; the integration applies when one is installed.
        install: Switches it on; returns whether it did.
        deferred: Call ``install`` only once the script imports the first of ``frameworks``
            (it imports the framework); else call it at once.
    """

    def __init__(
        self,
        name: str,
        frameworks: tuple[str, ...],
        install: Callable[[], bool],
        *,
        deferred: bool = True,
    ) -> None:
        self.name = name
        self.frameworks = frameworks
        self._install = install
        self._deferred = deferred

    def __repr__(self) -> str:
        return f"Integration({self.name!r})"

    @hookimpl
    def swapopt_install_integrations(self) -> str | None:
        """Switch the integration on when its framework is installed and the variables ask."""
        if not any(importlib.util.find_spec(name) is not None for name in self.frameworks):
            logger.debug("swapopt: %s is not installed; integration skipped", self.name)
            return None
        if not self._deferred:
            return self.name if self._install() else None
        if not read_settings({}, owner="swapopt run").requested:  # a bad value stops it now
            return None
        if any(name in sys.modules for name in self.frameworks):
            return self.name if self._install() else None
        _after_import.add(self.frameworks[0], self._install)
        logger.debug("swapopt: %s switches on when the script imports it", self.name)
        return self.name


class ClassPatch:
    """Functions put on a framework class for the whole process, the class's own kept.

    ``own`` holds the class's methods as they were when the patch was made (before any
    ``install``): what the integration's functions call, and what ``uninstall`` puts back.

    Args:
        cls: The framework class, e.g. ``accelerate.Accelerator``.
        names: The methods to keep in ``own``; ``install`` may replace any of them.
        read: Reads the settings from the environment; they have ``enabled``.
    """

    def __init__(self, cls: type, names: tuple[str, ...], read: Callable[[], Any]) -> None:
        self.cls = cls
        self.read = read
        self.own: dict[str, Callable[..., Any]] = {name: cls.__dict__[name] for name in names}
        self.settings: Any = None  # what install read; None while not installed
        self.replaced: tuple[str, ...] = ()

    def guard(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function``, which turns back into the class's own ``name`` once uninstalled."""

        def guarded(instance: object, *args: Any, **kwargs: Any) -> Any:
            if self.settings is None:  # a reference taken to a patch since removed
                return self.own[name](instance, *args, **kwargs)
            return function(instance, *args, **kwargs)

        return guarded

    def install(self, methods: Mapping[str, Callable[..., Any]]) -> bool:
        """Put ``methods`` on the class when the settings ``read()`` returns are ``enabled``.

        Reads nothing and changes nothing when installed already.

        Returns:
            Whether the patch is in place.
        """
        if self.settings is not None:
            return True
        settings = self.read()
        if not settings.enabled:
            logger.debug("swapopt: no swap asked for (SWAPOPT_*); %s unchanged", self.cls.__name__)
            return False
        for name, function in methods.items():
            setattr(self.cls, name, function)
        self.settings, self.replaced = settings, tuple(methods)
        logger.info("swapopt: every %s swaps its optimizers (%s)", self.cls.__name__, settings)
        return True

    def installed(self) -> Any:
        """The settings ``install`` read, or None when the patch is not in place."""
        return self.settings

    def copy_settings(self) -> Any:
        """A copy of the settings ``install`` read (each caller its own), else ``read()``."""
        return self.read() if self.settings is None else dataclasses.replace(self.settings)

    def uninstall(self) -> bool:
        """Put the class's own methods back; returns whether a patch was removed."""
        if self.settings is None:
            return False
        for name in self.replaced:
            setattr(self.cls, name, self.own[name])
        self.settings, self.replaced = None, ()
        return True


accelerate = Integration(
    "accelerate", ("accelerate",), _module_install("swapopt_plugins.accelerate")
)
lightning = Integration(
    "lightning", ("pytorch_lightning", "lightning"), enable_lightning_auto, deferred=False
)
transformers = Integration(
    "transformers", ("transformers",), _module_install("swapopt_plugins.transformers")
)
