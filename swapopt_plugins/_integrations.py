"""The integrations ``swapopt run`` switches on, as ``swapopt`` plugins.

Registered through the ``swapopt`` entry-point group (``pyproject.toml``), one plugin object
per framework, each implementing ``swapopt_install_integrations``: when its framework is
installed, it imports its integration module (only then, so a plain ``swap_optimizer`` never
imports Accelerate, Lightning or Transformers) and calls its ``install_globally()``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable, MutableMapping

from swapopt_core import hookimpl
from swapopt_plugins._options import AUTO_ENV, ENV_VARS, auto_enabled, read_settings

logger = logging.getLogger(__name__)

__all__ = ["Integration", "accelerate", "enable_lightning_auto", "lightning", "transformers"]


def enable_lightning_auto(environ: MutableMapping[str, str] | None = None) -> bool:
    """Add the callback to every Lightning ``Trainer``: set ``SWAPOPT_LIGHTNING_AUTO=1``.

    Done when ``SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu``, or when an activation budget is set
    and the device variable does not say ``none`` (the callback then swaps the optimizer state
    too). A ``SWAPOPT_LIGHTNING_AUTO`` the user set is left as it is and decides. The variable
    is inherited by the processes the script starts (DDP workers).

    Args:
        environ: Where the variables are read and set. Default: ``os.environ``.

    Returns:
        Whether every Trainer now gets the callback.

    Raises:
        ValueError: A ``SWAPOPT_*`` variable is invalid; the message names it.
    """
    environ = os.environ if environ is None else environ
    settings = read_settings({}, owner="swapopt run", environ=environ)
    if environ.get(AUTO_ENV, "").strip():
        return auto_enabled(environ)
    device = environ.get(ENV_VARS["offload_optimizer_device"], "").strip().lower()
    if not (settings.enabled or (settings.activations is not None and device != "none")):
        return False
    environ[AUTO_ENV] = "1"
    return True


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


class Integration:
    """One framework's integration, as a plugin for ``swapopt_install_integrations``.

    Args:
        name: What ``swapopt run`` reports when it is on, e.g. ``"accelerate"``.
        frameworks: Top-level packages; the integration applies when one is installed.
        install: Switches it on; returns whether it did.
    """

    def __init__(self, name: str, frameworks: tuple[str, ...], install: Callable[[], bool]):
        self.name = name
        self.frameworks = frameworks
        self._install = install

    def __repr__(self) -> str:
        return f"Integration({self.name!r})"

    @hookimpl
    def swapopt_install_integrations(self) -> str | None:
        """Switch the integration on when its framework is installed and the variables ask."""
        if not any(importlib.util.find_spec(name) is not None for name in self.frameworks):
            logger.debug("swapopt: %s is not installed; integration skipped", self.name)
            return None
        return self.name if self._install() else None


accelerate = Integration(
    "accelerate", ("accelerate",), _module_install("swapopt_plugins.accelerate")
)
lightning = Integration("lightning", ("pytorch_lightning", "lightning"), enable_lightning_auto)
transformers = Integration(
    "transformers", ("transformers",), _module_install("swapopt_plugins.transformers")
)
