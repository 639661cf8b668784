"""Graph passes: shape/type inference, constant folding, dead-code elimination,
BatchNorm folding, bias/activation fusion into GEMM/CONV2D epilogues, and the numpy
reference run used by constant folding, calibration and tests.

Every pass rewrites the graph in place and returns how many changes it made, so the
driver can report what each pass did.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import _ops
from ._ir import Graph, GraphError, Node, Value


def infer_shapes(g: Graph) -> int:
    """Re-infer every node's output shape/dtype and check it against what is recorded
    (a pass that broke shapes is caught here, naming the node)."""
    defined = {id(v) for v in g.inputs}
    for n in g.nodes:
        for i, v in enumerate(n.inputs):
            if v is not None and not v.is_const and id(v) not in defined:
                raise GraphError(f"node {n.name} ({n.op}): operand {i} {v.name} is not "
                                 f"defined before it")
        spec = _ops.get(n.op)
        try:
            got = spec.infer(n)
        except GraphError as e:
            raise GraphError(f"node {n.name} ({n.op}): {e}") from None
        if len(got) != len(n.outputs):
            raise GraphError(f"node {n.name}: {len(got)} results inferred, "
                             f"{len(n.outputs)} recorded")
        for (shape, dt), v in zip(got, n.outputs):
            if tuple(shape) != v.shape or dt != v.dtype:
                raise GraphError(f"node {n.name} ({n.op}): output {v.name} is recorded as "
                                 f"{v.dtype}{list(v.shape)} but infers {dt}{list(shape)}")
            defined.add(id(v))
    for v in g.outputs:
        if not v.is_const and id(v) not in defined:
            raise GraphError(f"graph output {v.name} is not computed by the graph")
    return 0


def reference_run(g: Graph, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Evaluate the graph in numpy: {output name: array}. Also the PTQ calibrator."""
    env = _run(g, feeds)
    return {v.name: env[id(v)] for v in g.outputs}


def _run(g: Graph, feeds: Mapping[str, Any]) -> dict[int, np.ndarray]:
    env: dict[int, np.ndarray] = {}
    for v in g.inputs:
        if v.name not in feeds:
            raise GraphError(f"no value fed for input {v.name}")
        env[id(v)] = np.asarray(feeds[v.name], dtype=v.dtype).reshape(v.shape)

    def get(v: Value | None) -> Any:
        if v is None:
            return None
        return v.const if v.is_const else env[id(v)]

    for n in g.nodes:
        outs = _ops.evaluate(n, [get(v) for v in n.inputs])
        for v, a in zip(n.outputs, outs):
            env[id(v)] = np.asarray(a, dtype=v.dtype).reshape(v.shape)
    for v in g.outputs:
        if v.is_const:
            env[id(v)] = v.const  # type: ignore[assignment]
    return env


def fold_constants(g: Graph) -> int:
    """Evaluate nodes whose operands are all constants at compile time."""
    changed = 0
    keep: list[Node] = []
    for n in g.nodes:
        if all(v is None or v.is_const for v in n.inputs) and n.inputs:
            outs = _ops.evaluate(n, [None if v is None else v.const for v in n.inputs])
            for v, a in zip(n.outputs, outs):
                arr = np.array(np.asarray(a, dtype=v.dtype).reshape(v.shape), order="C")
                arr.setflags(write=False)
                v.const, v.producer = arr, None
            changed += 1
        else:
            keep.append(n)
    g.nodes = keep
    return changed


def eliminate_dead_code(g: Graph) -> int:
    """Drop nodes none of whose outputs reach a graph output."""
    live = {id(v) for v in g.outputs}
    keep: list[Node] = []
    for n in reversed(g.nodes):
        if any(id(o) in live for o in n.outputs):
            keep.append(n)
            live.update(id(v) for v in n.inputs if v is not None)
    removed = len(g.nodes) - len(keep)
    g.nodes = keep[::-1]
    return removed


def _single_use(g: Graph, v: Value) -> bool:
    return len(g.consumers().get(id(v), [])) == 1 and v not in g.outputs


def _replace_uses(g: Graph, old: Value, new: Value) -> None:
    for n in g.nodes:
        n.inputs = [new if v is old else v for v in n.inputs]
    g.outputs = [new if v is old else v for v in g.outputs]


def _forward(g: Graph, node: Node, producer_out: Value) -> None:
    """Make `producer_out` take the place of `node`'s single output (and its name)."""
    out = node.outputs[0]
    was_output = any(v is out for v in g.outputs)
    _replace_uses(g, out, producer_out)
    if was_output:
        producer_out.name = out.name  # graph outputs keep their names
    g.nodes.remove(node)


def fold_batchnorm(g: Graph) -> int:
    """BatchNorm(conv2d/gemm(x)) with constant parameters -> the conv/gemm with scaled
    weights and shifted bias. gemm qualifies when its output channels are axis 1."""
    changed = 0
    for bn in [n for n in g.nodes if n.op == "batchnorm"]:
        x = bn.inputs[0]
        p = x.producer if x is not None else None
        if p is None or p.op not in ("conv2d", "gemm") or p.attrs.get("activation"):
            continue
        if not all(v is not None and v.is_const for v in bn.inputs[1:]):
            continue
        if x is None or not _single_use(g, x) or p.inputs[1] is None or \
                not p.inputs[1].is_const:
            continue
        if p.op == "gemm" and (p.attrs.get("trans_a") or p.inputs[0].dtype != "float32"):  # type: ignore[union-attr]
            continue
        consts = [v.const for v in bn.inputs[1:] if v is not None and v.const is not None]
        scale, shift, mean, var = (c.astype(np.float64) for c in consts)
        inv = scale / np.sqrt(var + bn.attrs["epsilon"])
        wv = p.inputs[1]
        assert wv is not None and wv.const is not None
        w = wv.const.astype(np.float64)
        old_bias = p.inputs[2] if len(p.inputs) > 2 else None
        n_out = p.outputs[0].shape[1]
        if old_bias is not None and old_bias.const is None:
            continue
        b_old = None if old_bias is None else old_bias.const
        if p.op == "conv2d":
            w = w * inv.reshape(-1, 1, 1, 1)
            b0 = np.zeros(n_out) if b_old is None else b_old.astype(np.float64)
        else:
            if b_old is not None and (b_old.ndim > 1 or b_old.size not in (1, n_out)):
                continue                      # a full (m, n) C: not a per-channel bias
            alpha, beta = p.attrs.get("alpha", 1.0), p.attrs.get("beta", 1.0)
            w = alpha * (w * inv.reshape(-1, 1) if p.attrs.get("trans_b")
                         else w * inv.reshape(1, -1))
            b0 = np.zeros(n_out) if b_old is None else \
                beta * np.broadcast_to(b_old.reshape(-1).astype(np.float64), (n_out,))
            p.attrs["alpha"], p.attrs["beta"] = 1.0, 1.0
        new_b = (np.asarray(b0, np.float64) - mean) * inv + shift
        p.inputs[1] = g.constant(w.astype(np.float32), name=wv.name + "_bnfold")
        bias_v = g.constant(new_b.astype(np.float32), name=f"{p.name}_bias_bnfold")
        if len(p.inputs) > 2:
            p.inputs[2] = bias_v
        else:
            p.inputs.append(bias_v)
        _forward(g, bn, p.outputs[0])
        changed += 1
    return changed


def _bias_vector(v: Value, n_out: int, axis_last: bool, rank: int) -> np.ndarray | None:
    """The per-output-channel bias `v` denotes when added to a gemm/conv result."""
    if not v.is_const:
        return None
    c = v.const
    assert c is not None
    if axis_last:      # gemm output (..., n): bias (n,), (1, n), (1, 1, n) ...
        if c.ndim <= rank and c.ndim >= 1 and c.shape[-1] == n_out and c.size == n_out:
            return c.reshape(n_out)
        return None
    # conv output (N, C, H, W): bias (C, 1, 1) or (1, C, 1, 1)
    if c.ndim >= 3 and c.size == n_out and c.shape[-3] == n_out and c.ndim <= rank:
        return c.reshape(n_out)
    return None


def _matmul_to_gemm(g: Graph) -> int:
    """Make GEMMs of matmuls with a constant or 2-D B: 2-D x 2-D is a gemm; an A of
    rank 3 or more times a 2-D B is reshape(A, (M, K)) -> gemm -> reshape back (the
    batch folded into M), so that transformer linear layers take epilogues and int8."""
    changed = 0
    out: list[Node] = []
    for n in g.nodes:
        a, b = (n.inputs + [None, None])[:2]
        if n.op != "matmul" or a is None or b is None or len(b.shape) != 2:
            out.append(n)
            continue
        attrs = {"trans_a": False, "trans_b": False, "alpha": 1.0, "beta": 1.0,
                 "activation": None}
        if len(a.shape) == 2:
            n.op, n.inputs, n.attrs = "gemm", [a, b, None], attrs
            out.append(n)
            changed += 1
            continue
        if len(a.shape) < 2:
            out.append(n)
            continue
        y = n.outputs[0]
        m = int(np.prod(a.shape[:-1]))
        a2 = Value(g.unique(f"{n.name}_a2d"), (m, a.shape[-1]), a.dtype)
        r1 = Node("reshape", [a], [a2], {"shape": a2.shape}, g.unique(f"{n.name}_rows"))
        a2.producer = r1
        y2 = Value(g.unique(f"{n.name}_2d"), (m, b.shape[1]), y.dtype)
        gm = Node("gemm", [a2, b, None], [y2], attrs, n.name)
        y2.producer = gm
        r2 = Node("reshape", [y2], [y], {"shape": y.shape}, g.unique(f"{n.name}_unrows"))
        y.producer = r2
        out += [r1, gm, r2]
        changed += 1
    g.nodes = out
    return changed


def _epilogue_producer(x: Value, uses: dict[int, int], outs: set[int]
                       ) -> tuple[Node, Node | None] | None:
    """The gemm/conv2d whose result `x` is, directly or through one reshape that
    keeps the gemm's last dimension (a 3-D linear layer), when nothing else reads it."""
    p = x.producer
    if p is None or uses.get(id(x), 0) != 1 or id(x) in outs:
        return None
    if p.op in ("gemm", "conv2d"):
        return p, None
    if p.op == "reshape" and p.inputs[0] is not None:
        inner = p.inputs[0]
        q = inner.producer
        if (q is not None and q.op == "gemm" and uses.get(id(inner), 0) == 1
                and id(inner) not in outs and x.shape[-1:] == inner.shape[-1:]):
            return q, p
    return None


def fuse_epilogues(g: Graph, activations: frozenset[str] = frozenset({"relu"})) -> int:
    """add(gemm/conv, const bias) -> bias in the epilogue; relu(gemm/conv) -> its
    activation. Only for producers whose output has no other consumer. One pass in
    order (a fusion only ever enables fusions of later nodes), linear in the graph."""
    changed = _matmul_to_gemm(g)
    uses: dict[int, int] = {}
    for n in g.nodes:
        for v in n.inputs:
            if v is not None:
                uses[id(v)] = uses.get(id(v), 0) + 1
    outs = {id(v) for v in g.outputs}
    subst: dict[int, Value] = {}
    keep: list[Node] = []
    for n in g.nodes:
        n.inputs = [None if v is None else subst.get(id(v), v) for v in n.inputs]
        target = _fuse_one(g, n, activations, uses, outs)
        if target is None:
            keep.append(n)
            continue
        old = n.outputs[0]
        subst[id(old)] = target
        uses[id(target)] = uses.get(id(old), 0)
        if id(old) in outs:
            outs.add(id(target))
            target.name = old.name   # graph outputs keep their names
        changed += 1
    g.nodes = keep
    g.outputs = [subst.get(id(v), v) for v in g.outputs]
    return changed


def _fuse_one(g: Graph, n: Node, activations: frozenset[str], uses: dict[int, int],
              outs: set[int]) -> Value | None:
    """Fuse `n` into its producer's epilogue if it can be: the value that now stands
    for n's output, else None."""
    if n.op == "add":
        for i in (0, 1):
            x, b = n.inputs[i], n.inputs[1 - i]
            if x is None or b is None:
                continue
            found = _epilogue_producer(x, uses, outs)
            if found is None:
                continue
            p, via = found
            if p.attrs.get("activation") or (len(p.inputs) > 2 and p.inputs[2] is not None):
                continue
            if p.op == "gemm" and p.attrs.get("beta", 1.0) != 1.0:
                continue
            out = p.outputs[0]
            if n.outputs[0].shape != x.shape:
                continue
            vec = _bias_vector(b, out.shape[1], p.op == "gemm", len(x.shape))
            if vec is None or vec.dtype != np.dtype(out.dtype):
                continue
            bias_v = g.constant(vec, name=f"{p.name}_bias")
            if len(p.inputs) > 2:
                p.inputs[2] = bias_v
            else:
                p.inputs.append(bias_v)
            return x
        return None
    if n.op in activations:
        x = n.inputs[0]
        if x is None:
            return None
        found = _epilogue_producer(x, uses, outs)
        if found is None:
            return None
        p, _ = found
        if p.attrs.get("activation") or p.outputs[0].dtype != "float32":
            return None
        if n.op == "gelu" and n.attrs.get("approximate", "none") != "none":
            return None
        p.attrs["activation"] = n.op
        return x
    return None


def _scalar_const(v: Value | None, want: float, rtol: float = 1e-6) -> bool:
    """`v` is a constant whose every element is `want` (within rtol)."""
    if v is None or v.const is None or v.const.size == 0:
        return False
    c = v.const.astype(np.float64)
    return bool(np.all(np.abs(c - want) <= rtol * abs(want)))


def _other(n: Node, v: Value) -> Value | None:
    """The operand of binary `n` that is not `v` (None if v is not an operand)."""
    a, b = n.inputs[0], n.inputs[1]
    if a is v:
        return b
    if b is v:
        return a
    return None


def fuse_patterns(g: Graph) -> int:
    """Exporters' spellings of activations, made single ops so that they fuse into
    epilogues: x * sigmoid(x) -> silu(x) (EfficientNet's SiLU); x * 0.5 * (1 + erf(x /
    sqrt 2)) in torch's groupings -> gelu(x) (nn.GELU at opset 17). What is left of the
    old spelling is dead code for the next DCE."""
    uses: dict[int, list[Node]] = {}
    for n in g.nodes:
        for v in n.inputs:
            if v is not None:
                uses.setdefault(id(v), []).append(n)
    outs = {id(v) for v in g.outputs}

    def single(v: Value) -> Node | None:
        us = uses.get(id(v), [])
        return us[0] if len(us) == 1 and id(v) not in outs else None

    replace: dict[int, Node] = {}
    for n in g.nodes:
        if n.op == "mul" and id(n) not in replace:
            for s in (n.inputs[0], n.inputs[1]):
                if s is None:
                    continue
                p = s.producer
                if p is not None and p.op == "sigmoid" and _other(n, s) is p.inputs[0] \
                        and single(s) is n:
                    replace[id(n)] = Node("silu", [p.inputs[0]], n.outputs, {}, n.name)
                    break
        if n.op != "unary" or n.attrs.get("fn") != "erf":
            continue
        d = n.inputs[0].producer if n.inputs[0] is not None else None
        if d is None or d.op not in ("div", "mul") or d.inputs[0] is None:
            continue
        x = d.inputs[0]
        if not (_scalar_const(d.inputs[1], 2 ** 0.5, 1e-5) if d.op == "div"
                else _scalar_const(d.inputs[1], 0.5 ** 0.5, 1e-5)):
            continue
        add = single(n.outputs[0])
        if add is None or add.op != "add" or not _scalar_const(_other(add, n.outputs[0]), 1):
            continue
        m1 = single(add.outputs[0])
        if m1 is None or m1.op != "mul":
            continue
        f = _other(m1, add.outputs[0])
        final: Node | None = None
        if f is x:                                 # (x * (1 + erf)) * 0.5
            m2 = single(m1.outputs[0])
            if m2 is not None and m2.op == "mul" and \
                    _scalar_const(_other(m2, m1.outputs[0]), 0.5):
                final = m2
        elif f is not None and f.producer is not None and f.producer.op == "mul" \
                and single(f) is m1 and _other(f.producer, x) is not None \
                and _scalar_const(_other(f.producer, x), 0.5):   # (x * 0.5) * (1 + erf)
            final = m1
        if final is not None and final.outputs[0].dtype == x.dtype:
            replace[id(final)] = Node("gelu", [x], final.outputs, {"approximate": "none"},
                                      final.name)
    for n in g.nodes:
        r = replace.get(id(n))
        if r is not None:
            r.outputs[0].producer = r
    g.nodes = [replace.get(id(n), n) for n in g.nodes]
    return len(replace)
