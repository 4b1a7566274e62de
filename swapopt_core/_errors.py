"""Exception and warning types raised by swapopt."""

from __future__ import annotations

__all__ = ["SwapOptError", "SwapOptWarning", "UnsupportedOptimizerError"]


class SwapOptError(RuntimeError):
    """A request swapopt cannot serve: an unsupported optimizer, flag or tensor layout."""

    __module__ = "swapopt_core"


class UnsupportedOptimizerError(SwapOptError):
    """The optimizer itself cannot be swapped: no family serves it, its update reads across
    parameters (LBFGS), or one of its flags needs its state resident.

    The automatic ways in (``swapopt run``, the integrations' callbacks) catch this one and
    leave the optimizer as it is with one warning; ``SWAPOPT_STRICT=1`` makes them raise it.
    An explicit ``swap_optimizer`` call always raises it.
    """

    __module__ = "swapopt_core"


class SwapOptWarning(UserWarning):
    """Something the user should know about, such as a swap that moves nothing."""

    __module__ = "swapopt_core"
