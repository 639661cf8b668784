"""Helpers for the compiler tests: run a compiled module in a VM with one VA-1."""
from __future__ import annotations

import shutil
import subprocess
from typing import Any, Mapping

import numpy as np
import pytest

from userspace_runtime.compiler import CompileResult
from virtaccel.models import run_module_in_vm

SEED = 20261122


def run_on_device(code: bytes | CompileResult, feeds: Mapping[str, Any], *,
                  int8: bool = False, seed: int = SEED) -> dict[str, np.ndarray]:
    """Boot a VM, load the code object, launch `main` with `feeds`, return the outputs."""
    data = code.code_object if isinstance(code, CompileResult) else code
    return run_module_in_vm(data, dict(feeds), seed=seed, int8=int8)


def readelf_clean(path: str) -> str:
    """Run `readelf -a -W`; fail on any warning/error; skip when readelf is absent."""
    exe = shutil.which("readelf")
    if exe is None:
        pytest.skip("readelf (binutils) is not installed")
    p = subprocess.run([exe, "-a", "-W", path], capture_output=True, text=True, check=False)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text
    assert p.stderr == "", p.stderr
    assert "warning" not in text.lower() and "error" not in text.lower(), text
    return p.stdout


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "onnx_coverage: set by onnx's backend test runner")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the ONNX node-test counts (passed, failed, skipped) of the claimed cases."""
    import sys
    claimed: set[str] = set()
    for mod in list(sys.modules.values()):
        claimed.update(getattr(mod, "CLAIMED_CASES", ()) if getattr(
            mod, "__name__", "").endswith("test_onnx_node_tests") else ())
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for key in counts:
        for rep in terminalreporter.stats.get(key, []):
            nodeid = getattr(rep, "nodeid", "")
            if "OnnxBackendNodeModelTest::" not in nodeid:
                continue
            name = nodeid.rsplit("::", 1)[-1]
            name = name[:-len("_cpu")] if name.endswith("_cpu") else name
            if name in claimed and (rep.when == "call" or key == "skipped"):
                counts[key] += 1
    if claimed and sum(counts.values()):   # nothing to say when they were deselected
        terminalreporter.write_line(
            f"ONNX backend node tests for the claimed operators: {len(claimed)} cases, "
            f"{counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped")
