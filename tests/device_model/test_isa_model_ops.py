"""The ISA additions real models need (spec §7) against numpy: POOL2D (max / average,
padding, dilation, ceil mode, count_include_pad), GATHER (embedding lookup), the
ELEMENTWISE ops MAX, MIN, POW, ERF, SQRT, TANH, EXP, NEG, RECIPROCAL, SILU, ABS, LOG,
the SILU epilogue, and their roofline times.

Tolerances as in test_isa_ops: f32 within 1e-5 of a float64 reference (ERF and SILU
within 2.5e-7 relative: the erfc fit plus one rounding), f16 within one f16 ulp."""
from __future__ import annotations

import itertools
import math
import numpy as np
import pytest
from dm_driver import Rig
from test_isa_ops import CFG, NPDT, SEED, close, enc, get, ok, put

from hwspec import isa
from hwspec.isa import Activation, EltOp, Opcode, PoolOp


@pytest.fixture
def rig() -> Rig:
    return Rig(CFG)


def pool_ref(x: np.ndarray, op: int, k: tuple[int, int], st: tuple[int, int],
             pads: tuple[int, int, int, int], dil: tuple[int, int], ceil: bool,
             include_pad: bool) -> np.ndarray:
    """One window at a time, in float64 (PyTorch's and ONNX's semantics)."""
    n, c, h, w = x.shape
    pt, pl, pb, pr = pads

    def extent(size: int, kk: int, s: int, d: int, lo: int, hi: int) -> int:
        span = size + lo + hi - (d * (kk - 1) + 1)
        o = (-(-span // s) if ceil else span // s) + 1
        return o - 1 if ceil and (o - 1) * s >= size + lo else o

    oh, ow = extent(h, k[0], st[0], dil[0], pt, pb), extent(w, k[1], st[1], dil[1], pl, pr)
    y = np.zeros((n, c, oh, ow))
    for i, j in itertools.product(range(oh), range(ow)):
        taps = [(i * st[0] - pt + a * dil[0], j * st[1] - pl + b * dil[1])
                for a in range(k[0]) for b in range(k[1])]
        inside = [(u, v) for u, v in taps if 0 <= u < h and 0 <= v < w]
        vals = np.stack([x[:, :, u, v] for u, v in inside], -1).astype(np.float64)
        if op == PoolOp.MAX:
            y[:, :, i, j] = vals.max(-1)
        else:
            padded = [(u, v) for u, v in taps if -pt <= u < h + pb and -pl <= v < w + pr]
            y[:, :, i, j] = vals.sum(-1) / (len(padded) if include_pad else len(inside))
    return y


POOL_CASES = [
    # n, c, h, w, kernel, stride, pads (t, l, b, r), dilation, ceil
    (1, 3, 8, 8, (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), False),
    (2, 4, 9, 7, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False),    # ResNet's stem pool
    (1, 2, 13, 13, (3, 3), (2, 2), (0, 0, 0, 0), (1, 1), True),   # SqueezeNet (ceil_mode)
    (1, 2, 10, 9, (3, 2), (1, 2), (2, 0, 1, 1), (2, 1), True),
    (2, 3, 6, 6, (1, 1), (3, 3), (0, 0, 0, 0), (1, 1), False),
]


@pytest.mark.parametrize("case", POOL_CASES)
@pytest.mark.parametrize("op,include", [(PoolOp.MAX, False), (PoolOp.AVG, False),
                                        (PoolOp.AVG, True)])
@pytest.mark.parametrize("dtype", [0, 1])
def test_pool2d_vs_window_reference(rig: Rig, case: tuple, op: PoolOp,  # type: ignore[type-arg]
                                    include: bool, dtype: int) -> None:
    n, c, h, w, k, st, pads, dil, ceil = case
    x = np.random.default_rng(SEED).standard_normal((n, c, h, w)).astype(NPDT[dtype])
    ref = pool_ref(x, op, k, st, pads, dil, ceil, include)
    put(rig, 0, x)
    flags = (isa.POOL_CEIL if ceil else 0) | (isa.POOL_COUNT_INCLUDE_PAD if include else 0)
    ok(rig, enc(Opcode.POOL2D, flags, dtype=dtype, op=op, n=n, c=c, h=h, w=w, r=k[0],
                s=k[1], stride_h=st[0], stride_w=st[1], dilation_h=dil[0], dilation_w=dil[1],
                pad_top=pads[0], pad_left=pads[1], pad_bottom=pads[2], pad_right=pads[3],
                x=0, y=1 << 20))
    close(get(rig, 1 << 20, NPDT[dtype], ref.shape), ref, dtype)


def test_gather_rows_negative_and_out_of_range_indices(rig: Rig) -> None:
    table = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    idx = np.array([0, 4, -1, -5, 5, -6, 2, 2**31 - 1], np.int32)
    put(rig, 0, table)
    put(rig, 4096, idx)
    ok(rig, enc(Opcode.GATHER, dtype=0, rows=5, cols=3, count=idx.size, table=0,
                indices=4096, out=8192))
    want = np.stack([table[0], table[4], table[4], table[0], np.zeros(3), np.zeros(3),
                     table[2], np.zeros(3)])
    np.testing.assert_array_equal(get(rig, 8192, np.float32, (idx.size, 3)), want)


@pytest.mark.parametrize("dtype", [2, 3])
def test_gather_moves_any_dtype_bit_exactly(rig: Rig, dtype: int) -> None:
    npdt = np.dtype(isa.DTYPE_NUMPY[isa.DType(dtype)])
    table = np.random.default_rng(SEED).integers(-100, 100, (7, 4)).astype(npdt)
    idx = np.array([6, 0, 3], np.int32)
    put(rig, 0, table)
    put(rig, 4096, idx)
    ok(rig, enc(Opcode.GATHER, dtype=dtype, rows=7, cols=4, count=3, table=0, indices=4096,
                out=8192))
    np.testing.assert_array_equal(get(rig, 8192, npdt, (3, 4)), table[idx])


UNARY = {EltOp.SQRT: np.sqrt, EltOp.TANH: np.tanh, EltOp.EXP: np.exp, EltOp.NEG: np.negative,
         EltOp.RECIPROCAL: np.reciprocal, EltOp.ABS: np.abs, EltOp.LOG: np.log,
         EltOp.ERF: np.vectorize(math.erf),
         EltOp.SILU: lambda v: v / (1 + np.exp(-v))}


@pytest.mark.parametrize("dtype", [0, 1])
@pytest.mark.parametrize("op", list(UNARY), ids=lambda o: o.name)
def test_unary_elementwise_ops(rig: Rig, op: EltOp, dtype: int) -> None:
    npdt = NPDT[dtype]
    x = np.random.default_rng(SEED).uniform(-4, 4, 777).astype(npdt)
    if op in (EltOp.SQRT, EltOp.LOG):
        x = np.abs(x) + npdt.type(0.01)
    if op == EltOp.RECIPROCAL:
        x = np.where(np.abs(x) < 0.1, npdt.type(0.5), x).astype(npdt)
    put(rig, 0, x)
    ok(rig, enc(Opcode.ELEMENTWISE, op=op, dtype=dtype, count=x.size, a=0, out=1 << 16))
    got = get(rig, 1 << 16, npdt, x.shape)
    with np.errstate(over="ignore"):
        ref = UNARY[op](x.astype(np.float64))
    if dtype == 0 and op in (EltOp.ERF, EltOp.SILU):
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=2.5e-7, atol=1e-7)
    else:
        close(got, ref, dtype)


@pytest.mark.parametrize("dtype", [0, 1])
@pytest.mark.parametrize("op", [EltOp.MAX, EltOp.MIN, EltOp.POW], ids=lambda o: o.name)
@pytest.mark.parametrize("bcast", [False, True])
def test_binary_max_min_pow(rig: Rig, op: EltOp, dtype: int, bcast: bool) -> None:
    npdt = NPDT[dtype]
    rng = np.random.default_rng(SEED)
    a = rng.uniform(0.1, 3, (20, 8)).astype(npdt)
    b = rng.uniform(-2, 2, (8,) if bcast else (20, 8)).astype(npdt)
    put(rig, 0, a)
    put(rig, 4096, b)
    ok(rig, enc(Opcode.ELEMENTWISE, isa.ELT_BROADCAST_B if bcast else 0, op=op, dtype=dtype,
                cols=8 if bcast else 0, count=a.size, a=0, b=4096, out=8192))
    fn = {EltOp.MAX: np.maximum, EltOp.MIN: np.minimum, EltOp.POW: np.power}[op]
    close(get(rig, 8192, npdt, a.shape), fn(a.astype(np.float64), b.astype(np.float64)),
          dtype)


def test_max_min_propagate_nan(rig: Rig) -> None:
    a = np.array([np.nan, 1.0, -np.inf], np.float32)
    b = np.array([0.0, np.nan, 2.0], np.float32)
    put(rig, 0, a)
    put(rig, 4096, b)
    ok(rig, enc(Opcode.ELEMENTWISE, op=EltOp.MAX, dtype=0, count=3, a=0, b=4096, out=8192))
    got = get(rig, 8192, np.float32, (3,))
    assert np.isnan(got[0]) and np.isnan(got[1]) and got[2] == 2.0


def test_silu_epilogue_of_gemm_and_conv(rig: Rig) -> None:
    rng = np.random.default_rng(SEED)
    a, b = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((6, 7)).astype(
        np.float32)
    put(rig, 0, a)
    put(rig, 4096, b)
    ok(rig, enc(Opcode.GEMM, dtype=0, activation=Activation.SILU, m=5, n=7, k=6, a=0, b=4096,
                c=8192, alpha=1.0, beta=0.0))
    t = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(get(rig, 8192, np.float32, (5, 7)), t / (1 + np.exp(-t)),
                               rtol=1e-5, atol=1e-6)


def test_roofline_of_pool2d_and_gather(rig: Rig) -> None:
    ov, peak, bw = CFG.cmd_overhead_ns, CFG.peak_flops, CFG.mem_bandwidth

    def t(flops: int, nbytes: int) -> int:
        return ov + max(math.ceil(flops * 1e9 / peak), math.ceil(nbytes * 1e9 / bw))

    cases: list[tuple[bytes, int]] = [
        (enc(Opcode.POOL2D, dtype=0, op=0, n=2, c=8, h=32, w=32, r=3, s=3, stride_h=2,
             stride_w=2, dilation_h=1, dilation_w=1, pad_top=1, pad_left=1, pad_bottom=1,
             pad_right=1, x=0, y=1 << 20),
         t(2 * 8 * 16 * 16 * 9, 4 * (2 * 8 * 32 * 32 + 2 * 8 * 16 * 16))),
        (enc(Opcode.GATHER, dtype=0, rows=1000, cols=64, count=128, table=0, indices=1 << 20,
             out=2 << 20), t(0, 2 * 128 * 64 * 4 + 128 * 4)),
        (enc(Opcode.ELEMENTWISE, op=EltOp.ERF, dtype=0, count=10**5, a=0, out=1 << 20),
         t(10**5, 8 * 10**5)),
    ]
    for i, (buf, expect) in enumerate(cases):
        cid = rig.create_context()
        r = rig.submit(cid, buf, fence=i + 1)
        assert r.status == 0, (i, r)
        assert r.end_ns - r.start_ns == expect, i
