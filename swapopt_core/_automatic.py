"""How the automatic ways in install a swap: an optimizer swapopt cannot serve is left alone.

``swapopt run``, the integrations' callbacks and patches (Lightning, Accelerate,
Transformers, MindFormers) swap optimizers the script never handed to swapopt itself. Each
of them installs through ``swap_automatically``: an ``UnsupportedOptimizerError`` (LBFGS, a
family no plugin serves, a flag that needs the state resident) leaves that optimizer as it
is, with one ``SwapOptWarning`` per optimizer, and the script runs as it would without
swapopt. ``SWAPOPT_STRICT=1`` turns the refusal back into the error. Every other error
(a bad config value, an optimizer swapped with another config) propagates. An explicit
``swap_optimizer(opt)`` call always raises.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
import weakref
from collections.abc import Callable, Mapping

from swapopt_core._api import is_swap_optimizer, swap_optimizer
from swapopt_core._config import SwapOptimizerConfig
from swapopt_core._errors import SwapOptWarning, UnsupportedOptimizerError
from swapopt_core._launch import note_nothing_to_swap
from swapopt_core._options import env_flag

logger = logging.getLogger(__name__)

__all__ = ["STRICT_ENV", "refused", "strict_mode", "swap_automatically"]

#: A yes word makes the automatic ways in raise ``UnsupportedOptimizerError``.
STRICT_ENV = "SWAPOPT_STRICT"

# The optimizers left unswapped, so each is named once (weakly held: they may go away).
_refused: weakref.WeakSet[object] = weakref.WeakSet()
# Those a WeakSet cannot hold (no hash: an ``__eq__`` without ``__hash__``; or no weak
# reference), by id. An id alone would name a new optimizer that lands at a dead one's
# address, so each id keeps what tells its own optimizer: a weak reference, which a lookup
# checks is that very object and whose death removes the entry, or the optimizer itself
# where it takes no weak reference.
_refused_by_id: dict[int, Callable[[], object]] = {}


def strict_mode(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``SWAPOPT_STRICT`` asks the automatic ways in to raise; unset or empty: no.

    Raises:
        ValueError: The variable holds something other than a yes/no word; the message
            names it, shows the value and lists the accepted words.
    """
    return env_flag(
        os.environ if environ is None else environ,
        STRICT_ENV,
        "to raise for an optimizer swapopt cannot serve (no: leave it unswapped with a warning)",
    )


def refused(optimizer: object) -> bool:
    """Whether ``swap_automatically`` left ``optimizer`` unswapped as one it cannot serve."""
    held = _refused_by_id.get(id(optimizer))
    if held is not None and held() is optimizer:
        return True
    try:
        return optimizer in _refused  # False for an object without weak references
    except TypeError:  # no hash: only ever in ``_refused_by_id``
        return False


def _first_time(optimizer: object) -> bool:
    """Whether ``optimizer`` is refused now for the first time (and note it)."""
    if refused(optimizer):
        return False
    try:
        _refused.add(optimizer)
    except TypeError:  # no hash, or no weak reference
        _refused_by_id[id(optimizer)] = _holder(optimizer)
    return True


def _holder(optimizer: object) -> Callable[[], object]:
    """What ``_refused_by_id`` keeps for ``optimizer``: it returns ``optimizer`` while it lives."""
    key = id(optimizer)
    try:
        return weakref.ref(optimizer, functools.partial(_forget, key))
    except TypeError:  # no weak reference: held, so its id stays its own
        return lambda: optimizer


def _forget(key: int, ref: weakref.ref[object]) -> None:
    """A refused optimizer known by its id died: drop its entry (unless a new one took it)."""
    if _refused_by_id.get(key) is ref:
        del _refused_by_id[key]


def swap_automatically(optimizer: object, config: SwapOptimizerConfig) -> bool:
    """``swap_optimizer(optimizer, config)`` for a way in the user did not call explicitly.

    An optimizer swapopt cannot serve stays as it is: warned about once (a ``SwapOptWarning``
    naming its class and the reason), the step runs as without swapopt. Set
    ``SWAPOPT_STRICT=1`` to raise instead.

    Returns:
        Whether ``optimizer`` is swapped now (False also when ``runtime="auto"`` found no
        accelerator, which ``swap_optimizer`` says itself).

    Raises:
        UnsupportedOptimizerError: With ``SWAPOPT_STRICT`` set to a yes word.
        ValueError: ``SWAPOPT_STRICT`` is not a yes/no word, or a config value does not fit.
        SwapOptError: Any other refusal of ``swap_optimizer``.
    """
    strict = strict_mode()
    try:
        swap_optimizer(optimizer, config)
    except UnsupportedOptimizerError as error:
        if strict:
            raise
        name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        logger.debug("swapopt: %s left unswapped: %s", name, error)
        if _first_time(optimizer):
            note_nothing_to_swap()  # `swapopt run` then does not add its own exit message
            warnings.warn(
                f"swapopt leaves {name} unswapped: {error} The script runs on without "
                f"swapping this optimizer (its state stays where it is); set {STRICT_ENV}=1 "
                "to make this an error.",
                SwapOptWarning,
                stacklevel=3,
            )
        return False
    return is_swap_optimizer(optimizer)
