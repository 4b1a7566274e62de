"""The pages the doc tests cover.

A page is listed once every fenced block in it carries a ``<!-- doc: ... -->`` marker
(``tests/docs/blocks.py``): ``test_pages.test_every_block_is_marked`` fails on an unmarked
block of a listed page (naming ``page:line``), and ``test_pages.test_page`` runs each listed
page. The core pages are listed here (owned with their setups in ``tests/docs/setups.py``);
the framework pages in ``tests/docs/setups_frameworks.PAGES``, so two people marking pages
never edit one line. A page not listed yet is not run; ``test_every_page_is_listed`` (once
all are marked) keeps a new page from being forgotten.
"""

from __future__ import annotations

from tests.docs import setups, setups_frameworks  # noqa: F401  (registers the setups)

__all__ = ["CORE_PAGES", "PAGES"]

#: The core pages, in the order they run.
CORE_PAGES: tuple[str, ...] = (
    "README.md",
    "docs/optimizer_swap.md",
    "docs/activation_offload.md",
    "docs/device_budget.md",
    "docs/estimate.md",
    "docs/formats.md",
    "docs/performance.md",
    "docs/plugins.md",
    "docs/configuration.md",
    "docs/figures.md",
)

PAGES: tuple[str, ...] = CORE_PAGES + setups_frameworks.PAGES
