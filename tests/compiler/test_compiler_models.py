"""The three models end to end on a VA-1 in a VM, against the numpy reference:
MLP, small CNN, transformer encoder block in f32; MLP and CNN int8 (PTQ); tiling to a
small scratchpad gives the untiled results."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from userspace_runtime.compiler import CompileOptions, Graph, Target, compile_graph, run_reference

from . import models
from .conftest import run_on_device

F32_TOL = {"mlp": 1e-5, "cnn": 1e-4, "encoder": 1e-4}   # max abs error, f32 end to end
INT8_REL_TOL = 0.06                                       # max abs error / max |reference|

MODELS: dict[str, tuple[Callable[[], Graph], dict[str, tuple[int, ...]]]] = {
    "mlp": (models.mlp, {"x": (4, 16)}),
    "cnn": (models.cnn, {"image": (2, 3, 8, 8)}),
    "encoder": (models.encoder_block, {"x": (8, 16)}),
}


def _feeds(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_f32_model_matches_numpy(name: str) -> None:
    build, shapes = MODELS[name]
    g = build()
    feeds = _feeds(shapes, 1)
    result = compile_graph(g)
    out = run_on_device(result, feeds)
    ref = run_reference(g, feeds)
    assert set(out) == set(ref)
    for k in ref:
        assert out[k].shape == ref[k].shape and out[k].dtype == ref[k].dtype
        np.testing.assert_allclose(out[k], ref[k], rtol=0, atol=F32_TOL[name])


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_int8_model_within_tolerance(name: str) -> None:
    build, shapes = MODELS[name]
    g = build()
    calibration = [_feeds(shapes, 100 + i) for i in range(4)]
    result = compile_graph(g, options=CompileOptions(calibration=calibration))
    assert result.passes["quantize_int8"] >= 2
    assert "GEMM" in result.disassembly and "dtype=I8" in result.disassembly
    feeds = _feeds(shapes, 1)
    out = run_on_device(result, feeds, int8=True)
    ref = run_reference(g, feeds)
    for k in ref:
        err = float(np.max(np.abs(out[k] - ref[k])) / np.max(np.abs(ref[k])))
        assert err <= INT8_REL_TOL, (k, err)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tiled_equals_untiled(name: str) -> None:
    """A scratchpad far smaller than the operands: many more commands, same results
    (up to f32 rounding of differently blocked BLAS calls: 1e-6)."""
    build, shapes = MODELS[name]
    g = build()
    feeds = _feeds(shapes, 2)
    untiled = compile_graph(g)
    tiled = compile_graph(g, Target(scratchpad_size=512))
    assert tiled.commands > untiled.commands
    a = run_on_device(untiled, feeds)
    b = run_on_device(tiled, feeds)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-6)


def test_int8_cnn_tiled_equals_untiled() -> None:
    """int8 results are exact integers before dequantization: tiling changes nothing."""
    g = models.cnn()
    shapes = MODELS["cnn"][1]
    cal = [_feeds(shapes, 7)]
    opts = CompileOptions(calibration=cal)
    feeds = _feeds(shapes, 3)
    a = run_on_device(compile_graph(g, options=opts), feeds, int8=True)
    b = run_on_device(compile_graph(g, Target(scratchpad_size=4096), opts), feeds, int8=True)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_same_seed_same_device_result() -> None:
    g = models.encoder_block()
    feeds = _feeds(MODELS["encoder"][1], 4)
    r = compile_graph(g)
    a, b = run_on_device(r, feeds, seed=5), run_on_device(r, feeds, seed=5)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
