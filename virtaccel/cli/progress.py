"""A progress bar for long CLI work (rich.progress): drawn on a terminal, silent when piped.

    with Progress(total=12, label="bench") as bar:
        for step in steps:
            bar.start(step.name)
            run(step)
            bar.advance(note=step.name)

It draws on stderr (stdout stays clean for tables and JSON), and only when that stream
is a terminal (or `enabled` forces it); rich is imported only then. The bar is
transient: it is gone when the work ends.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress, TaskID


class Progress:
    """`label: note [bar] done/total elapsed`, or nothing at all."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None,
                 enabled: bool | None = None) -> None:
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty()) if callable(isatty) else False
        self.enabled = enabled
        self.done = 0
        self._bar: "RichProgress | None" = None
        self._task: "TaskID | None" = None

    def _description(self, note: str) -> str:
        return f"{self.label}: {note}" if self.label and note else self.label or note

    def _draw(self, note: str) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn)
            console = Console(file=self.stream, force_terminal=True, markup=False,
                              highlight=False)
            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     console=console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self._description(note), total=self.total)
        assert self._task is not None
        self._bar.update(self._task, completed=self.done, description=self._description(note))

    def start(self, note: str = "") -> None:
        """Show the bar at its current count, naming the step about to run."""
        self._draw(note)

    def advance(self, n: int = 1, note: str = "") -> None:
        """Count `n` more steps done and redraw."""
        self.done += n
        self._draw(note)

    def close(self) -> None:
        """Take the bar off the terminal."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
