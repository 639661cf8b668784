"""Masks computed at run time: comparisons and logic become COMPARE (int8 masks of
0 / 1), Where with a run-time condition SELECT, exact for inf and NaN (masked_fill
with -inf); bool graph inputs are int8 arguments fed from numpy bools."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")

from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from userspace_runtime.compiler import Graph, compile_graph, run_reference  # noqa: E402
from userspace_runtime.onnx_import import compile_onnx  # noqa: E402

from .conftest import run_on_device  # noqa: E402


def _model(nodes: list, inputs: list, outputs: list, inits: list | None = None  # type: ignore[type-arg]
           ) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "masks", inputs, outputs, inits or [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    return m


def test_masked_fill_with_a_runtime_mask_is_exact_for_inf() -> None:
    """scores.masked_fill(tokens == pad, -inf) then softmax: the -inf lands exactly
    (the mask arithmetic would have made NaN of inf * 0)."""
    f = TensorProto.FLOAT
    m = _model(
        [helper.make_node("Equal", ["tokens", "pad"], ["is_pad2"]),
         helper.make_node("Unsqueeze", ["is_pad2", "axis1"], ["is_pad"]),
         helper.make_node("Where", ["is_pad", "ninf", "scores"], ["masked"]),
         helper.make_node("Softmax", ["masked"], ["p"], axis=-1)],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [2, 6]),
         helper.make_tensor_value_info("scores", f, [2, 3, 6])],
        [helper.make_tensor_value_info("masked", f, [2, 3, 6]),
         helper.make_tensor_value_info("p", f, [2, 3, 6])],
        [helper.make_tensor("pad", TensorProto.INT64, [], [0]),
         helper.make_tensor("ninf", f, [], [-np.inf]),
         helper.make_tensor("axis1", TensorProto.INT64, [1], [1])])
    result = compile_onnx(m)
    ops = [n.op for n in result.graph.nodes]
    assert ops.count("select") == 1 and ops.count("compare") == 1, ops
    assert "COMPARE" in result.disassembly and "SELECT" in result.disassembly
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 3, (2, 6)).astype(np.int64)
    tokens[:, 0] = 1                                   # no row entirely masked
    feeds = {"tokens": tokens, "scores": rng.standard_normal((2, 3, 6)).astype(np.float32)}
    got = run_on_device(result, feeds)
    ref = ReferenceEvaluator(m).run(None, feeds)
    assert np.array_equal(got["masked"], ref[0])       # -inf where padded, bit for bit
    np.testing.assert_allclose(got["p"], ref[1], rtol=1e-6, atol=1e-7)
    assert np.all(got["p"][np.broadcast_to(tokens[:, None, :] == 0, (2, 3, 6))] == 0)


def test_bool_inputs_logic_and_int32_select() -> None:
    """A bool graph input (an int8 argument fed from numpy bools), Not / And / Or /
    Xor and LessOrEqual on it and on int32 data, Where on int32 branches, a bool output
    (widened back by the backend; here read as the int8 mask)."""
    b, i = TensorProto.BOOL, TensorProto.INT32
    m = _model(
        [helper.make_node("LessOrEqual", ["x", "y"], ["le"]),
         helper.make_node("Not", ["keep"], ["drop"]),
         helper.make_node("And", ["le", "keep"], ["both"]),
         helper.make_node("Or", ["both", "drop"], ["any"]),
         helper.make_node("Xor", ["any", "le"], ["sel"]),
         helper.make_node("Where", ["sel", "x", "y"], ["z"])],
        [helper.make_tensor_value_info("x", i, [3, 4]),
         helper.make_tensor_value_info("y", i, [4]),
         helper.make_tensor_value_info("keep", b, [3, 1])],
        [helper.make_tensor_value_info("sel", b, [3, 4]),
         helper.make_tensor_value_info("z", i, [3, 4])])
    rng = np.random.default_rng(6)
    feeds = {"x": rng.integers(-3, 3, (3, 4)).astype(np.int32),
             "y": rng.integers(-3, 3, 4).astype(np.int32),
             "keep": np.array([[True], [False], [True]])}
    got = run_on_device(compile_onnx(m), feeds)
    ref = ReferenceEvaluator(m).run(None, feeds)
    assert got["sel"].dtype == np.int8 and np.array_equal(got["sel"].astype(bool), ref[0])
    assert np.array_equal(got["z"], ref[1])


def test_compile_time_condition_keeps_the_arithmetic_form() -> None:
    """A condition known at compile time with float branches stays a * m + b * (1 - m):
    no int8 mask, so models without runtime masks need nothing new."""
    f = TensorProto.FLOAT
    m = _model([helper.make_node("Where", ["c", "x", "y"], ["z"])],
               [helper.make_tensor_value_info("x", f, [2, 3]),
                helper.make_tensor_value_info("y", f, [2, 3])],
               [helper.make_tensor_value_info("z", f, [2, 3])],
               [helper.make_tensor("c", TensorProto.BOOL, [3], [1, 0, 1])])
    ops = [n.op for n in compile_onnx(m).graph.nodes]
    assert "select" not in ops and "mul" in ops


def test_graph_api_compare_and_select_reference() -> None:
    g = Graph("masks")
    x, y = g.input("x", (4, 5)), g.input("y", (5,))
    mask = g.add_node("compare", [x, y], {"fn": "greater"})[0]
    assert mask.dtype == "int8" and mask.shape == (4, 5)
    g.output(g.add_node("select", [mask, x, g.constant(np.float32(np.nan))], {})[0],
             names=["z"])
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((4, 5)).astype(np.float32),
             "y": rng.standard_normal(5).astype(np.float32)}
    got = run_on_device(compile_graph(g), feeds)["z"]
    ref = run_reference(g, feeds)["z"]
    np.testing.assert_array_equal(got, ref)            # NaN where not greater
    assert np.isnan(got).any() and not np.isnan(got).all()
    with pytest.raises(Exception, match="int8 mask"):
        g2 = Graph("bad")
        a = g2.input("a", (2,))
        g2.add_node("select", [a, a, a], {})
