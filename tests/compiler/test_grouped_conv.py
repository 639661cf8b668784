"""Depthwise and grouped convolutions in graphs built with the builder: compiled to
CONV2D with `groups`, run on a VA-1 in a VM (the tap-by-tap device path), against the
numpy reference; in an int8 graph they stay f32 next to int8 dense convs."""
from __future__ import annotations

import numpy as np

from userspace_runtime.compiler import CompileOptions, Graph, Value, compile_graph, run_reference

from .conftest import run_on_device

F32 = np.float32


def _mobile_block(seed: int = 0) -> Graph:
    """MobileNetV2 / ShuffleNet-style: 1x1 expand (dense) -> 3x3 depthwise stride 2 ->
    3x3 depthwise with channel multiplier 2 (dilation 2) -> 3x3 grouped (4 groups) ->
    1x1 grouped projection; relu fused on the way."""
    rng = np.random.default_rng(seed)
    g = Graph("mobile_block")

    def conv(x: Value, k: int, r: int, groups: int, stride: int = 1, dil: int = 1,
             act: str | None = "relu") -> Value:
        c = x.shape[1]
        w = (rng.standard_normal((k, c // groups, r, r)) * np.sqrt(2 / (c // groups * r * r))
             ).astype(F32)
        p = dil * (r - 1) // 2
        return g.conv2d(x, g.constant(w), g.constant((0.1 * rng.standard_normal(k)).astype(F32)),
                        stride=(stride, stride), padding=(p, p, p, p), dilation=(dil, dil),
                        groups=groups, activation=act)

    x = g.input("image", (2, 8, 20, 20))
    y = conv(x, 32, 1, 1)
    y = conv(y, 32, 3, 32, stride=2)
    y = conv(y, 64, 3, 32, dil=2)
    y = conv(y, 64, 3, 4)
    g.output(conv(y, 16, 1, 4, act=None), names=["features"])
    return g


def test_grouped_and_depthwise_convs_match_numpy_on_the_device() -> None:
    g = _mobile_block()
    result = compile_graph(g)
    groups = [line for line in result.disassembly.splitlines() if "CONV2D" in line]
    assert len(groups) == 5
    for want in ("groups=32", "groups=4"):
        assert any(want in line for line in groups), (want, groups)
    feeds = {"image": np.random.default_rng(1).standard_normal((2, 8, 20, 20)).astype(F32)}
    out = run_on_device(result, feeds)["features"]
    ref = run_reference(g, feeds)["features"]
    assert out.shape == (2, 16, 10, 10)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * float(np.max(np.abs(ref))))


def test_int8_keeps_grouped_convs_f32() -> None:
    g = _mobile_block(seed=2)
    rng = np.random.default_rng(3)
    cal = [{"image": rng.standard_normal((2, 8, 20, 20)).astype(F32)} for _ in range(2)]
    result = compile_graph(g, options=CompileOptions(calibration=cal))
    assert result.passes["quantize_int8"] == 1          # only the dense 1x1 expand
    (q,) = result.quantization
    assert q.cosine >= 0.99
    out = run_on_device(result, cal[0], int8=True)["features"]
    np.testing.assert_allclose(out, run_reference(result.graph, cal[0])["features"],
                               rtol=0, atol=1e-5 * float(np.max(np.abs(out))))
