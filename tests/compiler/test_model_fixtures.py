"""The real-model fixture set is sound without torch: every file is the one the manifest
names, onnx's checker accepts it, it is what torch.onnx.export(opset 17, dynamo=False)
wrote, and onnx's reference evaluator reproduces the outputs recorded at export time."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")

from onnx.reference import ReferenceEvaluator  # noqa: E402

from . import model_fixtures as mf  # noqa: E402

NAMES = sorted(mf.ARCHITECTURES)
TOL = 1e-4
LIMIT = 20 * 1024 * 1024


def test_the_set_is_the_twelve_architectures_under_20_mb() -> None:
    doc = mf.manifest()
    assert sorted(doc["models"]) == NAMES
    assert doc["opset"] == 17 and doc["exporter"] == "torch.onnx.export(dynamo=False)"
    sizes = {n: (mf.FIXTURES_DIR / f"{n}.onnx").stat().st_size for n in NAMES}
    assert sum(sizes.values()) == doc["total_bytes"] < LIMIT
    assert set(mf.CNNS) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_fixture_files_match_the_manifest(name: str) -> None:
    fx = mf.load(name)
    data = fx.path.read_bytes()
    assert len(data) == fx.info["bytes"]
    assert hashlib.sha256(data).hexdigest() == fx.info["sha256"]
    assert {k: (list(v.shape), str(v.dtype)) for k, v in fx.inputs.items()} == \
        {k: (v["shape"], v["dtype"]) for k, v in fx.info["inputs"].items()}
    assert {k: (list(v.shape), str(v.dtype)) for k, v in fx.expected.items()} == \
        {k: (v["shape"], v["dtype"]) for k, v in fx.info["outputs"].items()}
    for v in fx.expected.values():  # an informative output, not zeros or NaN
        assert np.all(np.isfinite(v)) and float(np.std(v)) > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_checker_accepts_a_torch_opset17_export(name: str) -> None:
    fx = mf.load(name)
    model = onnx.load(str(fx.path))
    onnx.checker.check_model(model, full_check=True)
    assert model.producer_name == "pytorch"
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
    assert [i.name for i in model.graph.input] == list(fx.inputs)
    assert [o.name for o in model.graph.output] == list(fx.expected)
    ops: dict[str, int] = {}
    for node in model.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    assert ops == fx.info["ops"] and len(model.graph.node) == fx.info["nodes"]


@pytest.mark.parametrize("name", NAMES)
def test_reference_evaluator_reproduces_the_recorded_outputs(name: str) -> None:
    fx = mf.load(name)
    got = ReferenceEvaluator(str(fx.path)).run(None, fx.inputs)
    for out, g in zip(fx.expected, got):
        assert g.shape == fx.expected[out].shape
        assert mf.rel_err(g, fx.expected[out]) <= TOL, out
        if fx.onnxruntime is not None:
            assert mf.rel_err(g, fx.onnxruntime[out]) <= TOL, out


@pytest.mark.parametrize("name", NAMES)
def test_onnxruntime_agreed_with_torch_at_export(name: str) -> None:
    fx = mf.load(name)
    assert fx.onnxruntime is not None, "exported without onnxruntime: re-export with it"
    assert sorted(fx.onnxruntime) == sorted(fx.expected)
    for out, ref in fx.expected.items():
        assert mf.rel_err(fx.onnxruntime[out], ref) <= TOL, out


def test_rel_err_is_relative_to_the_reference_peak() -> None:
    ref = np.array([1.0, -4.0, 2.0], dtype=np.float32)
    assert mf.rel_err(ref, ref) == 0.0
    assert mf.rel_err(ref.astype(np.float64) + 0.004, ref) == pytest.approx(1e-3)
    assert mf.rel_err(np.ones(2), np.zeros(2)) == 1.0
