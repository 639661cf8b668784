"""int8 post-training quantization on ResNet-shaped convolutions (the blocked int8
conv lowering), its error report, and `virtaccel compile --int8 --calibrate`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from userspace_runtime.compiler import (
    CompileOptions,
    CompileResult,
    Target,
    compile_graph,
    run_reference,
)

from . import models
from .conftest import run_on_device


def _image(seed: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {"image": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_resnet18_shaped_int8_compiles_and_keeps_cosine() -> None:
    """Stem 7x7/2 at 112x112, 3x3 convs at 64 x 56 x 56 and a stride-2 stage: the
    im2col columns of one image (576 x 3136 bytes) exceed the 1 MiB scratchpad, which
    was "tiling needs a temporary"; now blocks of output rows."""
    g = models.resnet_stage(hw=56, c=64)
    shape = (1, 3, 112, 112)
    result = compile_graph(g, options=CompileOptions(calibration=[_image(1, shape),
                                                                  _image(2, shape)]))
    assert result.passes["quantize_int8"] == 7
    assert "block into y" in result.disassembly
    feeds = _image(3, shape)
    out = run_on_device(result, feeds, int8=True)["logits"]
    f32 = run_reference(g, feeds)["logits"]
    assert _cos(out, f32) >= 0.99
    # the device computes exactly what the quantized graph's numpy reference does
    np.testing.assert_allclose(out, run_reference(result.graph, feeds)["logits"],
                               rtol=0, atol=1e-6 * float(np.max(np.abs(f32))))
    (q,) = result.quantization
    assert q.output == "logits" and q.cosine >= 0.99 and 0 < q.max_rel_err < 0.1


@pytest.mark.parametrize("scratchpad", [1 << 26, 1 << 14, 2048])
def test_int8_conv_blocks_give_the_whole_image_result(scratchpad: int) -> None:
    """Whole image (64 MiB), blocks of output rows (16 KiB) and pieces of one output
    row (2 KiB: fewer pixels than a row): the same int32 sums, the same outputs."""
    g = models.resnet_stage(hw=16, c=16, stem=False)
    shape = (1, 16, 16, 16)
    opts = CompileOptions(calibration=[_image(4, shape)])
    feeds = _image(5, shape)
    whole = compile_graph(g, Target(scratchpad_size=1 << 26), opts)
    assert "block into y" not in whole.disassembly
    res = compile_graph(g, Target(scratchpad_size=scratchpad), opts)
    assert ("block into y" in res.disassembly) == (scratchpad < 1 << 26)
    if scratchpad == 2048:
        assert "rows 0+1 cols 0+" in res.disassembly
    a = run_on_device(whole, feeds, int8=True)
    b = run_on_device(res, feeds, int8=True)
    np.testing.assert_array_equal(a["logits"], b["logits"])


def test_quantization_error_is_empty_without_int8_and_exact_for_equal_graphs() -> None:
    from userspace_runtime.compiler._quant import quantization_error
    g = models.mlp()
    assert compile_graph(g).quantization == []
    feeds = [{"x": np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)}]
    (q,) = quantization_error(g, g, feeds)
    assert q.cosine == pytest.approx(1.0) and q.max_rel_err == 0.0


def test_activation_qparams_use_all_256_codes_and_keep_zero_exact() -> None:
    from userspace_runtime.compiler._quant import activation_qparams
    from userspace_runtime.compiler._ops import quantize_ref
    s, zp = activation_qparams(0.0, 2.55)          # after a ReLU: unsigned
    assert zp == -128 and s == pytest.approx(0.01)
    s, zp = activation_qparams(-1.0, 1.0)          # symmetric: the zero point is 0
    assert zp == 0 and s == pytest.approx(2 / 255)
    s, zp = activation_qparams(0.5, 3.0)           # widened to hold 0: 0 stays exact
    assert zp == -128 and quantize_ref(np.zeros(1, np.float32), s, zp)[0] == -128
    assert activation_qparams(0.0, 0.0) == (1.0, 0)


def test_relu_inputs_get_a_zero_point_and_padding_holds_it_on_the_device() -> None:
    """A 3x3 conv after a ReLU: its input's zero point is -128, padding is filled with
    it (a real 0) and the zero point's share is in the int32 bias; the device gives the
    reference's int32 sums exactly, and the result is nearer f32 than symmetric int8."""
    g = models.resnet_stage(hw=8, c=8, stem=False)
    shape = (1, 8, 8, 8)
    cal = [_image(s, shape) for s in (10, 11, 12)]
    res = compile_graph(g, options=CompileOptions(calibration=cal, int8_min_cosine=None,
                                                  int8_scales="static"))
    assert res.int8 is not None and res.int8.kept_f32 == [] and res.int8.cosine is None
    assert res.int8.scales == "static" and "QUANTIZE_DYNAMIC" not in res.disassembly
    padded = [n for n in res.graph.nodes if n.op == "conv2d" and n.attrs.get("pad_value")]
    # the raw image is signed (a zero point near 0); the ReLU outputs' is -128
    assert sum(n.attrs["pad_value"] == -128 for n in padded) >= 2
    assert "(fill -128)" in res.disassembly
    feeds = _image(13, shape)
    out = run_on_device(res, feeds, int8=True)["logits"]
    np.testing.assert_allclose(out, run_reference(res.graph, feeds)["logits"], rtol=0,
                               atol=1e-6 * float(np.max(np.abs(out))))
    assert _cos(out, run_reference(g, feeds)["logits"]) >= 0.999


def test_dynamic_scales_follow_the_input_at_run_time_on_the_device() -> None:
    """Dynamic scales: each int8 layer is QUANTIZE_DYNAMIC -> int8 GEMMs -> one
    DEQUANTIZE_DYNAMIC, a padded conv's input padded in f32 first (no FILL of a zero
    point); the device computes what the graph's numpy reference does. An input 40x the
    calibration feeds' range keeps its cosine (its scale is its own), where static scales
    calibrated on those feeds clip it."""
    g = models.resnet_stage(hw=8, c=8, stem=False)
    shape = (1, 8, 8, 8)
    cal = [_image(s, shape) for s in (10, 11, 12)]
    res = compile_graph(g, options=CompileOptions(calibration=cal, int8_min_cosine=None))
    assert res.int8 is not None and res.int8.scales == "dynamic" and not res.int8.kept_f32
    ops = [n.op for n in res.graph.nodes]
    assert ops.count("quantize_dynamic") == ops.count("dequantize_dynamic") == 6
    assert "quantize" not in ops and "dequantize" not in ops
    assert all(not any(n.attrs["padding"]) for n in res.graph.nodes if n.op == "conv2d")
    text = res.disassembly
    assert text.count("QUANTIZE_DYNAMIC len=48") == 6 and "(fill" not in text
    assert "DEQUANTIZE_DYNAMIC" in text and "activation=RELU" in text
    big = {"image": _image(13, shape)["image"] * 40}
    out = run_on_device(res, big, int8=True)["logits"]
    np.testing.assert_allclose(out, run_reference(res.graph, big)["logits"], rtol=0,
                               atol=1e-6 * float(np.max(np.abs(out))))
    f32 = run_reference(g, big)["logits"]
    assert _cos(out, f32) >= 0.999
    static = compile_graph(g, options=CompileOptions(calibration=cal, int8_min_cosine=None,
                                                     int8_scales="static"))
    assert _cos(run_reference(static.graph, big)["logits"], f32) < 0.99


def test_int8_scales_mistake() -> None:
    from userspace_runtime.compiler import GraphError
    g = models.resnet_stage(hw=8, c=8, stem=False)
    with pytest.raises(GraphError, match="int8 scales must be one of dynamic, static"):
        compile_graph(g, options=CompileOptions(calibration=[_image(1, (1, 8, 8, 8))],
                                                int8_scales="runtime"))


@pytest.mark.parametrize("pad_value, dtype, message", [
    (200, "int8", "pad_value must be an int8 int"),
    (1.5, "int8", "pad_value must be an int8 int"),
    (3, "float32", "pad_value 3 is for int8 x"),
])
def test_conv_pad_value_mistakes(pad_value: object, dtype: str, message: str) -> None:
    from userspace_runtime.compiler import Graph, GraphError
    g = Graph("padv")
    x = g.input("x", (1, 2, 4, 4), dtype=dtype)
    w = g.constant(np.ones((2, 2, 3, 3), dtype))
    with pytest.raises(GraphError, match=message):
        g.conv2d(x, w, padding=(1, 1, 1, 1), pad_value=pad_value)


def test_accuracy_fallback_keeps_the_costliest_layers_in_f32() -> None:
    """A target the all-int8 graph misses: the fallback keeps layers in f32 (costliest
    first) until each feed, scored with the other feeds' ranges, meets it; 1.0 keeps
    every layer in f32; None quantizes all; a target outside 0 .. 1 is refused."""
    from userspace_runtime.compiler import GraphError
    g = models.resnet_stage(hw=8, c=8, stem=False)
    shape = (1, 8, 8, 8)
    cal = [_image(s, shape) for s in (20, 21, 22, 23)]

    def comp(c: float | None) -> CompileResult:
        return compile_graph(g, options=CompileOptions(calibration=cal, int8_min_cosine=c))

    every = comp(None)
    assert every.int8 is not None and len(every.int8.quantized) == 6
    strict = comp(0.99999)
    assert strict.int8 is not None and strict.int8.kept_f32 and strict.int8.quantized
    assert strict.int8.cosine is not None and strict.int8.cosine >= 0.99999
    assert set(strict.int8.kept_f32) | set(strict.int8.quantized) == set(every.int8.quantized)
    assert strict.passes["quantize_int8"] == len(strict.int8.quantized)
    f32_convs = [n.name for n in strict.graph.nodes if n.op in ("conv2d", "gemm")
                 and n.inputs[0] is not None and n.inputs[0].dtype == "float32"]
    assert set(strict.int8.kept_f32) <= set(f32_convs)
    everything = comp(1.0)
    assert everything.int8 is not None and everything.int8.quantized == []
    assert everything.int8.cosine == 1.0 and "int8" not in everything.disassembly.lower()
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(GraphError, match="min_cosine must be in 0 .. 1"):
            comp(bad)


# --- the CLI --------------------------------------------------------------------------

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")

from virtaccel.cli import main as cli_main  # noqa: E402

from . import model_fixtures  # noqa: E402


def test_cli_compile_int8_reports_the_error_and_runs(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    fx = model_fixtures.load("mlp")
    out = tmp_path / "mlp8.vaelf"
    base = ["compile", str(fx.path), "-o", str(out), "--int8"]
    cal = tmp_path / "cal.npz"    # a stack of 3 feeds, then the fixture's one feed
    rng = np.random.default_rng(0)
    np.savez(cal, input=rng.standard_normal((3, 4, 64)).astype(np.float32))
    assert cli_main(base + ["--calibrate", str(cal), "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["int8"] is True and doc["passes"]["quantize_int8"] == 3
    err = doc["int8_error"]["logits"]
    assert err["cosine"] >= 0.99 and 0 < err["max_rel_err"] < 0.1
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **fx.inputs)
    assert cli_main(base + ["--calibrate", str(inputs)]) == 0
    text = capsys.readouterr().out
    assert "int8 vs f32 logits" in text and "cosine 0.99" in text
    assert cli_main(["run", str(out), "--inputs", str(inputs), "--out",
                     str(tmp_path / "o.npz")]) == 0
    capsys.readouterr()
    with np.load(tmp_path / "o.npz") as z:
        assert _cos(z["logits"], fx.expected["logits"]) >= 0.99


@pytest.mark.parametrize("arrays, flags, message", [
    (None, ["--int8"], "--int8 needs --calibrate"),
    ({"input": np.zeros((4, 64), np.float32)}, [], "--calibrate is for --int8"),
    ({"x": np.zeros((4, 64), np.float32)}, ["--int8"], "no array for graph input(s) input"),
    ({"input": np.zeros((4, 64), np.float32), "y": np.zeros(1)}, ["--int8"],
     "array(s) y name no graph input"),
    ({"input": np.zeros((4, 63), np.float32)}, ["--int8"],
     "array 'input' has shape [4, 63]; graph input 'input' takes [4, 64]"),
    ({"input": np.zeros((0, 4, 64), np.float32)}, ["--int8"], "has shape [0, 4, 64]"),
    ({"input": np.full((4, 64), np.nan, np.float32)}, ["--int8"], "NaN or infinite"),
    ({"input": np.array(["a"] * 256).reshape(4, 64)}, ["--int8"], "not numbers"),
])
def test_cli_calibration_mistakes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  arrays: dict[str, np.ndarray] | None, flags: list[str],
                                  message: str) -> None:
    fx = model_fixtures.load("mlp")
    out = tmp_path / "o.vaelf"
    argv = ["compile", str(fx.path), "-o", str(out), *flags]
    if arrays is not None:
        np.savez(tmp_path / "cal.npz", **arrays)  # type: ignore[arg-type]
        argv += ["--calibrate", str(tmp_path / "cal.npz")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("virtaccel compile: ")
    assert not out.exists()


def test_cli_int8_on_transformer_linear_layers_reports_layers_and_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """nn.TransformerEncoderLayer: its four linear layers (3-D matmuls made GEMMs) go
    int8; the summary names the layers and the error against f32; the device result
    stays near torch's."""
    fx = model_fixtures.load("transformer_encoder_layer")
    (inp, arr), = fx.inputs.items()
    rng = np.random.default_rng(0)
    cal = tmp_path / "cal.npz"
    np.savez(cal, **{inp: np.concatenate([arr[None], rng.standard_normal((3, *arr.shape))
                                          .astype(arr.dtype)])})
    out = tmp_path / "tel8.vaelf"
    base = ["compile", str(fx.path), "-o", str(out), "--int8", "--calibrate", str(cal)]
    assert cli_main(base + ["--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    layers = doc["int8_layers"]
    assert len(layers["int8"]) == doc["passes"]["quantize_int8"] == 4 and layers["f32"] == []
    assert layers["min_cosine"] == 0.998 and layers["worst_feed_cosine"] >= 0.998
    assert layers["scales"] == "dynamic"
    (err,) = doc["int8_error"].values()
    assert err["cosine"] >= 0.999 and 0 < err["max_rel_err"] < 0.05
    assert cli_main(base) == 0
    text = capsys.readouterr().out
    assert "int8 layers" in text and "4 int8, 0 kept f32" in text
    assert "int8 worst feed cosine" in text and "fallback target 0.998" in text
    assert "int8 activation scales" in text and "dynamic (taken at run time)" in text
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **fx.inputs)
    assert cli_main(["run", str(out), "--inputs", str(inputs), "--out",
                     str(tmp_path / "o.npz")]) == 0
    capsys.readouterr()
    with np.load(tmp_path / "o.npz") as z:
        (name,) = z.files
        assert _cos(z[name], fx.expected[name]) >= 0.999


def test_cli_int8_min_cosine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--int8-min-cosine 1 keeps every layer f32 (listed), 0 quantizes all; a value
    outside 0 .. 1 or without --int8 is refused."""
    fx = model_fixtures.load("mlp")
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **fx.inputs)
    out = tmp_path / "o.vaelf"
    base = ["compile", str(fx.path), "-o", str(out)]
    cal = ["--int8", "--calibrate", str(inputs)]
    assert cli_main(base + cal + ["--int8-min-cosine", "1", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["int8_layers"]["int8"] == [] and len(doc["int8_layers"]["f32"]) == 3
    assert cli_main(base + cal + ["--int8-min-cosine", "1"]) == 0
    text = capsys.readouterr().out
    assert "0 int8, 3 kept f32" in text and text.count("int8 kept f32") == 3
    assert cli_main(base + cal + ["--int8-min-cosine", "0", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["int8_layers"]["int8"]) == 3 and doc["int8_layers"]["min_cosine"] is None
    for bad, message in (("1.5", "1.5 is outside 0 .. 1"), ("nan", "nan is outside 0 .. 1"),
                         ("x", "'x' is not a number")):
        out.unlink(missing_ok=True)
        assert cli_main(base + cal + ["--int8-min-cosine", bad]) == 2
        assert message in capsys.readouterr().err and not out.exists()
    assert cli_main(base + ["--int8-min-cosine", "0.9"]) == 2
    assert "--int8-min-cosine is for --int8" in capsys.readouterr().err and not out.exists()


def test_cli_int8_scales(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--int8-scales static puts calibrated immediates in QUANTIZE / DEQUANTIZE, the
    default dynamic QUANTIZE_DYNAMIC / DEQUANTIZE_DYNAMIC; both run on the device; an
    unknown value or one without --int8 is refused."""
    fx = model_fixtures.load("mlp")
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **fx.inputs)
    base = ["compile", str(fx.path), "--int8", "--calibrate", str(inputs)]
    for scales, opcode in (("static", "QUANTIZE"), (None, "QUANTIZE_DYNAMIC")):
        out = tmp_path / f"{scales}.vaelf"
        extra = [] if scales is None else ["--int8-scales", scales]
        assert cli_main(base + ["-o", str(out), *extra, "--json", "-"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["int8_layers"]["scales"] == (scales or "dynamic")
        from userspace_runtime.codeobject import read
        from userspace_runtime.commands import decode
        names = {c.opcode_name for c in decode(read(out.read_bytes()).text)}
        assert opcode in names and ({"QUANTIZE_DYNAMIC", "QUANTIZE"} - {opcode}) & names \
            == set()
        assert cli_main(["run", str(out), "--inputs", str(inputs), "--out",
                         str(tmp_path / "o.npz")]) == 0
        capsys.readouterr()
        with np.load(tmp_path / "o.npz") as z:
            assert _cos(z["logits"], fx.expected["logits"]) >= 0.99
    out = tmp_path / "bad.vaelf"
    assert cli_main(base + ["-o", str(out), "--int8-scales", "runtime"]) == 2
    assert "invalid choice: 'runtime'" in capsys.readouterr().err and not out.exists()
    assert cli_main(["compile", str(fx.path), "-o", str(out), "--int8-scales", "static"]) == 2
    assert "--int8-scales is for --int8" in capsys.readouterr().err and not out.exists()


def test_cli_calibration_npy_and_feed_counts(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "cal.npy", np.zeros((4, 64), np.float32))
    fx = model_fixtures.load("mlp")
    argv = ["compile", str(fx.path), "-o", str(tmp_path / "o.vaelf"), "--int8", "--calibrate"]
    assert cli_main(argv + [str(tmp_path / "cal.npy")]) == 2
    assert "--calibrate" in capsys.readouterr().err
    from userspace_runtime.compiler import Graph
    from virtaccel.cli._args import CliError
    from virtaccel.cli.compile import calibration_feeds
    g = Graph("three")
    q, k = g.input("query", (6, 2)), g.input("key", (6, 2))
    g.output(g.add(g.add(q, k), g.input("value", (6, 2))))
    np.savez(tmp_path / "c.npz", query=np.zeros((2, 6, 2), np.float32),
             key=np.zeros((3, 6, 2), np.float32), value=np.zeros((6, 2), np.float32))
    with pytest.raises(CliError, match=r"different numbers of feeds \(query: 2, key: 3, "
                                       r"value: 1\)"):
        calibration_feeds(str(tmp_path / "c.npz"), g)
    np.savez(tmp_path / "c.npz", query=np.ones((2, 6, 2), np.float32),
             key=np.zeros((2, 6, 2), np.float32), value=np.zeros((6, 2), np.float32))
    with pytest.raises(CliError, match="different numbers of feeds"):
        calibration_feeds(str(tmp_path / "c.npz"), g)
    np.savez(tmp_path / "c.npz", query=np.ones((2, 6, 2), np.float32),
             key=np.zeros((2, 6, 2), np.float32), value=np.zeros((2, 6, 2), np.float32))
    feeds = calibration_feeds(str(tmp_path / "c.npz"), g)
    assert len(feeds) == 2 and feeds[1]["query"].shape == (6, 2)


# The seven CNNs' fixtures have random weights and BatchNorms calibrated to unit variance:
# such a net amplifies a small perturbation layer after layer (ResNet-50: 1% noise at the
# stem alone costs 3.5% cosine at the logits, at layer4 0.005%). Dynamic activation
# scales remove the calibration's share of the error (a new input's range is its own);
# int8's resolution still costs some layers more than the bar allows, so the accuracy
# fallback keeps those in f32, chosen on the calibration feeds: the fixture input and
# seven more drawn like it. The bar is checked on other random inputs, each one.
_CAL_FEEDS = 8
_BAR_SEED0 = 5000          # the inputs the bar is checked on: seeds 5000, 5001, ...
_BAR_FAST, _BAR_CAMPAIGN = 6, 50


def _fixture_bar(name: str, inputs: int) -> None:
    """Compile the fixture to int8 (the CLI's defaults) and check that on `inputs` random
    inputs none of the calibration feeds, every output's cosine to f32 is >= 0.99, input
    by input (the seed of each is printed, and named when it fails)."""
    from userspace_runtime.onnx_import import import_model
    fx = model_fixtures.load(name)
    graph = import_model(str(fx.path))
    (inp, arr), = fx.inputs.items()

    def draw(seed: int) -> dict[str, np.ndarray]:
        return {inp: np.random.default_rng(seed).standard_normal(arr.shape).astype(arr.dtype)}

    cal = [fx.inputs, *(draw(100 + i) for i in range(_CAL_FEEDS - 1))]
    result = compile_graph(graph, options=CompileOptions(calibration=cal))
    r = result.int8
    assert r is not None and r.scales == "dynamic" and r.min_cosine == 0.998
    assert result.passes["quantize_int8"] == len(r.quantized) >= 1
    assert r.cosine is not None and r.cosine >= 0.998
    assert all(q.cosine >= 0.99 for q in result.quantization), result.quantization
    print(f"{name}: {len(r.quantized)} int8, {len(r.kept_f32)} kept f32")
    low = []
    for seed in range(_BAR_SEED0, _BAR_SEED0 + inputs):
        feed = draw(seed)
        got = run_reference(result.graph, feed)
        for out, f32 in run_reference(graph, feed).items():
            c = _cos(got[out], f32)
            print(f"{name} seed {seed} {out}: cosine {c:.6f}")
            if c < 0.99:
                low.append(f"seed {seed} {out}: cosine {c:.6f}")
    assert not low, f"{name}: int8 cosine to f32 below 0.99 on " + ", ".join(low)


@pytest.mark.parametrize("name", ["mlp", *model_fixtures.CNNS])
def test_int8_fixture_keeps_cosine_to_f32(name: str) -> None:
    """The real models' int8 versions keep cosine >= 0.99 to f32 on every one of
    _BAR_FAST random inputs the calibration did not see."""
    _fixture_bar(name, _BAR_FAST)


@pytest.mark.campaign
@pytest.mark.parametrize("name", model_fixtures.CNNS)
def test_int8_fixture_keeps_cosine_to_f32_on_50_inputs(name: str) -> None:
    """The same bar on 50 random inputs per CNN."""
    _fixture_bar(name, _BAR_CAMPAIGN)


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_b0"])
def test_int8_fixture_runs_on_the_device_as_its_reference(name: str) -> None:
    """A real CNN in dynamic int8 on the device (QUANTIZE_DYNAMIC's record, the int8
    GEMMs, DEQUANTIZE_DYNAMIC) gives the numpy reference's result and stays near f32.
    Not bit for bit: the layers kept f32 sum in another order on the device (1e-7), which
    can move an int8 code downstream, and these nets amplify that (up to ~1e-2)."""
    from userspace_runtime.onnx_import import import_model
    fx = model_fixtures.load(name)
    graph = import_model(str(fx.path))
    (inp, arr), = fx.inputs.items()
    feeds = {inp: np.random.default_rng(_BAR_SEED0).standard_normal(arr.shape)
             .astype(arr.dtype)}
    res = compile_graph(graph, options=CompileOptions(calibration=[fx.inputs]))
    assert res.int8 is not None and res.int8.quantized
    assert "QUANTIZE_DYNAMIC" in res.disassembly and "DEQUANTIZE_DYNAMIC" in res.disassembly
    out = run_on_device(res, feeds, int8=True)
    for k, ref in run_reference(res.graph, feeds).items():
        print(f"{name} {k}: device vs reference cosine {_cos(out[k], ref):.7f}")
        assert _cos(out[k], ref) >= 0.9995
        assert _cos(out[k], run_reference(graph, feeds)[k]) >= 0.99
