"""The `virtaccel hostile --html` page in a real browser: headless Chromium loads it and
the DOM it builds has the summary and one table per category. Skipped (saying so) when
no Chromium binary is on the machine: the project does not install one
(docs/hostile.md, "The HTML report in a browser")."""
from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from virtaccel.cli import main

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def _browser() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


class _Dom(HTMLParser):
    """Tables, the h2 headings and verdict cells of the DOM Chromium dumps."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = 0
        self.h2: list[str] = []
        self.verdicts: list[str] = []
        self._tag = ""
        self._cls = ""

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self._tag, self._cls = tag, dict(attrs).get("class") or ""
        self.tables += tag == "table"

    def handle_data(self, data: str) -> None:
        if self._tag == "h2" and data.strip():
            self.h2.append(data.strip())
        elif self._tag == "td" and self._cls.startswith("v-"):
            self.verdicts.append(data.strip())


def test_the_html_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    browser = _browser()
    if browser is None:
        pytest.skip(f"no Chromium binary on this machine (looked for {', '.join(BROWSERS)})")
    page = tmp_path / "hostile.html"
    assert main(["hostile", "--attach", "mmio,pci", "--html", str(page), "--scenario",
                 "ring/loop-self,status/ack-to-0x02,mmio/write8-status,pci/notify-wrong-value,"
                 "cmd/opcode-0x7f"]) == 0
    run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                          "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    dom = _Dom()
    dom.feed(run.stdout)
    cats = ["split ring", "status state machine", "virtio-mmio registers", "virtio-pci",
            "accelerator"]
    assert dom.h2[0] == "Summary"
    assert [h.split(" (")[0] for h in dom.h2[1:]] == cats
    assert dom.tables == 1 + len(cats)
    assert set(dom.verdicts) <= {"PASS", "REJECT"} and "REJECT" in dom.verdicts
    shot = tmp_path / "hostile.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    "--window-size=1300,900", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
