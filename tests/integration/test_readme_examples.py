"""The README's Python examples run as written: run_model on a model file, then the
guest program and the launcher that runs it."""
from __future__ import annotations

import pathlib
import re
from typing import Any

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3, "README lost its Python examples"
    return blocks


def _exec(source: str, namespace: dict[str, Any]) -> list[tuple[Any, ...]]:
    printed: list[tuple[Any, ...]] = []
    namespace["print"] = lambda *args, **kw: printed.append(args)
    exec(compile(source, "README.md", "exec"), namespace)
    return printed


def test_readme_run_model_example(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")
    from onnx import TensorProto, helper, numpy_helper
    w = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "readme", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])],
        [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              str(tmp_path / "model.onnx"))
    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {}
    printed = _exec(_blocks()[0], ns)
    x = ns["x"]
    np.testing.assert_allclose(ns["outputs"]["y"], np.maximum(x @ w, 0), rtol=1e-5, atol=1e-6)
    report = ns["report"]
    assert len(printed) == len(report.commands) + 1 and report.commands
    device_ns, virtual_ns, wall_s, digest = printed[-1]
    assert 0 < device_ns <= virtual_ns and wall_s > 0 and len(digest) == 64


def test_readme_guest_program_and_launcher_examples_compute_the_right_answer() -> None:
    blocks = _blocks()
    ns: dict[str, Any] = {}
    printed = _exec(blocks[1] + blocks[2], ns)
    out = ns["out"]
    # ones(64x512) @ ones(512x256) + 0, ReLU: every element is 512
    assert isinstance(out, np.ndarray) and out.shape == (64, 256)
    assert np.all(out == 512.0)
    (first, digest), = printed
    assert list(first) == [512.0] * 4
    assert isinstance(digest, str) and len(digest) == 64
    assert ns["session"].state.value == "closed"


def test_tenants_doc_example_builds_the_card_it_describes() -> None:
    doc = README.parent / "docs" / "tenants.md"
    (block,) = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    ns: dict[str, Any] = {}
    (printed,) = _exec(block, ns)
    pf, vfs, vms = printed
    assert pf == "0000:01:00.0" and len(vfs) == 8 and vms == [f"tenant{n}" for n in range(1, 9)]
    assert ns["session"].state.value == "closed"
