"""View folding: batched matmuls read their operands as strided views.

Exported attention computes `q @ k^T` as MatMul(Transpose / Reshape chains of the
projections, ...), often with a scalar Mul (the 1/sqrt(d) scale) on the way. Each of
those would be a COPY (or an ELEMENTWISE) through the workspace. GEMM_BATCHED reads any
operand whose matrix has one unit stride, through leading dimensions and batch strides,
so a batched matmul becomes a `bmm` node that names the value at the start of the chain
and the (shape, strides) its operand is in that value's row-major data, with the
scalars folded into alpha. What no longer has a reader is then dead code.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ._ir import Graph, Node, Value

Shape = tuple[int, ...]


def contiguous(shape: Shape) -> Shape:
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return tuple(reversed(st))


def reshape_strides(shape: Shape, strides: Shape, new: Shape) -> Shape | None:
    """Strides of the reshape of a strided view without a copy, or None when there is
    none (numpy's no-copy rule: each group of old dims that makes up a group of new
    dims must be contiguous within itself)."""
    if math.prod(shape) != math.prod(new):
        return None
    old = [(d, s) for d, s in zip(shape, strides) if d != 1]
    out = [0] * len(new)
    nz = [i for i, d in enumerate(new) if d != 1]
    oi = ni = 0
    while oi < len(old) and ni < len(nz):
        oj, nj = oi + 1, ni + 1
        op, np_ = old[oi][0], new[nz[ni]]
        while op != np_:
            if op < np_:
                op *= old[oj][0]
                oj += 1
            else:
                np_ *= new[nz[nj]]
                nj += 1
        for t in range(oi, oj - 1):          # the old group must be contiguous
            if old[t][1] != old[t + 1][0] * old[t + 1][1]:
                return None
        st = old[oj - 1][1]
        for t in range(nj - 1, ni - 1, -1):  # the new group, innermost first
            out[nz[t]] = st
            st *= new[nz[t]]
        oi, ni = oj, nj
    return tuple(out)


def matrix_ok(shape: Shape, strides: Shape) -> bool:
    """A GEMM operand: its matrix has a unit stride along rows or along columns (an
    extent-1 dimension has any stride)."""
    r, c = shape[-2:]
    sr, sc = strides[-2:]
    return c == 1 or sc == 1 or r == 1 or sr == 1


def _scalar(v: Value | None) -> float | None:
    if v is None or v.const is None or v.const.size != 1:
        return None
    return float(v.const.reshape(-1)[0])


def _step(v: Value) -> tuple[Node, Value, float] | None:
    """The view op that makes `v` out of one other value: (node, that value, factor)."""
    p = v.producer
    if p is None:
        return None
    if p.op in ("transpose", "reshape") and p.inputs[0] is not None:
        return p, p.inputs[0], 1.0
    if p.op == "mul" and v.dtype in ("float32", "float16"):
        for i in (0, 1):
            x, c = p.inputs[i], _scalar(p.inputs[1 - i])
            if x is not None and c is not None and x.shape == v.shape:
                return p, x, c
    return None


def operand_view(v: Value) -> tuple[Value, Shape, Shape, float]:
    """(base value, shape, strides, scalar factor) for reading `v` from the deepest
    value of its view chain that gives a GEMM operand (v itself at worst)."""
    chain: list[tuple[Node, Value, float]] = []
    cur = v
    while (s := _step(cur)) is not None:
        chain.append(s)
        cur = s[1]
    for depth in range(len(chain), 0, -1):
        base = chain[depth - 1][1]
        shape, strides, alpha = base.shape, contiguous(base.shape), 1.0
        for node, _, factor in reversed(chain[:depth]):
            if node.op == "transpose":
                perm: Sequence[int] = node.attrs["perm"]
                shape = tuple(shape[p] for p in perm)
                strides = tuple(strides[p] for p in perm)
            elif node.op == "reshape":
                new = node.outputs[0].shape
                st = reshape_strides(shape, strides, new)
                if st is None:
                    break
                shape, strides = new, st
            else:
                alpha *= factor
        else:
            if len(shape) >= 2 and matrix_ok(shape, strides):
                return base, shape, strides, alpha
    return v, v.shape, contiguous(v.shape), 1.0


def fold_matmul_views(g: Graph) -> int:
    """Batched matmuls (both operands of rank >= 2, a batch) become `bmm` nodes reading
    their operands as views; returns how many matmuls were rewritten."""
    changed = 0
    for n in g.nodes:
        a, b = (n.inputs + [None, None])[:2]
        if (n.op != "matmul" or a is None or b is None or len(a.shape) < 2
                or len(b.shape) < 2 or len(n.outputs[0].shape) < 3):
            continue
        ba, sa, sta, fa = operand_view(a)
        bb, sb, stb, fb = operand_view(b)
        alpha = fa * fb
        if a.dtype == "int8" and alpha != 1.0:   # int8 never has scalar muls; be safe
            ba, sa, sta, bb, sb, stb, alpha = (a, a.shape, contiguous(a.shape), b, b.shape,
                                               contiguous(b.shape), 1.0)
        changed += 1
        n.op, n.inputs = "bmm", [ba, bb]
        n.attrs = {"a_view": (sa, sta), "b_view": (sb, stb),
                   "alpha": float(np.float32(alpha))}
    return changed
