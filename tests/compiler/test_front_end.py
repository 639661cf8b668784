"""The ONNX front end on what exporters produce: long chains (iterative passes), shape
arithmetic on static shapes (folded at import), Constant nodes feeding other nodes in
the backend, and sizes that could not fit any device refused by name."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from userspace_runtime.compiler import Graph, Target, compile_graph  # noqa: E402
from userspace_runtime.compiler._onnx import _Importer  # noqa: E402
from userspace_runtime.onnx_import import OnnxImportError, compile_onnx  # noqa: E402
from virtaccel import onnx_backend  # noqa: E402

from .conftest import run_on_device  # noqa: E402

N = helper.make_node
F32 = np.float32


def _vi(name: str, shape: list[int], elem: int = TensorProto.FLOAT) -> Any:
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any],
           inits: list[Any] | None = None, opset: int = 17) -> Any:
    g = helper.make_graph(nodes, "m", inputs, outputs, inits or [])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_a_10000_node_chain_compiles() -> None:
    """The passes are iterative: the graph copy (deepcopy recursed once per producer
    link, RecursionError from 99 nodes on), the fusion and the memory planner."""
    nodes = []
    prev = "x"
    for i in range(10_000):
        op = "Relu" if i % 2 else "Add"
        ins = [prev] if op == "Relu" else [prev, "one"]
        nodes.append(N(op, ins, [f"t{i}"], name=f"n{i}"))
        prev = f"t{i}"
    nodes[-1].output[0] = "y"
    one = numpy_helper.from_array(np.full((8,), 0.5, F32), "one")
    m = _model(nodes, [_vi("x", [2, 8])], [_vi("y", [2, 8])], [one])
    result = compile_onnx(m)
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(F32)
    want = x
    for i in range(10_000):
        want = np.maximum(want, 0) if i % 2 else want + F32(0.5)
    np.testing.assert_array_equal(run_on_device(result, {"x": x})["y"], want)


def test_a_long_chain_of_linear_layers_fuses_in_linear_time() -> None:
    g = Graph("deep")
    h = g.input("x", (2, 4))
    for _ in range(3000):
        h = g.relu(g.add(g.matmul(h, g.constant(np.eye(4, dtype=F32))),
                         g.constant(np.zeros(4, F32))))
    g.output(h)
    r = compile_graph(g)
    assert r.passes["fuse_epilogues"] == 9000
    assert [n.op for n in r.graph.nodes] == ["gemm"] * 3000


def _torch_flatten() -> Any:
    """x.view(x.size(0), -1) and a head with shape arithmetic, as torch exports it."""
    nodes = [
        N("Shape", ["x"], ["s"], name="shape"),
        N("Constant", [], ["zero"], name="c0", value=numpy_helper.from_array(np.array(0))),
        N("Gather", ["s", "zero"], ["n"], name="gather", axis=0),
        N("Unsqueeze", ["n", "ax0"], ["n1"], name="unsq"),
        N("Concat", ["n1", "minus1"], ["shp"], name="concat", axis=0),
        N("Reshape", ["x", "shp"], ["flat"], name="reshape"),
        N("Shape", ["flat"], ["fs"], name="shape2"),
        N("Slice", ["fs", "one", "two"], ["last"], name="slice"),
        N("Cast", ["last"], ["lastf"], name="cast", to=TensorProto.FLOAT),
        N("Sqrt", ["lastf"], ["scale"], name="sqrt"),
        N("Div", ["flat", "scale"], ["y"], name="div"),
    ]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "ax0"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([2], np.int64), "two")]
    return _model(nodes, [_vi("x", [3, 4, 4])], [_vi("y", [3, 16])], inits)


def test_shape_arithmetic_on_static_shapes_is_folded_at_import() -> None:
    m = _torch_flatten()
    im = _Importer(m, {})
    g = im.run()
    assert im.folded == 9   # Shape x2, Constant, Gather, Unsqueeze, Concat, Slice, Cast, Sqrt
    assert [n.op for n in g.nodes] == ["reshape", "div"]
    x = np.random.default_rng(0).standard_normal((3, 4, 4)).astype(F32)
    out = run_on_device(compile_onnx(m), {"x": x})["y"]
    np.testing.assert_allclose(out, ReferenceEvaluator(m).run(None, {"x": x})[0], rtol=1e-6)


def test_the_backend_runs_models_whose_constant_nodes_feed_other_nodes() -> None:
    """Reshape's shape from a Constant node: it was a KeyError in the backend (the
    shape was taken for a graph input to feed)."""
    shape = numpy_helper.from_array(np.array([4, 3], np.int64))
    m = _model([N("Constant", [], ["shp"], value=shape), N("Reshape", ["x", "shp"], ["y"])],
               [_vi("x", [2, 6])], [_vi("y", [4, 3])])
    x = np.arange(12, dtype=F32).reshape(2, 6)
    (y,) = onnx_backend.run_model(m, [x])
    np.testing.assert_array_equal(y, x.reshape(4, 3))


@pytest.mark.parametrize("node,words", [
    (N("ConstantOfShape", ["shp"], ["y"], name="cos"),
     "node cos (ConstantOfShape): its output would have 1099511627776 elements"),
    (N("Expand", ["one", "shp"], ["y"], name="ex"),
     "node ex (Expand): its output would have 1099511627776 elements"),
])
def test_folded_tensors_no_device_holds_are_refused_before_they_are_made(node: Any,
                                                                          words: str) -> None:
    inits = [numpy_helper.from_array(np.array([1 << 20, 1 << 20], np.int64), "shp"),
             numpy_helper.from_array(np.ones((1,), F32), "one")]
    m = _model([node], [], [_vi("y", [1 << 20, 1 << 20])], inits)
    with pytest.raises(OnnxImportError) as ei:
        compile_onnx(m)
    assert words in str(ei.value) and "device memory" in str(ei.value)


def test_a_node_the_reference_cannot_evaluate_is_refused_by_name() -> None:
    inits = [numpy_helper.from_array(np.array([1, 2, 3], np.int64), "a"),
             numpy_helper.from_array(np.array([5], np.int64), "i")]
    m = _model([N("Gather", ["a", "i"], ["y"], name="bad_gather", axis=0)], [],
               [_vi("y", [1], TensorProto.INT64)], inits)
    with pytest.raises(OnnxImportError, match=r"node bad_gather \(Gather\): cannot be "
                                              r"evaluated at compile time"):
        _Importer(m, {}).run()


def test_a_weight_whose_columns_are_tiled_is_not_copied_into_the_workspace() -> None:
    """A constant B too large for the scratchpad is stored transposed and its column
    blocks read in place: the workspace holds a block of C, not a copy of B (a 128 MiB
    weight needed 268 MB of device memory). Tiled, the result is the same."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((256, 512)).astype(F32)     # 512 KiB, scratchpad 64 KiB
    g = Graph("wide")
    x = g.input("x", (3, 256))
    g.output(g.matmul(x, g.constant(w)))
    r = compile_graph(g, Target(scratchpad_size=64 << 10))
    assert r.workspace_bytes < 16 << 10 and r.const_bytes == w.nbytes
    assert "B columns" not in r.disassembly and "flags=0x2" in r.disassembly   # TRANS_B
    xv = rng.standard_normal((3, 256)).astype(F32)
    got = run_on_device(r, {"x": xv})
    np.testing.assert_allclose(list(got.values())[0], xv @ w, rtol=1e-5, atol=1e-4)


def test_a_128_mib_weight_needs_no_second_copy() -> None:
    g = Graph("big")
    x = g.input("x", (2, 4096))
    g.output(g.matmul(x, g.constant(np.zeros((4096, 8192), F32))))
    r = compile_graph(g, Target(device_memory_size=192 << 20))
    assert r.const_bytes == 128 << 20 and r.workspace_bytes < 1 << 20


@pytest.mark.parametrize("mode", ["edge", "reflect", "wrap"])
def test_pad_modes_run_on_the_device_as_gathers(mode: str) -> None:
    """Pad's edge / reflect / wrap modes become one GATHER per padded axis and match
    numpy's pad on the device; a reflect pad as long as its axis is refused by name."""
    from userspace_runtime.onnx_import import import_model
    pads = [0, 2, 1, 3]   # axis 0: 0 before, 1 after; axis 1: 2 before, 3 after
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 10])
    p = helper.make_tensor("p", TensorProto.INT64, [4], pads)
    node = helper.make_node("Pad", ["x", "p"], ["y"], mode=mode, name="pad")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], [p]),
                              opset_imports=[helper.make_opsetid("", 17)])
    data = np.arange(15, dtype=np.float32).reshape(3, 5)
    result = compile_onnx(model)
    ops = [nd.op for nd in result.graph.nodes]
    assert ops.count("gather") == 2 and "pad" not in ops
    got = run_on_device(result, {"x": data})["y"]
    assert np.array_equal(got, np.pad(data, ((0, 1), (2, 3)), mode=mode))
    if mode == "reflect":
        bad = helper.make_tensor("p", TensorProto.INT64, [4], [0, 5, 0, 0])
        model = helper.make_model(helper.make_graph([node], "g", [x], [y], [bad]),
                                  opset_imports=[helper.make_opsetid("", 17)])
        with pytest.raises(OnnxImportError, match="reflect padding of 5"):
            import_model(model)
