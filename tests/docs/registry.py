"""Setups and checkers the doc pages name in their markers, registered by name.

A setup puts into a page's namespace what its text assumes (``MyModel``, ``loader``, a
tiny model) and may write files into the page's folder; a checker validates a file a
``<!-- doc: file=PATH check=NAME -->`` block wrote. Both modules of setups
(``tests/docs/setups.py`` for the core pages, ``tests/docs/setups_frameworks.py`` for the
framework pages) register through the decorators below, so neither edits the other::

    from tests.docs.registry import check, setup

    @setup("tiny_model")
    def tiny_model(ns: dict[str, Any], folder: Path) -> None:
        ns["MyModel"] = ...

    @check("yaml")
    def yaml_file(path: Path) -> None:
        yaml.safe_load(path.read_text())

    @verify("docs/mypage.md")
    def mypage_did_it(ns: dict[str, Any]) -> None:
        assert swap_stats(ns["opt"]).swapped_tensors > 0

A verifier runs after the page's last block, on its last namespace: what the page claims
happened (something swapped, a budget that binds) is asserted there, out of the reader's way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CHECKS", "SETUPS", "VERIFIERS", "Check", "Setup", "Verify", "check", "setup", "verify"]

#: ``setup(namespace, folder)``: fills the page's namespace before a ``run`` block.
Setup = Callable[[dict[str, Any], Path], None]
#: ``check(path)``: raises (an ``AssertionError`` or any error) when the file is wrong.
Check = Callable[[Path], None]

#: ``verify(namespace)``: asserts what a page's run must have done.
Verify = Callable[[dict[str, Any]], None]

SETUPS: dict[str, Setup] = {}
CHECKS: dict[str, Check] = {}
VERIFIERS: dict[str, Verify] = {}


def _register(table: dict[str, Any], kind: str, name: str) -> Callable[[Any], Any]:
    def add(fn: Any) -> Any:
        if name in table:
            raise ValueError(f"the doc {kind} {name!r} is registered twice ({fn.__module__})")
        table[name] = fn
        return fn

    return add


def setup(name: str) -> Callable[[Setup], Setup]:
    """Register a setup under ``name`` (what ``<!-- doc: run setup=NAME -->`` calls)."""
    return _register(SETUPS, "setup", name)


def check(name: str) -> Callable[[Check], Check]:
    """Register a file checker under ``name`` (``<!-- doc: file=PATH check=NAME -->``)."""
    return _register(CHECKS, "check", name)


def verify(page: str) -> Callable[[Verify], Verify]:
    """Register the verifier of ``page`` (its path from the repository root)."""
    return _register(VERIFIERS, "verifier", page)
