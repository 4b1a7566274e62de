"""The guard under which swapopt's own bookkeeping runs ops inside a session entry."""

from __future__ import annotations

__all__ = ["Quiet"]


class Quiet:
    """A depth count, above zero while swapopt's own bookkeeping runs ops (page-ins,
    recomputes, regions): the entry's dispatch mode lets those through untouched."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
