"""Finding the fenced code blocks of a Markdown page and the ``doc`` marker above each.

A marker is an HTML comment on the line directly above the opening fence (indented like
the fence for a block inside a list item), e.g. ``<!-- doc: run setup=tiny fresh -->``.
Words: ``run``, ``shell``, ``output``, ``ci``, ``file=PATH``; options ``setup=NAME``,
``fresh``, ``check=NAME``, ``status=N``, ``needs=cuda`` / ``needs=ascend``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["KINDS", "Block", "Marker", "parse_marker", "read_blocks"]

KINDS = ("run", "shell", "output", "ci", "file")
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doc:(?P<body>.*?)-->\s*$")
_OPTIONS = {"setup", "check", "status", "needs", "file"}


@dataclass(frozen=True)
class Marker:
    """What a ``<!-- doc: ... -->`` comment asks of the block below it."""

    kind: str
    setup: str | None = None
    fresh: bool = False
    path: str | None = None
    check: str | None = None
    status: int = 0
    needs: str | None = None


@dataclass(frozen=True)
class Block:
    """One fenced block: where it opens (1-based line of the fence), its text and marker."""

    page: str
    line: int
    lang: str
    text: str
    marker: Marker | None = field(default=None)

    @property
    def where(self) -> str:
        """``page:line`` of the opening fence, as errors name it."""
        return f"{self.page}:{self.line}"


def parse_marker(body: str, where: str = "?") -> Marker:
    """The marker of a comment body (what follows ``doc:``).

    Raises:
        ValueError: An unknown word or option, or no kind; the message names ``where``.
    """
    kind: str | None = None
    values: dict[str, str] = {}
    fresh = False
    for word in body.split():
        name, eq, value = word.partition("=")
        if not eq and name in KINDS and name != "file":
            kind = name if kind is None else _twice(where, kind, name)
        elif not eq and name == "fresh":
            fresh = True
        elif eq and name in _OPTIONS and value:
            values[name] = value
            if name == "file":
                kind = "file" if kind is None else _twice(where, kind, name)
        else:
            raise ValueError(
                f"{where}: doc marker word {word!r} is unknown; use run, shell, output, ci, "
                "file=PATH and the options setup=NAME, fresh, check=NAME, status=N, needs=cuda"
            )
    if kind is None:
        if "needs" not in values:
            raise ValueError(f"{where}: doc marker {body.strip()!r} names no kind (run, ...)")
        kind = "run"  # a bare needs=cuda marks a Python block that runs only there
    return Marker(
        kind=kind,
        setup=values.get("setup"),
        fresh=fresh,
        path=values.get("file"),
        check=values.get("check"),
        status=int(values.get("status", "0")),
        needs=values.get("needs"),
    )


def _twice(where: str, first: str, second: str) -> str:
    raise ValueError(f"{where}: doc marker names two kinds, {first!r} and {second!r}")


def read_blocks(path: Path, page: str) -> list[Block]:
    """Every fenced block of the page at ``path`` (named ``page`` in errors), in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    number = 0
    while number < len(lines):
        opening = _FENCE.match(lines[number])
        if opening is None:
            number += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        body: list[str] = []
        end = number + 1
        while end < len(lines) and not (
            lines[end].strip() == fence and lines[end].startswith(indent)
        ):
            line = lines[end]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{number + 1}: the fenced block is never closed")
        where = f"{page}:{number + 1}"
        above = _MARKER.match(lines[number - 1]) if number else None
        marker = parse_marker(above["body"], where) if above else None
        text = "\n".join(body) + "\n"
        blocks.append(Block(page, number + 1, opening["lang"], text, marker))
        number = end + 1
    return blocks
