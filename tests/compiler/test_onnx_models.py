"""ONNX models through the importer, the CLI (`virtaccel compile/run/objdump`) and the
onnx backend, checked against onnx.reference.ReferenceEvaluator."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")

from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from virtaccel import onnx_backend  # noqa: E402
from userspace_runtime.onnx_import import OnnxImportError, compile_onnx, supported_ops  # noqa: E402
from virtaccel.cli import main as cli_main  # noqa: E402

from . import onnx_models  # noqa: E402
from .conftest import readelf_clean, run_on_device  # noqa: E402

# Max abs error vs the reference evaluator, f32 end to end; QDQ: one int8 step.
TOL = {"mlp": 1e-5, "cnn": 1e-4, "encoder": 1e-4, "qdq_mlp": 0.0201}
SHAPES = {"mlp": {"x": (4, 16)}, "cnn": {"image": (2, 3, 8, 8)}, "encoder": {"x": (8, 16)},
          "qdq_mlp": {"x": (4, 16)}}


def _feeds(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES[name].items()}


@pytest.mark.parametrize("name", sorted(TOL))
def test_onnx_model_matches_reference_evaluator(name: str) -> None:
    model = getattr(onnx_models, name)()
    feeds = _feeds(name)
    result = compile_onnx(model)
    out = run_on_device(result, feeds, int8=name.startswith("qdq"))
    ref = ReferenceEvaluator(model).run(None, feeds)
    names = [o.name for o in model.graph.output]
    for n, r in zip(names, ref):
        assert out[n].shape == r.shape
        np.testing.assert_allclose(out[n], r, rtol=0, atol=TOL[name])


def test_unsupported_operator_names_operator_and_node() -> None:
    with pytest.raises(OnnxImportError, match=r"1 operator\(s\) not supported by the VA-1 "
                                              r"compiler, in 1 node\(s\): Cos x1 "
                                              r"\(the_cosine\)"):
        compile_onnx(onnx_models.unsupported())


def test_every_unsupported_operator_is_listed_at_once_with_counts() -> None:
    """Not only the first: each operator with how many nodes use it and their names,
    also when one unsupported node reads another's output, and custom domains."""
    N = helper.make_node
    nodes = [N("Cos", ["x"], ["a"], name="cos1"), N("Relu", ["a"], ["b"], name="r"),
             N("Cos", ["b"], ["c"], name="cos2"), N("Sin", ["c"], ["d"], name="sin1"),
             N("Fancy", ["d"], ["y"], name="f1", domain="com.example")]
    m = helper.make_model(
        helper.make_graph(nodes, "many", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                        [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(OnnxImportError) as ei:
        compile_onnx(m)
    msg = str(ei.value)
    assert ("3 operator(s) not supported by the VA-1 compiler, in 4 node(s): Cos x2 (cos1, "
            "cos2); Sin x1 (sin1); com.example.Fancy x1 (f1)") in msg, msg
    assert "\n" not in msg


def test_onnx_shape_mismatch_names_the_node() -> None:
    m = onnx_models.mlp()
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 15
    with pytest.raises(OnnxImportError, match=r"node fc1 \(MatMul\): .*inner dimensions"):
        compile_onnx(m)


def test_dynamic_dims_are_refused() -> None:
    m = onnx_models.mlp()
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    with pytest.raises(OnnxImportError, match=r"input .x.: dimension 0 \(batch\) is not static"):
        compile_onnx(m)


def test_cli_compile_objdump_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = onnx_models.cnn()
    mpath, opath = tmp_path / "cnn.onnx", tmp_path / "cnn.vaelf"
    onnx.save(model, str(mpath))
    assert cli_main(["compile", str(mpath), "-o", str(opath), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passes"]["fold_batchnorm"] == 1 and report["workspace_peak"] > 0
    readelf_clean(str(opath))
    assert cli_main(["objdump", str(opath)]) == 0
    assert "CONV2D" in capsys.readouterr().out
    feeds = _feeds("cnn", 3)
    np.savez(tmp_path / "in.npz", **feeds)
    ref = ReferenceEvaluator(model).run(None, feeds)[0]
    for src in (opath, mpath):                     # a code object, or the model itself
        out = tmp_path / f"out_{src.suffix[1:]}.npz"
        assert cli_main(["run", str(src), "--inputs", str(tmp_path / "in.npz"),
                         "--out", str(out)]) == 0
        capsys.readouterr()
        with np.load(out) as z:
            assert z.files == ["logits"]
            np.testing.assert_allclose(z["logits"], ref, atol=1e-4)


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.onnx"
    onnx.save(onnx_models.unsupported(), str(bad))
    assert cli_main(["compile", str(bad), "-o", str(tmp_path / "x.vaelf")]) == 2
    assert "Cos x1 (the_cosine)" in capsys.readouterr().err
    assert cli_main(["compile", str(tmp_path / "missing.onnx"), "-o", "x"]) == 2
    capsys.readouterr()
    good = tmp_path / "mlp.onnx"
    onnx.save(onnx_models.mlp(), str(good))
    np.savez(tmp_path / "in.npz", x=np.zeros((4, 16), np.float64))
    assert cli_main(["run", str(good), "--inputs", str(tmp_path / "in.npz"),
                     "--out", str(tmp_path / "o.npz")]) == 2
    assert "dtype float64, expected float32" in capsys.readouterr().err


def test_backend_run_model_and_prepare() -> None:
    model = onnx_models.encoder()
    x = _feeds("encoder", 5)["x"]
    assert onnx_backend.supports_device("CPU") and not onnx_backend.supports_device("CUDA")
    assert onnx_backend.VA1Backend.is_compatible(model)
    assert not onnx_backend.VA1Backend.is_compatible(onnx_models.unsupported())
    rep = onnx_backend.prepare(model)
    (y,) = rep.run([x])
    ref = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, ref, atol=1e-4)
    (y2,) = onnx_backend.run_model(model, {"x": x})
    np.testing.assert_array_equal(y, y2)


def test_claimed_operators() -> None:
    assert set(supported_ops()) == {
        "Abs", "Add", "AveragePool", "BatchNormalization", "Clip", "Concat", "Constant",
        "ConstantOfShape", "Conv", "DequantizeLinear", "Div", "Erf", "Exp", "Expand",
        "Flatten", "Gather", "Gelu", "Gemm", "GlobalAveragePool", "GlobalMaxPool",
        "HardSigmoid", "HardSwish", "Identity", "LayerNormalization", "Log", "MatMul", "Max",
        "MaxPool", "Min", "Mul", "Neg", "Pad", "Pow", "QuantizeLinear", "Range",
        "Reciprocal", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceSum", "Relu",
        "Reshape", "Shape", "Sigmoid", "Size", "Slice", "Softmax", "Split", "Sqrt",
        "Squeeze", "Sub", "Tanh", "Transpose", "Unsqueeze", "Where",
        "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor",
        "Not"}


@pytest.mark.parametrize("image", ["microvm-mmio.toml", "passthrough-pci.toml"])
def test_cli_run_on_a_vm_image(image: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[2] / "vm_images"
    if not (root / image).exists():
        pytest.skip(f"VM image {image} is not in this tree")
    model = tmp_path / "enc.onnx"
    onnx.save(onnx_models.encoder(), str(model))
    feeds = _feeds("encoder", 8)
    np.savez(tmp_path / "in.npz", **feeds)
    out = tmp_path / "out.npz"
    assert cli_main(["run", str(model), "--inputs", str(tmp_path / "in.npz"), "--out", str(out),
                     "--image", str(root / image)]) == 0, capsys.readouterr().err
    ref = ReferenceEvaluator(onnx_models.encoder()).run(None, feeds)[0]
    with np.load(out) as z:
        np.testing.assert_allclose(z["y"], ref, atol=1e-4)


def test_cli_run_int8_model_on_an_image_without_int8(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("virtaccel.images", reason="VM images are not in this tree")
    image = tmp_path / "float-only.toml"
    image.write_text('name = "float-only"\n[accelerator]\nmode = "emulated"\n'
                     'transport = "mmio"\n[accelerator.config]\ndtype_mask = 3\n')
    model = tmp_path / "qdq.onnx"
    onnx.save(onnx_models.qdq_mlp(), str(model))
    np.savez(tmp_path / "in.npz", **_feeds("qdq_mlp"))
    assert cli_main(["run", str(model), "--inputs", str(tmp_path / "in.npz"),
                     "--out", str(tmp_path / "o.npz"), "--image", str(image)]) == 2
    assert "needs int8 and int32 tensors" in capsys.readouterr().err
