"""Running a documentation page's code blocks, in page order, like a notebook.

Each page runs in its own fresh temporary folder (the working directory, also first on
``sys.path`` so a ``file=`` block's module imports), with the CPU switch on
(``tests/docs/cpu_switch.py``):

- ``run``: Python, executed in the page's one namespace (``fresh`` starts a new one;
  ``setup=NAME`` first calls the registered setup, ``tests/docs/registry.py``). Tracebacks
  name the page and its line numbers. What it prints to stdout is its output. ``status=1``
  marks a block that shows an error: it must raise, and its output is the last line of the
  traceback (``ValueError: ...``).
- ``file=PATH``: the text is written to ``PATH`` in the folder; ``check=NAME`` validates it.
- ``shell``: the text runs through ``bash -e`` in the folder, with the running interpreter's
  ``bin`` directory first on ``PATH``, the repository first on ``PYTHONPATH``, the CPU switch's
  variables set, and ``.venv`` and ``benchmarks`` in the folder linked to the interpreter's
  environment and the repository's ``benchmarks/`` (commands are written as run from a
  checkout). It must exit with ``status`` (0 unless given). Its output is stdout and stderr
  together, as a terminal shows them. A ``console`` block marked ``shell`` holds the commands
  (lines starting ``$ ``, a trailing ``\\`` continues one) and, under each, its output, which is
  checked like an ``output`` block.
- ``output``: what the block before printed. Checked line by line after masking every number
  on both sides (a run of digits, with a fraction or exponent, reads as ``0``: figures move
  with the machine, the words around them must not); trailing spaces and blank lines at the
  ends are ignored; ``...`` alone on a line matches any number of lines, ``...`` within a line
  any text. Numbers that must be exact are asserted in a ``run`` block, or written by
  ``docs/regenerate.py`` and compared by its ``--check``.
- ``ci``: not run here; ``test_pages.test_ci_blocks`` compares them with ``.ci/run``.
- After the last block, the page's verifier (``registry.verify``), if it has one, asserts on the
  namespace what the page claims happened.
- ``needs=cuda`` (or ``needs=ascend``): skipped without that device, with the output block after
  it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from swapopt_core._device.registry import forget_shared_runtimes
from tests.docs.blocks import Block, read_blocks
from tests.docs.cpu_switch import SHELL_ENV, cpu_switch
from tests.docs.registry import CHECKS, SETUPS, VERIFIERS

__all__ = ["REPO", "match_output", "page_blocks", "run_page"]

REPO = Path(__file__).resolve().parents[2]
SHELL_TIMEOUT_S = 300
_NUMBER = re.compile(r"[-+]?\d[\d,_]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def page_blocks(page: str) -> list[Block]:
    """The blocks of ``page`` (a path relative to the repository root)."""
    return read_blocks(REPO / page, page)


def _mask(text: str) -> list[str]:
    return [_NUMBER.sub("0", line.rstrip()) for line in text.strip("\n").splitlines()]


def match_output(expected: str, actual: str) -> bool:
    """Whether ``actual`` output fits the ``expected`` text shown on a page (rules above)."""
    parts = []
    for line in _mask(expected):
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*".join(re.escape(piece) for piece in line.split("...")) + r"\n")
    actual_text = "".join(line + "\n" for line in _mask(actual))
    return re.fullmatch("".join(parts), actual_text, re.DOTALL) is not None


def _skipped(block: Block) -> str | None:
    needs = block.marker.needs if block.marker else None
    if needs == "cuda" and not torch.cuda.is_available():
        return "cuda"
    if needs is not None and needs != "cuda":
        return needs  # no Ascend device on the test machines
    return None


class _Page:
    """The state of one page's run: its namespace, folder and the last block's output."""

    def __init__(self, page: str, folder: Path) -> None:
        self.page = page
        self.folder = folder
        self.namespace: dict[str, Any] = {}
        self.output: str | None = None
        self.source: Block | None = None

    def run(self, block: Block) -> None:
        marker = block.marker
        assert marker is not None
        if marker.fresh:
            self.namespace = {}
        if marker.setup is not None:
            if marker.setup not in SETUPS:
                raise KeyError(f"{block.where}: no doc setup {marker.setup!r} ({sorted(SETUPS)})")
            SETUPS[marker.setup](self.namespace, self.folder)
        self.namespace.setdefault("__name__", "__main__")
        code = compile("\n" * block.line + block.text, str(REPO / self.page), "exec")
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                exec(code, self.namespace)
        except Exception as error:
            if not marker.status:
                print(buffer.getvalue(), end="")
                raise
            buffer.write(traceback.format_exception_only(error)[-1])
        else:
            if marker.status:
                raise AssertionError(f"{block.where}: the block should raise, and did not")
        print(buffer.getvalue(), end="")  # pytest shows it when the page fails
        self.output = buffer.getvalue()

    def write(self, block: Block) -> None:
        marker = block.marker
        assert marker is not None and marker.path is not None
        target = self.folder / marker.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text, encoding="utf-8")
        if marker.check is not None:
            if marker.check not in CHECKS:
                raise KeyError(f"{block.where}: no doc check {marker.check!r} ({sorted(CHECKS)})")
            CHECKS[marker.check](target)
        self.output = None

    def shell(self, block: Block) -> None:
        marker = block.marker
        assert marker is not None
        if block.lang != "console":
            self.output = self._bash(block, block.text, marker.status)
            return
        for command, expected in _console(block.text):
            actual = self._bash(block, command, marker.status)
            if expected.strip() and not match_output(expected, actual):
                raise AssertionError(
                    f"{block.where}: `{command.strip()}` printed\n{actual}\nnot what the page "
                    f"shows:\n{expected}"
                )
        self.output = None

    def _bash(self, block: Block, script: str, status: int) -> str:
        env = dict(os.environ, **SHELL_ENV)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), str(self.folder), env.get("PYTHONPATH")) if p
        )
        done = subprocess.run(
            ["bash", "-e", "-c", script],
            cwd=self.folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=SHELL_TIMEOUT_S,
            check=False,
        )
        print(f"$ {script.strip()}\n{done.stdout}")
        if done.returncode != status:
            raise AssertionError(
                f"{block.where}: exited {done.returncode}, the page expects {status}:\n"
                f"{done.stdout}"
            )
        return done.stdout

    def compare(self, block: Block) -> None:
        if self.output is None or self.source is None:
            raise AssertionError(f"{block.where}: an output block follows no block that prints")
        if not match_output(block.text, self.output):
            raise AssertionError(
                f"{block.where}: {self.source.where} printed\n{self.output}\nnot what the "
                f"page shows (numbers masked, ... matches anything):\n{block.text}"
            )


def _console(text: str) -> list[tuple[str, str]]:
    """``(command, expected output)`` pairs of a console transcript."""
    pairs: list[tuple[list[str], list[str]]] = []
    continued = False
    for line in text.splitlines():
        if continued and pairs:
            pairs[-1][0].append(line)
        elif line.startswith("$ "):
            pairs.append(([line[2:]], []))
        elif pairs:
            pairs[-1][1].append(line)
        continued = line.endswith("\\")
    return [("\n".join(command) + "\n", "\n".join(out)) for command, out in pairs]


def _link(folder: Path, name: str, target: Path) -> None:
    if target.exists() and not (folder / name).exists():
        (folder / name).symlink_to(target, target_is_directory=target.is_dir())


def run_page(page: str, folder: Path) -> list[str]:
    """Run every marked block of ``page`` in ``folder``; return the skipped blocks' places.

    Raises:
        AssertionError: A block failed, printed other than its ``output`` block shows, or
            exited with another status than its marker says.
    """
    state = _Page(page, folder)
    _link(folder, ".venv", Path(sys.prefix))
    _link(folder, "benchmarks", REPO / "benchmarks")
    skipped: list[str] = []
    before = os.getcwd()
    modules = set(sys.modules)
    sys.path.insert(0, str(folder))
    os.chdir(folder)
    try:
        with cpu_switch():
            skip_output = False
            for block in page_blocks(page):
                marker = block.marker
                if marker is None or marker.kind == "ci":
                    continue
                if marker.kind == "output":
                    if not skip_output:
                        state.compare(block)
                    continue
                skip_output = _skipped(block) is not None
                if skip_output:
                    skipped.append(f"{block.where} (needs {_skipped(block)})")
                    continue
                state.source = block
                getattr(state, {"run": "run", "file": "write", "shell": "shell"}[marker.kind])(
                    block
                )
            if page in VERIFIERS:
                VERIFIERS[page](state.namespace)
    finally:
        os.chdir(before)
        sys.path.remove(str(folder))
        for name in set(sys.modules) - modules:  # the page's own modules (file= blocks)
            if str(folder) in str(getattr(sys.modules[name], "__file__", "") or ""):
                del sys.modules[name]
        forget_shared_runtimes()
    return skipped
