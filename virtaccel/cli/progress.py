"""A progress bar for long CLI work: drawn on a terminal, silent when piped.

    with Progress(total=12, label="bench") as bar:
        for step in steps:
            run(step)
            bar.advance(note=step.name)

It writes to stderr (so stdout stays clean for tables and JSON), redraws in place with
a carriage return, and draws nothing at all unless the stream is a TTY (or `enabled`
forces it).
"""
from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    """A one-line `[#####.....] 5/10 label: note` bar."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None,
                 enabled: bool | None = None, width: int = 30) -> None:
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty()) if callable(isatty) else False
        self.enabled = enabled
        self.width = width
        self.done = 0
        self._last_len = 0

    def render(self, note: str = "") -> str:
        """The bar's text for the current count (no control characters)."""
        frac = 1.0 if self.total == 0 else min(self.done / self.total, 1.0)
        fill = int(round(frac * self.width))
        text = f"[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total}"
        if self.label:
            text += f" {self.label}"
        if note:
            text += f": {note}"
        return text

    def _draw(self, note: str) -> None:
        if not self.enabled:
            return
        text = self.render(note)
        pad = max(self._last_len - len(text), 0)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._last_len = len(text)

    def start(self, note: str = "") -> None:
        """Draw the bar at its current count (e.g. naming the step about to run)."""
        self._draw(note)

    def advance(self, n: int = 1, note: str = "") -> None:
        """Count `n` more steps done and redraw."""
        self.done += n
        self._draw(note)

    def close(self) -> None:
        """Clear the bar's line (on a terminal)."""
        if self.enabled and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self.stream.flush()
        self._last_len = 0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
