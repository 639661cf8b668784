"""VA-1 op kernels: GEMM (float and int8, batched), ELEMENTWISE, COMPARE, SELECT, CONV2D (im2col + matmul),
SOFTMAX, LAYERNORM, REDUCE, QUANTIZE, DEQUANTIZE (static and dynamic), strided COPY and the D2D move.

Inputs are zero-copy views of device memory. Every kernel takes `budget`: the host bytes
its temporaries may use (spec §7, "Work bounds": the function's work_memory_size less
what was staged). A kernel whose whole problem fits the budget computes it in one piece;
otherwise it tiles over independent outputs (rows, pixels, output channels) and, when
even one output needs more, over the reduction. Tiling over outputs gives the same bits;
a split reduction rounds in another order.

Tiles write their outputs as they go, so an input must not overlap the output except in
place (the same view, each output read only by itself): the validator copies the other
overlapping inputs first (`staged`), which is what makes "reads all inputs before it
writes" hold.
"""
from __future__ import annotations

import struct
from typing import Any, Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from hwspec.isa import Activation, CmpOp, EltOp, ReduceOp

from .activations import apply_activation, erf, gelu64, sigmoid64, silu64

_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")

# Temporary bytes per element of the pointwise functions and epilogues (GELU and
# SIGMOID go through a dozen-odd f64 arrays); they size the tiles.
_ACT_BYTES: dict[int, int] = {Activation.NONE: 0, Activation.RELU: 0, Activation.GELU: 160,
                              Activation.SIGMOID: 112, Activation.SILU: 128}
_ELT_ACT = {EltOp.GELU: (gelu64, 160), EltOp.SIGMOID: (sigmoid64, 112),
            EltOp.SILU: (silu64, 128), EltOp.ERF: (erf, 160)}


def staged(kernel: Callable[..., None], operands: dict[str, Any], snapshot: tuple[str, ...],
           budget: int, **kw: Any) -> None:
    """Run `kernel` on `operands` after copying the named ones: inputs that overlap the
    output other than in place, so that tiles never read what an earlier tile wrote."""
    ops = dict(operands)
    for name in snapshot:
        ops[name] = np.array(ops[name])
    kernel(**ops, budget=budget, **kw)


def _chunks(total: int, step: int) -> range:
    return range(0, total, max(1, step))


# --- GEMM ------------------------------------------------------------------------------

def _gemm_tiles(m: int, n: int, k: int, budget: int, a_es: int, b_es: int,
                out_es: int) -> tuple[int, int, int]:
    """(mb, nb, kb): a tile whose A (mb x kb, `a_es` temporary bytes an element), B
    (kb x nb) and output (mb x nb) temporaries fit `budget`; the whole problem if it fits."""
    if m * k * a_es + k * n * b_es + m * n * out_es <= budget:
        return m, n, k
    q = max(1, budget // 3)
    kb = min(k, max(1, q // max(a_es, b_es, 1)))
    nb = min(n, max(1, q // max(kb * b_es, out_es)))
    mb = min(m, max(1, q // max(kb * a_es, 1)), max(1, q // (nb * out_es)))
    return mb, nb, kb


def gemm(a: np.ndarray, b: np.ndarray, c: np.ndarray, bias: np.ndarray | None, *,
         alpha: float, beta: float, activation: int, budget: int) -> None:
    """C = act(alpha * A @ B + beta * C + bias) in f32, rounded once to C's dtype."""
    f32 = a.dtype == _F32 and a.flags.aligned and b.flags.aligned and c.flags.aligned
    if (f32 and alpha == 1.0 and beta == 0.0
            and activation in (Activation.NONE, Activation.RELU)
            and not np.may_share_memory(c, a) and not np.may_share_memory(c, b)
            and (bias is None or (bias.dtype == _F32 and not np.may_share_memory(bias, c)))):
        # Fast path: BLAS writes straight into device memory; the epilogue (bias, ReLU)
        # runs in place on it. Same f32 operations in the same order as the tiles below.
        np.matmul(a, b, out=c)
        if bias is not None:
            np.add(c, bias, out=c)
        if activation == Activation.RELU:
            np.maximum(c, 0, out=c)
        return
    m, k = a.shape
    n = b.shape[1]
    conv = 0 if f32 else 4
    mb, nb, kb = _gemm_tiles(m, n, k, budget, conv, conv, 16 + _ACT_BYTES[activation])
    for n0 in _chunks(n, nb):
        for m0 in _chunks(m, mb):
            _gemm_tile(a[m0:m0 + mb], b[:, n0:n0 + nb], c[m0:m0 + mb, n0:n0 + nb],
                       None if bias is None else bias[n0:n0 + nb], kb, bool(conv),
                       alpha, beta, activation)


def _f32_product(a: np.ndarray, b: np.ndarray, conv: bool) -> np.ndarray:
    """A @ B in f32 (a function: the converted blocks are gone when it returns)."""
    p: np.ndarray = np.matmul(a.astype(_F32), b.astype(_F32)) if conv else np.matmul(a, b)
    return p


def _gemm_tile(a: np.ndarray, b: np.ndarray, c: np.ndarray, bias: np.ndarray | None,
               kb: int, conv: bool, alpha: float, beta: float, activation: int) -> None:
    """One output tile (a function, so that its temporaries are gone when it returns)."""
    k = a.shape[1]
    t = _f32_product(a[:, :kb], b[:kb], conv)
    for k0 in range(kb, k, kb):
        t += _f32_product(a[:, k0:k0 + kb], b[k0:k0 + kb], conv)
    if alpha != 1.0:
        t *= np.float32(alpha)
    if beta != 0.0:
        t += np.float32(beta) * c.astype(_F32)
    if bias is not None:
        t += bias.astype(_F32)
    np.copyto(c, apply_activation(t, activation), casting="unsafe")


def gemm_i8(a: np.ndarray, b: np.ndarray, c: np.ndarray, bias: np.ndarray | None, *,
            accumulate: bool, relu: bool, budget: int) -> None:
    """C(i32) = [relu](A(i8) @ B(i8) [+ C] [+ bias]) exactly, wrapped to 32 bits.

    Products sum to at most k * 2^14 < 2^46, exact in float64, so BLAS does the work;
    a split k sums its exact partial results in int64."""
    m, k = a.shape
    n = b.shape[1]
    mb, nb, kb = _gemm_tiles(m, n, k, budget, 8, 8, 40)
    for n0 in _chunks(n, nb):
        for m0 in _chunks(m, mb):
            _gemm_i8_tile(a[m0:m0 + mb], b[:, n0:n0 + nb], c[m0:m0 + mb, n0:n0 + nb],
                          None if bias is None else bias[n0:n0 + nb], kb, accumulate, relu)


def _i64_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    p: np.ndarray = np.matmul(a.astype(_F64), b.astype(_F64)).astype(np.int64)
    return p


def _gemm_i8_tile(a: np.ndarray, b: np.ndarray, c: np.ndarray, bias: np.ndarray | None,
                  kb: int, accumulate: bool, relu: bool) -> None:
    k = a.shape[1]
    t = _i64_product(a[:, :kb], b[:kb])
    for k0 in range(kb, k, kb):
        t += _i64_product(a[:, k0:k0 + kb], b[k0:k0 + kb])
    if accumulate:
        t += c
    if bias is not None:
        t += bias
    t32 = t.astype(np.int32)  # two's complement wrap (astype of int64 to int32 wraps)
    del t
    if relu:
        np.maximum(t32, 0, out=t32)
    np.copyto(c, t32)


def gemm_batched(a: np.ndarray, b: np.ndarray, c: np.ndarray, bias: np.ndarray | None, *,
                 alpha: float, beta: float, activation: int, budget: int) -> None:
    """GEMM_BATCHED: a [batch, m, k], b [batch, k, n], c [batch, m, n] (strided views);
    each batch is exactly one GEMM (the same kernels, tiles and bits), one after the
    other, each within the whole budget (batch is at most 65535: spec)."""
    i8 = a.dtype == np.int8
    for i in range(a.shape[0]):
        if i8:
            gemm_i8(a[i], b[i], c[i], bias, accumulate=beta == 1.0,
                    relu=activation == Activation.RELU, budget=budget)
        else:
            gemm(a[i], b[i], c[i], bias, alpha=alpha, beta=beta, activation=activation,
                 budget=budget)


# --- pointwise ---------------------------------------------------------------------------

_BINARY = {EltOp.ADD: np.add, EltOp.MUL: np.multiply, EltOp.SUB: np.subtract,
           EltOp.DIV: np.divide, EltOp.MAX: np.maximum, EltOp.MIN: np.minimum}
# Unary ops done by one f32 numpy ufunc (f16 operands widened, rounded once).
_UNARY_F32 = {EltOp.SQRT: np.sqrt, EltOp.TANH: np.tanh, EltOp.EXP: np.exp,
              EltOp.NEG: np.negative, EltOp.RECIPROCAL: np.reciprocal, EltOp.ABS: np.abs,
              EltOp.LOG: np.log}


def elementwise(a: np.ndarray, b: np.ndarray | None, out: np.ndarray, *, op: int,
                budget: int) -> None:
    """One numpy ufunc per command (no temporaries); f16 binary ops round once (numpy
    computes them in f32). GELU, SIGMOID, SILU and ERF go through f64 in chunks and round
    once; POW and the other unary functions run in f32 (f16 in chunks, rounded once)."""
    if op == EltOp.RELU:
        np.maximum(a, a.dtype.type(0), out=out)
    elif op in _ELT_ACT:
        fn, per = _ELT_ACT[EltOp(op)]
        fa, fo = a.reshape(-1), out.reshape(-1)
        step = max(1, budget // per)
        for i in _chunks(fa.size, step):
            np.copyto(fo[i:i + step], fn(fa[i:i + step]), casting="unsafe")
    elif op in _UNARY_F32 or op == EltOp.POW:
        _f32_pointwise(EltOp(op), a, b, out, budget)
    else:
        assert b is not None
        _BINARY[EltOp(op)](a, b, out=out)  # b of shape [cols] broadcasts over rows


def _f32_pointwise(op: EltOp, a: np.ndarray, b: np.ndarray | None, out: np.ndarray,
                   budget: int) -> None:
    """Unary functions and POW in f32: straight into `out` for f32, in chunks through
    f32 temporaries for f16."""
    if a.dtype == _F32:
        if op == EltOp.POW:
            assert b is not None
            np.power(a, b, out=out)
        else:
            _UNARY_F32[op](a, out=out)
        return
    rows = a if a.ndim > 1 else a.reshape(-1, 1)      # [rows, cols] with BROADCAST_B
    orows = out.reshape(rows.shape)
    brows = None if b is None else (b if a.ndim > 1 else b.reshape(-1, 1))
    step = max(1, budget // (12 * rows.shape[1]))
    for i in _chunks(rows.shape[0], step):
        x = rows[i:i + step].astype(_F32)
        if op == EltOp.POW:
            assert brows is not None
            y = np.power(x, (brows if brows.ndim == 1 else brows[i:i + step]).astype(_F32))
        else:
            y = _UNARY_F32[op](x)
        np.copyto(orows[i:i + step], y, casting="unsafe")


_CMP = {CmpOp.EQUAL: np.equal, CmpOp.LESS: np.less, CmpOp.GREATER: np.greater,
        CmpOp.LESS_EQUAL: np.less_equal, CmpOp.GREATER_EQUAL: np.greater_equal,
        CmpOp.AND: np.logical_and, CmpOp.OR: np.logical_or, CmpOp.XOR: np.logical_xor}


def compare(a: np.ndarray, b: np.ndarray | None, out: np.ndarray, *, op: int,
            budget: int) -> None:
    """out (I8) = 1 where `a op b` holds, else 0: one numpy ufunc writing its bool
    result straight into the mask's bytes (no temporaries; NaN compares false, and is
    true for the logic ops, as any nonzero)."""
    mask = out.view(np.bool_)
    if op == CmpOp.NOT:
        np.logical_not(a, out=mask)
    else:
        assert b is not None
        _CMP[CmpOp(op)](a, b, out=mask)   # b of shape [cols] broadcasts over rows


def select(cond: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, *,
           budget: int) -> None:
    """out = a where cond != 0, else b, in chunks (each read whole before it is
    written, so out may be any of the inputs in place); the bytes are moved as they
    are (NaN and inf too)."""
    step = max(1, budget // (2 * out.itemsize + 2))
    for i in _chunks(out.size, step):
        t = np.where(cond[i:i + step] != 0, a[i:i + step], b[i:i + step])
        out[i:i + step] = t


def quantize(x: np.ndarray, y: np.ndarray, *, scale: float, zero_point: int,
             budget: int) -> None:
    """ONNX QuantizeLinear: saturate(rint(x / scale) + zp) to int8; rint is half-to-even.
    NaN maps to zp, +-inf saturate."""
    step = max(1, budget // 16)
    for i in _chunks(x.size, step):
        _quantize(x[i:i + step], y[i:i + step], scale, zero_point)


def _quantize(x: np.ndarray, y: np.ndarray, scale: float, zero_point: int) -> None:
    t = x.astype(_F32) / np.float32(scale)
    np.rint(t, out=t)
    np.nan_to_num(t, copy=False, nan=0.0)
    t += np.float32(zero_point)
    np.clip(t, -128, 127, out=t)
    np.copyto(y, t, casting="unsafe")


def dequantize(x: np.ndarray, y: np.ndarray, *, scale: float, zero_point: int,
               budget: int) -> None:
    """ONNX DequantizeLinear: (x - zp) * scale; x - zp exact (int64), then f32."""
    step = max(1, budget // 32)
    for i in _chunks(x.size, step):
        _dequantize(x[i:i + step], y[i:i + step], scale, zero_point)


def _dequantize(x: np.ndarray, y: np.ndarray, scale: float, zero_point: int) -> None:
    t = (x.astype(np.int64) - zero_point).astype(_F32)
    t *= np.float32(scale)
    np.copyto(y, t, casting="unsafe")


def dynamic_qparams(x: np.ndarray, budget: int) -> tuple[float, int]:
    """QUANTIZE_DYNAMIC's (scale, zero point): x's finite range widened to hold 0,
    mapped onto int8's 256 codes; scale rounded to f32, zero point from it (spec §7)."""
    lo, hi = 0.0, 0.0
    step = max(1, budget // 8)
    for i in _chunks(x.size, step):
        t = x[i:i + step]
        t = t[np.isfinite(t)]
        if t.size:
            lo, hi = min(lo, float(t.min())), max(hi, float(t.max()))
    scale = float(np.float32((hi - lo) / 255.0))
    if scale == 0.0:
        return 1.0, 0
    return scale, int(np.clip(np.rint(-128.0 - lo / scale), -128, 127))


def quantize_dynamic(x: np.ndarray, y: np.ndarray, qparams: np.ndarray, *,
                     budget: int) -> None:
    """Two passes over x (its range, then QUANTIZE's arithmetic with the scale and zero
    point that range gives); the record is written last."""
    scale, zp = dynamic_qparams(x, budget)
    quantize(x, y, scale=scale, zero_point=zp, budget=budget)
    qparams[:] = np.frombuffer(struct.pack("<fi", scale, zp), np.uint8)


def dequantize_dynamic(x: np.ndarray, qparams: np.ndarray, wscale: np.ndarray,
                       wsum: np.ndarray, bias: np.ndarray | None, y: np.ndarray, *,
                       relu: bool, budget: int) -> None:
    """y = act(f32(x - zp * wsum[ch]) * f32(scale * wscale[ch]) + bias[ch]) over x, y
    [outer, channels, inner] (x I32), in chunks of whole outer rows, else of channels
    and elements of one; x - zp * wsum exact (int64)."""
    scale, zp = struct.unpack("<fi", bytes(qparams))
    mult = (np.float32(scale) * wscale.astype(_F32)).reshape(-1, 1)
    corr = (np.int64(zp) * wsum.astype(np.int64)).reshape(-1, 1)
    b = None if bias is None else bias.astype(_F32).reshape(-1, 1)
    outer, ch, inner = x.shape
    if budget >= 16 * ch * inner:
        rows = budget // (16 * ch * inner)
        for r0 in _chunks(outer, rows):
            _dequant_dyn(x[r0:r0 + rows], y[r0:r0 + rows], corr, mult, b, relu)
        return
    cstep, istep = max(1, budget // (16 * inner)), max(1, budget // 16)
    for r in range(outer):
        for c0 in _chunks(ch, cstep):
            cs = slice(c0, c0 + cstep)
            for i0 in _chunks(inner, istep):
                ins = slice(i0, i0 + istep)
                _dequant_dyn(x[r, cs, ins], y[r, cs, ins], corr[cs], mult[cs],
                             None if b is None else b[cs], relu)


def _dequant_dyn(x: np.ndarray, y: np.ndarray, corr: np.ndarray, mult: np.ndarray,
                 b: np.ndarray | None, relu: bool) -> None:
    t = (x.astype(np.int64) - corr).astype(_F32)
    t *= mult
    if b is not None:
        t += b
    if relu:
        np.maximum(t, np.float32(0), out=t)
    np.copyto(y, t, casting="unsafe")


# --- row-wise ----------------------------------------------------------------------------
# A block of whole rows when one row fits the budget (the same bits as the whole
# command); else each row in passes over column chunks. Loop bodies are functions so
# that a chunk's temporaries are freed before the next chunk's are made.

def softmax(x: np.ndarray, y: np.ndarray, *, budget: int) -> None:
    """Row-wise softmax over the last axis, max-subtracted, in f32; a row larger than
    the budget in three passes (max, sum of exponentials, write)."""
    rows, cols = x.shape
    block = budget // (8 * cols)
    if block:
        for r0 in _chunks(rows, block):
            _softmax_rows(x[r0:r0 + block], y[r0:r0 + block])
        return
    step = max(1, budget // 16)
    for i in range(rows):
        xr, yr = x[i], y[i]
        mx = np.float32(-np.inf)
        for j in _chunks(cols, step):
            mx = np.maximum(mx, xr[j:j + step].max().astype(_F32))
        total = np.float32(0)
        for j in _chunks(cols, step):
            total = np.float32(total + _exp_minus(xr[j:j + step], mx).sum(dtype=_F32))
        for j in _chunks(cols, step):
            np.copyto(yr[j:j + step], _exp_minus(xr[j:j + step], mx) / total,
                      casting="unsafe")


def _softmax_rows(x: np.ndarray, y: np.ndarray) -> None:
    t = x.astype(_F32)
    t -= t.max(axis=1, keepdims=True)
    np.exp(t, out=t)
    t /= t.sum(axis=1, keepdims=True)
    np.copyto(y, t, casting="unsafe")


def _exp_minus(x: np.ndarray, mx: np.float32) -> np.ndarray:
    t = x.astype(_F32)
    t -= mx
    return np.exp(t, out=t)


def layernorm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, y: np.ndarray, *,
              epsilon: float, budget: int) -> None:
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last axis (biased var), f32;
    a row larger than the budget in three passes (sum, squared deviations, write)."""
    rows, cols = x.shape
    eps = np.float32(epsilon)
    block = (budget - 8 * cols) // (8 * cols)
    if block > 0:
        g, b = gamma.astype(_F32), beta.astype(_F32)
        for r0 in _chunks(rows, block):
            _layernorm_rows(x[r0:r0 + block], g, b, y[r0:r0 + block], eps)
        return
    step = max(1, budget // 32)
    n = np.float32(cols)
    for i in range(rows):
        xr, yr = x[i], y[i]
        total = np.float32(0)
        for j in _chunks(cols, step):
            total = np.float32(total + xr[j:j + step].sum(dtype=_F32))
        mean = np.float32(total / n)
        sq = np.float32(0)
        for j in _chunks(cols, step):
            sq = np.float32(sq + _sq_dev(xr[j:j + step], mean))
        std = np.sqrt(np.float32(sq / n) + eps)
        for j in _chunks(cols, step):
            _normalize(xr[j:j + step], gamma[j:j + step], beta[j:j + step],
                       yr[j:j + step], mean, std)


def _layernorm_rows(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, y: np.ndarray,
                    eps: np.float32) -> None:
    t = x.astype(_F32)
    mean = t.mean(axis=1, keepdims=True, dtype=_F32)
    t -= mean
    var = np.mean(np.square(t), axis=1, keepdims=True, dtype=_F32)
    t /= np.sqrt(var + eps)
    t *= gamma
    t += beta
    np.copyto(y, t, casting="unsafe")


def _sq_dev(x: np.ndarray, mean: np.float32) -> np.float32:
    t = x.astype(_F32)
    t -= mean
    np.square(t, out=t)
    return np.float32(t.sum(dtype=_F32))


def _normalize(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, y: np.ndarray,
               mean: np.float32, std: np.float32) -> None:
    t = x.astype(_F32)
    t -= mean
    t /= std
    t *= gamma.astype(_F32)
    t += beta.astype(_F32)
    np.copyto(y, t, casting="unsafe")


def reduce(x: np.ndarray, y: np.ndarray, *, op: int, budget: int) -> None:
    """SUM / MAX / MEAN / MIN over the last axis of [rows, cols], f32 (pairwise sums);
    a row larger than the budget is reduced chunk by chunk."""
    rows, cols = x.shape
    block = budget // (4 * cols)
    if block:
        for r0 in _chunks(rows, block):
            np.copyto(y[r0:r0 + block], _reduce(op, x[r0:r0 + block], 1), casting="unsafe")
        return
    step = max(1, budget // 8)
    combine = {ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}.get(ReduceOp(op), np.add)
    for i in range(rows):
        xr = x[i]
        acc = _reduce(op, xr[:step], None)
        for j in range(step, cols, step):
            acc = combine(acc, _reduce(op, xr[j:j + step], None), dtype=_F32)
        if op == ReduceOp.MEAN:  # the chunks' sums, divided once
            acc = np.float32(acc / np.float32(cols))
        y[i] = acc


def _reduce(op: int, x: np.ndarray, axis: int | None) -> Any:
    """`op` over `axis` of x in f32; over all of a chunk (axis None) MEAN is the sum."""
    t = x.astype(_F32)
    if op == ReduceOp.SUM:
        return t.sum(axis=axis, dtype=_F32)
    if op == ReduceOp.MEAN:
        return t.mean(axis=axis, dtype=_F32) if axis is not None else t.sum(dtype=_F32)
    if op == ReduceOp.MAX:
        return t.max(axis=axis)
    return t.min(axis=axis)


# --- CONV2D ------------------------------------------------------------------------------

def conv2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, y: np.ndarray, *,
           groups: int, stride: tuple[int, int], dilation: tuple[int, int],
           pads: tuple[int, int, int, int], activation: int, budget: int) -> None:
    """y = act(conv(x, w) + bias); x NCHW, w OIHW (I = C/groups), y NKHW; f32 math.

    im2col + matmul per image and block of output rows: a strided view
    (G, Cg, R, S, rows, OW) of the (zero-padded, f32) image is gathered into
    (G, Cg*R*S, rows*OW) and multiplied by the (G, Kg, Cg*R*S) weights; each block's
    epilogue is written to y at once. When even one output row of that does not fit the
    budget (or the padded image does not), `_conv2d_tiled` gathers columns by index in
    tiles of output channels, pixels and the reduction."""
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    _, _, oh, ow = y.shape
    g = groups
    pt, pl, pb, pr = pads
    sh, sw = stride
    dh, dw = dilation
    padded = bool(pt or pl or pb or pr)
    w_conv = 0 if (w.dtype == _F32 and w.flags.aligned) else w.size * 4
    x_conv = c * (h + pt + pb) * (wd + pl + pr) * 4 if (padded or x.dtype != _F32) else 0
    if g > 1:
        # Grouped / depthwise: tap by tap, no im2col (whose columns are r*s times the
        # image): per block, one shifted input view (c x pixels) and the accumulator.
        per_row = ow * (c * 4 + k * (8 + _ACT_BYTES[activation]))
        rows = (budget - w_conv - x_conv - k * 4) // per_row
        if rows >= 1:
            wt = (w.astype(_F32) if w_conv else w).reshape(g, k // g, cg, r, s)
            bg = None if bias is None else bias.astype(_F32).reshape(g, k // g, 1)
            for i in range(n):
                _conv2d_grouped_image(x[i], wt, bg, y[i], rows, bool(x_conv), stride=stride,
                                      dilation=dilation, pads=pads, activation=activation)
            return
    per_row = ow * (c * r * s * 4 + k * (8 + _ACT_BYTES[activation]))
    rows = (budget - w_conv - x_conv - k * 4) // per_row
    if rows < 1:
        _conv2d_tiled(x, w, bias, y, groups=groups, stride=stride, dilation=dilation,
                      pads=pads, activation=activation, budget=budget)
        return
    wg = (w.astype(_F32) if w_conv else w).reshape(g, k // g, cg * r * s)
    b32 = None if bias is None else bias.astype(_F32).reshape(k, 1)
    for i in range(n):
        _conv2d_image(x[i], wg, b32, y[i], rows, bool(x_conv), stride=stride,
                      dilation=dilation, pads=pads, kernel=(r, s), activation=activation)


def _conv2d_image(x: np.ndarray, wg: np.ndarray, b32: np.ndarray | None, y: np.ndarray,
                  rows: int, pad: bool, *, stride: tuple[int, int],
                  dilation: tuple[int, int], pads: tuple[int, int, int, int],
                  kernel: tuple[int, int], activation: int) -> None:
    """One image [c, h, w] into y [k, oh, ow], `rows` output rows at a time."""
    c, h, wd = x.shape
    k, oh, ow = y.shape
    g, _, red = wg.shape
    cg = c // g
    r, s = kernel
    pt, pl, pb, pr = pads
    sh, sw = stride
    dh, dw = dilation
    if pad:
        xp = np.zeros((c, h + pt + pb, wd + pl + pr), _F32)
        xp[:, pt:pt + h, pl:pl + wd] = x
        x = xp
    s_c, s_h, s_w = x.strides
    for r0 in _chunks(oh, rows):
        nr = min(rows, oh - r0)
        cols = as_strided(x[:, r0 * sh:], shape=(g, cg, r, s, nr, ow),
                          strides=(cg * s_c, s_c, s_h * dh, s_w * dw, s_h * sh, s_w * sw),
                          writeable=False)
        _conv2d_block(wg, cols.reshape(g, red, nr * ow), b32, y[:, r0:r0 + nr, :],
                      activation)


def _conv2d_grouped_image(x: np.ndarray, wt: np.ndarray, b32: np.ndarray | None,
                          y: np.ndarray, rows: int, pad: bool, *, stride: tuple[int, int],
                          dilation: tuple[int, int], pads: tuple[int, int, int, int],
                          activation: int) -> None:
    """One image [c, h, w] into y [k, oh, ow] for groups > 1, `rows` output rows at a
    time: acc[g, o, p] += sum_ci wt[g, o, ci, kr, ks] * x[g*cg + ci, p shifted by the tap]
    over the r*s taps (a broadcast multiply when each group has one input channel, a
    batched matmul over the groups otherwise)."""
    c, h, wd = x.shape
    k, oh, ow = y.shape
    g, kg, cg, r, s = wt.shape
    pt, pl, pb, pr = pads
    sh, sw = stride
    dh, dw = dilation
    if pad:
        xp = np.zeros((c, h + pt + pb, wd + pl + pr), _F32)
        xp[:, pt:pt + h, pl:pl + wd] = x
        x = xp
    for r0 in _chunks(oh, rows):
        nr = min(rows, oh - r0)
        acc = np.zeros((g, kg, nr * ow), _F32)
        for i in range(r):
            top = r0 * sh + i * dh
            for j in range(s):
                view = x[:, top:top + (nr - 1) * sh + 1:sh, j * dw:j * dw + (ow - 1) * sw + 1:sw]
                tap = view.astype(_F32).reshape(g, cg, nr * ow)
                if cg == 1 and kg == 1:      # depthwise: scale the tap in place
                    tap *= wt[:, :, 0, i, j][:, :, None]
                    acc += tap
                elif cg == 1:
                    acc += wt[:, :, 0, i, j][:, :, None] * tap
                else:
                    acc += np.matmul(wt[:, :, :, i, j], tap)
        if b32 is not None:
            acc += b32
        np.copyto(y[:, r0:r0 + nr, :], apply_activation(acc.reshape(k, nr * ow), activation)
                  .reshape(k, nr, ow), casting="unsafe")


def _conv2d_block(wg: np.ndarray, cols: np.ndarray, b32: np.ndarray | None, y: np.ndarray,
                  activation: int) -> None:
    res = np.matmul(wg, cols).reshape(y.shape[0], -1)
    if b32 is not None:
        res += b32
    np.copyto(y, apply_activation(res, activation).reshape(y.shape), casting="unsafe")


_GATHER_BYTES = 48  # per gathered element: two int64 indices, masks, the value, in f32


def _conv2d_tiled(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, y: np.ndarray, *,
                  groups: int, stride: tuple[int, int], dilation: tuple[int, int],
                  pads: tuple[int, int, int, int], activation: int, budget: int) -> None:
    """CONV2D in tiles of (output channels of a group) x (output pixels), accumulating
    over chunks of the group's flattened (channel, kernel row, kernel column) reduction
    gathered by index from the unpadded image; zero where the window is in the padding."""
    n = x.shape[0]
    k, cg, r, s = w.shape
    _, _, oh, ow = y.shape
    kg = k // groups
    red, npix = cg * r * s, oh * ow
    q = max(1, budget // 3)
    jb = min(red, max(1, q // _GATHER_BYTES))
    pb = min(npix, max(1, q // (_GATHER_BYTES * jb)))
    ob = min(kg, max(1, min(q // (4 * jb), q // ((8 + _ACT_BYTES[activation]) * pb))))
    wf = w.reshape(k, red)
    geometry = _ConvGeometry(x.shape[2], x.shape[3], r, s, ow, stride, dilation, pads)
    for i in range(n):
        y2 = y[i].reshape(k, npix)
        for g in range(groups):
            for o0 in _chunks(kg, ob):
                lo, hi = g * kg + o0, g * kg + min(kg, o0 + ob)
                for p0 in _chunks(npix, pb):
                    _conv2d_tile(x[i, g * cg:(g + 1) * cg], wf[lo:hi],
                                 None if bias is None else bias[lo:hi],
                                 y2[lo:hi, p0:p0 + pb], p0, jb, geometry, activation)


class _ConvGeometry:
    """Where output pixel p and reduction index j = (channel, kernel row, kernel column)
    read the image."""

    def __init__(self, h: int, w: int, r: int, s: int, ow: int, stride: tuple[int, int],
                 dilation: tuple[int, int], pads: tuple[int, int, int, int]) -> None:
        self.h, self.w, self.r, self.s, self.ow = h, w, r, s, ow
        self.stride, self.dilation, self.pads = stride, dilation, pads

    def gather(self, x: np.ndarray, p0: int, npix: int, j0: int, nj: int) -> np.ndarray:
        """The (nj, npix) im2col block of image channels `x`, in f32, 0 in the padding."""
        sh, sw = self.stride
        dh, dw = self.dilation
        pt, pl = self.pads[0], self.pads[1]
        pix = np.arange(p0, p0 + npix)
        jj = np.arange(j0, j0 + nj)
        ih = (pix // self.ow * sh - pt)[None, :] + ((jj // self.s) % self.r * dh)[:, None]
        iw = (pix % self.ow * sw - pl)[None, :] + (jj % self.s * dw)[:, None]
        ok = (ih >= 0) & (ih < self.h) & (iw >= 0) & (iw < self.w)
        np.clip(ih, 0, self.h - 1, out=ih)
        np.clip(iw, 0, self.w - 1, out=iw)
        cols: np.ndarray = x[(jj // (self.r * self.s))[:, None], ih, iw].astype(
            _F32, copy=False)
        cols *= ok
        return cols


def _conv2d_tile(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, y: np.ndarray,
                 p0: int, jb: int, geo: _ConvGeometry, activation: int) -> None:
    """y [ko, P] = act(w [ko, red] @ im2col(x) [red, P] + bias), red in chunks of jb."""
    red = w.shape[1]
    acc = _conv2d_part(x, w[:, :jb], p0, y.shape[1], 0, geo)
    for j0 in range(jb, red, jb):
        acc += _conv2d_part(x, w[:, j0:j0 + jb], p0, y.shape[1], j0, geo)
    if bias is not None:
        acc += bias.astype(_F32)[:, None]
    np.copyto(y, apply_activation(acc, activation), casting="unsafe")


def _conv2d_part(x: np.ndarray, w: np.ndarray, p0: int, npix: int, j0: int,
                 geo: _ConvGeometry) -> np.ndarray:
    cols = geo.gather(x, p0, npix, j0, w.shape[1])
    part: np.ndarray = np.matmul(
        w if w.dtype == _F32 and w.flags.aligned else w.astype(_F32), cols)
    return part


# --- POOL2D ------------------------------------------------------------------------------

def pool2d(x: np.ndarray, y: np.ndarray, *, op: int, window: tuple[int, int],
           stride: tuple[int, int], dilation: tuple[int, int],
           pads: tuple[int, int, int, int], include_pad: bool, budget: int) -> None:
    """Max / average pooling of NCHW x into y, in f32, over blocks of (image, channel)
    planes: each plane is copied into a padded f32 plane (-inf for MAX, 0 for AVG)
    large enough for every window, then reduced tap by tap (r*s strided views)."""
    n, c, h, w = x.shape
    oh, ow = y.shape[2:]
    r, s = kernel = window
    sh, sw = stride
    dh, dw = dilation
    pt, pl, pb, pr = pads
    # every tap of every window (ceil mode may reach past the end pads) and the image
    hp = max(h + pt + pb, (oh - 1) * sh + dh * (r - 1) + 1)
    wp = max(w + pl + pr, (ow - 1) * sw + dw * (s - 1) + 1)
    planes = x.reshape(n * c, h, w)
    out = y.reshape(n * c, oh, ow)
    per_plane = 4 * (hp * wp + 2 * oh * ow)
    block = max(1, budget // max(per_plane, 1))
    div = None
    if op == 1:   # AVG: how many taps of each window are counted
        inside = np.zeros((hp, wp), _F32)
        if include_pad:
            inside[:min(hp, h + pt + pb), :min(wp, w + pl + pr)] = 1
        else:
            inside[pt:pt + h, pl:pl + w] = 1
        div = _pool_taps(inside[None], oh, ow, kernel, stride, dilation, np.add)[0]
    for p0 in _chunks(n * c, block):
        _pool_block(planes[p0:p0 + block], out[p0:p0 + block], op, (hp, wp), kernel,
                    stride, dilation, (pt, pl), div)


def _pool_taps(xp: np.ndarray, oh: int, ow: int, kernel: tuple[int, int],
               stride: tuple[int, int], dilation: tuple[int, int],
               combine: Any) -> np.ndarray:
    """combine over the r*s taps of every window of padded planes xp [p, hp, wp]."""
    r, s = kernel
    sh, sw = stride
    dh, dw = dilation
    acc: np.ndarray | None = None
    for i in range(r):
        for j in range(s):
            tap = xp[:, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
            acc = tap.copy() if acc is None else combine(acc, tap, out=acc)
    assert acc is not None
    return acc


def _pool_block(x: np.ndarray, y: np.ndarray, op: int, padded: tuple[int, int],
                kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
                offset: tuple[int, int], div: np.ndarray | None) -> None:
    p, h, w = x.shape
    xp = np.full((p,) + padded, -np.inf if op == 0 else 0.0, _F32)
    xp[:, offset[0]:offset[0] + h, offset[1]:offset[1] + w] = x
    acc = _pool_taps(xp, y.shape[1], y.shape[2], kernel, stride, dilation,
                     np.maximum if op == 0 else np.add)
    if div is not None:
        with np.errstate(invalid="ignore", divide="ignore"):
            acc /= div
    np.copyto(y, acc, casting="unsafe")


# --- data movement -----------------------------------------------------------------------

def gather(table: np.ndarray, indices: np.ndarray, out: np.ndarray, *, budget: int) -> None:
    """out[i] = table[indices[i]] for indices in [-rows, rows) (negative ones count from
    the end, as ONNX Gather); any other index gives a row of zeros."""
    rows = table.shape[0]
    step = max(1, budget // 32)      # per index: int64 copies and a mask
    for i in _chunks(indices.size, step):
        idx = indices[i:i + step].astype(np.int64)
        idx[idx < 0] += rows
        bad = (idx < 0) | (idx >= rows)
        idx[bad] = 0
        o = out[i:i + step]
        np.take(table, idx, axis=0, out=o, mode="clip")   # straight into device memory
        o[bad] = 0

def copy(src: np.ndarray, dst: np.ndarray, *, budget: int) -> None:
    """dst[idx] = src[idx] for every index; an overlapping src was staged (a copy)."""
    np.copyto(dst, src)


def move(src: np.ndarray, dst: np.ndarray, *, budget: int) -> None:
    """DMA_D2D with memmove semantics: disjoint ranges in one copy; overlapping ones in
    chunks of at most `budget` bytes, front to back when dst is below src, else back to
    front, so that no chunk reads what an earlier one wrote."""
    if not np.may_share_memory(src, dst):
        dst[...] = src
        return
    size = src.size
    step = max(1, budget)
    down = dst.__array_interface__["data"][0] < src.__array_interface__["data"][0]
    starts = list(_chunks(size, step))
    for i in (starts if down else reversed(starts)):
        dst[i:i + step] = src[i:i + step]  # numpy buffers a chunk that overlaps itself
