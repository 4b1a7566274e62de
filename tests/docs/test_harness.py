"""The doc-test harness itself: markers, output matching, console transcripts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import parse_marker, read_blocks
from tests.docs.harness import _console, match_output


def test_markers() -> None:
    assert parse_marker(" run setup=tiny fresh ").setup == "tiny"
    assert parse_marker("run fresh").fresh
    file = parse_marker("file=conf/a.yaml check=yaml")
    assert (file.kind, file.path, file.check) == ("file", "conf/a.yaml", "yaml")
    assert parse_marker("shell status=2").status == 2
    assert parse_marker("needs=cuda").kind == "run"
    with pytest.raises(ValueError, match="p.md:3.*'rnu'"):
        parse_marker("rnu", "p.md:3")
    with pytest.raises(ValueError, match="two kinds"):
        parse_marker("run shell")


def test_blocks_and_unmarked(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "text\n<!-- doc: run -->\n```python\nx = 1\n```\n\n```bash\nls\n```\n"
        "1. item\n   <!-- doc: file=a.toml -->\n   ```toml\n   [a]\n   ```\n"
    )
    blocks = read_blocks(page, "p.md")
    assert [(b.line, b.marker.kind if b.marker else None) for b in blocks] == [
        (3, "run"),
        (7, None),
        (12, "file"),
    ]
    assert blocks[2].text == "[a]\n"


def test_output_matching() -> None:
    assert match_output("loss 0.25 after 3 steps\n", "loss 0.19 after 12 steps")
    assert not match_output("loss 0.25 after 3 steps", "loss 0.19 before 12 steps")
    assert match_output("a\n...\nz", "a\nb\nc\nz\n\n")
    assert match_output("a\n...\nz", "a\nz")
    assert match_output("took ... s", "took 1.5 s")
    assert not match_output("a\nz", "a\nb\nz")


def test_console() -> None:
    text = "$ swapopt plan --a \\\n    --b\nline 1\n$ ls\n"
    assert _console(text) == [("swapopt plan --a \\\n    --b\n", "line 1"), ("ls\n", "")]
