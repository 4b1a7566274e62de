"""How ``swapopt demo`` shows its progress: a live bar on a terminal, plain lines elsewhere.

A CI log or a pipe gets no live bar (rich draws it only on a terminal), so without the plain
lines the demo would be silent until its table, minutes on a loaded machine. Each line names
the run, the step, the loss and the time since the run began; lines come at the first and last
step, every tenth of the run and at least every ``interval_s`` seconds.
"""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["DemoProgress"]


class DemoProgress:
    """The progress of the demo's runs, shown the way ``console`` can show it.

    Use as a context manager; call :meth:`begin` at the start of each run and :meth:`advance`
    after each of its steps.

    Args:
        console: Where the progress goes.
        interval_s: Longest time between two plain lines while a run goes on.
        plain: Plain lines (True) or a live bar (False); None: plain lines unless ``console``
            is a terminal.
    """

    def __init__(
        self, console: Console, *, interval_s: float = 10.0, plain: bool | None = None
    ) -> None:
        self.console = console
        self.interval_s = interval_s
        self.plain = not console.is_terminal if plain is None else plain
        columns = (
            TextColumn("{task.description:>14}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TimeElapsedColumn(),
        )
        self._bar = Progress(*columns, console=console, disable=self.plain)
        self._task: TaskID | None = None
        self._label, self._total, self._done = "", 0, 0
        self._began = self._last = time.monotonic()

    def __enter__(self) -> DemoProgress:
        self._bar.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._bar.__exit__(kind, error, trace)

    def note(self, text: str) -> None:
        """One plain line (the demo's opening line); nothing when the live bar is shown."""
        if self.plain:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def begin(self, label: str, total: int) -> None:
        """A run called ``label`` of ``total`` steps starts."""
        self._label, self._total, self._done = label, total, 0
        self._began = self._last = time.monotonic()
        self._task = self._bar.add_task(label, total=total, loss=float("nan"))

    def advance(self, loss: float) -> None:
        """The run made one more step, with ``loss``."""
        self._done += 1
        if self._task is not None:
            self._bar.update(self._task, advance=1, loss=loss)
        if not self.plain:
            return
        now = time.monotonic()
        tenth = max(1, self._total // 10)
        if (
            self._done in (1, self._total)
            or self._done % tenth == 0
            or now - self._last >= self.interval_s
        ):
            self._last = now
            self.note(
                f"{self._label}: step {self._done}/{self._total}, loss {loss:.4f}, "
                f"{now - self._began:.1f} s elapsed"
            )
