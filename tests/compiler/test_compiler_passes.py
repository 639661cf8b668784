"""Graph IR and passes, on the host: shape/type inference and its errors, constant
folding, DCE, BatchNorm folding, epilogue fusion, canonicalization, memory planning
and tiling decisions (the device runs are in test_compiler_models)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from userspace_runtime.compiler import (
    CompileOptions,
    Graph,
    GraphError,
    Target,
    compile_graph,
    run_reference,
)
from userspace_runtime.compiler import _passes

from . import models

F32 = np.float32


def test_shapes_and_dtypes_are_inferred() -> None:
    g = Graph()
    x = g.input("x", (2, 3, 8, 8))
    y = g.conv2d(x, g.constant(np.zeros((4, 3, 3, 3), F32)), stride=(2, 2),
                 padding=(1, 1, 1, 1))
    assert y.shape == (2, 4, 4, 4) and y.dtype == "float32"
    z = g.reduce(g.reshape(y, (2, -1)), "mean", axes=[1], keepdims=False)
    assert z.shape == (2,)
    q = g.quantize(g.transpose(y, (0, 2, 3, 1)), 0.1)
    assert q.shape == (2, 4, 4, 4) and q.dtype == "int8"
    assert g.matmul(g.input("a", (5, 2, 3)), g.constant(np.ones((3, 7), F32))).shape == (5, 2, 7)
    assert g.matmul(q, q).dtype == "int32"


@pytest.mark.parametrize("build, message", [
    (lambda g: g.matmul(g.input("a", (2, 3)), g.input("b", (4, 5))), "inner dimensions differ"),
    (lambda g: g.add(g.input("a", (2, 3)), g.input("b", (4,))), "do not broadcast"),
    (lambda g: g.reshape(g.input("a", (2, 3)), (4, 2)), "cannot reshape"),
    (lambda g: g.conv2d(g.input("a", (1, 3, 4, 4)), g.constant(np.ones((2, 4, 3, 3), F32))),
     "channels"),
    (lambda g: g.transpose(g.input("a", (2, 3)), (0, 0)), "not a permutation"),
    (lambda g: g.softmax(g.input("a", (2, 3)), axis=2), "out of range"),
    (lambda g: g.gemm(g.input("a", (2, 3)), g.input("b", (3, 4)), g.input("c", (5,))),
     "do not broadcast"),
    (lambda g: g.add(g.input("a", (2,)), g.input("b", (2,), np.int8)), "different dtypes"),
])
def test_shape_mismatches_name_the_node(build: object, message: str) -> None:
    g = Graph()
    with pytest.raises(GraphError, match=message) as ei:
        build(g)  # type: ignore[operator]
    assert re.match(r"node \w+ \(\w+\): ", str(ei.value)), str(ei.value)


def test_unknown_op_and_bad_attributes() -> None:
    g = Graph()
    x = g.input("x", (2, 2))
    with pytest.raises(GraphError, match="unknown op 'frobnicate'"):
        g.add_node("frobnicate", [x])
    with pytest.raises(GraphError, match="reduce op must be"):
        g.reduce(x, "median")
    with pytest.raises(GraphError, match="scale must be"):
        g.quantize(x, 0.0)


def test_constant_folding_and_dce() -> None:
    g = Graph()
    x = g.input("x", (3, 4))
    w = g.add(g.constant(np.ones((4, 4), F32)), g.constant(np.eye(4, dtype=F32)))
    dead = g.relu(g.mul(x, x))                  # never reaches an output
    y = g.matmul(x, g.transpose(w))
    g.output(y)
    assert dead is not None
    r = compile_graph(g)
    assert r.passes["fold_constants"] == 2 and r.passes["dce"] == 2
    assert [n.op for n in r.graph.nodes] == ["gemm"]
    feeds = {"x": np.arange(12, dtype=F32).reshape(3, 4)}
    np.testing.assert_allclose(run_reference(r.graph, feeds)[y.name],
                               run_reference(g, feeds)[y.name], rtol=1e-6)


def test_batchnorm_folds_into_conv_and_relu_fuses() -> None:
    g = models.cnn()
    r = compile_graph(g)
    assert r.passes["fold_batchnorm"] == 1
    ops = [n.op for n in r.graph.nodes]
    assert "batchnorm" not in ops and "relu" not in ops
    assert [n.attrs.get("activation") for n in r.graph.nodes if n.op == "conv2d"] == \
        ["relu", "relu"]
    feeds = {"image": np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(F32)}
    np.testing.assert_allclose(run_reference(r.graph, feeds)["logits"],
                               run_reference(g, feeds)["logits"], rtol=1e-4, atol=1e-5)


def test_bias_and_activation_fuse_into_gemm_epilogue() -> None:
    r = compile_graph(models.mlp(sizes=(16, 32, 32, 8)))
    gemms = [n for n in r.graph.nodes if n.op == "gemm"]
    assert len(r.graph.nodes) == 3 and len(gemms) == 3
    assert [n.attrs["activation"] for n in gemms] == ["relu", "relu", None]
    assert all(n.inputs[2] is not None for n in gemms)
    assert r.commands == 3 and r.disassembly.count("activation=RELU") == 2


def test_unfused_when_disabled() -> None:
    r = compile_graph(models.mlp(), options=CompileOptions(fuse=False))
    assert r.commands > 2


def test_standalone_batchnorm_and_gelu_tanh_are_canonicalized() -> None:
    g = Graph()
    x = g.input("x", (2, 3, 4, 4))
    c = np.arange(1, 4, dtype=F32)
    y = g.batchnorm(x, g.constant(c), g.constant(c * 0.1), g.constant(c * 0.2),
                    g.constant(c), epsilon=1e-3)
    y = g.gelu(y, approximate="tanh")
    g.output(y)
    r = compile_graph(g)
    ops = {n.op for n in r.graph.nodes}
    assert "batchnorm" not in ops and "gelu" not in ops and "sigmoid" in ops
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 4, 4)).astype(F32)}
    np.testing.assert_allclose(run_reference(r.graph, feeds)[y.name],
                               run_reference(g, feeds)[y.name], rtol=1e-5, atol=1e-6)


def test_memory_plan_reuses_dead_intermediates() -> None:
    """A chain of 8 relus over 64 KiB tensors: liveness needs two blocks, not eight."""
    g = Graph()
    h = g.input("x", (64, 256))
    for _ in range(8):
        h = g.sigmoid(h)
    g.output(h)
    r = compile_graph(g, options=CompileOptions(fuse=False))
    block = 64 * 256 * 4
    assert r.workspace_bytes == 2 * block
    assert r.workspace_bytes < 7 * block


def test_tiling_respects_the_scratchpad() -> None:
    g = models.mlp(batch=16, sizes=(64, 64, 8))
    sp = 8192
    r = compile_graph(g, Target(scratchpad_size=sp))
    for line in r.disassembly.splitlines():
        if " GEMM " not in line:
            continue
        f = dict(re.findall(r"(\w+)=(\d+)", line))
        m, n, k = int(f["m"]), int(f["n"]), int(f["k"])
        assert (m * k + k * n + m * n + n) * 4 <= sp, line
    assert r.disassembly.count(" GEMM ") > 2


def test_reference_needs_every_input() -> None:
    g = models.mlp()
    with pytest.raises(GraphError, match="no value fed for input x"):
        _passes.reference_run(g, {})
