"""The README's runtime example runs as written: guest program, then host side."""
from __future__ import annotations

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_examples_run_and_compute_the_right_answer() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2, "README lost its runtime example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0] + blocks[1].replace("print(", "_printed = ("), "README.md", "exec"), namespace)
    task = namespace["task"]
    assert task.error is None  # type: ignore[attr-defined]
    out = task.result  # type: ignore[attr-defined]
    # ones(64x512) @ ones(512x256) + 0, ReLU: every element is 512
    assert isinstance(out, np.ndarray) and out.shape == (64, 256)
    assert np.all(out == 512.0)
    digest = namespace["_printed"][1]  # type: ignore[index]
    assert isinstance(digest, str) and len(digest) == 64
