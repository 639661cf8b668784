"""Read constants and struct layouts from installed kernel headers with a compiled C probe.

Why: the project's numbers from real interfaces (VFIO, vhost, vdpa, virtio) must be
exactly the kernel's; the tests that compare them write a C program printing
`<key> <value>` lines and read them back here."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def c_compiler() -> str:
    """A C compiler, or the test is skipped saying none is installed."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang) to read the headers' values with")
    return cc


def run_probe(lines: list[str], workdir: Path, what: str) -> dict[str, str]:
    """Compile and run the C program `lines`; its output lines `<key> <value>` as a dict
    (the value after the last space)."""
    src = workdir / "probe.c"
    src.write_text("\n".join(lines) + "\n")
    r = subprocess.run([c_compiler(), "-std=gnu11", "-o", str(workdir / "probe"), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"probe against {what} does not compile:\n{r.stderr}"
    out = subprocess.run([str(workdir / "probe")], capture_output=True, text=True,
                         check=True).stdout
    values = {}
    for line in out.splitlines():
        key, _, value = line.rpartition(" ")
        values[key] = value
    return values
