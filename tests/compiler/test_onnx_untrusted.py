"""ONNX models from untrusted sources: every malformed node, attribute, input or shape is
an OnnxImportError / GraphError naming the node, attribute or tensor, never a Python
crash, an endless compile or a silently ignored field."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from userspace_runtime import UserspaceRuntimeError  # noqa: E402
from userspace_runtime.compiler import (  # noqa: E402
    Graph,
    GraphError,
    LoweringError,
    Target,
    compile_graph,
)
from userspace_runtime.compiler._onnx import SIGNATURES, _Importer  # noqa: E402
from userspace_runtime.onnx_import import (  # noqa: E402
    OnnxImportError,
    compile_onnx,
    supported_ops,
)

from . import models, onnx_models  # noqa: E402

F32 = np.float32
N = helper.make_node


def _vi(name: str, shape: list[int] | None, elem: int = TensorProto.FLOAT) -> Any:
    """A tensor's ValueInfo; shape None: rank 4 of unnamed sizes."""
    return helper.make_tensor_value_info(name, elem, shape or ["n", "c", "h", "w"])


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any],
           inits: list[Any] | None = None, opset: int = 21) -> Any:
    g = helper.make_graph(nodes, "m", inputs, outputs, inits or [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


def _conv(**attrs: Any) -> Any:
    w = numpy_helper.from_array(np.ones((4, 2, 3, 3), F32), "w")
    return _model([N("Conv", ["x", "w"], ["y"], name="conv1", **attrs)],
                  [_vi("x", [1, 2, 8, 8])], [_vi("y", None)], [w])


def _refused(model: Any, *words: str, error: type[Exception] = OnnxImportError) -> str:
    with pytest.raises(error) as ei:
        compile_onnx(model)
    msg = str(ei.value)
    assert isinstance(ei.value, UserspaceRuntimeError)
    for w in words:
        assert w in msg, msg
    assert "\n" not in msg
    return msg


# --- attribute ranges ---------------------------------------------------------------------

@pytest.mark.parametrize("attrs,words", [
    ({"strides": [0, 0], "auto_pad": "SAME_UPPER"}, "attribute strides [0, 0]"),
    ({"strides": [0, 1]}, "attribute strides [0, 1]: needs 2 integer(s), each >= 1"),
    ({"strides": [1, 1, 1]}, "attribute strides [1, 1, 1]"),
    ({"pads": [-1, 0, 0, 0]}, "attribute pads [-1, 0, 0, 0]: needs 4 integer(s), each >= 0"),
    ({"dilations": [1, 0]}, "attribute dilations [1, 0]"),
    ({"group": 0}, "attribute group [0]"),
    ({"group": 3}, "attribute group 3: the input has 2 channels"),
    ({"group": 2}, "attribute group 2"),   # 2 channels / 2 groups = 1, but w has 2 per group
    ({"kernel_shape": [5, 5]}, "attribute kernel_shape [5, 5] differs from the weights' [3, 3]"),
    ({"auto_pad": "SOMETIMES"}, "attribute auto_pad 'SOMETIMES'"),
])
def test_conv_attribute_out_of_range_names_node_and_attribute(attrs: dict[str, Any],
                                                              words: str) -> None:
    _refused(_conv(**attrs), "node conv1 (Conv)", words)


def test_axis_out_of_range_names_node() -> None:
    flat = _model([N("Flatten", ["x"], ["y"], name="flat", axis=3)], [_vi("x", [2, 3])],
                  [_vi("y", [6, 1])])
    _refused(flat, "node flat (Flatten)", "attribute axis 3 is out of range for an input of "
                                          "rank 2")
    soft = _model([N("Softmax", ["x"], ["y"], name="sm", axis=5)], [_vi("x", [2, 3])],
                  [_vi("y", [2, 3])], opset=11)
    _refused(soft, "node sm (Softmax)", "attribute axis 5")


def test_layernorm_epsilon_and_stash_type_are_checked() -> None:
    scale = numpy_helper.from_array(np.ones(3, F32), "s")
    for attrs, words in (({"epsilon": float("nan")}, "attribute epsilon nan"),
                         ({"epsilon": -1.0}, "attribute epsilon -1.0"),
                         ({"stash_type": 10}, "attribute stash_type 10")):
        m = _model([N("LayerNormalization", ["x", "s"], ["y"], name="ln", **attrs)],
                   [_vi("x", [2, 3])], [_vi("y", [2, 3])], [scale])
        _refused(m, "node ln (LayerNormalization)", words)


# --- arity and attributes, checked once for every handler ------------------------------------

def _node_model(op: str, n_inputs: int, **attrs: Any) -> Any:
    names = [f"i{k}" for k in range(n_inputs)]
    return _model([N(op, names, ["y"], name="the_node", **attrs)],
                  [_vi(nm, [2, 2]) for nm in names], [_vi("y", None)])


@pytest.mark.parametrize("op", supported_ops())
def test_every_handler_checks_its_input_count(op: str) -> None:
    """Below the fewest or above the most inputs is refused before the handler runs
    (the importer's own table, behind onnx's checker)."""
    lo, hi, _ = SIGNATURES[op]
    for n in {lo - 1, hi + 1} - {-1}:
        with pytest.raises(OnnxImportError) as ei:
            _Importer(_node_model(op, n), {}).run()
        want = f"{lo}" if lo == hi else f"{lo} to {hi}"
        assert f"node the_node ({op}): has {n} input(s), {op} takes {want}" in str(ei.value)


@pytest.mark.parametrize("op", supported_ops())
def test_every_handler_refuses_an_unknown_attribute(op: str) -> None:
    lo, _, known = SIGNATURES[op]
    with pytest.raises(OnnxImportError) as ei:
        _Importer(_node_model(op, lo, bogus=1), {}).run()
    assert f"node the_node ({op}): attribute 'bogus' is not supported" in str(ei.value)


def test_a_required_input_left_empty_is_refused() -> None:
    m = _model([N("Gemm", ["", "i1"], ["y"], name="g")], [_vi("i1", [2, 2])], [_vi("y", None)])
    with pytest.raises(OnnxImportError, match=r"node g \(Gemm\): input 0 is required but empty"):
        _Importer(m, {}).run()


def test_too_few_inputs_where_the_checker_agrees_is_its_message() -> None:
    m = _model([N("Add", ["x"], ["y"], name="add1")], [_vi("x", [2])], [_vi("y", [2])])
    _refused(m, "the ONNX checker rejects the model", "input size 1", "Name: add1")


def test_too_few_inputs_the_checker_allows_is_refused_by_the_table() -> None:
    """Reshape-1 takes its shape as an attribute: the checker passes it, the compiler
    needs the shape operand (Reshape-5 and later)."""
    m = _model([N("Reshape", ["x"], ["y"], name="rs", shape=[4])], [_vi("x", [2, 2])],
               [_vi("y", [4])], opset=1)
    _refused(m, "node rs (Reshape): has 1 input(s), Reshape takes 2")


def test_a_legacy_attribute_is_refused_not_ignored() -> None:
    """Add-6's broadcast/axis change its meaning; the checker accepts them at opset 6."""
    m = _model([N("Add", ["x", "x"], ["y"], name="add6", broadcast=1)], [_vi("x", [4])],
               [_vi("y", [4])], opset=6)
    onnx.checker.check_model(m)
    _refused(m, "node add6 (Add): attribute 'broadcast' is not supported")


@pytest.mark.parametrize("case", ["unknown attribute", "extra input", "undefined input"])
def test_models_the_checker_rejects_are_refused_with_its_message(case: str) -> None:
    x, y = _vi("x", [2, 2]), _vi("y", [2, 2])
    node = {"unknown attribute": N("Relu", ["x"], ["y"], name="r", alpha=0.1),
            "extra input": N("Relu", ["x", "x"], ["y"], name="r"),
            "undefined input": N("Relu", ["nowhere"], ["y"], name="r")}[case]
    msg = _refused(_model([node], [x], [y]), "the ONNX checker rejects the model")
    assert "r" in msg and "Relu" in msg


def test_a_model_only_the_checker_rejects_no_longer_compiles() -> None:
    m = onnx_models.mlp()
    m.graph.output[0].type.tensor_type.ClearField("shape")
    _refused(m, "the ONNX checker rejects the model", "Field 'shape' of 'type' is required")


# --- inputs, initializers, element types ---------------------------------------------------

def test_unknown_elem_type_names_the_input() -> None:
    m = _model([N("Relu", ["x"], ["y"], name="r")], [_vi("x", [2, 2], elem=99)],
               [_vi("y", [2, 2])])
    _refused(m, "input 'x': element type 99 (not an ONNX element type) is not supported")


def test_unsupported_elem_type_names_the_input() -> None:
    m = _model([N("Relu", ["x"], ["y"], name="r")], [_vi("x", [2, 2], TensorProto.DOUBLE)],
               [_vi("y", [2, 2], TensorProto.DOUBLE)])
    _refused(m, "input 'x': element type DOUBLE is not supported")


@pytest.mark.parametrize("declared,words", [
    (_vi("w", [2, 2]), "input 'w': declared shape [2, 2], its initializer has shape [16, 8]"),
    (_vi("w", [16, 8], TensorProto.INT32), "input 'w': declared INT32, its initializer is "
                                           "FLOAT"),
    (_vi("w", [16]), "input 'w': declared shape [16], its initializer has shape [16, 8]"),
])
def test_initializer_that_disagrees_with_its_input_names_it(declared: Any, words: str) -> None:
    w = numpy_helper.from_array(np.ones((16, 8), F32), "w")
    m = _model([N("MatMul", ["x", "w"], ["y"], name="mm")], [_vi("x", [4, 16]), declared],
               [_vi("y", [4, 8])], [w])
    _refused(m, words)


def test_initializer_of_an_unsupported_type_names_it() -> None:
    w = numpy_helper.from_array(np.ones((2, 2), np.float64), "w")
    w.data_type = TensorProto.STRING
    w.ClearField("raw_data")
    w.string_data.extend([b"a", b"b", b"c", b"d"])
    m = _model([N("Add", ["x", "w"], ["y"], name="a")], [_vi("x", [2, 2])], [_vi("y", [2, 2])],
               [w])
    with pytest.raises(OnnxImportError, match="initializer 'w'"):
        _Importer(m, {}).run()


# --- shapes that no device holds ------------------------------------------------------------

def test_an_input_of_2_to_the_40_is_refused_at_import() -> None:
    m = _model([N("Relu", ["x"], ["y"], name="r")], [_vi("x", [1 << 40, 4])],
               [_vi("y", [1 << 40, 4])])
    _refused(m, "input 'x': float32[1099511627776, 4] is 17592186044416 bytes",
             "device memory (17179869184 bytes at most)")


def test_a_tensor_larger_than_the_target_is_refused_before_the_passes() -> None:
    m = _model([N("Relu", ["x"], ["y"], name="r")], [_vi("x", [1 << 20, 1024])],
               [_vi("y", [1 << 20, 1024])])
    _refused(m, "tensor 'x' (float32[1048576, 1024]) is 4294967296 bytes",
             "the target's device memory (268435456 bytes)", error=GraphError)


def test_a_node_whose_output_no_device_holds_names_the_node() -> None:
    g = Graph("outer")
    a, b = g.input("a", (1 << 17, 1)), g.input("b", (1, 1 << 16))
    with pytest.raises(GraphError, match=r"node outer_sum \(add\): output 'outer_sum_out': "
                                         r"float32\[131072, 65536\] is 34359738368 bytes"):
        g.add(a, b, name="outer_sum")


def test_a_code_object_larger_than_the_target_memory_is_refused() -> None:
    with pytest.raises(LoweringError, match=r"graph mlp: the code object needs \d+ bytes of "
                                            r"device memory .* the target has 4096"):
        compile_graph(models.mlp(), Target(device_memory_size=4096))


def test_target_device_memory_is_read_from_params_and_checked() -> None:
    assert Target.from_params({"device_memory_size": 1 << 20}).device_memory_size == 1 << 20
    with pytest.raises(ValueError, match="device_memory_size"):
        Target(device_memory_size=1 << 40)


def test_bytes_that_are_not_a_model_are_an_import_error() -> None:
    with pytest.raises(OnnxImportError, match=r"not an ONNX model \(protobuf: "):
        compile_onnx(bytes(range(256)) * 4)
