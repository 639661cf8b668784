"""ISA additions (spec §7) against numpy: CONV2D, SOFTMAX, LAYERNORM, REDUCE, the new
ELEMENTWISE ops and broadcast form, GEMM epilogues and int8 GEMM, strided COPY,
QUANTIZE / DEQUANTIZE (static and dynamic), CALL, and their roofline times.

Tolerances: f32 results within rtol 1e-5 (atol 1e-5) of a float64 reference; f16
results within 1 f16 ulp (rtol 2^-10) of the float64 reference rounded to f16; GELU /
SIGMOID within 2.5e-7 relative of math.erf / math.exp (the erfc fit's 1.2e-7 bound plus
the final f32 rounding); integer results exact."""
from __future__ import annotations

import itertools
import math
import struct
from typing import Any

import numpy as np
import pytest
from dm_driver import Rig, fill, gemm, hdr, nop

from device_model import Va1Config
from hwspec import isa
from hwspec.isa import Activation, DType, EltOp, Opcode, ReduceOp
from hwspec.va1 import NO_OFFSET, Status

MEM = 4 << 20
CFG = Va1Config(device_memory_size=MEM)
SEED = 4242
NPDT = {0: np.dtype("<f4"), 1: np.dtype("<f2")}


def enc(opcode: Opcode, flags: int = 0, **fields: Any) -> bytes:
    """Encode one command from its hwspec layout (unnamed fields are 0)."""
    layout = isa.PAYLOAD[opcode]
    return hdr(opcode, isa.command_length(opcode), flags) + struct.pack(
        layout.format, *(fields.get(n, 0) for n in layout.names))


@pytest.fixture
def rig() -> Rig:
    return Rig(CFG)


def put(rig: Rig, addr: int, arr: np.ndarray) -> None:
    rig.dev.memory.write(addr, np.ascontiguousarray(arr).tobytes())


def get(rig: Rig, addr: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    return np.frombuffer(rig.dev.memory.read(addr, n), dtype=dt).reshape(shape)


def ok(rig: Rig, buf: bytes, fence: int = 1) -> Any:
    cid = rig.create_context()
    r = rig.submit(cid, buf, fence=fence)
    assert (Status(r.status), r.error_offset) == (Status.OK, NO_OFFSET), r
    return r


def close(got: np.ndarray, ref: np.ndarray, dtype: int) -> None:
    """f32: rtol/atol 1e-5; f16: 1 ulp of the f16-rounded reference."""
    if dtype == 0:
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(got.astype(np.float64),
                                   ref.astype(np.float16).astype(np.float64),
                                   rtol=2 ** -10, atol=2 ** -14)


def gelu_ref(x: np.ndarray) -> np.ndarray:
    return np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x.astype(np.float64).ravel()]
                    ).reshape(x.shape)


def act_ref(t: np.ndarray, act: int) -> np.ndarray:
    if act == Activation.RELU:
        return np.maximum(t, 0)
    if act == Activation.GELU:
        return gelu_ref(t)
    if act == Activation.SIGMOID:
        return 1 / (1 + np.exp(-t))
    return t


# --- CONV2D ------------------------------------------------------------------------------

def conv_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: tuple[int, int],
             pads: tuple[int, int, int, int], dil: tuple[int, int], groups: int) -> np.ndarray:
    """Direct convolution, one output pixel at a time (float64)."""
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    pt, pl, pb, pr = pads
    xp = np.zeros((n, c, h + pt + pb, wd + pl + pr))
    xp[:, :, pt:pt + h, pl:pl + wd] = x
    oh = (h + pt + pb - dil[0] * (r - 1) - 1) // stride[0] + 1
    ow = (wd + pl + pr - dil[1] * (s - 1) - 1) // stride[1] + 1
    kg = k // groups
    y = np.zeros((n, k, oh, ow))
    for ni, ki, i, j in itertools.product(range(n), range(k), range(oh), range(ow)):
        g = ki // kg
        win = xp[ni, g * cg:(g + 1) * cg,
                 i * stride[0]:i * stride[0] + dil[0] * (r - 1) + 1:dil[0],
                 j * stride[1]:j * stride[1] + dil[1] * (s - 1) + 1:dil[1]]
        y[ni, ki, i, j] = np.sum(win * w[ki]) + (0 if b is None else b[ki])
    return y


CONV_CASES = [
    # n, c, h, w, k, r, s, stride, pads (t, l, b, r), dilation, groups
    (1, 3, 8, 8, 4, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1),
    (2, 4, 9, 7, 6, 3, 2, (2, 1), (0, 1, 2, 0), (1, 1), 2),
    (1, 4, 10, 10, 4, 3, 3, (1, 2), (2, 2, 2, 2), (2, 2), 4),    # depthwise, dilated
    (2, 6, 7, 9, 3, 1, 1, (2, 3), (0, 0, 0, 0), (1, 1), 3),      # 1x1, grouped
    (1, 2, 5, 6, 5, 5, 3, (1, 1), (4, 2, 0, 1), (1, 2), 1),      # asymmetric padding
    (3, 8, 6, 6, 8, 2, 2, (3, 3), (1, 0, 1, 0), (3, 1), 2),
]


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("dtype", [0, 1])
@pytest.mark.parametrize("with_bias,act", [(False, 0), (True, 1), (True, 2), (False, 3)])
def test_conv2d_vs_direct_reference(rig: Rig, case: tuple, dtype: int,  # type: ignore[type-arg]
                                    with_bias: bool, act: int) -> None:
    n, c, h, w, k, r, s, stride, pads, dil, groups = case
    npdt = NPDT[dtype]
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((n, c, h, w)).astype(npdt)
    wt = rng.standard_normal((k, c // groups, r, s)).astype(npdt)
    b = rng.standard_normal(k).astype(npdt)
    put(rig, 0, x)
    put(rig, 1 << 20, wt)
    put(rig, 2 << 20, b)
    ref = act_ref(conv_ref(x.astype(np.float64), wt.astype(np.float64),
                           b.astype(np.float64) if with_bias else None, stride, pads, dil,
                           groups), act)
    ok(rig, enc(Opcode.CONV2D, isa.CONV_BIAS if with_bias else 0, dtype=dtype,
                activation=act, groups=groups, n=n, c=c, h=h, w=w, k=k, r=r, s=s,
                stride_h=stride[0], stride_w=stride[1], dilation_h=dil[0],
                dilation_w=dil[1], pad_top=pads[0], pad_left=pads[1], pad_bottom=pads[2],
                pad_right=pads[3], x=0, weight=1 << 20, bias=2 << 20, y=3 << 20))
    got = get(rig, 3 << 20, npdt, ref.shape)
    if dtype == 0:
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    else:  # f32 accumulation, one f16 rounding
        np.testing.assert_allclose(got.astype(np.float64),
                                   ref.astype(np.float16).astype(np.float64),
                                   rtol=2 ** -10, atol=2e-3)


@pytest.mark.parametrize("budget", [1, 700, 4096, 1 << 16])
@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("dtype,act", [(0, 1), (1, 2)])
def test_conv2d_blocked_and_tiled_paths(case: tuple, budget: int,  # type: ignore[type-arg]
                                        dtype: int, act: int) -> None:
    """A small memory budget forces several row blocks of the im2col path, or the tiled
    gather path (output channels x pixels x reduction chunks); results stay the same."""
    from device_model.va1.ops import kernels
    n, c, h, w, k, r, s, stride, pads, dil, groups = case
    npdt = NPDT[dtype]
    rng = np.random.default_rng(SEED + budget)
    x = rng.standard_normal((n, c, h, w)).astype(npdt)
    wt = rng.standard_normal((k, c // groups, r, s)).astype(npdt)
    b = rng.standard_normal(k).astype(npdt)
    ref = act_ref(conv_ref(x.astype(np.float64), wt.astype(np.float64),
                           b.astype(np.float64), stride, pads, dil, groups), act)
    y = np.full(ref.shape, np.nan, npdt)
    kernels.conv2d(x, wt, b, y, groups=groups, stride=stride, dilation=dil, pads=pads,
                   activation=act, budget=budget)
    np.testing.assert_allclose(y.astype(np.float64), ref.astype(npdt).astype(np.float64),
                               rtol=1e-5 if dtype == 0 else 2 ** -10,
                               atol=1e-5 if dtype == 0 else 2e-3)


def test_conv2d_huge_padding_and_dilation_stay_small(rig: Rig) -> None:
    """A 1x1 image, dilation 40000 and pads just below the dilated extent: the padded
    image would be ~25 GB; the device gathers columns instead and gives bias only."""
    put(rig, 0, np.array([3.0], np.float32))
    put(rig, 64, np.array([[[[1.0, 2.0], [4.0, 8.0]]]], np.float32))
    put(rig, 128, np.array([0.5], np.float32))
    ok(rig, enc(Opcode.CONV2D, isa.CONV_BIAS, dtype=0, groups=1, n=1, c=1, h=1, w=1, k=1,
                r=2, s=2, stride_h=40000, stride_w=40000, dilation_h=40000,
                dilation_w=40000, pad_top=40000, pad_left=40000, pad_bottom=0, pad_right=0,
                x=0, weight=64, bias=128, y=256))
    # oh = ow = 1: the window's bottom-right tap (weight 8) lands on the one pixel
    np.testing.assert_array_equal(get(rig, 256, "<f4", (1, 1, 1, 1)), [[[[24.5]]]])


def test_conv2d_output_may_alias_input(rig: Rig) -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    put(rig, 0, x)
    put(rig, 4096, np.ones((1, 1, 1, 1), np.float32) * 2)
    ok(rig, enc(Opcode.CONV2D, dtype=0, groups=1, n=1, c=1, h=4, w=4, k=1, r=1, s=1,
                stride_h=1, stride_w=1, dilation_h=1, dilation_w=1, x=0, weight=4096, y=0))
    np.testing.assert_array_equal(get(rig, 0, "<f4", (1, 1, 4, 4)), 2 * x)


# --- SOFTMAX / LAYERNORM / REDUCE ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [0, 1])
@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 33), (64, 128)])
def test_softmax(rig: Rig, dtype: int, rows: int, cols: int) -> None:
    npdt = NPDT[dtype]
    x = (np.random.default_rng(SEED).standard_normal((rows, cols)) * 8).astype(npdt)
    x[0, 0] = 60000 if dtype else 1e30  # numerically stable: no overflow
    put(rig, 0, x)
    ok(rig, enc(Opcode.SOFTMAX, dtype=dtype, rows=rows, cols=cols, x=0, y=0))  # in place
    xd = x.astype(np.float64)
    e = np.exp(xd - xd.max(axis=1, keepdims=True))
    close(get(rig, 0, npdt, (rows, cols)), e / e.sum(axis=1, keepdims=True), dtype)


@pytest.mark.parametrize("dtype", [0, 1])
def test_layernorm(rig: Rig, dtype: int) -> None:
    npdt = NPDT[dtype]
    rng = np.random.default_rng(SEED)
    rows, cols, eps = 9, 48, 1e-5
    x = (rng.standard_normal((rows, cols)) * 3 + 1).astype(npdt)
    gamma = rng.standard_normal(cols).astype(npdt)
    beta = rng.standard_normal(cols).astype(npdt)
    put(rig, 0, x)
    put(rig, 8192, gamma)
    put(rig, 12288, beta)
    ok(rig, enc(Opcode.LAYERNORM, dtype=dtype, rows=rows, cols=cols, epsilon=eps, x=0,
                gamma=8192, beta=12288, y=16384))
    xd = x.astype(np.float64)
    mu = xd.mean(axis=1, keepdims=True)
    ref = (xd - mu) / np.sqrt(((xd - mu) ** 2).mean(axis=1, keepdims=True) + eps)
    ref = ref * gamma.astype(np.float64) + beta.astype(np.float64)
    if dtype == 0:
        np.testing.assert_allclose(get(rig, 16384, npdt, (rows, cols)), ref, rtol=1e-5,
                                   atol=1e-5)
    else:
        close(get(rig, 16384, npdt, (rows, cols)), ref, dtype)


@pytest.mark.parametrize("dtype", [0, 1])
@pytest.mark.parametrize("op", list(ReduceOp))
def test_reduce(rig: Rig, dtype: int, op: ReduceOp) -> None:
    npdt = NPDT[dtype]
    x = np.random.default_rng(SEED + op).standard_normal((11, 37)).astype(npdt)
    put(rig, 0, x)
    ok(rig, enc(Opcode.REDUCE, op=op, dtype=dtype, rows=11, cols=37, x=0, y=4096))
    xd = x.astype(np.float64)
    ref = {ReduceOp.SUM: xd.sum(1), ReduceOp.MAX: xd.max(1), ReduceOp.MEAN: xd.mean(1),
           ReduceOp.MIN: xd.min(1)}[op]
    got = get(rig, 4096, npdt, (11,))
    if dtype == 0:
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    else:  # f16 sums of 37 values near 1 in magnitude: 1 ulp of the result + input noise
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=2 ** -10, atol=2e-3)
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        np.testing.assert_array_equal(got, ref.astype(npdt))  # exact


# --- ELEMENTWISE ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [0, 1])
@pytest.mark.parametrize("op", [EltOp.SUB, EltOp.DIV])
def test_elementwise_sub_div_bit_exact(rig: Rig, op: EltOp, dtype: int) -> None:
    npdt = NPDT[dtype]
    rng = np.random.default_rng(SEED)
    a = rng.standard_normal(500).astype(npdt)
    b = rng.standard_normal(500).astype(npdt)
    put(rig, 0, a)
    put(rig, 4096, b)
    ok(rig, enc(Opcode.ELEMENTWISE, op=op, dtype=dtype, count=500, a=0, b=4096, out=8192))
    ref = a - b if op == EltOp.SUB else a / b
    np.testing.assert_array_equal(get(rig, 8192, npdt, (500,)), ref)


@pytest.mark.parametrize("dtype", [0, 1])
@pytest.mark.parametrize("op", [EltOp.GELU, EltOp.SIGMOID])
def test_elementwise_gelu_sigmoid(rig: Rig, op: EltOp, dtype: int) -> None:
    npdt = NPDT[dtype]
    x = np.concatenate([np.linspace(-12, 12, 4001), [0.0, -0.0, 1e-30, -1e-30, 40, -40,
                                                    np.inf, -np.inf]]).astype(npdt)
    put(rig, 0, x)
    ok(rig, enc(Opcode.ELEMENTWISE, op=op, dtype=dtype, count=x.size, a=0, out=65536))
    got = get(rig, 65536, npdt, (x.size,)).astype(np.float64)
    xd = x.astype(np.float64)
    with np.errstate(over="ignore"):
        if op == EltOp.GELU:
            fin = np.isfinite(xd)
            ref = np.where(fin, 0.0, np.where(xd > 0, np.inf, -0.0))
            ref[fin] = gelu_ref(xd[fin])
        else:
            ref = 1 / (1 + np.exp(-xd))
    if dtype == 0:
        np.testing.assert_allclose(got, ref, rtol=2.5e-7, atol=1e-45)
    else:
        np.testing.assert_array_equal(got, ref.astype(np.float16).astype(np.float64))


@pytest.mark.parametrize("dtype", [0, 1])
@pytest.mark.parametrize("op", [EltOp.ADD, EltOp.MUL, EltOp.SUB, EltOp.DIV])
def test_elementwise_broadcast_row_vector(rig: Rig, op: EltOp, dtype: int) -> None:
    npdt = NPDT[dtype]
    rng = np.random.default_rng(SEED)
    a = rng.standard_normal((6, 10)).astype(npdt)
    b = rng.standard_normal(10).astype(npdt)
    put(rig, 0, a)
    put(rig, 4096, b)
    ok(rig, enc(Opcode.ELEMENTWISE, isa.ELT_BROADCAST_B, op=op, dtype=dtype, cols=10,
                count=60, a=0, b=4096, out=0))
    ref = {EltOp.ADD: a + b, EltOp.MUL: a * b, EltOp.SUB: a - b, EltOp.DIV: a / b}[op]
    np.testing.assert_array_equal(get(rig, 0, npdt, (6, 10)), ref)


# --- GEMM epilogues and int8 ------------------------------------------------------------

@pytest.mark.parametrize("act", [Activation.GELU, Activation.SIGMOID])
@pytest.mark.parametrize("dtype", [0, 1])
def test_gemm_gelu_sigmoid_epilogue(rig: Rig, act: int, dtype: int) -> None:
    npdt = NPDT[dtype]
    rng = np.random.default_rng(SEED)
    A = rng.standard_normal((5, 8)).astype(npdt)
    B = rng.standard_normal((8, 7)).astype(npdt)
    bias = rng.standard_normal(7).astype(npdt)
    put(rig, 0, A)
    put(rig, 4096, B)
    put(rig, 8192, bias)
    ok(rig, gemm(5, 7, 8, 0, 4096, 12288, bias=8192, dtype=dtype, act=act, flags=4))
    ref = act_ref(A.astype(np.float64) @ B.astype(np.float64) + bias.astype(np.float64), act)
    close(get(rig, 12288, npdt, (5, 7)), ref, dtype)


@pytest.mark.parametrize("flags", range(8))
@pytest.mark.parametrize("beta,act", [(0.0, 0), (1.0, 0), (0.0, 1), (1.0, 1)])
def test_gemm_int8_exact(rig: Rig, flags: int, beta: float, act: int) -> None:
    rng = np.random.default_rng(SEED + flags)
    m, n, k = 6, 9, 300
    A = rng.integers(-128, 128, (m, k), dtype=np.int8)
    B = rng.integers(-128, 128, (k, n), dtype=np.int8)
    C0 = rng.integers(-2**20, 2**20, (m, n), dtype=np.int32)
    bias = rng.integers(-2**20, 2**20, n, dtype=np.int32)
    A[0, :] = -128  # the extreme products
    B[:, 0] = -128
    put(rig, 0, A.T if flags & 1 else A)
    put(rig, 8192, B.T if flags & 2 else B)
    put(rig, 16384, C0)
    put(rig, 20480, bias)
    ok(rig, gemm(m, n, k, 0, 8192, 16384, bias=20480, dtype=2, act=act, flags=flags,
                 beta=beta))
    ref = A.astype(np.int64) @ B.astype(np.int64)
    if beta:
        ref += C0
    if flags & 4:
        ref += bias
    if act:
        ref = np.maximum(ref, 0)
    np.testing.assert_array_equal(get(rig, 16384, "<i4", (m, n)), ref.astype(np.int32))


def test_gemm_int8_wraps_modulo_2_32(rig: Rig) -> None:
    put(rig, 0, np.full(1, 2**31 - 1, np.int32))
    put(rig, 64, np.ones(2, np.int8))
    ok(rig, gemm(1, 1, 1, 64, 65, 0, dtype=2, beta=1.0))
    assert get(rig, 0, "<i4", (1,))[0] == -2**31


# --- COPY ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [0, 1, 2, 3])
@pytest.mark.parametrize("perm", list(itertools.permutations(range(4)))[::5])
def test_copy_transpose_4d(rig: Rig, dtype: int, perm: tuple[int, ...]) -> None:
    npdt = np.dtype(isa.DTYPE_NUMPY[DType(dtype)])
    shape = (2, 3, 4, 5)
    x = np.arange(120).reshape(shape).astype(npdt)
    put(rig, 8, x)  # unaligned on purpose
    es = npdt.itemsize
    st = np.array(x.strides) // es
    out_shape = tuple(shape[p] for p in perm)
    dense = np.array(np.empty(out_shape, npdt).strides) // es
    f = {"dtype": dtype, "ndim": 4, "src": 8, "dst": 4099}
    for i in range(4):
        f[f"shape{i}"], f[f"src_stride{i}"], f[f"dst_stride{i}"] = \
            out_shape[i], int(st[perm[i]]), int(dense[i])
    ok(rig, enc(Opcode.COPY, **f))
    np.testing.assert_array_equal(get(rig, 4099, npdt, out_shape), x.transpose(perm))


def test_copy_strided_gather_scatter_and_broadcast(rig: Rig) -> None:
    x = np.arange(64, dtype=np.float32)
    put(rig, 0, x)
    put(rig, 4096, np.full(64, -1, np.float32))
    # src: every 3rd element of rows of 16 (2x4 block), row stride 0 (broadcast) at dim 0
    ok(rig, enc(Opcode.COPY, dtype=0, ndim=3, src=4, dst=4096, shape0=2, shape1=2, shape2=4,
                src_stride0=0, src_stride1=16, src_stride2=3,
                dst_stride0=20, dst_stride1=8, dst_stride2=2))
    got = get(rig, 4096, "<f4", (64,))
    src = np.lib.stride_tricks.as_strided(x[1:], (2, 2, 4), (0, 64, 12))
    exp = np.full(64, -1, np.float32)
    dst = np.lib.stride_tricks.as_strided(exp, (2, 2, 4), (80, 32, 8))
    dst[...] = src
    np.testing.assert_array_equal(got, exp)


def test_copy_overlapping_src_dst_reads_first(rig: Rig) -> None:
    x = np.arange(16, dtype=np.int32)
    put(rig, 0, x)
    ok(rig, enc(Opcode.COPY, dtype=3, ndim=2, src=0, dst=4, shape0=4, shape1=4,
                src_stride0=1, src_stride1=4, dst_stride0=4, dst_stride1=1))  # transpose
    np.testing.assert_array_equal(get(rig, 4, "<i4", (4, 4)), x.reshape(4, 4).T)


# --- QUANTIZE / DEQUANTIZE -------------------------------------------------------------

def quant_ref(x: np.ndarray, scale: float, zp: int) -> np.ndarray:
    """ONNX QuantizeLinear reference (onnx.reference: rint, then + zp, then clip)."""
    q = np.rint(x.astype(np.float32) / np.float32(scale))
    return np.clip(q + zp, -128, 127).astype(np.int8)


@pytest.mark.parametrize("zp", [0, 3, -128, 127])
def test_quantize_round_half_even_and_saturation(rig: Rig, zp: int) -> None:
    halves = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 126.5, -127.5, 0.49999997],
                      np.float32)
    put(rig, 0, halves)
    ok(rig, enc(Opcode.QUANTIZE, dtype=0, int_dtype=2, scale=1.0, zero_point=zp,
                count=halves.size, x=0, y=1024))
    got = get(rig, 1024, "i1", (halves.size,))
    expect = np.array([0, 2, 2, 4, 0, -2, -2, -4, 126, -128, 0]) + zp
    np.testing.assert_array_equal(got, np.clip(expect, -128, 127))
    np.testing.assert_array_equal(got, quant_ref(halves, 1.0, zp))
    sat = np.array([300, -300, 1e30, -1e30, np.inf, -np.inf, np.nan, 127.4, -128.6],
                   np.float32)
    put(rig, 0, sat)
    ok(rig, enc(Opcode.QUANTIZE, dtype=0, int_dtype=2, scale=1.0, zero_point=zp,
                count=sat.size, x=0, y=1024), fence=2)
    got = get(rig, 1024, "i1", (sat.size,))
    assert got[:6].tolist() == [127, -128, 127, -128, 127, -128]
    assert got[6] == zp  # NaN maps to the zero point
    assert got[7:].tolist() == np.clip([127 + zp, -129 + zp], -128, 127).tolist()


@pytest.mark.parametrize("dtype", [0, 1])
def test_quantize_random_vs_onnx_reference(rig: Rig, dtype: int) -> None:
    rng = np.random.default_rng(SEED)
    x = (rng.standard_normal(5000) * 40).astype(NPDT[dtype])
    x[:8] = np.array([0.25, 0.75, -0.25, -0.75, 1.25, 2.75, 100.25, -0.0])  # halves at scale
    put(rig, 0, x)
    ok(rig, enc(Opcode.QUANTIZE, dtype=dtype, int_dtype=2, scale=0.5, zero_point=-7,
                count=x.size, x=0, y=65536))
    np.testing.assert_array_equal(get(rig, 65536, "i1", (x.size,)), quant_ref(x, 0.5, -7))


@pytest.mark.parametrize("dtype,int_dtype,zp", [(0, 2, 5), (1, 2, -128), (0, 3, 0),
                                                (0, 3, -1000)])
def test_dequantize(rig: Rig, dtype: int, int_dtype: int, zp: int) -> None:
    inp = np.dtype(isa.DTYPE_NUMPY[DType(int_dtype)])
    info = np.iinfo(inp)
    x = np.random.default_rng(SEED).integers(info.min, info.max, 777, dtype=inp,
                                             endpoint=True)
    put(rig, 0, x)
    ok(rig, enc(Opcode.DEQUANTIZE, dtype=dtype, int_dtype=int_dtype, scale=0.0625,
                zero_point=zp, count=777, x=0, y=8192))
    ref = ((x.astype(np.int64) - zp).astype(np.float32) * np.float32(0.0625)).astype(
        NPDT[dtype])
    np.testing.assert_array_equal(get(rig, 8192, NPDT[dtype], (777,)), ref)


# --- CALL -----------------------------------------------------------------------------

def test_call_runs_the_callee_in_place(rig: Rig) -> None:
    inner = fill(0, 16, 0x11111111) + enc(Opcode.ELEMENTWISE, op=EltOp.ADD, dtype=0, count=4,
                                           a=0, b=0, out=16)
    inner_addr = rig.put(inner)
    leaf = rig.put(fill(64, 8, 0x22222222))
    mid = rig.put(nop() + enc(Opcode.CALL, addr=leaf, size=32))
    r = ok(rig, fill(0, 64, 0) + enc(Opcode.CALL, addr=inner_addr, size=len(inner))
           + enc(Opcode.CALL, addr=mid, size=32) + fill(72, 4, 0x33333333))
    f = np.frombuffer(struct.pack("<I", 0x11111111), np.float32)[0]
    np.testing.assert_array_equal(get(rig, 16, "<f4", (4,)), [f + f] * 4)
    assert rig.dev.memory.read(64, 12) == b"\x22" * 8 + b"\x33" * 4
    cmds = rig.tracer.kinds("cmd")
    assert [(c["opcode"], c["offset"], c.get("path")) for c in cmds] == [
        ("FILL", 0, None), ("CALL", 32, None), ("FILL", 32, "0"), ("ELEMENTWISE", 32, "32"),
        ("CALL", 56, None), ("NOP", 56, "0"), ("CALL", 56, "8"), ("FILL", 56, "8/0"),
        ("FILL", 80, None)]
    ov = CFG.cmd_overhead_ns
    link = math.ceil(len(inner) * 1e9 / CFG.link_bandwidth)
    assert cmds[1]["end_ns"] - cmds[1]["start_ns"] == ov + link
    assert r.end_ns == cmds[-1]["end_ns"]


def test_call_depth_limit_and_cycles() -> None:
    cfg = Va1Config(device_memory_size=MEM, max_call_depth=3)
    rig = Rig(cfg)
    # a chain of callees: depth 3 is fine, depth 4 fails at the top-level CALL
    leaf = rig.put(fill(0, 4, 7))
    addrs = [leaf]
    for _ in range(4):
        addrs.append(rig.put(enc(Opcode.CALL, addr=addrs[-1], size=32 if len(addrs) == 1
                                 else 24)))
    ok(rig, nop() + enc(Opcode.CALL, addr=addrs[2], size=24))  # depth 3
    assert rig.dev.memory.read(0, 4) == struct.pack("<I", 7)
    rig.dev.memory.write(0, bytes(4))
    cid = rig.create_context()
    r = rig.submit(cid, nop() + enc(Opcode.CALL, addr=addrs[3], size=24), fence=2)
    assert (Status(r.status), r.error_offset) == (Status.CALL_DEPTH, 8)
    assert rig.dev.memory.read(0, 4) == bytes(4)
    # a buffer that calls itself ends at the depth limit too
    me = rig.alloc.alloc(32, 64)
    rig.dma.g_write(me, nop() + enc(Opcode.CALL, addr=me, size=32))
    cid = rig.create_context()
    r = rig.submit(cid, enc(Opcode.CALL, addr=me, size=32), fence=3)
    assert (Status(r.status), r.error_offset) == (Status.CALL_DEPTH, 0)
    bad = rig.tracer.kinds("cmd_invalid")[-1]
    assert "inner offset 8/8/8" in bad["message"]


def test_call_depth_zero_refuses_every_call() -> None:
    rig = Rig(Va1Config(device_memory_size=MEM, max_call_depth=0))
    cid = rig.create_context()
    r = rig.submit(cid, enc(Opcode.CALL, addr=rig.put(nop()), size=8))
    assert (Status(r.status), r.error_offset) == (Status.CALL_DEPTH, 0)


def test_call_expansion_is_bounded() -> None:
    rig = Rig(Va1Config(device_memory_size=MEM, max_cmdbuf_size=4096))
    callee = rig.put(nop(4096))
    call = enc(Opcode.CALL, addr=callee, size=4096)
    cid = rig.create_context()
    r = rig.submit(cid, call * 3)  # 72 + 3 * 4096 <= 4 * 4096
    assert r.status == Status.OK
    cid = rig.create_context()
    r = rig.submit(cid, call * 4, fence=2)  # 96 + 4 * 4096 > 4 * 4096
    assert (Status(r.status), r.error_offset) == (Status.CMDBUF_TOO_LARGE, 72)


def test_call_dma_fault_at_run_time_reports_the_call(rig: Rig) -> None:
    out = rig.alloc.alloc(8)
    inner = rig.put(nop() + enc(Opcode.SIGNAL, addr=out, value=5))
    cid = rig.create_context()
    resp = rig.submit_nowait(cid, gemm(512, 512, 512, 0, 0, 0)
                             + enc(Opcode.CALL, addr=inner, size=32))
    rig.kick()
    rig.dma.holes.append((out, out + 8))
    rig.clock.run()
    assert rig.queues[2].pop_used() is not None
    r = rig.resp(resp)
    assert (Status(r.status), r.error_offset) == (Status.DMA_FAULT, 64)
    assert rig.tracer.kinds("cmd_fault")[-1]["path"] == "8"


# --- timing -----------------------------------------------------------------------------

def test_roofline_of_new_opcodes(rig: Rig) -> None:
    ov, peak, bw = CFG.cmd_overhead_ns, CFG.peak_flops, CFG.mem_bandwidth

    def t(flops: int, peak_: int, nbytes: int) -> int:
        return ov + max(math.ceil(flops * 1e9 / peak_), math.ceil(nbytes * 1e9 / bw))

    conv = enc(Opcode.CONV2D, dtype=0, groups=2, n=2, c=16, h=32, w=32, k=32, r=3, s=3,
               stride_h=1, stride_w=1, dilation_h=1, dilation_w=1, pad_top=1, pad_left=1,
               pad_bottom=1, pad_right=1, x=0, weight=1 << 20, y=2 << 20)
    cases = [
        (conv, t(2 * 2 * 32 * 32 * 32 * 8 * 9, peak,
                 4 * (2 * 16 * 32 * 32 + 32 * 8 * 9 + 2 * 32 * 32 * 32))),
        (enc(Opcode.SOFTMAX, dtype=1, rows=64, cols=1000, x=0, y=0),
         t(5 * 64000, 2 * peak, 2 * 2 * 64000)),
        (enc(Opcode.LAYERNORM, dtype=0, rows=64, cols=1000, x=0, gamma=0, beta=0, y=0),
         t(8 * 64000, peak, 4 * (2 * 64000 + 2 * 1000))),
        (enc(Opcode.REDUCE, dtype=0, rows=64, cols=1000, x=0, y=0),
         t(64000, peak, 4 * (64000 + 64))),
        (enc(Opcode.QUANTIZE, dtype=0, int_dtype=2, scale=1.0, count=10**5, x=0, y=0),
         t(2 * 10**5, peak, 5 * 10**5)),
        (gemm(256, 256, 256, 0, 0, 0, dtype=2), t(2 * 256**3, 4 * peak,
                                                   2 * 256 * 256 + 4 * 256 * 256)),
        (enc(Opcode.COPY, dtype=0, ndim=2, shape0=100, shape1=100, src_stride0=1,
             src_stride1=100, dst_stride0=100, dst_stride1=1, src=0, dst=1 << 20),
         ov + math.ceil(2 * 4 * 10**4 * 1e9 / bw)),
        (enc(Opcode.ELEMENTWISE, isa.ELT_BROADCAST_B, op=0, dtype=0, cols=100, count=10**5,
             a=0, b=0, out=1 << 20), t(10**5, peak, 4 * (2 * 10**5 + 100))),
    ]
    for i, (buf, expect) in enumerate(cases):
        cid = rig.create_context()
        r = rig.submit(cid, buf, fence=i + 1)
        assert r.status == 0, (i, r)
        assert r.end_ns - r.start_ns == expect, i


# --- QUANTIZE_DYNAMIC / DEQUANTIZE_DYNAMIC -----------------------------------------------

def qparams_ref(x: np.ndarray) -> tuple[float, int]:
    """The spec's run-time qparams: the finite range widened to hold 0 on 256 codes."""
    fin = x[np.isfinite(x)].astype(np.float64)
    lo, hi = min(float(fin.min(initial=0.0)), 0.0), max(float(fin.max(initial=0.0)), 0.0)
    scale = float(np.float32((hi - lo) / 255.0))
    if scale == 0.0:
        return 1.0, 0
    return scale, int(np.clip(np.rint(-128.0 - lo / scale), -128, 127))


@pytest.mark.parametrize("dtype,case", list(itertools.product(
    [0, 1], ["normal", "relu", "negative", "special", "zeros"])))
def test_quantize_dynamic_takes_the_range_at_run_time(rig: Rig, dtype: int, case: str) -> None:
    rng = np.random.default_rng(SEED)
    x = (rng.standard_normal(3000) * 7).astype(NPDT[dtype])
    if case == "relu":
        x = np.maximum(x, 0)
    elif case == "negative":
        x = -np.abs(x) - 1
    elif case == "special":
        x[[3, 50, 999]] = [np.nan, np.inf, -np.inf]
    elif case == "zeros":
        x[:] = 0
    put(rig, 0, x)
    put(rig, 65536, np.zeros(2, np.int32))
    ok(rig, enc(Opcode.QUANTIZE_DYNAMIC, dtype=dtype, int_dtype=2, count=x.size, x=0,
                y=32768, qparams=65536))
    scale, zp = struct.unpack("<fi", rig.dev.memory.read(65536, 8))
    assert (scale, zp) == qparams_ref(x)
    got = get(rig, 32768, "i1", (x.size,))
    fin = np.isfinite(x)
    np.testing.assert_array_equal(got[fin], quant_ref(x[fin], scale, zp))
    if case == "special":  # NaN and inf are left out of the range: NaN -> zp, inf saturate
        assert got[[3, 50, 999]].tolist() == [zp, 127, -128]
    if case == "normal":   # every code of the range is used, both ends reached
        assert got.min() == -128 and got.max() == 127
    if case == "relu":     # 0 is exact: the zero point is -128
        assert zp == -128 and got[x == 0].tolist() == [-128] * int((x == 0).sum())
    if case == "zeros":
        assert (scale, zp) == (1.0, 0) and not got.any()


@pytest.mark.parametrize("budget", [1, 4096, 1 << 24])
def test_quantize_dynamic_in_tiles_matches_one_piece(budget: int) -> None:
    """A budget too small for x in one piece: the range is still over all of x."""
    from device_model.va1.ops import kernels
    x = np.random.default_rng(SEED).standard_normal(5000).astype(np.float32)
    x[4000] = 30.0                        # the peak, in a late tile
    y, rec = np.zeros(x.size, np.int8), np.zeros(8, np.uint8)
    kernels.quantize_dynamic(x, y, rec, budget=budget)
    scale, zp = struct.unpack("<fi", rec.tobytes())
    assert (scale, zp) == qparams_ref(x)
    np.testing.assert_array_equal(y, quant_ref(x, scale, zp))


def dequant_dynamic_ref(acc: np.ndarray, scale: float, zp: int, ws: np.ndarray,
                        wsum: np.ndarray, bias: np.ndarray | None, relu: bool) -> np.ndarray:
    t = (acc.astype(np.int64) - np.int64(zp) * wsum.astype(np.int64)[:, None]).astype(
        np.float32)
    t *= (np.float32(scale) * ws)[:, None]
    if bias is not None:
        t += bias[:, None]
    return np.maximum(t, np.float32(0)) if relu else t


@pytest.mark.parametrize("dtype,flags,act", [(0, isa.DQD_BIAS, Activation.RELU),
                                             (0, 0, Activation.NONE),
                                             (1, isa.DQD_BIAS, Activation.NONE)])
def test_dequantize_dynamic_reads_the_record_and_the_channel_vectors(
        rig: Rig, dtype: int, flags: int, act: int) -> None:
    rng = np.random.default_rng(SEED)
    outer, ch, inner = 3, 5, 7
    lim = 2**31 if dtype == 0 else 2**20      # f16 results stay finite
    acc = rng.integers(-lim, lim, (outer, ch, inner), dtype=np.int64).astype(np.int32)
    ws = rng.uniform(1e-3, 1e-1, ch).astype(np.float32)
    wsum = rng.integers(-5000, 5000, ch).astype(np.int32)
    bias = rng.standard_normal(ch).astype(np.float32)
    put(rig, 0, acc)
    put(rig, 8192, np.frombuffer(struct.pack("<fi", 0.0421, -97), np.uint8))
    put(rig, 8200, ws)
    put(rig, 8300, wsum)
    put(rig, 8400, bias)
    ok(rig, enc(Opcode.DEQUANTIZE_DYNAMIC, flags, dtype=dtype, activation=act, channels=ch,
                inner=inner, count=acc.size, x=0, y=16384, qparams=8192, wscale=8200,
                wsum=8300, bias=8400))
    ref = np.stack([dequant_dynamic_ref(a, 0.0421, -97, ws, wsum,
                                        bias if flags else None, act == Activation.RELU)
                    for a in acc]).astype(NPDT[dtype])
    np.testing.assert_array_equal(get(rig, 16384, NPDT[dtype], acc.shape), ref)


def test_dequantize_dynamic_in_place(rig: Rig) -> None:
    """y over x (I32 -> F32, the same bytes): the sums are read before y is written."""
    rng = np.random.default_rng(SEED)
    acc = rng.integers(-10**6, 10**6, (2, 6, 100)).astype(np.int32)
    ws = rng.uniform(0.5, 2, 6).astype(np.float32)
    wsum = rng.integers(-99, 99, 6).astype(np.int32)
    put(rig, 0, acc)
    put(rig, 32768, np.frombuffer(struct.pack("<fi", 0.01, 3), np.uint8))
    put(rig, 32776, ws)
    put(rig, 32800, wsum)
    ok(rig, enc(Opcode.DEQUANTIZE_DYNAMIC, dtype=0, channels=6, inner=100, count=acc.size,
                x=0, y=0, qparams=32768, wscale=32776, wsum=32800))
    ref = np.stack([dequant_dynamic_ref(a, 0.01, 3, ws, wsum, None, False) for a in acc])
    np.testing.assert_array_equal(get(rig, 0, "<f4", acc.shape), ref)


@pytest.mark.parametrize("budget", [1, 700, 1 << 24])
def test_dequantize_dynamic_in_tiles(budget: int) -> None:
    """Whole rows, channel blocks of one row, pieces of one channel: the same bits."""
    from device_model.va1.ops import kernels
    rng = np.random.default_rng(SEED)
    acc = rng.integers(-10**6, 10**6, (2, 6, 100)).astype(np.int32)
    ws = rng.uniform(0.5, 2, 6).astype(np.float32)
    wsum = rng.integers(-99, 99, 6).astype(np.int32)
    bias = rng.standard_normal(6).astype(np.float32)
    rec = np.frombuffer(struct.pack("<fi", 0.01, -3), np.uint8)
    y = np.full(acc.shape, np.nan, np.float32)
    kernels.dequantize_dynamic(acc, rec, ws, wsum, bias, y, relu=True, budget=budget)
    ref = np.stack([dequant_dynamic_ref(a, 0.01, -3, ws, wsum, bias, True) for a in acc])
    np.testing.assert_array_equal(y, ref)


def test_dynamic_quant_roofline_times(rig: Rig) -> None:
    """QUANTIZE_DYNAMIC reads x twice (range, then codes); DEQUANTIZE_DYNAMIC reads the
    sums, the record and the channel vectors once."""
    ov, peak, bw = CFG.cmd_overhead_ns, CFG.peak_flops, CFG.mem_bandwidth

    def t(flops: int, nbytes: int) -> int:
        return ov + max(-(-flops * 10**9 // peak), -(-nbytes * 10**9 // bw))

    count = 1 << 16
    r = ok(rig, enc(Opcode.QUANTIZE_DYNAMIC, dtype=0, int_dtype=2, count=count, x=0,
                    y=1 << 20, qparams=2 << 20))
    assert r.end_ns - r.start_ns == t(3 * count, 2 * 4 * count + count + 8)
    r = ok(rig, enc(Opcode.DEQUANTIZE_DYNAMIC, isa.DQD_BIAS, dtype=0, channels=64,
                    inner=count // 64, count=count, x=0, y=1 << 20, qparams=2 << 20,
                    wscale=3 << 20, wsum=3 << 20, bias=3 << 20), fence=2)
    assert r.end_ns - r.start_ns == t(3 * count, 8 * count + 8 + 3 * 4 * 64)
