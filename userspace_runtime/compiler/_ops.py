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

ACTIVATIONS = (None, "relu", "gelu", "sigmoid", "silu")


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
    if act == "silu":
        s: np.ndarray = x.astype(np.float64) * sigmoid_ref(x.astype(np.float64))
        return s.astype(x.dtype)
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


# bmm: a batched matmul whose operands are strided views of other values (what the
# view-folding pass makes of MatMul(Transpose / Reshape / scalar Mul of x, ...)):
# attrs a_view / b_view = (shape, element strides) into the row-major data of inputs 0 /
# 1, and alpha. out = alpha * matmul(view_a, view_b), numpy broadcasting of batch dims.

def _view_ok(v: Any, view: Any, what: str) -> tuple[Shape, Shape]:
    try:
        shape, strides = (tuple(int(d) for d in view[0]), tuple(int(s) for s in view[1]))
    except (TypeError, ValueError, IndexError):
        raise _err(f"{what} must be (shape, strides), got {view!r}") from None
    if len(shape) != len(strides) or len(shape) < 2 or min(shape) < 1 or min(strides) < 0:
        raise _err(f"{what} {view!r}: rank >= 2, dims >= 1, strides >= 0")
    if sum((d - 1) * st for d, st in zip(shape, strides)) >= v.size:
        raise _err(f"{what} {view!r} reaches past {v.name} ({v.size} elements)")
    return shape, strides


def _bmm_infer(node: Node) -> list[tuple[Shape, str]]:
    a, b = _req(node, 0, "a"), _req(node, 1, "b")
    dt = _same_dtype(node)
    sa, _ = _view_ok(a, node.attrs.get("a_view"), "a_view")
    sb, _ = _view_ok(b, node.attrs.get("b_view"), "b_view")
    if sa[-1] != sb[-2]:
        raise _err(f"inner dimensions differ: a view is {list(sa)}, b view is {list(sb)}")
    try:
        batch = np.broadcast_shapes(sa[:-2], sb[:-2])
    except ValueError:
        raise _err(f"batch dims of {list(sa)} and {list(sb)} do not broadcast") from None
    if dt == "int8" and node.attrs.get("alpha", 1.0) != 1.0:
        raise _err("int8 bmm with alpha != 1")
    out_dt = "int32" if dt == "int8" else dt
    return [(tuple(int(d) for d in batch) + (sa[-2], sb[-1]), out_dt)]


def view_of(x: np.ndarray, view: Any) -> np.ndarray:
    """The strided view (shape, element strides) of x's row-major data."""
    flat = np.ascontiguousarray(x).reshape(-1)
    return np.lib.stride_tricks.as_strided(
        flat, tuple(view[0]), tuple(s * flat.itemsize for s in view[1]), writeable=False)


def _bmm_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    a, b = view_of(x[0], node.attrs["a_view"]), view_of(x[1], node.attrs["b_view"])
    if a.dtype == np.int8:
        return [np.matmul(a.astype(np.int32), b.astype(np.int32))]
    y = np.matmul(a, b)
    alpha = node.attrs.get("alpha", 1.0)
    if alpha != 1.0:
        y = y * np.float32(alpha)
    return [y.astype(a.dtype)]


_register("bmm", _bmm_infer, _bmm_ref)


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
    pv = at.get("pad_value", 0)
    if not isinstance(pv, int) or not -128 <= pv <= 127:
        raise _err(f"conv2d pad_value must be an int8 int, got {pv!r}")


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
    if node.attrs.get("pad_value", 0) and x.dtype != "int8":
        raise _err(f"pad_value {node.attrs['pad_value']} is for int8 x, x is {x.dtype}")
    out_dt = "int32" if x.dtype == "int8" else x.dtype
    if bias is not None and (bias.shape != (o,) or bias.dtype != out_dt):
        raise _err(f"bias must be {out_dt}[{o}], it is {bias.dtype}{list(bias.shape)}")
    return [((n, o, oh, ow), out_dt)]


def im2col(x: np.ndarray, kh: int, kw: int, stride: Sequence[int], padding: Sequence[int],
           dilation: Sequence[int], pad_value: int = 0) -> tuple[np.ndarray, int, int]:
    """(N, C*kh*kw, OH*OW) patches of NCHW x, and OH, OW; padding holds `pad_value`."""
    n, c, h, w = x.shape
    pt, pl, pb, pr = padding
    sh, sw = stride
    dh, dw = dilation
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=pad_value)
    oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    ow = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
    cols = np.empty((n, c, kh, kw, oh, ow), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            cols[:, :, i, j] = xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                                  j * dw:j * dw + sw * (ow - 1) + 1:sw]
    return cols.reshape(n, c * kh * kw, oh * ow), oh, ow


def _conv_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    """An int8 x is padded with `pad_value` (its zero point: the quantizer folds the
    zero point's share of every sum into the int32 bias) and summed exactly in int32."""
    inp, w, bias = x[0], x[1], x[2] if len(x) > 2 else None
    at = node.attrs
    g = at["groups"]
    o, ci, kh, kw = w.shape
    acc = np.int32 if inp.dtype == np.int8 else inp.dtype
    n = inp.shape[0]
    cols, oh, ow = im2col(inp.astype(acc), kh, kw, at["stride"], at["padding"],
                          at["dilation"], at.get("pad_value", 0))
    if g == 1:
        y = np.einsum("ok,nkp->nop", w.reshape(o, -1).astype(acc), cols)
    else:   # all groups in one einsum (a Python loop per group was slow for depthwise)
        y = np.einsum("gok,ngkp->ngop", w.reshape(g, o // g, -1).astype(acc),
                      cols.reshape(n, g, ci * kh * kw, -1))
    y = y.reshape(n, o, oh, ow).astype(acc)
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


def dynamic_qparams(x: np.ndarray) -> tuple[float, int]:
    """QUANTIZE_DYNAMIC's (scale, zero point) of x (spec §7): the finite range widened
    to hold 0 on int8's 256 codes, the scale rounded to f32; scale 1, zero point 0 for a
    range of 0."""
    fin = x[np.isfinite(x)]
    lo = min(float(fin.min()) if fin.size else 0.0, 0.0)
    hi = max(float(fin.max()) if fin.size else 0.0, 0.0)
    scale = float(np.float32((hi - lo) / 255.0))
    if scale == 0.0:
        return 1.0, 0
    return scale, int(np.clip(np.rint(-128.0 - lo / scale), -128, 127))


def qparams_record(scale: float, zp: int) -> np.ndarray:
    """The 8-byte qparams record (scale f32, zero point i32) as the int32[2] value the
    graph holds it in."""
    return np.array([np.float32(scale).view(np.int32), zp], np.int32)


def _qdyn_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    _float(node, 0)
    return [(x.shape, "int8"), ((2,), "int32")]


def _qdyn_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    scale, zp = dynamic_qparams(np.asarray(x[0], np.float32))
    return [quantize_ref(x[0], scale, zp), qparams_record(scale, zp)]


def _dqdyn_attrs(node: Node) -> None:
    if node.attrs.get("activation") not in (None, "relu"):
        raise _err(f"dequantize_dynamic activation must be None or relu, got "
                   f"{node.attrs.get('activation')!r}")


def _dqdyn_infer(node: Node) -> list[tuple[Shape, str]]:
    acc, qp = _req(node, 0, "sums"), _req(node, 1, "qparams")
    ws, wsum = _req(node, 2, "wscale"), _req(node, 3, "wsum")
    bias = node.inputs[4] if len(node.inputs) > 4 else None
    if acc.dtype != "int32" or len(acc.shape) < 2:
        raise _err(f"dequantize_dynamic needs int32 sums of rank >= 2, got {acc.dtype} "
                   f"{acc.shape}")
    ch = acc.shape[1]
    if qp.dtype != "int32" or qp.shape != (2,):
        raise _err(f"dequantize_dynamic qparams must be int32 (2,), got {qp.dtype} {qp.shape}")
    for v, dt in ((ws, "float32"), (wsum, "int32"), (bias, "float32")):
        if v is not None and (v.dtype != dt or v.shape != (ch,)):
            raise _err(f"dequantize_dynamic {v.name} must be {dt} ({ch},), got {v.dtype} "
                       f"{v.shape}")
    return [(acc.shape, "float32")]


def _dqdyn_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    acc, qp, ws, wsum = x[0], x[1], x[2], x[3]
    bias = x[4] if len(x) > 4 else None
    scale, zp = float(np.asarray(qp[0], np.int32).view(np.float32)), int(qp[1])
    ch = acc.shape[1]
    shape = (1, ch) + (1,) * (acc.ndim - 2)
    t = (acc.astype(np.int64) - np.int64(zp) * wsum.astype(np.int64).reshape(shape)
         ).astype(np.float32)
    t *= (np.float32(scale) * ws.astype(np.float32)).reshape(shape)
    if bias is not None:
        t += bias.astype(np.float32).reshape(shape)
    if node.attrs.get("activation") == "relu":
        t = np.maximum(t, np.float32(0))
    return [t.astype(np.float32)]


_register("quantize_dynamic", _qdyn_infer, _qdyn_ref)
_register("dequantize_dynamic", _dqdyn_infer, _dqdyn_ref, _dqdyn_attrs)


def evaluate(node: Node, inputs: list[np.ndarray | None]) -> list[np.ndarray]:
    """Run `node` in numpy (the reference semantics of the op)."""
    ref: Callable[..., list[np.ndarray]] = get(node.op).ref
    return ref(node, inputs)


# --- ops for exported models: pointwise functions, pooling, data movement ---------------

UNARY_FNS = ("erf", "sqrt", "tanh", "exp", "neg", "reciprocal", "abs", "log", "silu")


def _unary_attrs(node: Node) -> None:
    if node.attrs.get("fn") not in UNARY_FNS:
        raise _err(f"unary fn must be one of {', '.join(UNARY_FNS)}, got "
                   f"{node.attrs.get('fn')!r}")


def _erf64(x: np.ndarray) -> np.ndarray:
    from math import erf
    y: np.ndarray = np.vectorize(erf, otypes=[np.float64])(x)
    return y


_UNARY_REF: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "erf": _erf64, "sqrt": np.sqrt, "tanh": np.tanh, "exp": np.exp, "neg": np.negative,
    "reciprocal": np.reciprocal, "abs": np.abs, "log": np.log,
    "silu": lambda x: x * (1 / (1 + np.exp(-x))),
}


def _unary_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    with np.errstate(all="ignore"):
        return [_UNARY_REF[node.attrs["fn"]](x[0].astype(np.float64)).astype(x[0].dtype)]


_register("unary", _unary_float_infer, _unary_ref, _unary_attrs)
_register("silu", _unary_float_infer,
          lambda n, x: [_UNARY_REF["silu"](x[0].astype(np.float64)).astype(x[0].dtype)])
_register("max", _binary_infer, lambda n, x: [np.maximum(x[0], x[1]).astype(x[0].dtype)])
_register("min", _binary_infer, lambda n, x: [np.minimum(x[0], x[1]).astype(x[0].dtype)])


def _pow_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    with np.errstate(all="ignore"):
        return [np.power(x[0].astype(np.float32), x[1].astype(np.float32)).astype(x[0].dtype)]


_register("pow", _binary_infer, _pow_ref)


def pool_extent(size: int, k: int, stride: int, dil: int, lo: int, hi: int,
                ceil: bool) -> int:
    """Output extent of one pooling axis (ONNX / PyTorch, ceil_mode included)."""
    span = size + lo + hi - (dil * (k - 1) + 1)
    if span < 0:
        raise _err(f"the kernel extent {dil * (k - 1) + 1} is larger than the padded input "
                   f"{size + lo + hi}")
    out = (-(-span // stride) if ceil else span // stride) + 1
    if ceil and (out - 1) * stride >= size + lo:
        out -= 1
    return out


def _pool_attrs(node: Node) -> None:
    at = node.attrs
    if at.get("mode") not in ("max", "avg"):
        raise _err(f"pool2d mode must be 'max' or 'avg', got {at.get('mode')!r}")
    for key, n in (("kernel", 2), ("stride", 2), ("padding", 4), ("dilation", 2)):
        v = at.get(key)
        if not isinstance(v, tuple) or len(v) != n or not all(isinstance(i, int) for i in v):
            raise _err(f"pool2d {key} must be {n} ints, got {v!r}")
    if min(at["kernel"] + at["stride"] + at["dilation"]) < 1 or min(at["padding"]) < 0:
        raise _err(f"pool2d kernel/stride/dilation must be >= 1 and padding >= 0: {at}")


def _pool_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    _float(node, 0)
    if len(x.shape) != 4:
        raise _err(f"pool2d needs NCHW x, got {list(x.shape)}")
    at = node.attrs
    n, c, h, w = x.shape
    pt, pl, pb, pr = at["padding"]
    oh = pool_extent(h, at["kernel"][0], at["stride"][0], at["dilation"][0], pt, pb,
                     at.get("ceil", False))
    ow = pool_extent(w, at["kernel"][1], at["stride"][1], at["dilation"][1], pl, pr,
                     at.get("ceil", False))
    return [((n, c, oh, ow), x.dtype)]


def _pool_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    a = x[0].astype(np.float64)
    at = node.attrs
    (r, s), (sh, sw), (dh, dw) = at["kernel"], at["stride"], at["dilation"]
    pt, pl, pb, pr = at["padding"]
    n, c, h, w = a.shape
    (_, _, oh, ow), _ = _pool_infer(node)[0]
    hp = max(h + pt + pb, (oh - 1) * sh + dh * (r - 1) + 1)
    wp = max(w + pl + pr, (ow - 1) * sw + dw * (s - 1) + 1)
    mx = at["mode"] == "max"
    xp = np.full((n, c, hp, wp), -np.inf if mx else 0.0)
    xp[:, :, pt:pt + h, pl:pl + w] = a
    inside = np.zeros((hp, wp))
    if at.get("count_include_pad"):
        inside[:h + pt + pb, :w + pl + pr] = 1
    else:
        inside[pt:pt + h, pl:pl + w] = 1
    acc = np.full((n, c, oh, ow), -np.inf) if mx else np.zeros((n, c, oh, ow))
    cnt = np.zeros((oh, ow))
    for i in range(r):
        for j in range(s):
            sl = (slice(i * dh, i * dh + sh * (oh - 1) + 1, sh),
                  slice(j * dw, j * dw + sw * (ow - 1) + 1, sw))
            acc = np.maximum(acc, xp[(..., *sl)]) if mx else acc + xp[(..., *sl)]
            cnt += inside[sl]
    if not mx:
        with np.errstate(all="ignore"):
            acc = acc / cnt
    return [acc.astype(x[0].dtype)]


_register("pool2d", _pool_infer, _pool_ref, _pool_attrs)


def _concat_infer(node: Node) -> list[tuple[Shape, str]]:
    vals = [v for v in node.inputs if v is not None]
    if not vals:
        raise _err("concat needs at least one operand")
    dt = _same_dtype(node)
    rank = len(vals[0].shape)
    ax = _norm_axis(node.attrs["axis"], rank)
    for v in vals:
        if len(v.shape) != rank or any(d != e for i, (d, e) in
                                       enumerate(zip(v.shape, vals[0].shape)) if i != ax):
            raise _err(f"concat operands {[list(u.shape) for u in vals]} differ outside "
                       f"axis {ax}")
    shape = list(vals[0].shape)
    shape[ax] = sum(v.shape[ax] for v in vals)
    return [(tuple(shape), dt)]


_register("concat", _concat_infer,
          lambda n, x: [np.concatenate([a for a in x if a is not None],
                                       axis=n.attrs["axis"])])


def _slice_attrs(node: Node) -> None:
    sl = node.attrs.get("slices")
    if not isinstance(sl, tuple) or not all(
            isinstance(t, tuple) and len(t) == 3 and all(isinstance(i, int) for i in t)
            and t[1] >= 1 and t[2] != 0 and t[0] >= 0 for t in sl):
        raise _err(f"slice needs ((start >= 0, count >= 1, step != 0), ...) per axis, got "
                   f"{sl!r}")


def _slice_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    sl = node.attrs["slices"]
    if len(sl) != len(x.shape):
        raise _err(f"slice has {len(sl)} axes, x has rank {len(x.shape)}")
    for ax, ((start, count, step), d) in enumerate(zip(sl, x.shape)):
        last = start + (count - 1) * step
        if not (0 <= start < d and 0 <= last < d):
            raise _err(f"slice axis {ax}: elements {start} .. {last} outside [0, {d})")
    return [(tuple(t[1] for t in sl), x.dtype)]


def _slice_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    idx = np.ix_(*[s + st * np.arange(c) for s, c, st in node.attrs["slices"]])
    return [np.ascontiguousarray(x[0][idx])]


_register("slice", _slice_infer, _slice_ref, _slice_attrs)


def _gather_infer(node: Node) -> list[tuple[Shape, str]]:
    x, idx = _req(node, 0, "data"), _req(node, 1, "indices")
    if idx.dtype != "int32":
        raise _err(f"indices are {idx.dtype}, int32 is needed")
    ax = _norm_axis(node.attrs["axis"], len(x.shape))
    return [(x.shape[:ax] + idx.shape + x.shape[ax + 1:], x.dtype)]


def _gather_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    data, idx = x[0], x[1].astype(np.int64)
    ax = node.attrs["axis"] % data.ndim
    d = data.shape[ax]
    idx = np.where(idx < 0, idx + d, idx)
    ok = (idx >= 0) & (idx < d)
    out = np.take(data, np.where(ok, idx, 0), axis=ax)
    mask = ok.reshape((1,) * ax + ok.shape + (1,) * (data.ndim - ax - 1))
    return [np.where(mask, out, np.zeros((), data.dtype)).astype(data.dtype)]


_register("gather", _gather_infer, _gather_ref)


def _pad_attrs(node: Node) -> None:
    p = node.attrs.get("pads")
    if not isinstance(p, tuple) or not all(isinstance(i, int) and i >= 0 for i in p):
        raise _err(f"pad needs non-negative (begin..., end...) pads, got {p!r}")
    if not isinstance(node.attrs.get("value", 0.0), float):
        raise _err(f"pad value must be a float, got {node.attrs.get('value')!r}")


def _pad_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    p = node.attrs["pads"]
    r = len(x.shape)
    if len(p) != 2 * r:
        raise _err(f"pad needs {2 * r} pads for rank {r}, got {len(p)}")
    return [(tuple(d + p[i] + p[i + r] for i, d in enumerate(x.shape)), x.dtype)]


def _pad_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    p = node.attrs["pads"]
    r = x[0].ndim
    return [np.pad(x[0], [(p[i], p[i + r]) for i in range(r)],
                   constant_values=node.attrs.get("value", 0.0)).astype(x[0].dtype)]


_register("pad", _pad_infer, _pad_ref, _pad_attrs)


def _expand_infer(node: Node) -> list[tuple[Shape, str]]:
    x = _req(node, 0, "x")
    shape = tuple(node.attrs["shape"])
    if broadcast(x.shape, shape) != shape:
        raise _err(f"{list(x.shape)} does not broadcast to {list(shape)}")
    return [(shape, x.dtype)]


_register("expand", _expand_infer,
          lambda n, x: [np.ascontiguousarray(np.broadcast_to(x[0], n.attrs["shape"]))])


# --- masks: comparisons, logic, select --------------------------------------------------
# Booleans are int8 tensors of 0 / 1 (the VA-1's masks); readers take nonzero as true.

COMPARE_FNS = ("equal", "less", "greater", "less_equal", "greater_equal", "and", "or",
               "xor", "not")
_COMPARE_REF = {"equal": np.equal, "less": np.less, "greater": np.greater,
                "less_equal": np.less_equal, "greater_equal": np.greater_equal,
                "and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


def _compare_attrs(node: Node) -> None:
    if node.attrs.get("fn") not in COMPARE_FNS:
        raise _err(f"compare fn must be one of {', '.join(COMPARE_FNS)}, got "
                   f"{node.attrs.get('fn')!r}")


def _compare_infer(node: Node) -> list[tuple[Shape, str]]:
    a = _req(node, 0, "a")
    if node.attrs.get("fn") == "not":
        return [(a.shape, "int8")]
    b = _req(node, 1, "b")
    _same_dtype(node)
    return [(broadcast(a.shape, b.shape), "int8")]


def _compare_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    fn = node.attrs["fn"]
    r = np.logical_not(x[0]) if fn == "not" else _COMPARE_REF[fn](x[0], x[1])
    return [np.asarray(r).astype(np.int8)]


_register("compare", _compare_infer, _compare_ref, _compare_attrs)


def _select_infer(node: Node) -> list[tuple[Shape, str]]:
    c, a, b = _req(node, 0, "cond"), _req(node, 1, "a"), _req(node, 2, "b")
    if c.dtype != "int8":
        raise _err(f"the condition is {c.dtype}, an int8 mask is needed")
    if a.dtype != b.dtype:
        raise _err(f"branches have different dtypes: {a.dtype} and {b.dtype}")
    return [(broadcast(broadcast(c.shape, a.shape), b.shape), a.dtype)]


def _select_ref(node: Node, x: list[Any]) -> list[np.ndarray]:
    return [np.where(np.asarray(x[0]) != 0, x[1], x[2]).astype(x[1].dtype)]


_register("select", _select_infer, _select_ref)
