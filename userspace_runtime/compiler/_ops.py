"""The op registry: for every IR op, attribute checks, shape/dtype inference and a numpy
reference implementation (used by constant folding, calibration and the tests).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    from ._ir import Node

Shape = tuple[int, ...]
Infer = Callable[["Node"], list[tuple[Shape, str]]]
Ref = Callable[["Node", list[Any]], list[np.ndarray]]

ACTIVATIONS = (None, "relu", "gelu", "sigmoid")


def _err(msg: str) -> Exception:
    from ._ir import GraphError
    return GraphError(msg)


@dataclass(frozen=True)
class OpSpec:
    name: str
    infer: Infer
    ref: Ref
    attrs: Callable[[Node], None] = lambda n: None

    def check_attrs(self, node: Node) -> None:
        self.attrs(node)


_REGISTRY: dict[str, OpSpec] = {}


def get(op: str) -> OpSpec:
    try:
        return _REGISTRY[op]
    except KeyError:
        raise _err(f"unknown op {op!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def names() -> list[str]:
    return sorted(_REGISTRY)


def _register(name: str, infer: Infer, ref: Ref, attrs: Callable[[Node], None] | None = None
              ) -> None:
    _REGISTRY[name] = OpSpec(name, infer, ref, attrs or (lambda n: None))


def _req(node: Node, i: int, what: str) -> Any:
    v = node.inputs[i] if i < len(node.inputs) else None
    if v is None:
        raise _err(f"{what} (operand {i}) is required")
    return v


def _float(node: Node, *idx: int) -> None:
    for i in idx:
        v = node.inputs[i] if i < len(node.inputs) else None
        if v is not None and v.dtype not in ("float32", "float16"):
            raise _err(f"operand {i} ({v.name}) is {v.dtype}, a float dtype is needed")


def _same_dtype(node: Node) -> str:
    dts = {v.dtype for v in node.inputs if v is not None}
    if len(dts) != 1:
        raise _err(f"operands have different dtypes: {sorted(dts)}")
    return dts.pop()


def _norm_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise _err(f"axis {axis} is out of range for rank {rank}")
    return axis % max(rank, 1)


def broadcast(a: Shape, b: Shape) -> Shape:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(a, b))
    except ValueError:
        raise _err(f"shapes {list(a)} and {list(b)} do not broadcast") from None


def _activate(x: np.ndarray, act: str | None) -> np.ndarray:
    if act is None:
        return x
    if act == "relu":
        y: np.ndarray = np.maximum(x, 0).astype(x.dtype)
        return y
    if act == "gelu":
        return gelu_ref(x)
    if act == "sigmoid":
        return sigmoid_ref(x)
    raise _err(f"unknown activation {act!r}")


def gelu_ref(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    xd = x.astype(np.float64)
    if approximate == "tanh":
        y = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    else:
        from math import erf
        y = 0.5 * xd * (1 + np.vectorize(erf, otypes=[np.float64])(xd / math.sqrt(2)))
    out: np.ndarray = y.astype(x.dtype)
    return out


def sigmoid_ref(x: np.ndarray) -> np.ndarray:
    xd = x.astype(np.float64)
    return (1 / (1 + np.exp(-xd))).astype(x.dtype)


def _check_act(node: Node) -> None:
    if node.attrs.get("activation") not in ACTIVATIONS:
        raise _err(f"activation {node.attrs.get('activation')!r} is not one of {ACTIVATIONS}")


# --- matmul / gemm ---------------------------------------------------------------------


def _matmul_infer(node: Node) -> list[tuple[Shape, str]]:
    a, b = _req(node, 0, "a"), _req(node, 1, "b")
    dt = _same_dtype(node)
    if len(a.shape) < 1 or len(b.shape) < 1:
        raise _err("matmul operands must have rank >= 1")
    try:
        shape = np.broadcast_shapes(a.shape[:-2] if len(a.shape) > 1 else (),
                                    b.shape[:-2] if len(b.shape) > 1 else ())
    except ValueError:
        raise _err(f"batch dims of {list(a.shape)} and {list(b.shape)} do not broadcast") from None
    ka = a.shape[-1]
    kb = b.shape[-2] if len(b.shape) > 1 else b.shape[0]
    if ka != kb:
        raise _err(f"inner dimensions differ: a is {list(a.shape)}, b is {list(b.shape)}")
    out = tuple(shape) + ((a.shape[-2],) if len(a.shape) > 1 else ()) + \
        ((b.shape[-1],) if len(b.shape) > 1 else ())
    out_dt = "int32" if dt == "int8" else dt
    return [(tuple(int(d) for d in out), out_dt)]


def _matmul_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    a, b = x[0], x[1]
    if a.dtype == np.int8:
        return [np.matmul(a.astype(np.int32), b.astype(np.int32))]
    return [np.matmul(a, b).astype(a.dtype)]


_register("matmul", _matmul_infer, _matmul_ref)


def _gemm_infer(node: Node) -> list[tuple[Shape, str]]:
    a, b = _req(node, 0, "a"), _req(node, 1, "b")
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    for nm, v in (("a", a), ("b", b)):
        if len(v.shape) != 2:
            raise _err(f"gemm {nm} must be 2-D, it is {list(v.shape)}")
    if a.dtype != b.dtype:
        raise _err(f"a is {a.dtype} but b is {b.dtype}")
    m, k = a.shape[::-1] if node.attrs.get("trans_a") else a.shape
    kb, n = b.shape[::-1] if node.attrs.get("trans_b") else b.shape
    if k != kb:
        raise _err(f"inner dimensions differ: op(a) is {m}x{k}, op(b) is {kb}x{n}")
    out_dt = "int32" if a.dtype == "int8" else a.dtype
    if bias is not None:
        if bias.dtype != out_dt:
            raise _err(f"bias is {bias.dtype}, expected {out_dt}")
        if broadcast(bias.shape, (m, n)) != (m, n):
            raise _err(f"bias {list(bias.shape)} does not broadcast to {[m, n]}")
    return [((m, n), out_dt)]


def _gemm_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    a, b, bias = x[0], x[1], x[2] if len(x) > 2 else None
    at = node.attrs
    if at.get("trans_a"):
        a = a.T
    if at.get("trans_b"):
        b = b.T
    if a.dtype == np.int8:
        y = a.astype(np.int32) @ b.astype(np.int32)
        if bias is not None:
            y = y + bias
        return [_activate(y.astype(np.int32), at.get("activation"))]
    y = np.float32(at.get("alpha", 1.0)) * (a @ b)
    if bias is not None:
        y = y + np.float32(at.get("beta", 1.0)) * bias
    return [_activate(y.astype(a.dtype), at.get("activation"))]


_register("gemm", _gemm_infer, _gemm_ref, _check_act)


# --- conv2d ----------------------------------------------------------------------------


def _conv_attrs(node: Node) -> None:
    _check_act(node)
    at = node.attrs
    for key, n in (("stride", 2), ("padding", 4), ("dilation", 2)):
        v = at.get(key)
        if not isinstance(v, tuple) or len(v) != n or not all(isinstance(i, int) for i in v):
            raise _err(f"conv2d {key} must be {n} ints, got {v!r}")
    if min(at["stride"]) < 1 or min(at["dilation"]) < 1 or min(at["padding"]) < 0:
        raise _err(f"conv2d stride/dilation must be >= 1 and padding >= 0: {at}")
    if at.get("groups", 1) < 1:
        raise _err(f"conv2d groups must be >= 1, got {at.get('groups')}")


def _conv_infer(node: Node) -> list[tuple[Shape, str]]:
    x, w = _req(node, 0, "x"), _req(node, 1, "w")
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise _err(f"conv2d needs NCHW x and OIHW w, got {list(x.shape)} and {list(w.shape)}")
    if x.dtype != w.dtype:
        raise _err(f"x is {x.dtype} but w is {w.dtype}")
    n, c, h, wd = x.shape
    o, ci, kh, kw = w.shape
    g = node.attrs["groups"]
    if c % g or o % g or ci != c // g:
        raise _err(f"channels: x has {c}, w expects {ci} per group x {g} groups, "
                   f"{o} outputs")
    sh, sw = node.attrs["stride"]
    pt, pl, pb, pr = node.attrs["padding"]
    dh, dw = node.attrs["dilation"]
    oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
    if oh < 1 or ow < 1:
        raise _err(f"output would be empty ({oh}x{ow})")
    out_dt = "int32" if x.dtype == "int8" else x.dtype
    if bias is not None and (bias.shape != (o,) or bias.dtype != out_dt):
        raise _err(f"bias must be {out_dt}[{o}], it is {bias.dtype}{list(bias.shape)}")
    return [((n, o, oh, ow), out_dt)]


def im2col(x: np.ndarray, kh: int, kw: int, stride: Sequence[int], padding: Sequence[int],
           dilation: Sequence[int]) -> tuple[np.ndarray, int, int]:
    """(N, C*kh*kw, OH*OW) patches of NCHW x, and OH, OW."""
    n, c, h, w = x.shape
    pt, pl, pb, pr = padding
    sh, sw = stride
    dh, dw = dilation
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    ow = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
    cols = np.empty((n, c, kh, kw, oh, ow), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            cols[:, :, i, j] = xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                                  j * dw:j * dw + sw * (ow - 1) + 1:sw]
    return cols.reshape(n, c * kh * kw, oh * ow), oh, ow


def _conv_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    inp, w, bias = x[0], x[1], x[2] if len(x) > 2 else None
    at = node.attrs
    g = at["groups"]
    o, ci, kh, kw = w.shape
    acc = np.int32 if inp.dtype == np.int8 else inp.dtype
    n = inp.shape[0]
    outs = []
    for gi in range(g):
        xs = inp[:, gi * ci:(gi + 1) * ci].astype(acc)
        cols, oh, ow = im2col(xs, kh, kw, at["stride"], at["padding"], at["dilation"])
        wg = w[gi * (o // g):(gi + 1) * (o // g)].reshape(o // g, -1).astype(acc)
        outs.append(np.einsum("ok,nkp->nop", wg, cols).reshape(n, o // g, oh, ow))
    y = np.concatenate(outs, axis=1).astype(acc)
    if bias is not None:
        y = y + bias.reshape(1, -1, 1, 1)
    return [_activate(y.astype(acc), at.get("activation"))]


_register("conv2d", _conv_infer, _conv_ref, _conv_attrs)


# --- elementwise -------------------------------------------------------------------------


def _binary_infer(node: Node) -> list[tuple[Shape, str]]:
    a, b = _req(node, 0, "a"), _req(node, 1, "b")
    dt = _same_dtype(node)
    _float(node, 0, 1)
    return [(broadcast(a.shape, b.shape), dt)]


def _unary_float_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    _float(node, 0)
    return [(x.shape, x.dtype)]


_register("add", _binary_infer, lambda n, x: [(x[0] + x[1]).astype(x[0].dtype)])
_register("sub", _binary_infer, lambda n, x: [(x[0] - x[1]).astype(x[0].dtype)])
_register("mul", _binary_infer, lambda n, x: [(x[0] * x[1]).astype(x[0].dtype)])
_register("div", _binary_infer, lambda n, x: [(x[0] / x[1]).astype(x[0].dtype)])
_register("relu", _unary_float_infer, lambda n, x: [np.maximum(x[0], 0).astype(x[0].dtype)])


def _gelu_attrs(node: Node) -> None:
    if node.attrs.get("approximate", "none") not in ("none", "tanh"):
        raise _err(f"gelu approximate must be 'none' or 'tanh', got "
                   f"{node.attrs.get('approximate')!r}")


_register("gelu", _unary_float_infer,
          lambda n, x: [gelu_ref(x[0], n.attrs.get("approximate", "none"))], _gelu_attrs)
_register("sigmoid", _unary_float_infer, lambda n, x: [sigmoid_ref(x[0])])


# --- softmax / layernorm ------------------------------------------------------------------


def _softmax_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    _float(node, 0)
    _norm_axis(node.attrs["axis"], len(x.shape))
    return [(x.shape, x.dtype)]


def _softmax_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    a = x[0].astype(np.float64)
    ax = node.attrs["axis"] % max(a.ndim, 1)
    e = np.exp(a - a.max(axis=ax, keepdims=True))
    return [(e / e.sum(axis=ax, keepdims=True)).astype(x[0].dtype)]


_register("softmax", _softmax_infer, _softmax_ref)


def _ln_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    _float(node, 0, 1, 2)
    ax = _norm_axis(node.attrs["axis"], len(x.shape))
    norm = x.shape[ax:]
    for i in (1, 2):
        v = node.inputs[i] if i < len(node.inputs) else None
        if v is not None and broadcast(v.shape, norm) != tuple(norm):
            raise _err(f"{'scale' if i == 1 else 'bias'} {list(v.shape)} does not broadcast "
                       f"to the normalized shape {list(norm)}")
    return [(x.shape, x.dtype)]


def _ln_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    a = x[0].astype(np.float64)
    ax = node.attrs["axis"] % a.ndim
    axes = tuple(range(ax, a.ndim))
    mu = a.mean(axis=axes, keepdims=True)
    var = ((a - mu) ** 2).mean(axis=axes, keepdims=True)
    y = (a - mu) / np.sqrt(var + node.attrs["epsilon"])
    if len(x) > 1 and x[1] is not None:
        y = y * x[1]
    if len(x) > 2 and x[2] is not None:
        y = y + x[2]
    return [y.astype(x[0].dtype)]


_register("layernorm", _ln_infer, _ln_ref)


def _bn_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    _float(node, 0, 1, 2, 3, 4)
    if len(x.shape) < 2:
        raise _err(f"batchnorm needs rank >= 2 (N, C, ...), got {list(x.shape)}")
    c = x.shape[1]
    for i, nm in enumerate(("scale", "bias", "mean", "var"), 1):
        v = _req(node, i, nm)
        if v.shape != (c,):
            raise _err(f"{nm} must have shape [{c}], it is {list(v.shape)}")
    return [(x.shape, x.dtype)]


def _bn_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    a, scale, bias, mean, var = x
    shp = (1, -1) + (1,) * (a.ndim - 2)
    inv = scale / np.sqrt(var.astype(np.float64) + node.attrs["epsilon"])
    y = (a - mean.reshape(shp)) * inv.reshape(shp) + bias.reshape(shp)
    return [y.astype(a.dtype)]


_register("batchnorm", _bn_infer, _bn_ref)


# --- shape ops ---------------------------------------------------------------------------


def reshape_target(in_shape: Shape, spec: Sequence[int], allowzero: bool = False) -> Shape:
    dims = []
    for i, d in enumerate(spec):
        if d == 0 and not allowzero:
            if i >= len(in_shape):
                raise _err(f"reshape 0 at dim {i} but the input has rank {len(in_shape)}")
            dims.append(in_shape[i])
        else:
            dims.append(d)
    if dims.count(-1) > 1:
        raise _err(f"reshape to {list(spec)}: more than one -1")
    total = math.prod(in_shape)
    known = math.prod(d for d in dims if d != -1)
    if -1 in dims:
        if known == 0 or total % known:
            raise _err(f"cannot reshape {list(in_shape)} to {list(spec)}")
        dims[dims.index(-1)] = total // known
    if any(d < 0 for d in dims) or math.prod(dims) != total:
        raise _err(f"cannot reshape {list(in_shape)} ({total} elements) to {list(spec)}")
    return tuple(dims)


def _reshape_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    return [(reshape_target(x.shape, node.attrs["shape"]), x.dtype)]


_register("reshape", _reshape_infer, lambda n, x: [x[0].reshape(n.outputs[0].shape)])


def _transpose_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    perm = node.attrs["perm"]
    if sorted(perm) != list(range(len(x.shape))):
        raise _err(f"perm {list(perm)} is not a permutation of rank {len(x.shape)}")
    return [(tuple(x.shape[p] for p in perm), x.dtype)]


_register("transpose", _transpose_infer,
          lambda n, x: [np.ascontiguousarray(np.transpose(x[0], n.attrs["perm"]))])


def _reduce_attrs(node: Node) -> None:
    if node.attrs.get("reduce_op") not in ("sum", "mean", "max", "min"):
        raise _err(f"reduce op must be sum, mean, max or min, got "
                   f"{node.attrs.get('reduce_op')!r}")


def reduce_axes(node: Node, rank: int) -> tuple[int, ...]:
    axes = node.attrs.get("axes")
    if axes is None:
        return tuple(range(rank))
    out = tuple(sorted({_norm_axis(a, rank) for a in axes}))
    if len(out) != len(axes):
        raise _err(f"reduce axes {list(axes)} repeat an axis")
    return out


def _reduce_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    _float(node, 0)
    axes = reduce_axes(node, len(x.shape))
    if node.attrs["keepdims"]:
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return [(shape, x.dtype)]


def _reduce_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    a = x[0]
    axes = reduce_axes(node, a.ndim)
    op = node.attrs["reduce_op"]
    keep = node.attrs["keepdims"]
    src = a.astype(np.float64) if op in ("sum", "mean") else a
    if op == "sum":
        r = np.sum(src, axis=axes, keepdims=keep)
    elif op == "mean":
        r = np.mean(src, axis=axes, keepdims=keep)
    elif op == "max":
        r = np.max(src, axis=axes, keepdims=keep)
    else:
        r = np.min(src, axis=axes, keepdims=keep)
    return [np.asarray(r).astype(a.dtype)]


_register("reduce", _reduce_infer, _reduce_ref, _reduce_attrs)


# --- quantization ------------------------------------------------------------------------


def _q_attrs(node: Node) -> None:
    s = node.attrs.get("scale")
    if not isinstance(s, float) or not math.isfinite(s) or s <= 0:
        raise _err(f"scale must be a finite float > 0, got {s!r}")
    if not -128 <= node.attrs.get("zero_point", 0) <= 127:
        raise _err(f"zero_point {node.attrs.get('zero_point')} is outside int8")


def _quant_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    _float(node, 0)
    return [(x.shape, "int8")]


def quantize_ref(x: np.ndarray, scale: float, zp: int) -> np.ndarray:
    """ONNX QuantizeLinear: round half to even, then saturate to int8."""
    y = np.rint(x.astype(np.float32) / np.float32(scale)) + zp
    q: np.ndarray = np.clip(y, -128, 127).astype(np.int8)
    return q


def _dequant_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    if x.dtype not in ("int8", "int32"):
        raise _err(f"dequantize needs int8 or int32, got {x.dtype}")
    return [(x.shape, "float32")]


_register("quantize", _quant_infer,
          lambda n, x: [quantize_ref(x[0], n.attrs["scale"], n.attrs["zero_point"])], _q_attrs)
_register("dequantize", _dequant_infer,
          lambda n, x: [((x[0].astype(np.float32) - np.float32(n.attrs["zero_point"]))
                         * np.float32(n.attrs["scale"])).astype(np.float32)], _q_attrs)


def evaluate(node: Node, inputs: list[np.ndarray | None]) -> list[np.ndarray]:
    """Run `node` in numpy (the reference semantics of the op)."""
    ref: Callable[..., list[np.ndarray]] = get(node.op).ref
    return ref(node, inputs)
