"""Batched matmuls (attention) as GEMM_BATCHED: one command for every batch, operands
read in place through transposes, reshapes and scalar muls (view folding), results
equal to the numpy reference; the attention fixtures issue fewer commands."""
from __future__ import annotations

import re

import numpy as np
import pytest

from userspace_runtime.compiler import CompileOptions, Graph, Target, compile_graph, run_reference
from userspace_runtime.compiler._views import reshape_strides

from .conftest import run_on_device

RNG_SEED = 1414


def _attention(g: Graph, b: int, h: int, s: int, d: int) -> None:
    """torch's exported attention: [B, S, H*D] projections split into heads by reshape
    and transpose, q @ k^T with the 1/sqrt(d) scale on both sides, softmax, @ v."""
    rng = np.random.default_rng(RNG_SEED)
    x = g.input("x", (b, s, h * d))

    def heads(name: str) -> object:
        w = g.constant(rng.standard_normal((h * d, h * d)).astype(np.float32) / 8, name=name)
        return g.transpose(g.reshape(g.matmul(x, w), (b, s, h, d)), (0, 2, 1, 3))

    q, k, v = heads("wq"), heads("wk"), heads("wv")
    scale = g.constant(np.array(d ** -0.25, np.float32), name="scale")
    kt = g.mul(g.transpose(k, (0, 1, 3, 2)), scale)       # type: ignore[arg-type]
    att = g.softmax(g.matmul(g.mul(q, scale), kt), axis=-1)  # type: ignore[arg-type]
    y = g.matmul(att, v)                                     # type: ignore[arg-type]
    g.output(g.reshape(g.transpose(y, (0, 2, 1, 3)), (b, s, h * d)), names=["y"])


def _gemm_commands(text: str) -> tuple[int, int]:
    return (len(re.findall(r"^\S+ GEMM_BATCHED ", text, re.M)),
            len(re.findall(r"^\S+ GEMM ", text, re.M)))


def test_attention_is_batched_gemms_reading_views_in_place() -> None:
    g = Graph("attention")
    _attention(g, 2, 3, 5, 4)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 5, 12)).astype(np.float32)}
    folded = compile_graph(g, Target())
    plain = compile_graph(g, Target(), CompileOptions(fold_views=False))
    ops = [n.op for n in folded.graph.nodes]
    assert ops.count("bmm") == 2 and "matmul" not in ops
    assert ops.count("mul") == 0           # both scales became alpha
    assert ops.count("transpose") == 1     # only the output's; the heads are read in place
    assert folded.passes["fold_matmul_views"] == 2
    # heads interleaved in [B, S, H*D]: the H batches are one command per b (the B and
    # H strides do not merge), instead of one GEMM per (b, h)
    assert _gemm_commands(folded.disassembly) == (2 * 2, 3)
    assert _gemm_commands(plain.disassembly) == (0, 3 + 2 * 6)
    assert folded.commands < plain.commands - 10
    ref = run_reference(g, feeds)["y"]
    for result in (folded, plain):
        got = run_on_device(result, feeds)["y"]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("a_shape,b_shape", [
    ((4, 3, 5), (4, 5, 2)),            # same batch
    ((2, 1, 3, 5), (1, 4, 5, 6)),      # both broadcast: outer batch loops
    ((3, 5), (2, 3, 5, 4)),            # A shared by every batch (stride 0)
    ((2, 3, 1, 5), (2, 3, 5, 1)),      # m = n = 1
])
def test_broadcast_batches_match_numpy(a_shape: tuple[int, ...], b_shape: tuple[int, ...]
                                       ) -> None:
    rng = np.random.default_rng(RNG_SEED)
    g = Graph("bcast")
    a, b = g.input("a", a_shape), g.input("b", b_shape)
    g.output(g.matmul(a, b), names=["y"])
    feeds = {"a": rng.standard_normal(a_shape).astype(np.float32),
             "b": rng.standard_normal(b_shape).astype(np.float32)}
    result = compile_graph(g)
    assert [n.op for n in result.graph.nodes] == ["bmm"]
    np.testing.assert_allclose(run_on_device(result, feeds)["y"],
                               np.matmul(feeds["a"], feeds["b"]), rtol=1e-5, atol=1e-6)


def test_tiled_to_the_scratchpad_in_place() -> None:
    """Row and column blocks of each batch read A and B in place (no COPY, no workspace
    for them) and agree with the untiled command."""
    rng = np.random.default_rng(RNG_SEED + 1)
    g = Graph("tiled")
    a, b = g.input("a", (3, 40, 64)), g.input("b", (3, 48, 64))
    g.output(g.matmul(a, g.transpose(b, (0, 2, 1))), names=["y"])
    feeds = {"a": rng.standard_normal((3, 40, 64)).astype(np.float32),
             "b": rng.standard_normal((3, 48, 64)).astype(np.float32)}
    small = compile_graph(g, Target(scratchpad_size=4096))
    batched, plain = _gemm_commands(small.disassembly)
    assert batched > 4 and plain == 0 and "COPY" not in small.disassembly
    assert small.workspace_bytes == 0
    whole = run_on_device(compile_graph(g), feeds)["y"]
    got = run_on_device(small, feeds)["y"]
    np.testing.assert_allclose(got, feeds["a"] @ feeds["b"].transpose(0, 2, 1), rtol=1e-5,
                               atol=1e-5)
    # BLAS may sum a dot product in another order for another block shape
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=2e-5)


def test_a_view_numpy_would_copy_is_not_folded() -> None:
    """reshape(transpose(x)) that merges non-adjacent dims is no strided view: the
    transpose stays (a COPY) and the matmul reads its result (the reshape of that is a
    view)."""
    g = Graph("copyview")
    x = g.input("x", (4, 3, 2, 5))
    t = g.reshape(g.transpose(x, (0, 2, 1, 3)), (4, 6, 5))   # merges dims 2 and 1
    w = g.input("w", (4, 5, 2))
    g.output(g.matmul(t, w), names=["y"])
    result = compile_graph(g)
    nodes = result.graph.nodes
    assert [n.op for n in nodes] == ["transpose", "bmm"]
    assert nodes[1].inputs[0] is nodes[0].outputs[0]
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((4, 3, 2, 5)).astype(np.float32),
             "w": rng.standard_normal((4, 5, 2)).astype(np.float32)}
    np.testing.assert_allclose(run_on_device(result, feeds)["y"],
                               run_reference(g, feeds)["y"], rtol=1e-5, atol=1e-6)


def test_reshape_strides_agrees_with_numpy() -> None:
    """The no-copy reshape rule, on random transposed views: a view exactly when numpy
    makes one, with numpy's element mapping."""
    rng = np.random.default_rng(RNG_SEED)
    views = 0
    for _ in range(400):
        shape = tuple(int(d) for d in rng.integers(1, 4, rng.integers(1, 5)))
        base = np.arange(int(np.prod(shape))).reshape(shape)
        v = base.transpose(rng.permutation(len(shape)))
        dims, rest = [], v.size
        while rest > 1:
            d = int(rng.choice([q for q in range(1, rest + 1) if rest % q == 0]))
            dims += [d] + ([1] if rng.random() < 0.2 else [])
            rest //= d
        new = tuple(dims) or (1,)
        got = reshape_strides(v.shape, tuple(s // 8 for s in v.strides), new)
        r = v.reshape(new)
        if np.shares_memory(r, base):
            assert got is not None
            mine = np.lib.stride_tricks.as_strided(base.reshape(-1), new,
                                                   tuple(s * 8 for s in got))
            assert np.array_equal(mine, r)
            views += 1
        else:
            assert got is None
    assert views > 100


ATTENTION = ("transformer_encoder_layer", "multihead_attention", "gpt2_decoder", "vit_small")


@pytest.mark.parametrize("name", ATTENTION)
def test_attention_fixtures_issue_fewer_commands_and_still_match(name: str) -> None:
    """The torch exports: every attention product is GEMM_BATCHED (no per-batch GEMM is
    left), the command count drops, and the device result stays within 1e-4 of torch
    and onnxruntime (as test_real_models checks through the CLI path)."""
    pytest.importorskip("onnx", reason="the onnx extra is not installed")
    from userspace_runtime.onnx_import import compile_onnx

    from . import model_fixtures as mf
    fx = mf.load(name)
    folded = compile_onnx(str(fx.path))
    plain = compile_onnx(str(fx.path), options=CompileOptions(fold_views=False))
    batched, _ = _gemm_commands(folded.disassembly)
    assert batched > 0 and _gemm_commands(plain.disassembly)[0] == 0
    assert not re.search(r"\]: gemm rows", folded.disassembly)   # no per-batch GEMMs
    assert folded.commands < plain.commands, (folded.commands, plain.commands)
    assert [n.op for n in folded.graph.nodes].count("transpose") < \
        [n.op for n in plain.graph.nodes].count("transpose")
    out = run_on_device(folded, fx.inputs)
    for key, ref in fx.expected.items():
        got = out[key].astype(ref.dtype) if out[key].dtype != ref.dtype else out[key]
        assert mf.rel_err(got, ref) <= 1e-4, key
