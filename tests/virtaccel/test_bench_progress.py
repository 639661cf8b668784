"""virtaccel.cli.progress: a rich bar on a terminal, nothing when piped."""
from __future__ import annotations

import io
import sys

from virtaccel.cli.progress import Progress


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_piped_output_stays_silent_and_rich_is_not_loaded() -> None:
    out = io.StringIO()  # isatty() is False, as for a pipe or a file
    had_progress = "rich.progress" in sys.modules
    with Progress(3, "bench", stream=out) as bar:
        assert not bar.enabled
        bar.start("case a")
        for _ in range(3):
            bar.advance(note="x")
    assert out.getvalue() == ""
    assert bar.done == 3
    assert had_progress or "rich.progress" not in sys.modules


def test_terminal_gets_a_bar_that_is_removed_at_the_end() -> None:
    out = FakeTty()
    with Progress(4, "bench", stream=out) as bar:
        assert bar.enabled
        bar.start("case a")
        bar.advance(note="case a")
        bar.advance(3, note="case d")
    text = out.getvalue()
    assert "bench: case" in text and "4/4" in text
    assert "\x1b[" in text  # drawn in place with terminal codes (transient)


def test_enabled_can_be_forced_either_way() -> None:
    assert not Progress(1, stream=FakeTty(), enabled=False).enabled
    out = io.StringIO()
    with Progress(2, "x", stream=out, enabled=True) as bar:
        bar.advance(2, note="done")
    assert "2/2" in out.getvalue()
