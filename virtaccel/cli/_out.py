"""Output of the verbs: rich tables on stdout, JSON to a file (or `-`, stdout).

Why rich: column layout, alignment and terminal detection are its job, not ours. A
Console is made per call so it sees the current sys.stdout (pytest's capture, a pipe);
when that is not a terminal rich writes no escape codes, and the width is set wide so
that a table is never squeezed into 80 columns in a pipe or a file.
"""
from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, Iterable, Sequence, TextIO

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

PIPE_WIDTH = 240


def console(file: TextIO | None = None) -> "Console":
    """A Console on `file` (default: the current sys.stdout), plain when not a terminal."""
    from rich.console import Console
    stream = file if file is not None else sys.stdout
    isatty = getattr(stream, "isatty", None)
    tty = bool(isatty()) if callable(isatty) else False
    return Console(file=stream, markup=False, highlight=False, emoji=False,
                   soft_wrap=False, width=None if tty else PIPE_WIDTH, safe_box=True)


def table(columns: Sequence[str], rows: Iterable[Sequence[object]], *,
          title: str | None = None, right: Iterable[str] = (),
          totals: Iterable[Sequence[object]] = ()) -> "Table":
    """A rich Table; the columns named in `right` are right-aligned (numbers), and the
    `totals` rows come after a rule."""
    from rich import box
    from rich.table import Table
    align = set(right)
    t = Table(title=title, box=box.SIMPLE, title_justify="left", show_edge=False,
              pad_edge=False)
    for c in columns:
        t.add_column(c, justify="right" if c in align else "left", no_wrap=c in align)
    body = list(rows)
    extra = list(totals)
    for i, r in enumerate(body):
        t.add_row(*_cells(r), end_section=bool(extra) and i == len(body) - 1)
    for r in extra:
        t.add_row(*_cells(r))
    return t


def _cells(row: Sequence[object]) -> list[str]:
    return ["-" if v is None else str(v) for v in row]


def print_table(columns: Sequence[str], rows: Iterable[Sequence[object]], *,
                title: str | None = None, right: Iterable[str] = (),
                totals: Iterable[Sequence[object]] = ()) -> None:
    """Print a table on stdout."""
    console().print(table(columns, rows, title=title, right=right, totals=totals))


def write_json(path: str, doc: Any) -> None:
    """Write `doc` as JSON to `path` (`-`: stdout). OSError is left to the caller."""
    text = json.dumps(doc, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def wants_json_on_stdout(path: str | None) -> bool:
    """`--json -`: the JSON is the verb's stdout, so the human output is left out."""
    return path == "-"
