"""virtaccel.cli.progress: a bar on a terminal, nothing when piped."""
from __future__ import annotations

import io

from virtaccel.cli.progress import Progress


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_piped_output_stays_silent() -> None:
    out = io.StringIO()  # isatty() is False, as for a pipe or a file
    with Progress(3, "bench", stream=out) as bar:
        assert not bar.enabled
        bar.start("case a")
        for _ in range(3):
            bar.advance(note="x")
    assert out.getvalue() == ""
    assert bar.done == 3


def test_terminal_gets_a_bar_redrawn_in_place_and_cleared() -> None:
    out = FakeTty()
    with Progress(4, "bench", stream=out, width=8) as bar:
        assert bar.enabled
        bar.advance(note="case a")
        assert out.getvalue() == "\r[##......] 1/4 bench: case a"
        bar.advance(3)
    text = out.getvalue()
    assert "\r[########] 4/4 bench" in text
    assert text.endswith("\r")  # the line is cleared at the end
    assert "\n" not in text


def test_shorter_redraw_pads_over_the_previous_text() -> None:
    out = FakeTty()
    bar = Progress(2, stream=out, width=4)
    bar.advance(note="a long note")
    bar.advance()
    last = out.getvalue().split("\r")[-1]
    assert last.startswith("[####] 2/2") and len(last) == len("[##..] 1/2: a long note")


def test_enabled_can_be_forced_and_render_has_no_control_characters() -> None:
    out = io.StringIO()
    bar = Progress(0, "x", stream=out, enabled=True, width=4)
    assert bar.render() == "[####] 0/0 x"
    bar.start()
    assert out.getvalue() == "\r[####] 0/0 x"
    assert not Progress(1, stream=FakeTty(), enabled=False).enabled
