"""The numbers the pages show are what ``docs/regenerate.py`` would write (its ``--check``)."""

from __future__ import annotations

import importlib.util

from tests.docs.harness import REPO


def test_numbers_are_regenerated() -> None:
    path = REPO / "docs" / "regenerate.py"
    spec = importlib.util.spec_from_file_location("docs_regenerate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.regenerate(check=True) == [], "run: python docs/regenerate.py"
