"""Exception and warning types raised by swapopt."""

from __future__ import annotations

__all__ = ["SwapOptError", "SwapOptWarning"]


class SwapOptError(RuntimeError):
    """A request swapopt cannot serve: an unsupported optimizer, flag or tensor layout."""

    __module__ = "swapopt_core"


class SwapOptWarning(UserWarning):
    """Something the user should know about, such as a swap that moves nothing."""

    __module__ = "swapopt_core"
