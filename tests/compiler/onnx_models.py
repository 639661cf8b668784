"""Small ONNX models (onnx.helper) for the importer, CLI and backend tests."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F32 = np.float32


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(arr, name)


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           outputs: list[onnx.ValueInfoProto], inits: list[onnx.TensorProto],
           name: str, opset: int = 21) -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                          producer_name="virtaccel-tests")
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


def mlp(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [_init("w1", (rng.standard_normal((16, 32)) / 4).astype(F32)),
             _init("b1", (rng.standard_normal(32) * 0.1).astype(F32)),
             _init("w2", (rng.standard_normal((8, 32)) / 6).astype(F32)),
             _init("b2", (rng.standard_normal(8) * 0.1).astype(F32))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
             helper.make_node("Add", ["h0", "b1"], ["h1"], name="fc1_bias"),
             helper.make_node("Relu", ["h1"], ["h2"], name="act1"),
             helper.make_node("Gemm", ["h2", "w2", "b2"], ["logits"], name="fc2", transB=1)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 8])],
                  inits, "mlp")


def cnn(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    c = 8
    inits = [_init("w1", (rng.standard_normal((c, 3, 3, 3)) / 5).astype(F32)),
             _init("cb1", (rng.standard_normal(c) * 0.1).astype(F32)),
             _init("bn_s", (1 + 0.1 * rng.standard_normal(c)).astype(F32)),
             _init("bn_b", (0.1 * rng.standard_normal(c)).astype(F32)),
             _init("bn_m", (0.1 * rng.standard_normal(c)).astype(F32)),
             _init("bn_v", (1 + 0.2 * rng.random(c)).astype(F32)),
             _init("w2", (rng.standard_normal((c, c, 3, 3)) / 8).astype(F32)),
             _init("fc_w", (rng.standard_normal((c * 4 * 4, 5)) / 11).astype(F32)),
             _init("fc_b", (rng.standard_normal(5) * 0.1).astype(F32))]
    nodes = [helper.make_node("Conv", ["image", "w1", "cb1"], ["c1"], name="conv1",
                              pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "bn_s", "bn_b", "bn_m", "bn_v"],
                              ["n1"], name="bn1"),
             helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", strides=[2, 2],
                              auto_pad="SAME_UPPER"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Flatten", ["r2"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], name="fc")]
    return _model(nodes, [helper.make_tensor_value_info("image", TensorProto.FLOAT,
                                                        [2, 3, 8, 8])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 5])],
                  inits, "cnn")


def encoder(seed: int = 0, seq: int = 8, d: int = 16, heads: int = 2,
            ff: int = 32) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    dh = d // heads
    inits = []

    def w(name: str, *shape: int) -> str:
        inits.append(_init(name, (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(F32)))
        return name

    def b(name: str, n: int, value: float | None = None) -> str:
        arr = np.full(n, value, F32) if value is not None else \
            (rng.standard_normal(n) * 0.1).astype(F32)
        inits.append(_init(name, arr))
        return name

    inits.append(_init("heads_shape", np.array([seq, heads, dh], np.int64)))
    inits.append(_init("flat_shape", np.array([seq, d], np.int64)))
    inits.append(_init("scale", np.array(1 / np.sqrt(dh), F32)))
    N = helper.make_node
    nodes = []
    for p in ("q", "k", "v"):
        nodes += [N("MatMul", ["x", w(f"w{p}", d, d)], [f"{p}0"], name=f"{p}_proj"),
                  N("Add", [f"{p}0", b(f"b{p}", d)], [f"{p}1"], name=f"{p}_bias"),
                  N("Reshape", [f"{p}1", "heads_shape"], [f"{p}2"], name=f"{p}_split"),
                  N("Transpose", [f"{p}2"], [f"{p}3"], name=f"{p}_heads", perm=[1, 0, 2])]
    nodes += [N("Transpose", ["k3"], ["kt"], name="k_t", perm=[0, 2, 1]),
              N("MatMul", ["q3", "kt"], ["s0"], name="scores"),
              N("Mul", ["s0", "scale"], ["s1"], name="scale_scores"),
              N("Softmax", ["s1"], ["a"], name="softmax", axis=-1),
              N("MatMul", ["a", "v3"], ["c0"], name="context"),
              N("Transpose", ["c0"], ["c1"], name="merge_t", perm=[1, 0, 2]),
              N("Reshape", ["c1", "flat_shape"], ["c2"], name="merge"),
              N("MatMul", ["c2", w("wo", d, d)], ["o0"], name="o_proj"),
              N("Add", ["o0", b("bo", d)], ["o1"], name="o_bias"),
              N("Add", ["x", "o1"], ["r1"], name="residual1"),
              N("LayerNormalization", ["r1", b("g1", d, 1.0), b("be1", d, 0.0)], ["x1"],
                name="ln1", axis=-1, epsilon=1e-5),
              N("MatMul", ["x1", w("w_ff1", d, ff)], ["f0"], name="ff1"),
              N("Add", ["f0", b("b_ff1", ff)], ["f1"], name="ff1_bias"),
              N("Gelu", ["f1"], ["f2"], name="gelu"),
              N("MatMul", ["f2", w("w_ff2", ff, d)], ["f3"], name="ff2"),
              N("Add", ["f3", b("b_ff2", d)], ["f4"], name="ff2_bias"),
              N("Add", ["x1", "f4"], ["r2"], name="residual2"),
              N("LayerNormalization", ["r2", b("g2", d, 1.0), b("be2", d, 0.0)], ["y"],
                name="ln2", axis=-1, epsilon=1e-5)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, d])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [seq, d])],
                  inits, "encoder")


def qdq_mlp(seed: int = 0) -> onnx.ModelProto:
    """An int8 QDQ-style model: QuantizeLinear/DequantizeLinear around the data path."""
    rng = np.random.default_rng(seed)
    inits = [_init("w", (rng.standard_normal((16, 8)) / 4).astype(F32)),
             _init("s", np.array(0.05, F32)), _init("zp", np.array(3, np.int8)),
             _init("s2", np.array(0.02, F32)), _init("zp2", np.array(-2, np.int8))]
    N = helper.make_node
    nodes = [N("QuantizeLinear", ["x", "s", "zp"], ["xq"], name="q_in"),
             N("DequantizeLinear", ["xq", "s", "zp"], ["xd"], name="dq_in"),
             N("MatMul", ["xd", "w"], ["y0"], name="fc"),
             N("QuantizeLinear", ["y0", "s2", "zp2"], ["yq"], name="q_out"),
             N("DequantizeLinear", ["yq", "s2", "zp2"], ["y"], name="dq_out")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                  inits, "qdq")


def unsupported() -> onnx.ModelProto:
    N = helper.make_node
    nodes = [N("Relu", ["x"], ["r"], name="first"),
             N("Cos", ["r"], ["y"], name="the_cosine")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [],
                  "unsupported")
