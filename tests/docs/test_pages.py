"""The documentation's code blocks, run: one test per page (test id: the page's path).

See ``tests/docs/harness.py`` for what each marker does and ``tests/docs/pages.py`` for
which pages are covered.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.harness import REPO, page_blocks, run_page
from tests.docs.pages import PAGES

ALL_PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")))


@pytest.mark.parametrize("page", PAGES)
def test_page(page: str, tmp_path: Path) -> None:
    """Every block of the page runs on CPU and prints what the page shows."""
    skipped = run_page(page, tmp_path)
    if skipped:
        pytest.skip(f"ran all but {', '.join(skipped)}")


def test_every_block_is_marked() -> None:
    """Every fenced block of a covered page carries a doc marker (listed by page:line)."""
    unmarked = [block.where for page in PAGES for block in page_blocks(page) if not block.marker]
    assert not unmarked, "blocks without a <!-- doc: ... --> marker: " + ", ".join(unmarked)


def test_pages_listed_exist() -> None:
    """The lists name real pages, each once."""
    assert len(set(PAGES)) == len(PAGES)
    assert set(PAGES) <= set(ALL_PAGES), set(PAGES) - set(ALL_PAGES)


def test_every_page_is_listed() -> None:
    """Every page of README.md and docs/ is covered (skipped while some are not marked)."""
    missing = [page for page in ALL_PAGES if page not in PAGES]
    if missing:
        pytest.skip(f"not covered yet: {', '.join(missing)}")


def test_ci_blocks() -> None:
    """README's set-up commands: .ci/run runs the test command exactly, and the demo command
    installs the same way."""
    ci = [block for block in page_blocks("README.md") if block.marker and block.marker.kind == "ci"]
    if not ci:
        pytest.skip("README.md has no ci block yet")
    commands = [block.text.strip() for block in ci]
    test_command = next(command for command in commands if "pytest" in command)
    script = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_command in script, f".ci/run does not run README's test command {test_command}"
    install = test_command.split(" && ")[:2]
    for command in commands:
        assert command.split(" && ")[:2] == install, f"{command} installs otherwise"
