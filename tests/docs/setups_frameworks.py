"""Setups and checkers for the framework pages (lightning, accelerate, transformers,
mindspore); see ``tests/docs/registry.py`` for how to add one.

``PAGES`` lists the framework pages whose blocks are all marked: the doc tests run them and
fail on any unmarked block in them (the core pages are listed in ``tests/docs/pages.py``).
"""

from __future__ import annotations

from tests.docs.registry import check, setup  # noqa: F401  (what this module uses)

#: Framework pages (paths relative to the repository root) the doc tests cover.
PAGES: tuple[str, ...] = ()
