"""VA-1 op kernels: CONV2D (im2col + matmul), SOFTMAX, LAYERNORM, REDUCE, QUANTIZE,
DEQUANTIZE, int8 GEMM and strided COPY. Inputs are zero-copy views of device memory;
every kernel reads all of its inputs before it writes its output, so any overlap of
inputs and output is allowed."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from hwspec.isa import ReduceOp

from .activations import apply_activation

_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")


# Temporary buffers of CONV2D (padded image, im2col block) stay near this size whatever
# the command asks for; work is split into blocks of output pixels to keep it so.
CONV_BUDGET_BYTES = 32 << 20


def conv2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, y: np.ndarray, *,
           groups: int, stride: tuple[int, int], dilation: tuple[int, int],
           pads: tuple[int, int, int, int], activation: int) -> None:
    """y = act(conv(x, w) + bias); x NCHW, w OIHW (I = C/groups), y NKHW; f32 math.

    im2col + matmul per image and block of output rows: a strided view
    (G, Cg, R, S, rows, OW) of the zero-padded image is gathered into
    (G, Cg*R*S, rows*OW) and multiplied by the (G, Kg, Cg*R*S) weights. When even the
    padded image would be larger than CONV_BUDGET_BYTES (huge pads or dilations), the
    columns are gathered by index arrays from the unpadded image instead."""
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    _, _, oh, ow = y.shape
    g = groups
    kg = k // g
    pt, pl, pb, pr = pads
    sh, sw = stride
    dh, dw = dilation
    wg = w.astype(_F32).reshape(g, kg, cg * r * s)
    out = np.empty((n, k, oh * ow), _F32)
    col_bytes = c * r * s * 4  # one output pixel's column
    padded = c * (h + pt + pb) * (wd + pl + pr) * 4
    if padded <= CONV_BUDGET_BYTES:
        rows = max(1, CONV_BUDGET_BYTES // max(1, col_bytes * ow))
        for i in range(n):
            xi = x[i].astype(_F32)
            if pt or pl or pb or pr:
                xi = np.pad(xi, ((0, 0), (pt, pb), (pl, pr)))
            s_c, s_h, s_w = xi.strides
            for r0 in range(0, oh, rows):
                nr = min(rows, oh - r0)
                cols = as_strided(xi[:, r0 * sh:], shape=(g, cg, r, s, nr, ow),
                                  strides=(cg * s_c, s_c, s_h * dh, s_w * dw, s_h * sh,
                                           s_w * sw), writeable=False)
                res = np.matmul(wg, cols.reshape(g, cg * r * s, nr * ow))
                out[i, :, r0 * ow:(r0 + nr) * ow] = res.reshape(k, nr * ow)
    else:
        npix = max(1, CONV_BUDGET_BYTES // col_bytes)
        for i in range(n):
            xi = x[i].astype(_F32)
            for p0 in range(0, oh * ow, npix):
                pix = np.arange(p0, min(p0 + npix, oh * ow))
                ih = (pix // ow * sh - pt)[None, :] + (np.arange(r) * dh)[:, None]  # (r, P)
                iw = (pix % ow * sw - pl)[None, :] + (np.arange(s) * dw)[:, None]  # (s, P)
                ok = ((ih >= 0) & (ih < h))[:, None, :] & ((iw >= 0) & (iw < wd))[None]
                cols = xi[:, np.clip(ih, 0, h - 1)[:, None, :], np.clip(iw, 0, wd - 1)[None]]
                cols *= ok  # (c, r, s, P), zero where the window is in the padding
                res = np.matmul(wg, cols.reshape(g, cg * r * s, pix.size))
                out[i, :, p0:p0 + pix.size] = res.reshape(k, pix.size)
    out4 = out.reshape(n, k, oh, ow)
    if bias is not None:
        out4 += bias.astype(_F32).reshape(k, 1, 1)
    np.copyto(y, apply_activation(out4, activation), casting="unsafe")


def softmax(x: np.ndarray, y: np.ndarray) -> None:
    """Row-wise softmax over the last axis, max-subtracted, in f32."""
    t = x.astype(_F32)
    t -= t.max(axis=1, keepdims=True)
    np.exp(t, out=t)
    t /= t.sum(axis=1, keepdims=True)
    np.copyto(y, t, casting="unsafe")


def layernorm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, y: np.ndarray,
              epsilon: float) -> None:
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last axis (biased var), f32."""
    t = x.astype(_F32)
    mean = t.mean(axis=1, keepdims=True, dtype=_F32)
    t -= mean
    var = np.mean(np.square(t), axis=1, keepdims=True, dtype=_F32)
    t /= np.sqrt(var + np.float32(epsilon))
    t *= gamma.astype(_F32)
    t += beta.astype(_F32)
    np.copyto(y, t, casting="unsafe")


def reduce(op: int, x: np.ndarray, y: np.ndarray) -> None:
    """SUM / MAX / MEAN / MIN over the last axis of [rows, cols], f32."""
    t = x.astype(_F32)
    if op == ReduceOp.SUM:
        r = t.sum(axis=1, dtype=_F32)
    elif op == ReduceOp.MEAN:
        r = t.mean(axis=1, dtype=_F32)
    elif op == ReduceOp.MAX:
        r = t.max(axis=1)
    else:
        r = t.min(axis=1)
    np.copyto(y, r, casting="unsafe")


def quantize(x: np.ndarray, y: np.ndarray, scale: float, zero_point: int) -> None:
    """ONNX QuantizeLinear: saturate(rint(x / scale) + zp) to int8; rint is half-to-even.
    NaN maps to zp, +-inf saturate."""
    t = x.astype(_F32) / np.float32(scale)
    np.rint(t, out=t)
    np.nan_to_num(t, copy=False, nan=0.0)
    t += np.float32(zero_point)
    np.clip(t, -128, 127, out=t)
    np.copyto(y, t, casting="unsafe")


def dequantize(x: np.ndarray, y: np.ndarray, scale: float, zero_point: int) -> None:
    """ONNX DequantizeLinear: (x - zp) * scale; x - zp exact (int64), then f32."""
    t = (x.astype(np.int64) - zero_point).astype(_F32)
    t *= np.float32(scale)
    np.copyto(y, t, casting="unsafe")


def gemm_i8(a: np.ndarray, b: np.ndarray, c: np.ndarray, bias: np.ndarray | None,
            accumulate: bool, relu: bool) -> None:
    """C(i32) = [relu](A(i8) @ B(i8) [+ C] [+ bias]) exactly, wrapped to 32 bits.

    Products sum to at most k * 2^14 < 2^46, exact in float64, so BLAS does the work."""
    t = np.matmul(a.astype(_F64), b.astype(_F64)).astype(np.int64)
    if accumulate:
        t += c
    if bias is not None:
        t += bias
    t = t.astype(np.int32)  # two's complement wrap (astype of int64 to int32 wraps)
    if relu:
        np.maximum(t, 0, out=t)
    np.copyto(c, t)


def copy(src: np.ndarray, dst: np.ndarray) -> None:
    """dst[idx] = src[idx] for every index; src is read completely first if they overlap."""
    if np.may_share_memory(src, dst):
        src = src.copy()
    np.copyto(dst, src)
